"""A graph at concrete sizes: grid extents, global task ids and compiled index maps.

Maps are compiled once per graph (`MapTable`); binding to sizes is cheap, so one compiled graph
serves every M without recompiling. Global task ids follow the static order: the tasks of the
first device function, row-major over its grid, then the next function's, and so on.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .errors import GraphError, InputError
from .expr import RANK_NAME, WORLD_NAME, compile_fn, evaluate, expand_coords, is_span
from .ir import Access, EventSpec, GraphIR, Role, TaskSpec, TensorSpec, pinned_prefix, tail_start


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

    @property
    def pinned(self) -> int:
        """Ids below it are pinned: the static formula runs them under either schedule."""
        return self._first_id(pinned_prefix(self.table.ir.tasks))

    @property
    def tail(self) -> int:
        """Ids from it on are the tail: the static formula runs them under either schedule, after
        the queue under "dynamic". Ids in [pinned, tail) are the queued ones."""
        return self._first_id(tail_start(self.table.ir.tasks))

    def _first_id(self, k: int) -> int:
        """The global id of device function k's first task (the total past the last function)."""
        return self.functions[k].offset if k < len(self.functions) else self.total

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


def bind_inputs(ir, inputs, sizes: Optional[Mapping[str, int]], *, world: Optional[int] = None,
                device_type: Optional[str] = "cpu") -> dict[str, int]:
    """Check inputs against the graph and bind its sizes; raise before any launch.

    inputs: a list with one dict per rank (CPU runtime), or {rank: dict} for the ranks this
    process holds (GPU: its own) with `world` given. device_type: required device, or None.
    """
    if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)) and inputs and \
            all(isinstance(d, Mapping) or d is None for d in inputs):
        per_rank = dict(enumerate(inputs))
    elif isinstance(inputs, Mapping) and inputs and all(isinstance(k, int) for k in inputs):
        per_rank = dict(inputs)
    else:
        raise InputError(f"graph {ir.name!r}: pass a list with one dict of input tensors per rank")
    if world is None and sorted(per_rank) != list(range(len(per_rank))):
        raise InputError(f"graph {ir.name!r}: the CPU runtime runs every rank, so it needs inputs for ranks "
                         f"0..{len(per_rank) - 1}; got ranks {sorted(per_rank)} (pass a list, one dict per rank)")
    if sizes is not None and not isinstance(sizes, Mapping):
        raise InputError(f"graph {ir.name!r}: sizes= takes a dict of size name -> int, got {type(sizes).__name__}")
    world = len(per_rank) if world is None else world
    specs = [s for s in ir.tensors if s.role is Role.INPUT]
    names = {s.name for s in specs}
    bound: dict[str, int] = {WORLD_NAME: world}
    for k, v in (sizes or {}).items():
        if k not in ir.sizes or k in (RANK_NAME, WORLD_NAME):
            raise InputError(f"graph {ir.name!r} has no size {k!r} to set (its sizes: "
                             f"{[s for s in ir.sizes if s not in (RANK_NAME, WORLD_NAME)]})")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InputError(f"graph {ir.name!r}: size {k} must be a non-negative int, got {v!r}")
        bound[k] = v
    for r, given in per_rank.items():
        if not isinstance(given, Mapping):
            raise InputError(f"rank {r}: expected a dict of input tensors, got {type(given).__name__}")
        missing, extra = names - set(given), set(given) - names
        if missing or extra:
            raise InputError(f"graph {ir.name!r} rank {r}: missing inputs {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        for s in specs:
            _check_tensor(ir, s, given[s.name], r, device_type)
    first = per_rank[min(per_rank)]
    for s in specs:  # bind bare-symbol dims from the first rank given
        for d, n in zip(s.shape, first[s.name].shape):
            if d.op == "sym" and d.args[0] not in bound:
                bound[d.args[0]] = int(n)
    unbound = [s for s in ir.sizes if s not in bound and s != RANK_NAME]
    if unbound:
        raise InputError(f"graph {ir.name!r}: sizes {unbound} are not named by any input's shape; "
                         f"pass sizes={{{', '.join(repr(u) + ': ...' for u in unbound)}}}")
    for c in ir.checks:
        if not c.cond.evaluate(bound):
            raise InputError(f"graph {ir.name!r} at sizes {bound}: {c.message}")
    for name, m in ir.multiples:
        if bound[name] % m:
            raise InputError(f"graph {ir.name!r}: size {name}={bound[name]} is not a multiple of {m}, "
                             f"as the graph declares (g.size({name!r}, multiple_of={m}))")
    for r, given in per_rank.items():
        env = {**bound, RANK_NAME: r}
        for s in specs:
            want = tuple(evaluate(d, env) for d in s.shape)
            got = tuple(given[s.name].shape)
            if want != got:
                raise InputError(f"graph {ir.name!r}: input {s.name!r} on rank {r} has shape {list(got)}, "
                                 f"expected {list(want)} = {list(s.shape)} at sizes "
                                 f"{ {k: v for k, v in bound.items() if k != WORLD_NAME} } (world {world})")
    return bound


def _check_tensor(ir, s: TensorSpec, t: Any, rank: int, device_type: Optional[str]) -> None:
    where = f"graph {ir.name!r} input {s.name!r} on rank {rank}"
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != s.dtype:
        raise InputError(f"{where}: dtype {t.dtype}, expected {s.dtype}")
    if device_type is not None and t.device.type != device_type:
        raise InputError(f"{where}: on {t.device}; the CPU runtime takes CPU tensors "
                         "(compile with target='cuda' for GPU tensors)")
    if t.dim() != len(s.shape):
        raise InputError(f"{where}: {t.dim()} dims, expected {len(s.shape)} ({list(s.shape)})")
