"""Compile-time validation: what can be proven about a graph before anything runs.

Structural checks first (no sizes needed), then an enumeration of every task on every rank at a
few sample sizes: maps in bounds, every event element receiving exactly the notifies it waits for,
no wait on an element nothing notifies, no cycle, and (static schedule) every task waiting only on
tasks earlier in the static order. Data-dependent parts (maps or counts that read runtime tensors)
cannot be enumerated here; the runtimes check them as they run. Errors name the task, its index,
the rank, the event coordinate and the sizes.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from .bind import Bound, MapTable, bind, in_bounds
from .errors import GraphError
from .expr import RANK_NAME, WORLD_NAME, expand_coords, is_span
from .ir import GraphIR, read_counts

# Default sample sizes: small, ragged, and a couple of world sizes. Graphs with checks on their
# sizes (e.g. experts divisible by the world) should declare samples with graph.sample(...).
DEFAULT_VALUES = (1, 5, 37)
DEFAULT_WORLDS = (1, 2, 3, 4)
MAX_TASKS = 200_000  # enumeration budget per sample point
LAZY_TASKS = 20_000  # LazyCheck's budget per call point (it runs before a call, not at compile)


@dataclass(frozen=True)
class Report:
    samples: tuple[dict, ...]  # the sample points enumerated
    tasks: int                 # tasks enumerated over all samples and ranks
    dynamic_events: tuple[str, ...]  # events whose accounting is left to the runtime


def validate(ir: GraphIR, table: MapTable, schedule: str,
             samples: Optional[Sequence[Mapping[str, int]]] = None) -> Report:
    dynamic = _structural(ir, schedule)
    points = list(_sample_points(ir, samples))
    if not points:
        raise GraphError(f"graph {ir.name!r}: no sample sizes satisfy its checks "
                         f"({[c.message for c in ir.checks]}); pass compile(..., samples=[{{...}}])")
    total = 0
    for point in points:
        total += _enumerate(bind(table, point), schedule, dynamic)
    return Report(tuple(points), total, tuple(sorted(dynamic)))


def size_class(sizes: Mapping[str, int]) -> tuple:
    """Sizes within a power of two of each other, per size: one class (LazyCheck checks it once)."""
    return tuple(sorted((k, int(v).bit_length()) for k, v in sizes.items()))


class LazyCheck:
    """validate's enumeration at the sizes calls use, once per size class (size_class): compile()
    checks small sample sizes only, and some bugs show only at large ones (a map out of bounds from
    the 65th row tile on). A runtime calls it with each new call's bound sizes, before anything runs;
    it checks the largest sizes of the call's class (each size 2**bits - 1, WORLD as called), or the
    call's own sizes where the graph's checks do not hold there. Points of more than LAZY_TASKS
    tasks are left unchecked (their enumeration would cost seconds; ~13% of the CPU runtime tests'
    time at this bound)."""

    def __init__(self, ir: GraphIR, table: MapTable, schedule: str):
        self.ir, self.table, self.schedule = ir, table, schedule
        self.dynamic = _structural(ir, schedule)
        self.seen: set = set()

    def __call__(self, sizes: Mapping[str, int]) -> None:
        key = size_class(sizes)
        if key in self.seen:
            return
        multiples = dict(self.ir.multiples)
        top = {k: v if k == WORLD_NAME else _class_top(v, multiples.get(k, 1)) for k, v in sizes.items()}
        for point in (top, dict(sizes)):
            if point is top and not all(c.cond.evaluate(top) for c in self.ir.checks):
                continue
            b = bind(self.table, point)
            if b.sizes[WORLD_NAME] * b.total <= LAZY_TASKS:
                _enumerate(b, self.schedule, self.dynamic)
                break   # the class's top covers the call's own sizes' tiles and more
        self.seen.add(key)


def _class_top(v: int, multiple: int) -> int:
    """The largest value with v's bit length that is a multiple of `multiple` (at least v)."""
    top = (1 << int(v).bit_length()) - 1
    return max(v, top - top % multiple)


def _structural(ir: GraphIR, schedule: str) -> set[str]:
    """Checks that need no sizes; returns the events whose accounting is data-dependent."""
    tensors = {t.name: t for t in ir.tensors}
    notified = {a.event for t in ir.tasks for a in t.notifies}
    waited = {a.event for t in ir.tasks for a in t.waits}
    for e in ir.events:
        if e.name in waited and e.name not in notified:
            raise GraphError(f"event {e.name!r} is waited on (by {_users(ir, e.name, 'waits')}) "
                             "but no task notifies it")
        if e.name in notified and e.name not in waited:
            raise GraphError(f"event {e.name!r} is notified (by {_users(ir, e.name, 'notifies')}) "
                             "but no task waits on it")
    exprs = [(f"event {e.name!r} count", e.count) for e in ir.events]
    for t in ir.tasks:
        exprs += [(f"task {t.name!r} {kind} {a.event}", c) for kind in ("waits", "notifies")
                  for a in getattr(t, kind) for c in a.coord]
        if t.when is not None:
            exprs.append((f"task {t.name!r} when", t.when))
    for where, ex in exprs:
        for name in ex.loads():
            spec = tensors.get(name)
            if spec is None:
                raise GraphError(f"{where} reads tensor {name!r}, which the graph does not declare")
            if spec.dtype.is_floating_point or spec.dtype.is_complex:
                raise GraphError(f"{where} reads tensor {name!r} of dtype {spec.dtype}: "
                                 "index maps read integer tensors only")
    dynamic = read_counts(ir.events)
    for t in ir.tasks:
        if schedule == "dynamic":
            for a in t.waits:
                if any(c.is_data_dependent for c in a.coord):
                    raise GraphError(
                        f"task {t.name!r}: its wait on {a.event!r} reads a runtime tensor; the dynamic "
                        "schedule releases tasks through a map fixed before the data exists. Wait on a "
                        "fixed element and skip with `when=` instead")
        for a in t.notifies:
            if t.when is not None and t.when.is_data_dependent or any(c.is_data_dependent for c in a.coord):
                dynamic.add(a.event)
    return dynamic


def _users(ir: GraphIR, event: str, kind: str) -> list[str]:
    return [t.name for t in ir.tasks if any(a.event == event for a in getattr(t, kind))]


def _sample_points(ir: GraphIR, samples) -> Iterable[dict]:
    free = [s for s in ir.sizes if s not in (RANK_NAME, WORLD_NAME)]
    if samples is None and ir.samples:
        samples = [dict(s) for s in ir.samples]
    if samples is None:
        samples = [{s: v for s in free} for v in DEFAULT_VALUES]
        if len(free) > 1:  # a ragged point where every size differs
            samples.append({s: 3 + 2 * k for k, s in enumerate(free)})
    if isinstance(samples, Mapping) or not all(isinstance(s, Mapping) for s in samples):
        raise GraphError(f"graph {ir.name!r}: samples= takes a list of dicts of sizes, e.g. "
                         f"[{{{', '.join(repr(f) + ': 5' for f in free)}}}], got {samples!r}")
    for s in samples:
        unknown = set(s) - set(ir.sizes)
        if unknown:
            raise GraphError(f"graph {ir.name!r}: sample names unknown sizes {sorted(unknown)}; "
                             f"its sizes are {list(ir.sizes)}")
        missing = [f for f in free if f not in s]
        if missing:
            raise GraphError(f"graph {ir.name!r}: sample {s} has no value for {missing}")
        wrong = [f"{k}={v!r}" for k, v in s.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0
                 or (k == WORLD_NAME and v < 1)]
        if wrong:
            raise GraphError(f"graph {ir.name!r}: sample {s}: sizes must be non-negative ints (WORLD >= 1), "
                             f"got {', '.join(wrong)}")
        for w in ([s[WORLD_NAME]] if WORLD_NAME in s else DEFAULT_WORLDS):
            point = {**s, WORLD_NAME: w}
            if all(c.cond.evaluate(point) for c in ir.checks):
                yield point


def _enumerate(b: Bound, schedule: str, dynamic: set[str]) -> int:
    """Walk every task on every rank at one sample point; raise on the first violation."""
    world = b.sizes[WORLD_NAME]
    tasks = world * b.total
    if tasks > MAX_TASKS:
        raise GraphError(f"graph {b.table.ir.name!r}: {tasks} tasks at sample {dict(b.sizes)}; "
                         "declare smaller samples with graph.sample(...)")
    notifiers = defaultdict(list)  # (rank, event, coord) -> [(rank, gid)]
    waiters = defaultdict(list)
    at = f"(sizes {dict(b.sizes)})"
    for rank in range(world):
        env = {**b.sizes, RANK_NAME: rank}
        for f in b.functions:
            m = f.maps
            data_when = m.spec.when is not None and m.spec.when.is_data_dependent
            for local in range(f.size):
                idx = f.unravel(local)
                gid = f.offset + local
                name = f"{m.spec.name}{idx} on rank {rank} of {world}"
                if not data_when and not m.exists(idx, env):
                    continue
                env_t = {**env, **dict(zip(m.spec.index_names, idx))}
                for kind, accesses, book in (("waits on", m.spec.waits, waiters),
                                             ("notifies", m.spec.notifies, notifiers)):
                    for a in accesses:
                        if any(c.is_data_dependent for c in a.coord):
                            continue
                        values = tuple(tuple(x.evaluate(env_t) for x in c.args) if is_span(c)
                                       else c.evaluate(env_t) for c in a.coord)
                        ev, shape = b.event(a.event), b.event_shapes[a.event]
                        for coord in expand_coords(values):
                            if not in_bounds(coord, shape):
                                raise GraphError(f"task {name} {kind} {a.event}{list(coord)}, outside the "
                                                 f"event's shape {list(shape)} {at}")
                            owner = coord[0] if ev.distributed else rank
                            if kind == "waits on" and owner != rank:
                                raise GraphError(f"task {name} waits on {a.event}{list(coord)}, which lives on "
                                                 f"rank {owner}: a task may only wait on its own rank's events {at}")
                            book[(owner, a.event, coord)].append((rank, gid))
    _check_counts(b, notifiers, waiters, dynamic, at)
    _check_acyclic(b, notifiers, waiters, schedule, at)
    return tasks


def _label(b: Bound, rank: int, gid: int) -> str:
    f, idx = b.decode(gid)
    return f"{f.maps.spec.name}{idx}@rank{rank}"


def _check_counts(b: Bound, notifiers, waiters, dynamic, at) -> None:
    world = b.sizes[WORLD_NAME]
    for e in b.table.ir.events:
        if e.name in dynamic:
            continue
        shape = b.event_shapes[e.name]
        for rank in range(world):
            env = {**b.sizes, RANK_NAME: rank}
            for coord in itertools.product(*(range(s) for s in shape)):
                if e.distributed and coord[0] != rank:
                    continue
                expected = b.table.count(e.name, coord, env)
                if expected < 0:
                    raise GraphError(f"event {e.name}{list(coord)} on rank {rank}: its count evaluates to {expected}; "
                                     f"counts must be >= 0 (the event's count function) {at}")
                got = notifiers.get((rank, e.name, coord), [])
                if expected == len(got):
                    continue
                who = ", ".join(_label(b, r, g) for r, g in got[:6]) or "no task"
                waiting = waiters.get((rank, e.name, coord), [])
                if not got and waiting:
                    raise GraphError(f"{_label(b, *waiting[0])} waits on {e.name}{list(coord)} on rank "
                                     f"{rank}, which expects {expected} notifies, but no task notifies it {at}")
                blocked = f"; {_label(b, *waiting[0])} waits on it" if waiting else ""
                raise GraphError(f"event {e.name}{list(coord)} on rank {rank} expects {expected} notifies "
                                 f"but receives {len(got)} (from {who}){blocked} {at}")


def _check_acyclic(b: Bound, notifiers, waiters, schedule, at) -> None:
    succ = defaultdict(set)  # notifier -> waiters, over every shared element
    why = {}
    for key, ws in waiters.items():
        for n in notifiers.get(key, []):
            for w in ws:
                succ[n].add(w)
                why.setdefault((n, w), key)
    indeg = defaultdict(int)
    for n, ws in succ.items():
        for w in ws:
            indeg[w] += 1
    nodes = set(succ) | set(indeg)
    ready = [n for n in nodes if indeg[n] == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for w in succ[n]:
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
    if seen < len(nodes):
        # Walk predecessors among the remaining nodes until one repeats: that loop is a cycle.
        left = {n for n in nodes if indeg[n] > 0}
        pred = {w: n for n in left for w in succ[n] if w in left}
        node, path = next(iter(left)), []
        while node not in path:
            path.append(node)
            node = pred[node]
        cycle = path[path.index(node):][::-1]
        raise GraphError("dependency cycle: " + " -> ".join(_label(b, *n) for n in cycle + [cycle[0]])
                         + f" {at}")
    # The static formula (every task under "static", the pinned prefix and the tail under
    # "dynamic") spins on waits, so a waiter it walks must come after what it waits on.
    walked = (lambda gid: True) if schedule == "static" else (lambda gid: gid < b.pinned or gid >= b.tail)
    for (n, w), key in why.items():
        if walked(w[1]) and n[1] > w[1]:  # equal ids on different ranks are fine: (id, rank) order progresses
            what, fix = (("static schedule", " or use schedule='dynamic'") if schedule == "static" else
                         ("pinned task", " or unpin the waiter") if w[1] < b.pinned else
                         ("tail task", " or take the waiter out of the tail"))
            raise GraphError(
                f"{what}: {_label(b, *w)} waits on {key[1]}{list(key[2])}, notified by "
                f"{_label(b, *n)}, which comes later in the static order (device functions in "
                f"declaration order, then grid order); declare producers before consumers" + fix + f" {at}")
