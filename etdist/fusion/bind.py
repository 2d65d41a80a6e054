"""A graph at concrete sizes: grid extents, global task ids and compiled index maps.

Maps are compiled once per graph (`MapTable`); binding to sizes is cheap, so one compiled graph
serves every M without recompiling. Global task ids follow the static order: the tasks of the
first device function, row-major over its grid, then the next function's, and so on.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import GraphError
from .expr import RANK_NAME, compile_fn, evaluate, expand_coords, is_span
from .ir import Access, EventSpec, GraphIR, TaskSpec


@dataclass(frozen=True)
class TaskMaps:
    """Compiled wait/notify/when maps of one device function."""

    spec: TaskSpec
    waits: Callable[..., tuple]
    notifies: Callable[..., tuple]
    when: Callable[..., tuple] | None

    @staticmethod
    def build(spec: TaskSpec) -> "TaskMaps":
        def flat(accesses: tuple[Access, ...]):  # a span coordinate contributes its start and stop
            return compile_fn(tuple(x for a in accesses for c in a.coord
                                    for x in (c.args if is_span(c) else (c,))), spec.index_names)
        when = compile_fn((spec.when,), spec.index_names) if spec.when is not None else None
        return TaskMaps(spec, flat(spec.waits), flat(spec.notifies), when)

    @staticmethod
    def _split(accesses: tuple[Access, ...], flat: tuple) -> list[tuple[str, tuple[int, ...]]]:
        out, k = [], 0
        for a in accesses:
            values = []
            for c in a.coord:
                if is_span(c):
                    values.append((flat[k], flat[k + 1]))
                    k += 2
                else:
                    values.append(flat[k])
                    k += 1
            out.extend((a.event, coord) for coord in expand_coords(tuple(values)))
        return out

    def wait_elements(self, idx: tuple, env: Mapping[str, Any]) -> list[tuple[str, tuple]]:
        return self._split(self.spec.waits, self.waits(*idx, env))

    def notify_elements(self, idx: tuple, env: Mapping[str, Any]) -> list[tuple[str, tuple]]:
        return self._split(self.spec.notifies, self.notifies(*idx, env))

    def exists(self, idx: tuple, env: Mapping[str, Any]) -> bool:
        return True if self.when is None else bool(self.when(*idx, env)[0])


@dataclass(frozen=True)
class MapTable:
    """Everything compiled from a GraphIR once: task maps and event count functions."""

    ir: GraphIR
    tasks: tuple[TaskMaps, ...]
    counts: Mapping[str, Callable[..., tuple]]

    @staticmethod
    def build(ir: GraphIR) -> "MapTable":
        counts = {e.name: compile_fn((e.count,), e.coord_names) for e in ir.events}
        return MapTable(ir, tuple(TaskMaps.build(t) for t in ir.tasks), counts)

    def count(self, event: str, coord: tuple, env: Mapping[str, Any]) -> int:
        return self.counts[event](*coord, env)[0]


@dataclass(frozen=True)
class BoundFunction:
    maps: TaskMaps
    extents: tuple[int, ...]
    offset: int  # global id of its first task

    @property
    def size(self) -> int:
        return math.prod(self.extents)

    def unravel(self, local: int) -> tuple[int, ...]:
        idx = []
        for e in reversed(self.extents):
            local, r = divmod(local, e)
            idx.append(r)
        return tuple(reversed(idx))


@dataclass(frozen=True)
class Bound:
    """The graph at concrete sizes (the same on every rank: sizes may not depend on RANK)."""

    table: MapTable
    sizes: Mapping[str, int]
    functions: tuple[BoundFunction, ...]
    event_shapes: Mapping[str, tuple[int, ...]]
    offsets: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.functions[-1].offset + self.functions[-1].size if self.functions else 0

    def decode(self, gid: int) -> tuple[BoundFunction, tuple[int, ...]]:
        """Global task id -> (device function, grid index)."""
        k = bisect.bisect_right(self.offsets, gid) - 1
        f = self.functions[k]
        return f, f.unravel(gid - f.offset)

    def event(self, name: str) -> EventSpec:
        return self.table.ir.event(name)


def bind(table: MapTable, sizes: Mapping[str, int]) -> Bound:
    """Evaluate grid extents and event shapes at `sizes` (RANK excluded: it varies per rank)."""
    ir = table.ir
    missing = [s for s in ir.sizes if s != RANK_NAME and s not in sizes]
    if missing:
        raise GraphError(f"graph {ir.name!r}: no value for sizes {missing}")
    for e in ir.events:
        if any(RANK_NAME in d.symbols() or d.is_data_dependent for d in e.shape):
            raise GraphError(f"event {e.name!r}: its shape may not depend on RANK (every rank holds the same counters)")
    functions, offset = [], 0
    for m in table.tasks:
        if any(RANK_NAME in g.symbols() or g.is_data_dependent for g in m.spec.grid):
            raise GraphError(f"task {m.spec.name!r}: its grid may depend on sizes only, not on RANK or "
                             "runtime tensors (every rank runs the same grid); use `when=` to skip tasks")
        ext = tuple(evaluate(g, sizes) for g in m.spec.grid)
        if any(e < 0 for e in ext):
            raise GraphError(f"task {m.spec.name!r}: grid {ext} at sizes {dict(sizes)} has a negative extent")
        f = BoundFunction(m, ext, offset)
        functions.append(f)
        offset += f.size
    shapes = {e.name: tuple(evaluate(d, sizes) for d in e.shape) for e in ir.events}
    for name, shp in shapes.items():
        if any(d < 0 for d in shp):
            raise GraphError(f"event {name!r}: shape {shp} at sizes {dict(sizes)} is negative")
    return Bound(table, dict(sizes), tuple(functions), shapes, tuple(f.offset for f in functions))


def in_bounds(coord: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return len(coord) == len(shape) and all(0 <= c < s for c, s in zip(coord, shape))
