"""The user-facing graph builder: tensors, event tensors and tile tasks.

    g = et.Graph("gemm_rs")
    M, K, N = g.size("M"), g.size("K"), g.size("N")
    x = g.input("x", (M, K))
    done = g.event("done", (et.cdiv(M, 64),), count=1)

    @g.task(grid=(et.cdiv(M, 64),), notify=lambda i: done[i])
    def rows(t, i): ...

`Graph` is loose and pleasant; `to_ir()` canonicalises it into the frozen `GraphIR` (ir.py) that
validation, scheduling and code generation see.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from .errors import GraphError
from .expr import RANK_NAME, WORLD_NAME, Expr, Size, as_expr, load, sym, var
from .ir import Access, Check, EventSpec, GraphIR, Role, TaskSpec, TensorSpec, pinned_prefix, read_counts, tail_start


@dataclass(frozen=True)
class EventRef:
    """An element of an event tensor named inside an index map: `ready[i, j]`."""

    event: "EventTensor"
    coord: tuple[Expr, ...]


class EventTensor:
    """Counters that tasks notify and wait on. Index it inside maps: `ev[i, j]` is an element.

    count: notifies each element waits for: an int, an Expr, or a function of the coordinate
        (called with symbolic coordinates, so it may use arithmetic and runtime-tensor loads).
    distributed: coordinate 0 is the rank that holds the element (a notify with another rank
        there is a cross-GPU signal); a wait must name its own rank there.
    """

    def __init__(self, name: str, shape: Sequence[Size], count: Union[Size, Callable] = 1,
                 distributed: bool = False):
        if not name.isidentifier():
            raise GraphError(f"event name {name!r} must be a Python identifier")
        if len(shape) == 0:
            raise GraphError(f"event {name!r} needs at least one dimension")
        self.name, self.shape, self.count, self.distributed = name, tuple(shape), count, distributed
        self.spec = self._trace()  # now, while the names the count function reads mean what they mean

    def _trace(self) -> EventSpec:
        coord = tuple(var(f"c{i}") for i in range(len(self.shape)))
        count = self.count(*coord) if callable(self.count) else self.count
        what = f"count function {_fn_name(self.count)}" if callable(self.count) else "count"
        if isinstance(count, bool) or not isinstance(count, (int, Expr)):
            raise GraphError(f"event {self.name!r}: its {what} gave {type(count).__name__} {count!r}; a count is an "
                             f"int or an index expression of the coordinate (e.g. `lambda r, i: et.cdiv(K, 64)`)")
        count = as_expr(count)
        if count.op == "const" and count.args[0] < 0:
            raise GraphError(f"event {self.name!r}: its {what} is {count.args[0]}; an element waits for a number "
                             "of notifies >= 0")
        return EventSpec(self.name, tuple(as_expr(s) for s in self.shape), count, self.distributed)

    def __getitem__(self, coord) -> EventRef:
        coord = coord if isinstance(coord, tuple) else (coord,)
        if len(coord) != len(self.shape):
            raise GraphError(f"event {self.name!r} has {len(self.shape)} dims, indexed with {len(coord)}")
        return EventRef(self, tuple(as_expr(c) for c in coord))


class TensorRef:
    """A graph tensor. Inside index maps `counts[e]` reads it at run time (a data-dependent map)."""

    def __init__(self, name: str, shape: tuple, dtype: torch.dtype, role: Role, symmetric: bool, zeroed: bool = False):
        self.name, self.shape, self.dtype, self.role, self.symmetric = name, shape, dtype, role, symmetric
        self.zeroed = zeroed

    def __getitem__(self, index) -> Expr:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != len(self.shape):
            raise GraphError(f"tensor {self.name!r} has {len(self.shape)} dims, indexed with {len(index)}")
        return load(self.name, index)

    def to_spec(self) -> TensorSpec:
        return TensorSpec(self.name, tuple(as_expr(s) for s in self.shape), self.dtype, self.role, self.symmetric,
                          self.zeroed)


_MapFn = Optional[Callable[..., Union[EventRef, Sequence[EventRef], None]]]


class Graph:
    """A graph of tile tasks, event tensors and the tensors they read and write."""

    def __init__(self, name: str):
        self.name = name
        self.rank = sym(RANK_NAME)    # the rank running a task
        self.world = sym(WORLD_NAME)  # number of ranks
        self._sizes: dict[str, Expr] = {}
        self._tensors: dict[str, TensorRef] = {}
        self._events: dict[str, EventTensor] = {}
        self._tasks: list[TaskSpec] = []
        self._checks: list[Check] = []
        self._samples: list[dict[str, int]] = []
        self._multiples: dict[str, int] = {}

    # -- declarations ------------------------------------------------------------------------
    def size(self, name: str, multiple_of: int = 1) -> Expr:
        """A symbolic size; bound at call time from an input whose shape names it, or by keyword.

        multiple_of: a promise checked at every call; the GPU kernel uses it for aligned,
        vectorised memory access (e.g. 16 for a row length).
        """
        if name in (RANK_NAME, WORLD_NAME):
            raise GraphError(f"{name} is built in: use graph.rank / graph.world")
        if not isinstance(multiple_of, int) or multiple_of < 1:
            raise GraphError(f"size {name!r}: multiple_of must be a positive int, got {multiple_of!r}")
        if multiple_of > 1:
            self._multiples[name] = multiple_of
        return self._sizes.setdefault(name, sym(name))

    def input(self, name: str, shape: Sequence[Size], dtype: torch.dtype = torch.float32,
              symmetric: bool = False) -> TensorRef:
        return self._tensor(name, shape, dtype, Role.INPUT, symmetric)

    def output(self, name: str, shape: Sequence[Size], dtype: torch.dtype = torch.float32,
               symmetric: bool = False) -> TensorRef:
        return self._tensor(name, shape, dtype, Role.OUTPUT, symmetric)

    def scratch(self, name: str, shape: Sequence[Size], dtype: torch.dtype = torch.float32,
                symmetric: bool = False, zeroed: bool = False) -> TensorRef:
        """Internal memory, uninitialised; zeroed: zero when allocated, a promise that the graph's
        tasks leave it zero at the end of every launch (a counter one task takes and re-zeroes), so
        no launch needs a clearing pass. The CPU runtime checks the promise after each launch."""
        return self._tensor(name, shape, dtype, Role.SCRATCH, symmetric, zeroed)

    def event(self, name: str, shape: Sequence[Size], count: Union[Size, Callable] = 1,
              distributed: bool = False) -> EventTensor:
        if name in self._events:
            raise GraphError(f"graph {self.name!r} already has an event named {name!r}")
        ev = EventTensor(name, shape, count, distributed)
        self._events[name] = ev
        return ev

    def check(self, cond: Expr, message: str) -> None:
        """A condition on sizes every call must satisfy; `message` is the error when it does not."""
        self._checks.append(Check(as_expr(cond), message))

    def sample(self, **sizes: int) -> None:
        """Sizes at which compile() enumerates the graph to validate it (symbolic sizes)."""
        self._samples.append(sizes)

    def task(self, grid: Sequence[Size], wait: _MapFn = None, notify: _MapFn = None,
             when: _MapFn = None, name: Optional[str] = None, triton=None, constexprs: Optional[dict] = None,
             bind: Optional[dict] = None, pinned: bool = False, tail: bool = False):
        """Decorator: `body(t, *index)` runs once per index of `grid`.

        wait / notify: functions of the index returning an event element or a list of them.
        when: a function of the index returning a condition (it may read runtime tensors); the
            task is skipped, notifies included, where it is false. Evaluated after the waits.
        triton: the GPU tile body (@triton.jit); its parameters are bound by name: the index
            names, tensor names (pointers), `<tensor>_peers` (peer address tables of symmetric
            tensors), sizes, RANK, WORLD, and the `constexprs` given here.
        pinned: under schedule="dynamic", these tasks are still dealt to programs by the static
            formula, and every program runs its share before it pops the ready queue: for the work
            every run needs (a MoE router), which a queue would only delay by a hop per step of
            its chain. Pinned functions are declared first and wait only on what pinned tasks notify.
        tail: under schedule="dynamic", these tasks are dealt to programs by the static formula too,
            and every program runs its share once it finds the queue drained: for the last steps of
            a launch (a MoE layer's return and combine), which then spin on their waits instead of
            each waiting for a queue hop. Tail functions are declared last, and no other task waits
            on what they notify.
        The decorated function is the torch reference the CPU runtime runs: `body(t, *index)`.
        """
        def register(body: Callable) -> Callable:
            # Traced now: the maps' free names are read at declaration, as a reader expects.
            spec = self._trace_task(body, tuple(grid), wait, notify, when, name or body.__name__)
            spec = dataclasses.replace(spec, pinned=bool(pinned), tail=bool(tail))
            if triton is not None:
                idx = tuple(var(p) for p in spec.index_names)
                binds = tuple(sorted((k, v if isinstance(v, str) else as_expr(v(*idx) if callable(v) else v))
                                     for k, v in (bind or {}).items()))
                spec = dataclasses.replace(spec, triton_body=triton,
                                           constexprs=tuple(sorted((constexprs or {}).items())), bind=binds)
            self._tasks.append(spec)
            return body
        return register

    def _tensor(self, name, shape, dtype, role, symmetric, zeroed=False) -> TensorRef:
        if not name.isidentifier():
            raise GraphError(f"tensor name {name!r} must be a Python identifier")
        if name in self._tensors:
            raise GraphError(f"graph {self.name!r} already has a tensor named {name!r}")
        if not isinstance(dtype, torch.dtype):
            raise GraphError(f"tensor {name!r}: dtype must be a torch.dtype, got {dtype!r}")
        ref = TensorRef(name, tuple(shape), dtype, role, symmetric, zeroed)
        self._tensors[name] = ref
        return ref

    # -- canonicalisation --------------------------------------------------------------------
    def to_ir(self) -> GraphIR:
        clash = set(self._tensors) & (set(self._sizes) | {RANK_NAME, WORLD_NAME})
        if clash:
            raise GraphError(f"graph {self.name!r}: {sorted(clash)} name both a tensor and a size")
        tasks, seen = self._tasks, set()
        for t in tasks:
            if t.name in seen:
                raise GraphError(f"graph {self.name!r} has two tasks named {t.name!r}")
            seen.add(t.name)
        _check_pinned(self.name, tasks)
        used = {a.event for t in tasks for a in t.waits + t.notifies}
        events = tuple(e.spec for e in self._events.values())
        _check_tail(self.name, tasks, events)
        sizes = tuple(sorted(set(self._sizes) | {RANK_NAME, WORLD_NAME}))
        samples = tuple(tuple(sorted(s.items())) for s in self._samples)
        ir = GraphIR(self.name, tuple(t.to_spec() for t in self._tensors.values()), events,
                     tuple(tasks), tuple(self._checks), sizes, samples, tuple(sorted(self._multiples.items())))
        unused = [e.name for e in events if e.name not in used]
        if unused:
            raise GraphError(f"graph {self.name!r}: events {unused} are declared but no task uses them")
        return ir

    def _trace_task(self, body, grid, wait, notify, when, name) -> TaskSpec:
        params = list(inspect.signature(body).parameters)[1:]
        if len(params) != len(grid):
            raise GraphError(
                f"task {name!r}: grid has {len(grid)} dims but the body takes {len(params)} index "
                f"arguments after the tile context ({params}); write `def {name}(t, "
                f"{', '.join(f'i{k}' for k in range(len(grid)))})`")
        idx = tuple(var(p) for p in params)
        cond = None
        if when is not None:
            got = when(*idx)
            if isinstance(got, bool) or not isinstance(got, (int, Expr)):
                raise GraphError(f"task {name!r}: its when map {_fn_name(when)} gave {type(got).__name__} {got!r}; "
                                 "return a condition on the index (an index expression, e.g. `i < n`)")
            cond = as_expr(got)
        return TaskSpec(name, tuple(as_expr(g) for g in grid), tuple(params),
                        self._trace_map(name, "wait", wait, idx),
                        self._trace_map(name, "notify", notify, idx), cond, body)

    def _trace_map(self, task: str, what: str, fn: _MapFn, idx) -> tuple[Access, ...]:
        if fn is None:
            return ()
        refs = fn(*idx)
        if refs is not None and not isinstance(refs, (EventRef, list, tuple)):
            raise GraphError(f"task {task!r}: its {what} map {_fn_name(fn)} gave {type(refs).__name__} {refs!r}; "
                             "return an event element like ev[i], a list of them, or None")
        refs = [] if refs is None else [refs] if isinstance(refs, EventRef) else list(refs)
        out = []
        for r in refs:
            if not isinstance(r, EventRef):
                raise GraphError(f"task {task!r}: its {what} map {_fn_name(fn)} must return event elements like "
                                 f"ev[i], got {type(r).__name__} {r!r}")
            if self._events.get(r.event.name) is not r.event:
                raise GraphError(f"task {task!r}: {what} names event {r.event.name!r} of another graph")
            if what == "wait" and any(c.op == "span" for c in r.coord):
                raise GraphError(f"task {task!r}: a wait on et.every(...) is not supported: wait on one "
                                 "element whose count covers all the notifies instead")
            out.append(Access(r.event.name, r.coord))
        return tuple(out)


def _fn_name(fn) -> str:
    """How an error names a user's map or count function: its qualified name and where it is defined."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    code = getattr(fn, "__code__", None)
    return f"{name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code is not None else name


def _check_pinned(graph: str, tasks) -> None:
    """Pinned tasks run before any queued one (TaskSpec.pinned): they must be declared first, and
    wait only on events that pinned tasks alone notify, or a program could spin on a task that no
    program will pop until it stops spinning."""
    first_free = pinned_prefix(tasks)
    late = [t.name for t in tasks[first_free:] if t.pinned]
    if late:
        raise GraphError(f"graph {graph!r}: pinned tasks {late} are declared after the unpinned task "
                         f"{tasks[first_free].name!r}; declare the pinned ones first")
    free_notifies = {a.event: t.name for t in tasks if not t.pinned for a in t.notifies}
    for t in tasks[:first_free]:
        for a in t.waits:
            if a.event in free_notifies:
                raise GraphError(f"graph {graph!r}: pinned task {t.name!r} waits on {a.event!r}, which the "
                                 f"unpinned task {free_notifies[a.event]!r} notifies; pin it too, or unpin {t.name!r}")


def _check_tail(graph: str, tasks, events) -> None:
    """Tail tasks run after a program finds the queue drained (TaskSpec.tail): they must be declared
    last, and no other task may wait on what they notify, or a queued task could wait on work that
    no program starts until the queue is empty. A program reaches the tail once every queued task is
    claimed, not run: a first wait whose count reads a tensor would read it before it is written
    (early-pushed tasks leave such waits out for the same reason); wait first on an event of the
    task that writes it."""
    both = [t.name for t in tasks if t.tail and t.pinned]
    if both:
        raise GraphError(f"graph {graph!r}: tasks {both} are both pinned and tail; a task is one or the other")
    first = tail_start(tasks)
    early = [t.name for t in tasks[:first] if t.tail]
    if early:
        raise GraphError(f"graph {graph!r}: tail tasks {early} are declared before the task {tasks[first - 1].name!r}, "
                         "which is not; declare the tail ones last")
    counted = read_counts(events)
    for t in tasks[first:]:
        if t.waits and t.waits[0].event in counted:
            raise GraphError(f"graph {graph!r}: tail task {t.name!r} first waits on {t.waits[0].event!r}, whose count "
                             "reads a tensor: a tail task may start before that tensor is written; wait first on an "
                             "event of the task that writes it")
    tail_notifies = {a.event: t.name for t in tasks[first:] for a in t.notifies}
    for t in tasks[:first]:
        for a in t.waits:
            if a.event in tail_notifies:
                raise GraphError(f"graph {graph!r}: task {t.name!r} waits on {a.event!r}, which the tail task "
                                 f"{tail_notifies[a.event]!r} notifies; put {t.name!r} in the tail too, or take "
                                 f"{tail_notifies[a.event]!r} out of it")
