"""The frozen graph IR that every compiler pass sees (the builder in graph.py produces it).

Tasks, events, waits and notifies are frozen dataclasses with tuple fields; every index map is an
`Expr` over the task's index variables. `GraphIR.key()` is a content hash usable as a cache key.
"""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .expr import Expr


class Role(enum.Enum):
    INPUT = "input"      # given by the caller, one per rank
    OUTPUT = "output"    # allocated per launch, returned
    SCRATCH = "scratch"  # allocated per launch, internal


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[Expr, ...]
    dtype: torch.dtype
    role: Role
    symmetric: bool  # peers may read/write it (NVSHMEM symmetric heap on GPUs)
    zeroed: bool = False  # scratch zeroed when allocated, which the graph's tasks leave zero after each launch


@dataclass(frozen=True)
class EventSpec:
    """A tensor of counters; element `c` completes after `count(c)` notifies.

    `count` is an Expr over coordinate variables c0, c1, ... (it may read runtime tensors).
    When `distributed`, coordinate 0 names the rank whose memory holds the counter.
    """

    name: str
    shape: tuple[Expr, ...]
    count: Expr
    distributed: bool

    @property
    def coord_names(self) -> tuple[str, ...]:
        return tuple(f"c{i}" for i in range(len(self.shape)))


@dataclass(frozen=True)
class Access:
    """One event element named by a task: coordinates are Exprs of the task's indices."""

    event: str
    coord: tuple[Expr, ...]


@dataclass(frozen=True)
class TaskSpec:
    """A device function: one tile body run for every index of `grid`.

    Semantics per task: wait until every `waits` element is complete; then, if `when` holds
    (evaluated after the waits, so it may read data they guard), run the body and notify every
    `notifies` element once. A task whose `when` is false does nothing.
    """

    name: str
    grid: tuple[Expr, ...]
    index_names: tuple[str, ...]
    waits: tuple[Access, ...]
    notifies: tuple[Access, ...]
    when: Optional[Expr]
    body: Callable[..., Any] = field(compare=False, repr=False)
    # GPU tile body: a @triton.jit function whose parameters are bound by name (index names,
    # tensor names, `<tensor>_peers` tables of symmetric tensors, sizes, RANK, WORLD, constexprs).
    triton_body: Any = field(default=None, compare=False, repr=False)
    constexprs: tuple[tuple[str, Any], ...] = ()
    bind: tuple[tuple[str, Any], ...] = ()  # GPU body parameter -> kernel name or Expr of the index
    # Under schedule="dynamic", walked by the static formula before any program pops the queue:
    # work that every routing needs (a MoE layer's router) skips a queue hop per step of its chain.
    pinned: bool = False
    # Under schedule="dynamic", walked by the static formula once a program finds the queue drained:
    # the last steps of a launch (a MoE layer's return and combine) spin on their waits there
    # instead of each waiting for a queue hop.
    tail: bool = False


def pinned_prefix(tasks) -> int:
    """How many task functions, from the first, are pinned (TaskSpec.pinned; they are declared first)."""
    return next((k for k, t in enumerate(tasks) if not t.pinned), len(tasks))


def tail_start(tasks) -> int:
    """The first task function of the tail (TaskSpec.tail; they are declared last)."""
    k = len(tasks)
    while k and tasks[k - 1].tail:
        k -= 1
    return k


def read_counts(events) -> set[str]:
    """The events whose count reads a tensor (EventSpec.count.is_data_dependent): a task must not
    evaluate one before the task that writes the tensor ran."""
    return {e.name for e in events if e.count.is_data_dependent}


def early_pushed(ir: "GraphIR", chains: bool = False) -> frozenset[str]:
    """The unpinned task functions that wait only on events pinned tasks alone notify (the dynamic
    schedule's early push): they start in the ready queue, behind the tasks that wait on nothing,
    and spin on their waits when popped. That cannot deadlock: every program runs its pinned share
    before it pops, and pinned tasks wait on nothing queued (graph._check_pinned). It spares the
    release walk of an element that frees thousands of them at once (a MoE layer's `tiled`).
    Not a task that waits on a count read from a tensor: spinning from the launch's start, it would
    read the count before the pinned task that writes it (found by review); released by the
    notify that completes it, the count has been written.

    chains=True also pushes early the tasks whose waits are notified only by pinned tasks, by task
    functions without waits or by early-pushed functions declared before them (a MoE layer's down
    tiles, behind the gate/up tiles they wait on): no release walk is left on their path. Still
    deadlock-free: such a task spins only on tasks seeded ahead of it in the queue (seeded tasks
    are claimed in id order, before anything pushed, each by a running program), so by induction
    over the id order the earliest unfinished one always has its waits complete; none of them
    waits on a released task, and released tasks never spin."""
    tasks = ir.tasks
    first_free, tail = pinned_prefix(tasks), tail_start(tasks)
    notifiers: dict[str, set[int]] = {}
    for k, t in enumerate(tasks):
        for a in t.notifies:
            notifiers.setdefault(a.event, set()).add(k)
    counted = read_counts(ir.events)
    early: set[int] = set()

    def seeded_before(j: int, k: int) -> bool:   # task function j's tasks sit ahead of k's in the queue
        return j < first_free or (chains and j < k and (j in early or not tasks[j].waits))

    for k in range(first_free, tail):
        t = tasks[k]
        if t.waits and all(a.event not in counted and all(seeded_before(j, k) for j in notifiers.get(a.event, ()))
                           for a in t.waits):
            early.add(k)
    return frozenset(tasks[k].name for k in early)


def early_at(ir: "GraphIR", level: int) -> frozenset[str]:
    """The early-pushed task functions at an early-push level (et.compile's early_push): none at 0,
    early_pushed's at 1, with its chains at 2."""
    return early_pushed(ir, chains=level >= 2) if level else frozenset()


@dataclass(frozen=True)
class Check:
    """A condition on sizes that a call must satisfy (e.g. experts divisible by world size)."""

    cond: Expr
    message: str


@dataclass(frozen=True)
class GraphIR:
    name: str
    tensors: tuple[TensorSpec, ...]
    events: tuple[EventSpec, ...]
    tasks: tuple[TaskSpec, ...]  # in static order: a task may wait only on earlier ones
    checks: tuple[Check, ...]
    sizes: tuple[str, ...]  # every size symbol, RANK and WORLD included
    samples: tuple[tuple[tuple[str, int], ...], ...]  # sample sizes for validation
    multiples: tuple[tuple[str, int], ...] = ()  # sizes promised to be multiples (alignment hints)

    def tensor(self, name: str) -> TensorSpec:
        return self._by_name("tensors", name)

    def event(self, name: str) -> EventSpec:
        return self._by_name("events", name)

    def _by_name(self, what: str, name: str):
        for x in getattr(self, what):
            if x.name == name:
                return x
        raise KeyError(f"graph {self.name!r} has no {what[:-1]} named {name!r}")

    def key(self) -> str:
        """Content hash of everything but the tile bodies' code objects (their names count)."""
        text = repr((self.name, self.tensors, self.events, self.checks, self.sizes,
                     tuple((t, t.body.__qualname__) for t in self.tasks)))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
