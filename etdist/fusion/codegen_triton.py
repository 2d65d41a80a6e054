"""Codegen: a GraphIR -> the Triton source of one persistent megakernel.

The kernel is a fixed skeleton; only the per-task branches are generated:

    call agreement                                              # every peer started this call
    for task id in range(program, total, NUM_PROGRAMS):        # the static schedule's formula
        if id < end_of_function_0:  unravel -> waits -> [when] -> tile body -> notifies
        elif ...
    last program: epochs and the call number for the next launch

Sizes are run-time arguments (not specialised), so one compiled kernel serves every M.
Event counters live in one int32 arena (symmetric memory: peers notify into it):

    [0, 8) error record | [8, 8+W) exit lanes | [8+W] grid counter | [8+W+1] last finished
    launch (epoch) | [8+W+2] launches since the counters were zeroed (ev_epoch) | events at run-time
    offsets. The kernel reads both epochs and its last program bumps them: no per-call argument
    changes, so a captured launch replays correctly.

Waits spin until `counter >= launch epoch x count` (counters re-arm by growing, never reset
while shapes stay the same), bounded by the watchdog in etdist.kernels.sync. A wait's error
code is (16 + event index) << 20 | element, which the host decodes back to a coordinate.
ETDIST_DEBUG=1 logs the generated source (logger etdist.fusion.cuda_runtime, to stderr).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

from ..mesh.control import ControlLayout
from .errors import GraphError
from .expr import Expr, as_expr, var
from .ir import GraphIR, Role, TaskSpec, early_pushed, pinned_prefix, tail_start
from .loader import load_module
from .trace import PHASE_WORDS, TRACE_WORDS

ERR_WORDS = 8
EVENT_CODE_BASE = 16
ELEMENT_BITS = 20


# Words after the exit lanes, in order: the grid counter; the launch epoch (the last launch this
# GPU finished: the kernel reads it and bumps it); ev_epoch (launches since the event counters were
# zeroed: the host zeroes it with them); then the events.
_AFTER_LANES = {"grid": 0, "finished": 1, "ev_epoch": 2, "events": 3}


@dataclass(frozen=True)
class ArenaLayout:
    """One definition of the counter arena, shared by the codegen and the host runtime."""

    world: int

    @property
    def exit(self) -> int:
        return ERR_WORDS

    @property
    def grid(self) -> int:
        return ERR_WORDS + self.world + _AFTER_LANES["grid"]

    @property
    def finished(self) -> int:
        return ERR_WORDS + self.world + _AFTER_LANES["finished"]

    @property
    def ev_epoch(self) -> int:
        return ERR_WORDS + self.world + _AFTER_LANES["ev_epoch"]

    @property
    def events(self) -> int:
        return ERR_WORDS + self.world + _AFTER_LANES["events"]

    @staticmethod
    def in_kernel(name: str) -> str:
        """The same offset as generated code writes it (WORLD is a kernel argument)."""
        return f"{ERR_WORDS + _AFTER_LANES[name]} + WORLD"


def event_code(event_index: int, linear: int) -> int:
    return (EVENT_CODE_BASE + event_index) << ELEMENT_BITS | (linear & ((1 << ELEMENT_BITS) - 1))


def decode_event_code(code: int) -> tuple[int, int] | None:
    e = (code >> ELEMENT_BITS) - EVENT_CODE_BASE
    return (e, code & ((1 << ELEMENT_BITS) - 1)) if e >= 0 else None


# what every megakernel takes besides the graph's tensors, sizes and event offsets (error_host:
# pinned host memory, where the last program leaves the error record's first word; mesh_ctrl, its
# peer table and call_sig: the mesh's control block and this call's signature word, which every
# program checks against the peers' at entry; call_error_host: the mesh's pinned words where a launch
# whose call the ranks disagreed on leaves the record, mesh/calls.py)
OWN_PARAMS = ["arena", "arena_peers", "max_spins", "error_host", "mesh_ctrl", "mesh_ctrl_peers", "call_sig",
              "call_error_host"]
# names the generated module defines itself: the launch epochs, the constexprs, its imports
MODULE_NAMES = {"epoch", "ev_epoch", "NUM_PROGRAMS", "USE_ASM", "tl", "triton", "megakernel"}
# the dynamic schedule's ready queue (etdist.kernels.ready_queue): buffer, peers, then offsets
QUEUE_PARAMS = ["rq", "rq_peers", "rq_q", "rq_pending", "rq_rowptr", "rq_cols", "rq_init",
                "rq_ninit", "rq_seed_base", "rq_total"]


def kernel_params(ir: GraphIR, trace: bool = False, dynamic: bool = False) -> list[str]:
    """The megakernel's run-time parameters, in order (the host passes them in this order)."""
    ps = [t.name for t in ir.tensors]
    ps += [f"{t.name}_peers" for t in ir.tensors if t.symmetric]
    ps += list(ir.sizes)
    ps += [f"ev_{e.name}_off" for e in ir.events] + OWN_PARAMS
    return ps + (["trace_buf"] if trace else []) + (QUEUE_PARAMS if dynamic else [])


class _Lines:
    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def indent(self):
        return _Indent(self)


class _Indent:
    def __init__(self, out: _Lines):
        self.out = out

    def __enter__(self):
        self.out.depth += 1

    def __exit__(self, *exc):
        self.out.depth -= 1


def _linear(dims: list[str], coord: list[str]) -> str:
    """Row-major offset of `coord` in an array of `dims` (Horner form)."""
    text = coord[0]
    for d, c in zip(dims[1:], coord[1:]):
        text = f"({text}) * {d} + {c}"
    return text


# A program of the dynamic schedule claims its next queue index after its task's body, before its
# notifies, where they are all plain (a release walk can take tens of microseconds, the claimed task
# would wait behind it): the claim's round trip runs while the body's stores drain, which the
# notify's release fence waits for. One H200, nn.MoE: -0.6 to -1.7% at 128-4096 tokens against
# claiming after the task (records moe_claim_ab).


def generate(ir: GraphIR, trace: bool = False, dynamic: bool = False, early: Optional[frozenset] = None,
             check_events: bool = False, local_first: bool = False) -> str:
    """Source text of a module defining `megakernel` for this graph. trace=True adds a `trace_buf`
    argument (int64, TRACE_WORDS per task, indexed by the task's global id) and the timer reads that
    fill it; without it the kernel has neither (a compile-time switch: costs nothing when off).
    dynamic=True: programs walk the pinned prefix by the static formula (TaskSpec.pinned), then pop
    tasks from the rank's queue, then walk the tail by the static formula (TaskSpec.tail); notifies
    that complete an element some released task waits on push its consumers (ready_queue.py).
    early: the task functions queued at launch instead (default: ir.early_pushed, as
    compile's early_push=1; the kernel's host tables must agree). The next queue index is claimed
    ahead. check_events: every notify checks its coordinates against its event's shape,
    and the last program checks that no counter went past its count (a debug mode: what validation
    cannot see, a map out of bounds at sizes it did not enumerate, is named instead of surfacing as
    a watchdog on another element). local_first: the graph's local prefix (local_prefix) runs while
    the call agreement is still under way, its notifies after it."""
    reserved = set(kernel_params(ir, trace=True, dynamic=True))
    taken = sorted({*OWN_PARAMS, "trace_buf", *QUEUE_PARAMS, *MODULE_NAMES} & {*(t.name for t in ir.tensors), *ir.sizes})
    if taken:
        raise GraphError(f"graph {ir.name!r}: {taken} name the megakernel's own parameters; rename the tensor or size")
    params = kernel_params(ir, trace, dynamic)
    twice = sorted({n for n in params if params.count(n) > 1})
    if twice:
        raise GraphError(f"graph {ir.name!r}: {twice} would name two kernel parameters (a tensor `<x>_peers` next "
                         f"to a symmetric `x`, or a size named like a tensor); rename one")
    for t in ir.tasks:
        if t.triton_body is None:
            raise GraphError(f"task {t.name!r} has no GPU tile body: pass triton=<@triton.jit fn> to g.task")
        for n in t.index_names:
            if n in reserved or n.startswith("_et"):
                raise GraphError(f"task {t.name!r}: index name {n!r} collides with a tensor, size or kernel "
                                 "parameter; rename it")
    tensor_dims = {t.name: [f"_et_{t.name}_d{k}" for k in range(len(t.shape))] for t in ir.tensors}

    def load(name: str, idx: tuple) -> str:
        return f"tl.load({name} + {_linear(tensor_dims[name], list(idx))})"

    def tx(e: Expr) -> str:
        return as_expr(e).to_triton(load)

    out = _Lines()
    out("import triton")
    out("import triton.language as tl")
    out("from etdist.kernels.sync import notify as _et_notify, peer_base as _et_peer, wait as _et_wait")
    out("from etdist.kernels.sync import agree_call as _et_agree, finish_launch as _et_finish")
    out("from etdist.kernels.sync import agree_post as _et_agree_post, agree_wait as _et_agree_wait")
    out("from etdist.kernels.sync import hand_over_call_error as _et_call_error")
    if check_events:
        out("from etdist.kernels.sync import record_error as _et_record")
    if trace:
        out("from etdist.kernels.sync import trace_clock as _et_clock")
    if dynamic:
        out("from etdist.kernels.ready_queue import claim as _et_claim, take as _et_take, "
            "notify_release as _et_release, rewind_head as _et_rewind")
    out("")
    for t in ir.tasks:
        out(f"# _et_body_{t.name} is bound to {t.triton_body.__module__}.{t.triton_body.__name__}")
    out("")
    params = kernel_params(ir, trace, dynamic)
    # Run-time sizes are not specialised (one binary for every M), except those the graph promises
    # to be multiples of 16: Triton's divisibility specialisation is what vectorises their loads,
    # and the host checks the promise at every call, so they always hit the same binary.
    aligned = {n for n, m in ir.multiples if m % 16 == 0}
    scalars = [p for p in params if (p in ir.sizes and p not in aligned) or p.startswith("ev_")
               or p in ("max_spins", "call_sig") or (p.startswith("rq_") and p != "rq_peers")]
    out(f"@triton.jit(do_not_specialize={scalars!r})")
    out(f"def megakernel({', '.join(params)}, NUM_PROGRAMS: tl.constexpr, USE_ASM: tl.constexpr):")
    with out.indent():
        out("_et_pid = tl.program_id(0)")
        if trace:   # the launch's own phases per program: entry, call agreed, tasks done, end
            out("_et_p0, _et_psm = _et_clock(_et_pid)")
        # The epochs live in the arena and the kernel bumps them itself (the last program, below): the
        # arguments stay the same from call to call, so a launch replayed from a CUDA graph is correct.
        out(f"epoch = tl.load(arena + {ArenaLayout.in_kernel('finished')}, volatile=True) + 1")
        out(f"ev_epoch = tl.load(arena + {ArenaLayout.in_kernel('ev_epoch')}, volatile=True) + 1")
        for t in ir.tensors:  # tensor dims, for loads in data-dependent maps
            if any(t.name in x.loads() for x in _all_exprs(ir)):
                for d, e in zip(tensor_dims[t.name], t.shape):
                    out(f"{d} = {tx(e)}")
        for e in ir.events:
            for k, d in enumerate(e.shape):
                out(f"_et_ev_{e.name}_d{k} = {tx(d)}")
        ends = []
        for k, t in enumerate(ir.tasks):
            for a, g in enumerate(t.grid):
                out(f"_et_g{k}_{a} = {tx(g)}")
            size = " * ".join(f"_et_g{k}_{a}" for a in range(len(t.grid))) or "1"
            out(f"_et_end{k} = {'_et_end' + str(k - 1) + ' + ' if k else ''}{size}")
            ends.append(f"_et_end{k}")
        n = len(ir.tasks)
        pinned = pinned_prefix(ir.tasks) if dynamic else n   # task functions the static formula walks
        tail = tail_start(ir.tasks) if dynamic else n        # ... and from here on, after the queue
        # events some released task waits on: their notifies walk consumers into the queue; the
        # others (waited on by pinned, early-pushed or tail tasks only, which spin) are plain notifies
        early = early_pushed(ir) if early is None else early
        released = frozenset(a.event for u in ir.tasks[pinned:tail] if u.name not in early for a in u.waits)
        if dynamic:
            out("_et_limit = ev_epoch.to(tl.int64) * rq_total")
        # every rank makes the same call (mesh/calls.py): checked against the peers' before any task
        # touches what a peer can see; the local prefix's bodies run while the peers' words come
        local = min(local_prefix(ir), pinned) if local_first else 0
        call, seq = ControlLayout.in_kernel("call"), ControlLayout.in_kernel("call_seq")
        if local:
            out(f"_et_seq = _et_agree_post(mesh_ctrl, mesh_ctrl_peers, {call}, {seq}, RANK, WORLD, call_sig, _et_pid)")
            out(f"for _et_gid in range(_et_pid, {ends[local - 1]}, NUM_PROGRAMS):")
            with out.indent():
                _emit_dispatch(out, ir, tx, trace, released, range(local), check=check_events, part="body")
            out(f"_et_agreed = _et_agree_wait(mesh_ctrl, {call}, _et_seq, RANK, WORLD, call_sig, max_spins, arena, "
                "arena_peers, USE_ASM)")
        else:
            out(f"_et_seq, _et_agreed = _et_agree(mesh_ctrl, mesh_ctrl_peers, {call}, {seq}, RANK, WORLD, call_sig, "
                "max_spins, arena, arena_peers, _et_pid, USE_ASM)")
        if trace:
            out("_et_p1, _et_psm = _et_clock(_et_pid)")
        out("if _et_agreed != 0:")
        depth = out.depth
        out.depth += 1
        if any(t.notifies for t in ir.tasks[:local]):   # the local tasks' notifies (a refused call has none)
            out(f"for _et_gid in range(_et_pid, {ends[local - 1]}, NUM_PROGRAMS):")
            with out.indent():
                _emit_dispatch(out, ir, tx, trace, released, range(local), check=check_events, part="notify")
        if pinned > local:   # every task (static), or the pinned prefix: the static formula, waits spin
            # the same ids as one walk from _et_pid: the first past the local ones that is ours
            first = ("_et_pid" if not local else
                     f"{ends[local - 1]} + (_et_pid + NUM_PROGRAMS - {ends[local - 1]} % NUM_PROGRAMS) % NUM_PROGRAMS")
            out(f"for _et_gid in range({first}, {ends[pinned - 1]}, NUM_PROGRAMS):")
            with out.indent():
                _emit_dispatch(out, ir, tx, trace, released, range(local, pinned), check=check_events)
        if dynamic:
            # then pop until every queued task ran
            if pinned < tail:
                out("_et_claimed = _et_claim(rq)")   # this program's next queue index (-1: none claimed yet)
                out("_et_more = 1")
                out("while _et_more != 0:")
                with out.indent():
                    out(f"_et_gid = _et_take(rq, _et_claimed, rq_q, _et_limit, rq_init, rq_ninit, rq_seed_base, "
                        f"rq_total, ev_epoch, max_spins, arena, arena_peers, RANK, WORLD, "
                        f"{event_code(len(ir.events), 1)}, epoch)")
                    out("_et_claimed = _et_claimed * 0 - 1")
                    out("if _et_gid < 0:")
                    with out.indent():
                        out("_et_more = 0")
                    out("else:")
                    with out.indent():
                        _emit_dispatch(out, ir, tx, trace, released, range(pinned, tail), True, check_events)
                        out("if _et_claimed < 0:")   # not claimed ahead (or the task did not run)
                        with out.indent():
                            out("_et_claimed = _et_claim(rq)")
            if tail < n:   # the tail: every queued index is claimed, by a program that will run its task
                out(f"for _et_gid in range({ends[tail - 1] + ' + ' if tail else ''}_et_pid, {ends[n - 1]}, NUM_PROGRAMS):")
                with out.indent():
                    _emit_dispatch(out, ir, tx, trace, released, range(tail, n), check=check_events)
        out.depth = depth
        if trace:
            out("_et_p2, _et_psm = _et_clock(_et_pid)")
        # No exit rendezvous: the next launch's call agreement holds every rank at entry until each
        # peer has started its next launch, i.e. finished this one (mesh/calls.py), which is what the
        # rendezvous guaranteed, for one cross-GPU hop per launch instead of two
        out(f"_et_last = _et_finish(arena, arena_peers, {ERR_WORDS}, {ArenaLayout.in_kernel('grid')}, "
            f"{ArenaLayout.in_kernel('finished')}, epoch, RANK, WORLD, max_spins, _et_agreed, False, "
            f"{event_code(len(ir.events), 0)}, USE_ASM)")
        if check_events:   # every task of this GPU ran: no counter may be past its count
            out("if (_et_last != 0) & (_et_agreed != 0):")
            with out.indent():
                _emit_over_check(out, ir, tx)
        # The last program to finish: every program of this GPU has read this launch's epochs and call
        # number, stopped claiming from the queue and run its tasks.
        out("if _et_last != 0:")
        with out.indent():
            out("_et_call_error(arena, call_error_host)")   # a call the ranks disagreed on: to the mesh's words
            # the error record's first word straight into pinned host memory, where the host reads it
            # at the next call without a sync (a copy after each launch cost 8-15 us a call: records
            # error_word_ab)
            out("tl.store(error_host, tl.load(arena, volatile=True))")
            out(f"tl.atomic_xchg(mesh_ctrl + {ControlLayout.in_kernel('call_seq')}, _et_seq, sem='relaxed', "
                f"scope='gpu')")
        out("if (_et_last != 0) & (_et_agreed != 0):")   # a call the ranks disagreed on ran nothing
        with out.indent():
            out(f"tl.atomic_xchg(arena + {ArenaLayout.in_kernel('ev_epoch')}, ev_epoch, sem='relaxed', scope='gpu')")
            if dynamic:  # the queue's head back to the tasks pushed (claims overshoot it at the end)
                out("_et_rewind(rq, _et_limit)")
            for e in ir.events:
                if not e.count.is_data_dependent:
                    continue
                # counts read from tensors do not re-arm by epoch: zero them
                size = " * ".join(f"_et_ev_{e.name}_d{k}" for k in range(len(e.shape))) or "1"
                out(f"for _et_z in range(0, {size}, 256):")
                with out.indent():
                    out("_et_zo = _et_z + tl.arange(0, 256)")
                    out(f"tl.store(arena + ev_{e.name}_off + _et_zo, tl.zeros((256,), tl.int32), "
                        f"mask=_et_zo < {size})")
        if trace:   # after the tasks' records (trace.PHASE_WORDS per program)
            out("_et_p3, _et_psm = _et_clock(_et_pid)")
            out(f"_et_tr = trace_buf + (_et_pid * 0 + {ends[n - 1]}).to(tl.int64) * {TRACE_WORDS} "
                f"+ _et_pid.to(tl.int64) * {PHASE_WORDS}")
            for k, v in enumerate(("_et_p0", "_et_p1", "_et_p2", "_et_p3")):
                out(f"tl.store(_et_tr + {k}, {v})")
            out("tl.store(_et_tr + 4, (_et_psm.to(tl.int64) << 32) | _et_pid)")
    return "\n".join(out.lines) + "\n"


def _all_exprs(ir: GraphIR):
    for e in ir.events:
        yield e.count
    for t in ir.tasks:
        yield from (c for a in t.waits + t.notifies for c in a.coord)
        if t.when is not None:
            yield t.when


def _target(e, count: str) -> str:
    """What an element's counter reads once its `count` notifies of this launch are in: counters
    grow by count per launch (re-armed by epoch), except data-dependent ones, which the kernel
    zeroes at its end (see the finish in generate)."""
    return count if e.count.is_data_dependent else f"ev_epoch * ({count})"


def _emit_over_check(out: _Lines, ir: GraphIR, tx) -> None:
    """check_events' end of launch: each element of every epoch-armed event at most its count
    (counters grow by their count a launch); the first one past it is recorded as ERR_OVER."""
    for i, e in enumerate(ir.events):
        if e.count.is_data_dependent:   # zeroed at the end instead (their counts change every launch)
            continue
        dims = [f"_et_ev_{e.name}_d{d}" for d in range(len(e.shape))]
        size = " * ".join(dims) or "1"
        out(f"for _et_b in range(0, {size}, 256):")
        with out.indent():
            out("_et_i = _et_b + tl.arange(0, 256)")
            out("_et_r = _et_i")
            for d in reversed(range(len(e.shape))):   # unravel row-major
                out(f"_et_c{d} = _et_r % {dims[d]}" if d else f"_et_c{d} = _et_r")
                if d:
                    out(f"_et_r = _et_r // {dims[d]}")
            count = e.count.substitute({f"c{d}": var(f"_et_c{d}") for d in range(len(e.shape))})
            out(f"_et_want = {_target(e, tx(count))} + tl.zeros((256,), tl.int32)")
            out(f"_et_v = tl.load(arena + ev_{e.name}_off + _et_i, mask=_et_i < {size}, other=0, volatile=True)")
            out(f"_et_over = ((_et_i < {size}) & (_et_v - _et_want > 0)).to(tl.int32)")
            out("if tl.max(_et_over, axis=0) > 0:")
            with out.indent():
                out("_et_j = tl.argmax(_et_over, axis=0)")
                out("_et_at = tl.arange(0, 256) == _et_j")
                out(f"_et_record(arena, arena_peers, RANK, WORLD, 7, ({EVENT_CODE_BASE + i} << {ELEMENT_BITS}) | "
                    f"((_et_b + _et_j) & {(1 << ELEMENT_BITS) - 1}), tl.sum(tl.where(_et_at, _et_v, 0), axis=0), "
                    "tl.sum(tl.where(_et_at, _et_want, 0), axis=0), -1, epoch)")


def _emit_dispatch(out: _Lines, ir: GraphIR, tx, trace: bool, released: frozenset, functions: range,
                   claim: bool = False, check: bool = False, part: str = "all") -> None:
    """The branch on the global task id `_et_gid`: one arm per device function in `functions` (the
    ids reaching it lie in their range). claim: each task claims the next queue index ahead. check:
    notifies check their coordinates (generate's check_events). part: as _emit_task's."""
    for k in functions:
        kw = "if" if k == functions[0] else "elif" if k < functions[-1] else "else"
        out(f"{kw} _et_gid < _et_end{k}:" if kw != "else" else "else:")
        with out.indent():
            _emit_task(out, ir, k, ir.tasks[k], tx, trace, released, claim, check, part)


def local_prefix(ir: GraphIR) -> int:
    """How many task functions, from the first, touch nothing a peer can see: no waits, notifies of
    this GPU's events only, bodies given no output, no symmetric tensor, no peer table, none of the
    kernel's own words and no scratch kept zero across launches, and no `when`, value bind or notify
    coordinate that reads a tensor. They may run before the call agreement (generate's local_first):
    a call the ranks disagree on then has written this launch's scratch alone, and notified nothing."""
    tensors = {t.name: t for t in ir.tensors}
    events = {e.name: e for e in ir.events}
    own = {*OWN_PARAMS, *QUEUE_PARAMS, "trace_buf"}
    for k, t in enumerate(ir.tasks):
        bound = [b for _, const, b in _body_bindings(t) if not const]
        touched = [tensors.get(b) for b in bound if isinstance(b, str)]
        exprs = [b for b in bound if isinstance(b, Expr)] + [c for a in t.notifies for c in a.coord]
        if t.when is not None:
            exprs.append(t.when)
        if (t.waits or any(events[a.event].distributed for a in t.notifies)
                or any(isinstance(b, str) and (b.endswith("_peers") or b in own) for b in bound)
                or any(x is not None and (x.symmetric or x.zeroed or x.role == Role.OUTPUT) for x in touched)
                or any(as_expr(x).loads() for x in exprs)):
            return k
    return len(ir.tasks)


def _emit_task(out: _Lines, ir: GraphIR, k: int, t: TaskSpec, tx, trace: bool = False,
               released: frozenset = frozenset(), claim: bool = False, check: bool = False,
               part: str = "all") -> None:
    """One task's waits, body and notifies. released: the events whose completing notify walks
    their consumers into the ready queue (dynamic schedule); the rest are plain notifies. claim:
    where every notify is plain, the next queue index is claimed between the body and the
    notifies (into `_et_claimed`: held for a fence and an atomic, no walk; notifies never wait).
    part: "body" (waits and body, traced) or "notify" (the notifies alone) of a local task
    (generate's local_first), else "all"."""
    trace = trace and part != "notify"
    if trace:
        out("_et_t0, _et_sm = _et_clock(_et_gid)")
    out(f"_et_t = _et_gid - _et_end{k - 1}" if k else "_et_t = _et_gid")
    for a in reversed(range(len(t.grid))):  # unravel row-major
        name = t.index_names[a]
        if a == 0:
            out(f"{name} = _et_t")
        else:
            out(f"{name} = _et_t % _et_g{k}_{a}")
            out(f"_et_t = _et_t // _et_g{k}_{a}")
    events = {e.name: (i, e) for i, e in enumerate(ir.events)}
    out("_et_ok = 1")
    for acc in t.waits:
        i, e = events[acc.event]
        dims = [f"_et_ev_{e.name}_d{d}" for d in range(len(e.shape))]
        coord = [tx(c) for c in acc.coord]
        lin = _linear(dims, coord)
        count = e.count.substitute({f"c{d}": acc.coord[d] for d in range(len(e.shape))})
        scope = "sys" if e.distributed else "gpu"
        out(f"_et_lin = {lin}")
        out(f"_et_ok = _et_ok & _et_wait(arena + ev_{e.name}_off + _et_lin, {_target(e, tx(count))}, max_spins, "
            f"arena, arena_peers, RANK, WORLD, ({EVENT_CODE_BASE + i} << {ELEMENT_BITS}) | (_et_lin & "
            f"{(1 << ELEMENT_BITS) - 1}), -1, epoch, {scope!r}, USE_ASM)")
    cond = "_et_ok != 0" if t.when is None else f"(_et_ok != 0) & ({tx(t.when)})"
    if trace:
        out("_et_t1, _et_sm = _et_clock(_et_gid)")
    out(f"if {cond}:")
    with out.indent():
        if part == "notify" and not t.notifies:
            out("pass")
        if part != "notify":
            out(f"_et_body_{t.name}({', '.join(_bind_body_args(ir, t, tx))})")
        if claim and not any(acc.event in released for acc in t.notifies):
            out("_et_claimed = _et_claim(rq)")
        for acc in t.notifies if part != "body" else ():
            i, e = events[acc.event]
            dims = [f"_et_ev_{e.name}_d{d}" for d in range(len(e.shape))]
            coord, depth = [], out.depth
            for d, c in enumerate(acc.coord):  # et.every(a, b): one notify per coordinate in [a, b)
                if c.op == "span":
                    out(f"for _et_s{d} in range({tx(c.args[0])}, {tx(c.args[1])}):")
                    out.depth += 1
                    coord.append(f"_et_s{d}")
                else:
                    coord.append(tx(c))
            lin = _linear(dims, coord)
            base = f"_et_peer(arena_peers, {coord[0]}, arena)" if e.distributed else "arena"
            scope = "sys" if e.distributed else "gpu"
            if check:   # the first coordinate outside the shape is recorded (ERR_NOTIFY), the notify skipped
                out("_et_bad = -1")
                out("_et_bv = 0")
                out("_et_bn = 0")
                for d in reversed(range(len(coord))):
                    out(f"if ({coord[d]} < 0) | ({coord[d]} >= {dims[d]}):")
                    with out.indent():
                        out(f"_et_bad = {d}")
                        out(f"_et_bv = {coord[d]}")
                        out(f"_et_bn = {dims[d]}")
                out("if _et_bad >= 0:")
                with out.indent():
                    out(f"_et_record(arena, arena_peers, RANK, WORLD, 6, ({EVENT_CODE_BASE + i} << {ELEMENT_BITS}), "
                        "_et_bv, _et_bn, _et_bad, epoch)")
                out("else:")
                out.depth += 1
            if e.name in released:  # the element's count here (loop variables for spans)
                at = {f"c{d}": (var(coord[d]) if c.op == "span" else c) for d, c in enumerate(acc.coord)}
                owner = coord[0] if e.distributed else "RANK"
                n = tx(e.count.substitute(at))
                if e.count.is_data_dependent:   # its target reads a tensor one thread of this task may
                    out("tl.debug_barrier()")   # just have written (every thread evaluates it)
                out(f"_et_release({base} + ev_{e.name}_off + {lin}, {_target(e, n)}, "
                    f"ev_{e.name}_off + {lin}, {owner}, rq, rq_peers, rq_q, rq_pending, rq_rowptr, "
                    f"rq_cols, ev_epoch, RANK, {scope!r})")
            else:
                out(f"_et_notify({base} + ev_{e.name}_off + {lin}, 1, False, {scope!r})")
            out.depth = depth
        if trace:  # tasks that did not run (when false, or a wait timed out) keep zeros
            out("_et_t2, _et_sm = _et_clock(_et_gid)")
            out(f"_et_tr = trace_buf + _et_gid.to(tl.int64) * {TRACE_WORDS}")
            out("tl.store(_et_tr, _et_t0)")
            out("tl.store(_et_tr + 1, _et_t1)")
            out("tl.store(_et_tr + 2, _et_t2)")
            out("tl.store(_et_tr + 3, (_et_sm.to(tl.int64) << 32) | _et_pid)")


def _body_bindings(t: TaskSpec) -> list[tuple[str, bool, object]]:
    """The task's GPU body parameters in order: (name, whether a constexpr, what it is bound to: the
    constexpr's value, an Expr, or the name of a kernel parameter or index, as bind renames it)."""
    fn = t.triton_body
    names = list(getattr(fn, "arg_names", None) or inspect.signature(getattr(fn, "fn", fn)).parameters)
    consts, renamed = dict(t.constexprs), dict(t.bind)
    return [(n, True, consts[n]) if n in consts else (n, False, renamed.get(n, n)) for n in names]


def _bind_body_args(ir: GraphIR, t: TaskSpec, tx) -> list[str]:
    available = set(kernel_params(ir)) | set(t.index_names) | {"USE_ASM"}   # USE_ASM: the kernel's constexpr
    args = []
    for n, const, b in _body_bindings(t):
        if const:
            args.append(repr(b))
        elif isinstance(b, Expr):
            args.append(tx(b))
        elif b in available:
            args.append(b)
        else:
            raise GraphError(f"task {t.name!r}: GPU body {t.triton_body.__name__}() takes {n!r}, which is no index "
                             f"name, tensor, `<tensor>_peers` of a symmetric tensor, size, RANK/WORLD, USE_ASM or "
                             f"constexpr (given constexprs: {sorted(dict(t.constexprs))})")
    return args


_TRITON_TYPES = {"torch.float32": "*fp32", "torch.bfloat16": "*bf16", "torch.float16": "*fp16",
                 "torch.int64": "*i64", "torch.int32": "*i32", "torch.bool": "*i1"}


def signature(ir: GraphIR, trace: bool = False, dynamic: bool = False) -> dict[str, str]:
    """Triton types of the kernel parameters (for ahead-of-time compilation)."""
    sig = {}
    for p in kernel_params(ir, trace, dynamic):
        if p in {t.name for t in ir.tensors}:
            sig[p] = _TRITON_TYPES[str(ir.tensor(p).dtype)]
        elif p.endswith("_peers"):
            sig[p] = "*i64"
        elif p in ("arena", "error_host", "mesh_ctrl", "call_error_host"):
            sig[p] = "*i32"
        elif p in ("trace_buf", "rq"):
            sig[p] = "*i64"
        else:
            sig[p] = "i32"
    return sig


def compile_for(ir: GraphIR, num_programs: int = 132, arch: int = 90, num_warps: int = 4,
                trace: bool = False, dynamic: bool = False, num_stages: int = 3, early: Optional[frozenset] = None,
                local_first: bool = False):
    """The graph's megakernel compiled for sm_`arch` on the host, no GPU needed: Triton's compiled
    kernel (.asm["ptx"], .metadata.shared = bytes of shared memory per program). early, local_first:
    as generate's."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = load_module(ir, generate(ir, trace, dynamic, early, local_first=local_first)).megakernel
    sig = {**signature(ir, trace, dynamic), "NUM_PROGRAMS": "constexpr", "USE_ASM": "constexpr"}
    # Pointers are 16-byte aligned at run time (Triton specialises on that); say so here too.
    aligned = {n for n, m in ir.multiples if m % 16 == 0}
    attrs = {(k,): [["tt.divisibility", 16]] for k, (n, t) in enumerate(sig.items())
             if t.startswith("*") or n in aligned}
    src = triton.compiler.ASTSource(fn, sig, constexprs={"NUM_PROGRAMS": num_programs, "USE_ASM": True},
                                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_ptx(ir: GraphIR, num_programs: int = 132, arch: int = 90, num_warps: int = 4,
                trace: bool = False, dynamic: bool = False, num_stages: int = 3, early: Optional[frozenset] = None,
                local_first: bool = False) -> str:
    """PTX of the graph's megakernel for sm_`arch`, compiled on the host: no GPU needed."""
    return compile_for(ir, num_programs, arch, num_warps, trace, dynamic, num_stages, early, local_first).asm["ptx"]
