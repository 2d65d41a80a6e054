"""The CPU runtime: a compiled graph run as R simulated ranks x P simulated programs.

Each program is a generator that yields at every point where a real GPU program could be
overtaken: before a wait is satisfied (Blocked), after a body, after each notify. A scheduler
interleaves the programs round-robin or in a seeded-random order, so tests can sweep
interleavings. Tile bodies are the torch references; counters live in shared numpy arrays.

It reports what would hang or corrupt a GPU run: a deadlock (no program can move: the stuck
tasks, the elements they wait on and the counter values), a double notify, a notify or wait out
of bounds, and counters that do not end where the graph says. Counters re-arm without a reset
pass: each launch waits for `counter - base >= count`, and the end of a launch moves base to the
counter's value (on the GPU the base is the launch epoch times the count).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from .bind import Bound, MapTable, bind, bind_inputs, in_bounds
from .errors import CounterError, DeadlockError, DoubleNotifyError, GraphError, InputError, RuntimeFault
from .expr import RANK_NAME, WORLD_NAME, evaluate
from .ir import Role, early_at
from .schedule_dynamic import release_plan
from .schedule_static import StaticSchedule
from .tile_context import TileContext
from .validate import LazyCheck

INTERLEAVINGS = ("round_robin", "random")


@dataclass(frozen=True)
class Blocked:
    """A program that cannot move: on a wait (static) or on an empty queue (dynamic)."""

    rank: int
    program: int
    task: Optional[str]        # label of the task it is stuck in, None when idle
    element: Optional[tuple]   # (event, coord) waited on


_PROGRESS = object()


@dataclass
class LaunchStats:
    tasks_run: int = 0
    tasks_skipped: int = 0
    steps: int = 0
    wall_s: float = 0.0
    trace: list = field(default_factory=list)  # (rank, program, task, start step, end step)


class _Launch:
    """State of one launch: tensors, counters, queues, and the programs' generators."""

    def __init__(self, kernel: "CpuKernel", b: Bound, tensors: list[dict], trace: bool):
        self.k, self.b, self.tensors = kernel, b, tensors
        self.world = b.sizes[WORLD_NAME]
        self.envs = [{**b.sizes, RANK_NAME: r, **tensors[r]} for r in range(self.world)]
        self.counters, self.bases = kernel._counters_for(b)
        self.stats = LaunchStats()
        self.trace = trace
        self.step = 0
        if kernel.schedule == "dynamic":
            self.plans = [release_plan(b, r, kernel.early) for r in range(self.world)]
            # early-pushed tasks are queued, never released: they wait when popped, and have nothing to
            # count down (nor to list as stuck)
            self.early = [frozenset(p.early) for p in self.plans]
            self.pending = [[0 if gid in early else n for gid, n in enumerate(p.waits)]
                            for p, early in zip(self.plans, self.early)]
            # A rank's queue as the GPU's: pushes in order (None for a task whose `when` dropped it at
            # release: the GPU pops those as no-ops), and the next index to claim. A program claims
            # an index before its task is pushed and waits for it; one past the launch's queued
            # tasks goes on to the tail, though the tasks at earlier indices may not have run.
            self.queues = [[] for _ in range(self.world)]
            self.claimed = [0] * self.world
            self.queued = b.tail - b.pinned
            for r, p in enumerate(self.plans):
                for gid in p.initial:
                    self._release(r, gid)
                for (event, coord), consumers in p.consumers.items():
                    f, idx = b.decode(consumers[0])
                    self._check_element(f"{f.maps.spec.name}{idx}@rank{r}", r, "waits on", event, coord)
                    # Elements that need no notify (a constant count of 0) release their consumers now.
                    if not self.b.event(event).count.is_data_dependent and self.complete(r, event, coord):
                        for gid in consumers:
                            self.pending[r][gid] -= 1
                            if self.pending[r][gid] == 0:
                                self._release(r, gid)
                # early-pushed: queued as they are; their `when` may read what their waits guard
                self.queues[r].extend(p.early)

    # -- counters --------------------------------------------------------------------------
    def _count(self, owner: int, event: str, coord: tuple) -> int:
        n = self.b.table.count(event, coord, self.envs[owner])
        if n < 0:  # poisoned memory: a count read before the task that writes its tensor ran
            raise RuntimeFault(f"event {event}{list(coord)} on rank {owner}: its count evaluates to {n}, "
                               "read before its data was written; wait first on an event of the task "
                               "that writes the tensor the count reads")
        return n

    def _owner(self, rank: int, event: str, coord: tuple) -> int:
        return coord[0] if self.b.event(event).distributed else rank

    def _check_element(self, label: str, rank: int, kind: str, event: str, coord: tuple) -> int:
        shape = self.b.event_shapes[event]
        if not in_bounds(coord, shape):
            raise RuntimeFault(f"task {label} {kind} {event}{list(coord)}, outside the event's shape "
                               f"{list(shape)} (sizes {dict(self.b.sizes)})")
        owner = self._owner(rank, event, coord)
        if kind == "waits on" and owner != rank:
            raise RuntimeFault(f"task {label} waits on {event}{list(coord)} of rank {owner}: "
                               "tasks wait on their own rank's events only")
        return owner

    def complete(self, owner: int, event: str, coord: tuple) -> bool:
        arrived = self.counters[owner][event][coord] - self.bases[owner][event][coord]
        return arrived >= self._count(owner, event, coord)

    def notify(self, label: str, rank: int, event: str, coord: tuple) -> None:
        owner = self._check_element(label, rank, "notifies", event, coord)
        self.counters[owner][event][coord] += 1
        arrived = self.counters[owner][event][coord] - self.bases[owner][event][coord]
        expected = self._count(owner, event, coord)
        if arrived > expected:
            raise DoubleNotifyError(f"task {label} notified {event}{list(coord)} on rank {owner}: "
                                    f"{arrived} notifies arrived, the element expects {expected}")
        if self.k.schedule == "dynamic" and arrived == expected:
            for gid in self.plans[owner].consumers.get((event, coord), ()):
                self.pending[owner][gid] -= 1
                if self.pending[owner][gid] == 0:
                    self._release(owner, gid)

    def _release(self, rank: int, gid: int) -> None:
        f, idx = self.b.decode(gid)
        if f.maps.exists(idx, self.envs[rank]):
            self.queues[rank].append(gid)
        else:
            self.queues[rank].append(None)
            self.stats.tasks_skipped += 1

    # -- programs ----------------------------------------------------------------------------
    def static_program(self, rank: int, p: int, sched: StaticSchedule) -> Iterator:
        for gid in sched.tasks_of(p, self.b.total):
            yield from self.run_task(rank, p, gid, wait=True)

    def dynamic_program(self, rank: int, p: int, sched: StaticSchedule) -> Iterator:
        for gid in sched.tasks_of(p, self.b.pinned):   # the pinned prefix, as static
            yield from self.run_task(rank, p, gid, wait=True)
        q = self.queues[rank]
        while self.claimed[rank] < self.queued:   # past the last index: on to the tail
            c = self.claimed[rank]
            self.claimed[rank] += 1
            while len(q) <= c:   # claimed before it is pushed
                yield Blocked(rank, p, None, None)
            if q[c] is not None:   # released tasks are ready; early-pushed ones wait (on pinned work)
                yield from self.run_task(rank, p, q[c], wait=q[c] in self.early[rank])
        for gid in sched.tasks_of(p, self.b.total, start=self.b.tail):   # the tail, as static
            yield from self.run_task(rank, p, gid, wait=True)

    def run_task(self, rank: int, p: int, gid: int, wait: bool) -> Iterator:
        f, idx = self.b.decode(gid)
        m, env = f.maps, self.envs[rank]
        label = f"{m.spec.name}{idx}@rank{rank}"
        for event, coord in m.wait_elements(idx, env):
            self._check_element(label, rank, "waits on", event, coord)
            while not self.complete(rank, event, coord):
                if not wait:  # the dynamic queue released a task whose wait is not complete
                    raise RuntimeFault(f"task {label} was released before {event}{list(coord)} completed")
                yield Blocked(rank, p, label, (event, coord))
        if wait and not m.exists(idx, env):
            self.stats.tasks_skipped += 1
            return
        start = self.step
        try:
            m.spec.body(TileContext(self, rank), *idx)
        except RuntimeFault:
            raise
        except Exception as e:  # a tile body's own bug: say which task
            raise RuntimeFault(f"tile body of task {label} raised {type(e).__name__}: {e}") from e
        self.stats.tasks_run += 1
        yield _PROGRESS
        for event, coord in m.notify_elements(idx, env):
            self.notify(label, rank, event, coord)
            yield _PROGRESS
        if self.trace:
            self.stats.trace.append((rank, p, label, start, self.step))

    # -- end of launch ---------------------------------------------------------------------
    def finish(self) -> None:
        wrong = []
        for r in range(self.world):
            for name, arr in self.counters[r].items():
                ev = self.b.event(name)
                for coord in np.ndindex(arr.shape):
                    if ev.distributed and coord[0] != r:
                        continue
                    got = int(arr[coord] - self.bases[r][name][coord])
                    want = self._count(r, name, coord)
                    if got != want:
                        wrong.append(f"{name}{list(coord)} on rank {r}: {got} notifies, expected {want}")
        if wrong:
            raise CounterError(f"graph {self.b.table.ir.name!r} ended with {len(wrong)} counters off: "
                               + "; ".join(wrong[:8]) + (" ..." if len(wrong) > 8 else ""))
        for r in range(self.world):  # re-arm: the next launch counts from here
            for name in self.counters[r]:
                self.bases[r][name][...] = self.counters[r][name]

    def discard(self) -> None:
        for r in range(self.world):
            for name in self.counters[r]:
                self.counters[r][name][...] = self.bases[r][name]

    def deadlock(self, stalled: Mapping[tuple, Blocked]) -> DeadlockError:
        lines = []
        for (r, p), s in sorted(stalled.items()):
            if s.element is None:
                continue
            ev, coord = s.element
            have = int(self.counters[r][ev][coord] - self.bases[r][ev][coord])
            lines.append(f"  rank {r} program {p}: {s.task} waits on {ev}{list(coord)}: "
                         f"{have} of {self._count(r, ev, coord)} notifies")
        if self.k.schedule == "dynamic":
            for r in range(self.world):
                stuck = [(gid, n) for gid, n in enumerate(self.pending[r]) if n > 0]
                for gid, n in stuck[:8]:
                    f, idx = self.b.decode(gid)
                    missing = [f"{e}{list(c)}: {int(self.counters[r][e][c] - self.bases[r][e][c])} of "
                               f"{self._count(r, e, c)} notifies"
                               for e, c in f.maps.wait_elements(idx, self.envs[r])
                               if not self.complete(r, e, c)]
                    lines.append(f"  rank {r}: {f.maps.spec.name}{idx} never released: waits on "
                                 + ", ".join(missing))
                if len(stuck) > 8:
                    lines.append(f"  rank {r}: ... and {len(stuck) - 8} more unreleased tasks")
        return DeadlockError(f"deadlock in graph {self.b.table.ir.name!r} ({self.k.schedule} schedule, "
                             f"sizes {dict(self.b.sizes)}): no program can move\n" + "\n".join(lines))


class CpuKernel:
    """A graph compiled for the CPU runtime. Call `run(inputs)` with one dict of tensors per rank."""

    target = "cpu"

    def __init__(self, table: MapTable, schedule: str, programs: int, early_push: int = 1, check_sizes: bool = True):
        """check_sizes: run validate's enumeration at each new size class a call uses (LazyCheck);
        False leaves every check to the runtime itself (as a graph compiled without validation)."""
        self.table, self.ir, self.schedule, self.programs = table, table.ir, schedule, programs
        # the dynamic schedule's early-pushed task functions (ir.early_pushed)
        self.early = early_at(self.ir, early_push) if schedule == "dynamic" else frozenset()
        self._counters: dict = {}
        self._zeroed = [s.name for s in self.ir.tensors if s.zeroed]   # checked zero after each launch
        # the graph checks at the sizes calls use
        self._lazy_check = LazyCheck(self.ir, table, schedule) if check_sizes else (lambda sizes: None)
        self.last_stats: Optional[LaunchStats] = None
        self.trace_default = False   # compile(..., trace=True) sets it

    def __repr__(self) -> str:
        return f"CpuKernel({self.ir.name!r}, schedule={self.schedule!r}, programs={self.programs})"

    def run(self, inputs: Sequence[Mapping[str, torch.Tensor]], *, sizes: Optional[Mapping[str, int]] = None,
            interleave: str = "round_robin", seed: int = 0, trace: Optional[bool] = None) -> list[dict[str, torch.Tensor]]:
        """Run one launch on `len(inputs)` simulated ranks; returns each rank's outputs.

        interleave: "round_robin" or "random" (seeded by `seed`) order of program steps.
        Raises before touching anything if the inputs do not fit the graph, and returns no
        output if the run deadlocks or miscounts.
        """
        if interleave not in INTERLEAVINGS:
            raise InputError(f"interleave must be one of {INTERLEAVINGS}, got {interleave!r}")
        t0 = time.perf_counter()
        bound_sizes = bind_inputs(self.ir, inputs, sizes)
        self._lazy_check(bound_sizes)
        b = bind(self.table, bound_sizes)
        per_rank = inputs if isinstance(inputs, Mapping) else dict(enumerate(inputs))   # {rank: dict} or a list
        tensors = [self._allocate(per_rank[r], bound_sizes, r) for r in range(len(per_rank))]
        launch = _Launch(self, b, tensors, self.trace_default if trace is None else trace)
        sched = StaticSchedule(self.programs)
        program = launch.static_program if self.schedule == "static" else launch.dynamic_program
        gens = {(r, p): program(r, p, sched) for r in range(launch.world) for p in range(self.programs)}
        try:
            _interleave(launch, gens, interleave, seed)
            launch.finish()
        except Exception:
            launch.discard()  # the next launch starts from the counters as they were before this one
            raise
        for name in self._zeroed:   # a zeroed scratch's promise: its tasks left it zero
            bad = [r for r in range(launch.world) if tensors[r][name].any()]
            if bad:
                raise GraphError(f"graph {self.ir.name!r}: scratch {name!r} is declared zeroed but is not zero "
                                 f"after the launch on rank {bad[0]}: a task must leave it zero")
        launch.stats.wall_s = time.perf_counter() - t0
        self.last_stats = launch.stats
        outs = [s.name for s in self.ir.tensors if s.role is Role.OUTPUT]
        return [{n: tensors[r][n] for n in outs} for r in range(launch.world)]

    def _allocate(self, given: Mapping[str, torch.Tensor], sizes: Mapping[str, int], rank: int) -> dict:
        env = {**sizes, RANK_NAME: rank}
        out = dict(given)
        for s in self.ir.tensors:
            if s.role is Role.INPUT:
                continue
            shape = tuple(evaluate(d, env) for d in s.shape)
            if any(d < 0 for d in shape):
                raise InputError(f"tensor {s.name!r} of graph {self.ir.name!r} would have shape "
                                 f"{list(shape)} on rank {rank} at sizes {dict(sizes)}")
            out[s.name] = torch.zeros(shape, dtype=s.dtype) if s.zeroed else _poisoned(shape, s.dtype)
        return out

    def _counters_for(self, b: Bound):
        """Counter and base arrays per rank, kept across launches of the same shapes (re-arming)."""
        key = (b.sizes[WORLD_NAME], tuple(sorted(b.event_shapes.items())))
        if key not in self._counters:
            world = b.sizes[WORLD_NAME]
            mk = lambda: [{n: np.zeros(s, dtype=np.int64) for n, s in b.event_shapes.items()}
                          for _ in range(world)]
            self._counters[key] = (mk(), mk())
        return self._counters[key]


def _poisoned(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Fresh memory filled with a value no correct run leaves behind (NaN, or the dtype's minimum)."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype)


def _interleave(launch: _Launch, gens: dict, how: str, seed: int) -> None:
    rng = random.Random(seed)
    live = list(gens)
    stalled: dict = {}
    budget = 1000 + 200 * launch.world * max(1, launch.b.total) * max(1, len(launch.b.table.ir.events))
    turn = 0
    while live:
        launch.step += 1
        if launch.step > budget:  # the watchdog: unreachable unless the runtime itself is wrong
            raise RuntimeFault(f"watchdog: {launch.step} steps without finishing graph {launch.b.table.ir.name!r}")
        k = rng.randrange(len(live)) if how == "random" else turn % len(live)
        key = live[k]
        try:
            status = next(gens[key])
        except StopIteration:
            live.pop(k)
            stalled.pop(key, None)
            continue
        turn = k + 1
        if status is _PROGRESS:
            stalled.clear()
        else:
            stalled[key] = status
            if len(stalled) == len(live):
                raise launch.deadlock(stalled)
    launch.stats.steps = launch.step
