"""The GPU backend: a compiled graph launched as one persistent Triton kernel per rank.

Per call: check the inputs (before anything is launched), bind the sizes, and launch
`min(programs, SMs)` co-resident programs (a cooperative launch, so an oversized grid fails
loudly). The first call at a new shape allocates symmetric scratch (grown, never shrunk), zeroes
the event counters, checks that every rank agrees on the sizes, compiles, and ends with a
barrier, so no rank's kernel spins on a peer that is still compiling. Calls at a known shape
do none of that: counters re-arm by growing (`counter >= epoch x count`), and the epochs are the
kernel's own (arena words it bumps), so every argument but the inputs' and outputs' addresses stays
the same from call to call: a call captured in a CUDA graph replays correctly.

States: a kernel keeps one state (arena, buffers, epochs) per input shape on a mesh, the
STATES_KEPT most recently used ones prepared (so a layer's two calls of one kernel at different K
do not re-prepare each other), plus every state a CUDA graph captured: those are pinned for the
mesh's life, never re-laid or moved. Sharing one state, a call at another shape re-laid the counters
and grew (moved) the buffers under a captured graph: replays read garbage or waited forever.
Which states are pinned is agreed by every rank at the next new shape, so
their allocations stay in step even where only some ranks captured.

Watchdog: a wait that expires records the stalled event in the arena's error record (on every
rank) and the kernel drains. The host sees it at the next call or at `check()`, and raises an
error naming the graph, event, coordinate and counter value.

Agreement (mesh/calls.py): every launch checks at entry, on the device, that every rank makes the
same call (graph, plan, input shapes and dtypes, sizes, out= given: the state's signature word);
where one differs nothing runs, each rank records it in its own arena, and each raises
CallMismatchError at its next call of the kernel (or check()); the kernel and the mesh stay usable.
At a new shape the host runs the same check first (then the ranks swap the states CUDA graphs
captured), so ranks that are not at the same call never meet in a host exchange. A rank that
refuses its inputs publishes the refusal as its call (CallAgreement.refuse): the peers' launch
of that call sees it at entry and runs nothing. Publishing synchronises, which a CUDA graph capture
forbids: a call refused while capturing is published at this rank's next call outside a capture.

Streams: launches on one mesh run in call order whatever stream each goes to (mesh/stream_order.py);
launches captured in CUDA graphs are not ordered by us.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np
import torch
from triton.runtime import _allocation as triton_allocation

from .. import knobs, log
from ..kernels.launch_hooks import hooks_active
from ..mesh.calls import Signature, describe_word
from ..mesh.control import ControlLayout, ErrorKind, Event
from ..mesh.errors import CallMismatchError
from ..mesh.persistent import empty_persistent
from ..mesh.stream_order import capturing as stream_capturing, capturing_current
from .bind import MapTable, bind, bind_inputs
from .schedule_dynamic import release_plan
from .codegen_triton import ERR_WORDS, ArenaLayout, decode_event_code, generate, kernel_params
from .errors import GraphError, InputError, RuntimeFault
from .expr import RANK_NAME, WORLD_NAME, evaluate
from .ir import Role, early_at
from .loader import load_module
from .trace import PHASE_WORDS, TRACE_WORDS, earliest, gpu_rows, measure_offset, task_count
from .validate import LazyCheck

INT32_MAX = 2**31 - 1

# Keys of kernels' state in mesh.cache. Not id(kernel): a freed kernel's id is reused by a new one,
# which then found the old state on some ranks and not on others (their collectives desynchronised).
_KERNEL_IDS = itertools.count()
# Error record kinds in a kernel's arena (mesh.control.ErrorKind): a wait timed out, or the ranks'
# calls differed at entry (recorded by each rank in its own arena: nothing ran)
ERR_CALL = int(ErrorKind.CALL)
_LOG = logging.getLogger(__name__)   # ETDIST_DEBUG=1: the generated kernel, at debug level


def _sync(mesh) -> None:
    if mesh.device.type == "cuda":
        torch.cuda.synchronize(mesh.device)


@dataclass
class _Shape:
    """What the runtime prepared for one set of sizes."""

    sizes: dict
    event_shapes: dict
    outputs: dict                      # output name -> (shape on this rank, dtype)
    fixed: dict                        # kernel arguments that stay the same from call to call
    # The argument list, laid out once (the host path of a decode-sized call is tens of us):
    template: list = field(default_factory=list)   # the fixed arguments in place, None elsewhere
    per_call: tuple = ()                           # (position, name) of inputs and outputs
    addresses: Optional[list] = None               # template with tensors as their addresses, or
                                                   # None if a fixed tensor is not 16-byte aligned

    def lay_out(self, params: list) -> None:
        self.template = [self.fixed.get(p) for p in params]
        self.per_call = tuple((i, p) for i, p in enumerate(params) if p not in self.fixed)
        flat = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.template]
        aligned = all(f % 16 == 0 for a, f in zip(self.template, flat) if isinstance(a, torch.Tensor))
        self.addresses = flat if aligned else None

    def args(self, values: dict) -> list:
        """The kernel's arguments: the fixed ones and this call's `values`."""
        args = self.template.copy()
        for i, name in self.per_call:
            args[i] = values[name]
        return args

    def direct_args(self, values: dict) -> Optional[list]:
        """`addresses` with this call's values filled in, for a direct launch; None where a pointer
        is not 16-byte aligned (the compiled binary assumes it)."""
        if self.addresses is None:
            return None
        flat = self.addresses.copy()
        for i, name in self.per_call:
            a = values[name]
            if isinstance(a, torch.Tensor):
                a = a.data_ptr()
                if a % 16:
                    return None
            flat[i] = a
        return flat


@dataclass
class _HotLaunch:
    """The launch a decode step repeats eagerly, laid out once per state: the inputs' names, shapes
    and dtypes and the sizes it was made for, the outputs, and Triton's C launcher with its whole
    argument list (only the inputs' and outputs' addresses change from call to call). Its calls skip
    the general path's checks of a new shape and Triton's Python dispatch (CudaKernel._launch_hot)."""

    launch: object        # the C launcher (Triton's CudaLauncher.launch)
    args: list            # its arguments: grid, stream, function, scratch, metadata, hooks, kernel args
    inputs: tuple         # ((name, shape, dtype, position in args), ...) in call order
    outputs: tuple        # ((name, shape, dtype, position in args, an input of its dtype or None), ...)
    sizes: Optional[dict]
    stream: int


@dataclass
class _MeshState:
    serial: int = -1                 # creation order on this mesh, the same on every rank
    captured: bool = False           # this rank captured a launch of it in a CUDA graph
    pinned: bool = False             # every rank agreed it is captured: never re-laid nor freed
    arena: Optional[torch.Tensor] = None
    arena_peers: Optional[torch.Tensor] = None
    buffers: dict = field(default_factory=dict)  # name -> (flat symmetric/non-symmetric buffer)
    shape: Optional[_Shape] = None
    bind_key: Optional[tuple] = None  # input shapes/dtypes + sizes of the last call: skip re-binding
    # this shape's call signature word (mesh/calls.py) without out=, and {out names given: word}
    word: int = 0
    words: dict = field(default_factory=dict)
    signature: Optional[Signature] = None
    programs: int = 0
    # The arena's error word as the kernel leaves it, in pinned host memory: each launch's last
    # program stores it there (the kernel's `error_host`), and the host reads it at the next call
    error_word: Optional[torch.Tensor] = None
    error_np: object = None   # the same memory as numpy: read per call for ~0.1 us (not a tensor op)
    compiled: object = None  # Triton's compiled kernel, once launched: later calls skip its dispatch
    rq: Optional[torch.Tensor] = None        # the dynamic schedule's ready queue + tables (symmetric)
    rq_peers: Optional[torch.Tensor] = None
    scratch: Optional[torch.Tensor] = None   # Triton's per-program global scratch (TMA descriptors)
    device: Optional[torch.device] = None
    hot: Optional[_HotLaunch] = None          # the eager repeat's launch at this shape, once laid out

    def allocate_scratch(self, size: int, alignment: int, stream) -> torch.Tensor:
        """Triton's allocator hook: one buffer per mesh state, grown never shrunk. Launches of one
        graph on one mesh are stream-ordered (they share the arena too), so reuse is safe."""
        if self.scratch is None or self.scratch.numel() < size:
            self.scratch = empty_persistent(max(size, 1), torch.int8, self.device)
        return self.scratch


STATES_KEPT = 2   # unpinned states per kernel and mesh (each holds its own buffers)


@dataclass
class _KernelStates:
    """A kernel's states on one mesh: one per input shape (bind key), least recently used first."""
    by_key: "OrderedDict[tuple, _MeshState]" = field(default_factory=OrderedDict)
    serials: "itertools.count" = field(default_factory=itertools.count)
    gpu: Optional[int] = None           # the mesh's CUDA device index (None: a CPU mesh, the interpreter)
    last: Optional[_MeshState] = None   # the state of the last call
    watched: tuple = ()      # states captured in CUDA graphs: their replays' errors are read every call


def post_refusal(mesh, kernels=(), reason: str = "its inputs were refused") -> None:
    """This rank refused a call (an op's own argument checks, before choosing a kernel): publish it
    as this rank's call (mesh/calls.py, CallAgreement.refuse), so the peers' launch of that call
    runs nothing and every rank raises, instead of their launch pairing with our next call.
    `kernels` is kept for callers that name the op's kernels; the refusal covers every kernel."""
    calls = getattr(mesh, "calls", None)
    if calls is not None:
        calls.refuse(reason)


def control_block(mesh) -> tuple:
    """The mesh's control block, its peer table and its call-error words, which every launch's call
    agreement uses. A stand-in mesh without them (tests, launch/host_path_cpu.py: one rank, nobody to
    agree with) gets private ones."""
    ctrl = getattr(mesh, "ctrl", None)
    if ctrl is None:
        ctrl = mesh.cache.get("megakernel.ctrl")
        if ctrl is None:
            ctrl = mesh.cache["megakernel.ctrl"] = torch.zeros(ControlLayout(mesh.world_size).size, dtype=torch.int32,
                                                               device=mesh.device)
    call_error = getattr(mesh, "call_error", None)
    if call_error is None:
        call_error = mesh.cache.setdefault("megakernel.call_error", torch.zeros(ERR_WORDS, dtype=torch.int32))
    return ctrl, mesh.peer_ptrs(ctrl), call_error


class CudaKernel:
    """A graph compiled for GPUs. Call `kernel(mesh, **inputs)` on every rank; returns its outputs."""

    target = "cuda"

    def __init__(self, table: MapTable, schedule: str, programs: Optional[int] = None,
                 num_warps: int = 4, num_stages: int = 3, trace: bool = False, early_push: int = 1,
                 check_events: bool = False, check_sizes: bool = True):
        """check_events: the kernel checks every notify's coordinates and, at its end, that no counter
        went past its count (codegen's check_events: a debug mode). check_sizes: validate's
        enumeration at each new size class a call uses (LazyCheck); False leaves it to the kernel."""
        self.dynamic = schedule == "dynamic"
        # the dynamic schedule's early-pushed task functions: the kernel and its host tables agree on them
        self.early = early_at(table.ir, early_push) if self.dynamic else frozenset()
        for e in table.ir.events:
            if self.dynamic and RANK_NAME in e.count.symbols():   # a remote notifier evaluates it
                raise GraphError(f"event {e.name!r}: schedule='dynamic' on GPUs needs counts that do not "
                                 "depend on RANK")
        for e in table.ir.events:
            # A count read from a tensor changes from launch to launch, so its counters cannot re-arm
            # by epoch: the kernel zeroes them when every local task is done, which is race-free
            # only for events that no peer notifies.
            if e.count.is_data_dependent and e.distributed:
                raise GraphError(f"event {e.name!r}: counts that read runtime tensors are supported on "
                                 "target='cuda' for local events only (this one is distributed)")
        for s in table.ir.tensors:
            # Symmetric buffers are allocated (and grown) collectively, so every rank must need the
            # same size: one sized by RANK grew on some ranks only and their allocations desynchronised
            if s.symmetric and any(RANK_NAME in d.symbols() for d in s.shape):
                raise GraphError(f"symmetric tensor {s.name!r}: its shape {list(s.shape)} depends on RANK; "
                                 "on target='cuda' every rank holds the same symmetric buffers (size it "
                                 "for the largest rank, e.g. with the chunk size)")
        self.table, self.ir, self.schedule = table, table.ir, schedule
        self.programs, self.num_warps, self.num_stages = programs, num_warps, num_stages
        self.trace_on, self.check_events = trace, check_events
        # TRITON_INTERPRET=1: the same generated kernel runs on CPU tensors over a cpu-backend
        # mesh (one program per rank, atomic polls instead of inline asm): CI checks codegen
        self.interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if self.interpreted:
            if trace:
                raise GraphError("trace=True reads GPU timers (inline asm): not under TRITON_INTERPRET=1")
            from ..kernels.interpret import patch_interpreter
            patch_interpreter()
        self.source = generate(self.ir, trace, self.dynamic, self.early, check_events)
        if knobs.now("ETDIST_DEBUG", knobs.flag, False):
            log.show_debug(_LOG)
        _LOG.debug("generated kernel of graph %r:\n%s", self.ir.name, self.source)
        self.module = load_module(self.ir, self.source)
        # what ranks must share of the kernel (in every call's signature, mesh/calls.py): the generated
        # module's name carries a hash of its source and tile bodies
        self.plan_key = self.module.__name__.rsplit("_", 1)[-1]
        self.params = kernel_params(self.ir, trace, self.dynamic)
        self.output_names = frozenset(s.name for s in self.ir.tensors if s.role is Role.OUTPUT)
        # the graph checks at the sizes calls use
        self._lazy_check = LazyCheck(self.ir, table, schedule) if check_sizes else (lambda bound: None)
        self._key = ("megakernel", next(_KERNEL_IDS))

    def __repr__(self) -> str:
        return f"CudaKernel({self.ir.name!r}, schedule={self.schedule!r}{', trace=True' if self.trace_on else ''})"

    # -- host side --------------------------------------------------------------------------
    def __call__(self, mesh, sizes: Optional[Mapping[str, int]] = None, out: Optional[dict] = None,
                 **inputs: torch.Tensor) -> dict:
        want = "cpu" if self.interpreted else "nvshmem"
        if getattr(mesh, "backend", None) != want:
            raise InputError(f"graph {self.ir.name!r} was compiled for GPUs: it needs a mesh with the "
                             f"{want!r} backend{' (TRITON_INTERPRET=1)' if self.interpreted else ''}, "
                             f"got {getattr(mesh, 'backend', mesh)!r}")
        if out is not None and not isinstance(out, Mapping):
            raise InputError(f"graph {self.ir.name!r}: out= takes a dict of output tensors by name "
                             f"({sorted(self.output_names)}), got {type(out).__name__}")
        unknown = set(out) - self.output_names if out else None
        if unknown:
            raise InputError(f"graph {self.ir.name!r}: out= names {sorted(unknown)}, which are no outputs")
        if out is None:   # a decode step's repeat: the same shape as the last call, eagerly
            outs = self._launch_hot(mesh, sizes, inputs)
            if outs is not None:
                return outs
        # state lives in the mesh (closing it drops the state with the memory it points into)
        states = mesh.cache.get(self._key)
        if states is None:
            states = mesh.cache[self._key] = _KernelStates(
                gpu=mesh.device.index if mesh.device.type == "cuda" and not self.interpreted else None)
        gpu = states.gpu
        if gpu is None:
            capturing = stream_capturing(mesh.device)   # False but for tests' stand-ins
        elif torch._C._cuda_getDevice() != gpu:
            with torch.cuda.device(gpu):   # the stream we launch on and its capture are the mesh GPU's
                return self(mesh, sizes, out, **inputs)
        else:
            capturing = capturing_current()
        key = (tuple((n, t.shape, t.dtype) if isinstance(t, torch.Tensor) else (n, None, None)
                     for n, t in inputs.items()), tuple(sorted(sizes.items())) if sizes else ())
        last = states.last
        # the same shape as the last call (the common case) needs no lookup: keys compare cheaper than they hash
        st = last if last is not None and last.bind_key == key else states.by_key.get(key)
        calls = getattr(mesh, "calls", None)   # None: a test's stand-in mesh
        if calls is not None and not capturing:
            if calls.owed:
                calls.pay_owed()
            calls.raise_pending()   # an earlier launch (of any kernel) the ranks disagreed on
        if not capturing:
            for seen in states.watched:   # a graph replay's launch that failed (its error word is set)
                if seen.error_np[0] != 0 and seen is not st:
                    self._check_pending(mesh, seen)
        if st is None:   # a new shape: check everything, agree across ranks, prepare, remember
            if capturing:   # preparing synchronises, allocates and talks to the peers
                raise InputError(f"graph {self.ir.name!r}: captured in a CUDA graph at a shape it is not prepared "
                                 f"for: call it once at this shape outside the capture first, just before (a "
                                 f"warm-up, on every rank; only the {STATES_KEPT} shapes used last stay prepared)")
            st = states.last = self._new_shape(mesh, states, key, inputs, sizes, out)
        else:
            if st is not last:
                states.by_key.move_to_end(key)
                states.last = st
                if not capturing and last is not None:
                    self._check_pending(mesh, last)   # the previous call's launch, if it failed
            if not capturing:   # no checks that may synchronise while capturing: the next call makes them
                self._check_pending(mesh, st)
        try:   # cheap checks that shapes cannot cover (a new shape passed them in the agreement)
            for name, t in inputs.items():
                if t.device != mesh.device or not t.is_contiguous():
                    self._bind(mesh, inputs, sizes)  # raises the precise error
                if t.data_ptr() % 16:   # the kernels assume 16-byte aligned rows (TMA needs them): copy
                    inputs[name] = t.clone()
            self._check_out(mesh, out, st.shape.outputs)
        except InputError as e:
            # At a shape every rank has prepared, the peers exchange nothing with us and launch:
            # refused here alone, their launch would wait for our next call and take its data
            post_refusal(mesh, [self], str(e))
            raise
        if capturing and not st.captured:   # pinned at the next agreement; its replays' errors watched
            st.captured = True
            states.watched += (st,)
        if not self.interpreted:   # in call order across streams, ahead of any work on this stream (not captures)
            stream = torch._C._cuda_getCurrentRawStream(gpu)
            order = mesh.stream_order
            if not capturing and stream != order.last:
                order.before(stream)
        outs = {}
        for name, (shape, dtype) in st.shape.outputs.items():
            given = (out or {}).get(name)
            outs[name] = given if given is not None else torch.empty(shape, dtype=dtype, device=mesh.device)
        if self.trace_on:
            st.shape.fixed["trace_buf"].zero_()   # tasks that do not run this launch show no times
        # the epochs are the kernel's own (in the arena); the call's signature word, as out= was given
        values = {**inputs, **outs, "call_sig": st.word if not out else self._word(st, out)}
        scratch = triton_allocation._allocator.set(st.allocate_scratch)   # both launch paths ask it
        try:
            if self.interpreted:  # synchronous, on CPU tensors: errors are known at once
                self.module.megakernel[(st.programs,)](*st.shape.args(values), NUM_PROGRAMS=st.programs,
                                                       USE_ASM=False)
                if calls is not None:
                    calls.raise_pending()
                self._raise_if_this_call_failed(mesh, st)
                return outs
            if not self._launch_direct(mesh, st, values, stream):
                st.hot = None
                st.compiled = self.module.megakernel[(st.programs,)](
                    *st.shape.args(values), NUM_PROGRAMS=st.programs, USE_ASM=True, num_warps=self.num_warps,
                    num_stages=self.num_stages, launch_cooperative_grid=True)
            if not capturing and order.event is not None:
                order.after()
            # laid out again on another stream (a warm-up on a side stream, then calls on the main one)
            if not capturing and not out and not self.trace_on and (st.hot is None or st.hot.stream != stream):
                st.hot = self._hot_launch(st, inputs, sizes, stream)
        finally:
            triton_allocation._allocator.reset(scratch)
        return outs

    def _new_shape(self, mesh, states: _KernelStates, key: tuple, inputs, sizes, out) -> _MeshState:
        """A state prepared for a shape this kernel has no state for (collective): the ranks agree on
        the sizes and on which states CUDA graphs captured (pinned from now on, on every rank); then
        a fresh state, or the least recently used unpinned one once STATES_KEPT are held, re-laid."""
        # a failed launch may not have reached the pinned word yet: a peer that raised on it
        # would leave us waiting in the agreement
        for old in states.by_key.values():
            self._check_pending(mesh, old, now=old is states.last)
        captured = sorted(st.serial for st in states.by_key.values() if st.captured and not st.pinned)
        sig = self._agree_call(mesh, inputs, sizes, out)
        bound, pins = self._agree(mesh, inputs, sizes, out, captured)
        for st in states.by_key.values():
            st.pinned = st.pinned or st.serial in pins
        unpinned = [k for k, st in states.by_key.items() if not st.pinned]   # least recently used first
        if len(unpinned) >= STATES_KEPT:
            st = states.by_key.pop(unpinned[0])
        else:
            st = self._new_state(mesh)
            st.serial = next(states.serials)
        if st.shape is None or st.shape.sizes != bound:
            try:
                self._prepare(mesh, st, bound)
            except BaseException:
                # e.g. the symmetric heap exhausted: kept without a layout (under a key no call has),
                # to be re-laid first; no call can launch over what it freed
                spare = ("unprepared", st.serial)
                states.by_key[spare] = st
                states.by_key.move_to_end(spare, last=False)
                raise
        st.bind_key, st.hot = key, None   # a state kept at equal sizes under another key: its repeat made again
        st.signature, st.words = sig, {}
        st.word = self._word(st, None)
        states.by_key[key] = st
        return st

    def _signature(self, inputs, bound: dict, given=()) -> Signature:
        """What every rank's call at this shape must share (mesh/calls.py): inputs' dtypes, the outputs
        given, the sizes, and the plan (the graph's content, schedule, trace, early push). Not the
        inputs' shapes: a rank's may depend on its rank (its rows of a ragged M), and binding checked
        them against the sizes."""
        args = tuple((n, str(inputs[n].dtype).removeprefix("torch.")) for n in sorted(inputs))
        plan = (("schedule", self.schedule), ("early_push", tuple(sorted(self.early))), ("trace", self.trace_on),
                ("source", self.plan_key))   # the generated kernel's own hash: any other difference
        return Signature(self.ir.name, args + (("out", tuple(sorted(given))),
                                               ("sizes", tuple(sorted(bound.items()))), ("plan", plan)))

    def _check_offsets(self, bound: dict, world: int) -> None:
        """Every tensor and the event arena at these sizes within 32-bit element offsets (what the tile
        bodies and the arena's indices compute in), checked before anything is allocated."""
        at = {k: v for k, v in bound.items() if k != WORLD_NAME}
        for s in self.ir.tensors:
            for r in range(world if any(RANK_NAME in d.symbols() for d in s.shape) else 1):
                n = math.prod(evaluate(d, {**bound, RANK_NAME: r}) for d in s.shape)
                if n > INT32_MAX:
                    raise InputError(f"graph {self.ir.name!r}: tensor {s.name!r} would hold {n:,} elements at sizes "
                                     f"{at}: the GPU kernels address a tensor with 32-bit element offsets (at most "
                                     f"2**31 - 1 = {INT32_MAX:,}); split the call (fewer rows per call)")
        events = sum(math.prod(evaluate(d, bound) for d in e.shape) for e in self.ir.events)
        if events + ArenaLayout(world).events > INT32_MAX:
            raise InputError(f"graph {self.ir.name!r}: {events:,} event counters at sizes {at} pass 32-bit offsets; "
                             "split the call (fewer rows per call)")

    def _word(self, st: _MeshState, out: Optional[Mapping]) -> int:
        """The state's signature word for a call that gives the outputs `out` names."""
        given = frozenset(n for n, t in (out or {}).items() if t is not None)
        word = st.words.get(given)
        if word is None:
            sig = st.signature
            word = st.words[given] = (Signature(sig.op, sig.args[:-3] + (("out", tuple(sorted(given))),)
                                                + sig.args[-2:]).word if sig is not None else 2)
        return word

    def _agree_call(self, mesh, inputs, sizes, out) -> Optional[Signature]:
        """A new shape: this rank's inputs checked, then the call agreed with every rank on the host
        (mesh/calls.py) before anything else is swapped; a rank that refuses publishes the refusal, so
        no rank waits in an exchange its peers never join (a stand-in mesh without call agreement
        skips it). Returns this call's signature."""
        try:
            bound = self._bind(mesh, inputs, sizes)
            self._check_out(mesh, out, self._output_shapes(bound, mesh.rank))
            self._check_offsets(bound, mesh.world_size)
            self._lazy_check(bound)
        except (InputError, GraphError) as e:
            post_refusal(mesh, [self], f"{type(e).__name__}: {e}")
            raise
        sig = self._signature(inputs, bound)
        calls = getattr(mesh, "calls", None)
        if calls is not None:
            given = tuple(sorted(n for n, t in (out or {}).items() if t is not None))
            calls.agree(Signature(sig.op, sig.args[:-3] + (("out", given),) + sig.args[-2:]))
        return sig

    def _states(self, mesh) -> list:
        """Every state of this kernel on `mesh`."""
        states = mesh.cache.get(self._key)
        return list(states.by_key.values()) if states is not None else []

    def state(self, mesh) -> Optional[_MeshState]:
        """The state of this kernel's last call on `mesh` (its buffers, its compiled binary), or None."""
        states = mesh.cache.get(self._key)
        return states.last if states is not None else None

    def _hot_launch(self, st: _MeshState, inputs: dict, sizes, stream: int) -> Optional[_HotLaunch]:
        """The state's repeat launch, laid out after a call of the general path (None where the binary
        is not known yet, a pointer was not 16-byte aligned, an input is no tensor, or Triton asks
        for profiler scratch: those calls stay on the general path)."""
        k, shape = st.compiled, st.shape
        run = getattr(k, "run", None)
        if (k is None or shape.addresses is None or getattr(run, "profile_scratch_size", 1)
                or not all(isinstance(t, torch.Tensor) for t in inputs.values())):
            return None
        scratch = None
        if run.global_scratch_size:   # Triton's per-program scratch: st.scratch, sized at the first launch
            scratch = st.allocate_scratch(run.global_scratch_size * st.programs * getattr(run, "num_ctas", 1),
                                          run.global_scratch_align, stream).data_ptr()
        head = [st.programs, 1, 1, stream, k.function, run.launch_cooperative_grid, run.launch_pdl, scratch, None,
                k.packed_metadata, None, None, None]
        args = head + shape.addresses + [st.programs, True]   # NUM_PROGRAMS, USE_ASM
        at = {name: len(head) + i for i, name in shape.per_call}
        args[at["call_sig"]] = st.word
        # an output is made like an input of its dtype (Tensor.new_empty: ~1 us less than torch.empty's
        # keyword parsing, on the GPU machine's host: experiments/host_profile.py)
        like = {t.dtype: n for n, t in reversed(inputs.items())}
        return _HotLaunch(run.launch, args, tuple((n, t.shape, t.dtype, at[n]) for n, t in inputs.items()),
                          tuple((n, sh, dt, at[n], like.get(dt)) for n, (sh, dt) in shape.outputs.items()),
                          None if sizes is None else dict(sizes), stream)

    def _launch_hot(self, mesh, sizes, inputs: dict) -> Optional[dict]:
        """A call at the shape of this kernel's last call on `mesh`, eagerly, on the stream of the
        last launch, with no out=, no error pending and no profiler hook: the checks a known shape
        needs (device, contiguity, alignment, shapes and dtypes as before), fresh outputs, and
        Triton's C launcher (the host time is a decode call's eager time: records host_path).
        Returns its outputs, or None: the general path then handles the call (and any error)."""
        states = mesh.cache.get(self._key)
        st = states.last if states is not None else None
        hot = st.hot if st is not None else None
        if hot is None or sizes != hot.sizes or len(inputs) != len(hot.inputs):
            return None
        gpu = states.gpu
        if gpu is None or torch._C._cuda_getDevice() != gpu or capturing_current() or st.error_np[0] != 0:
            return None
        calls = getattr(mesh, "calls", None)
        if calls is not None:
            if calls.owed:
                return None
            calls.raise_pending()   # an earlier launch (of any kernel) the ranks disagreed on
        for seen in states.watched:
            if seen.error_np[0] != 0:
                return None
        order = mesh.stream_order
        stream = torch._C._cuda_getCurrentRawStream(gpu)
        if stream != hot.stream or order.last != stream or order.event is not None or hooks_active():
            return None
        args = hot.args.copy()
        for (name, t), (want, shape, dtype, at) in zip(inputs.items(), hot.inputs):
            if (name != want or not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype
                    or t.get_device() != gpu or not t.is_contiguous()):
                return None
            ptr = t.data_ptr()
            if ptr % 16:
                return None
            args[at] = ptr
        outs = {}
        for name, shape, dtype, at, like in hot.outputs:
            t = outs[name] = (inputs[like].new_empty(shape) if like is not None
                              else torch.empty(shape, dtype=dtype, device=mesh.device))
            args[at] = t.data_ptr()
        hot.launch(*args)
        return outs

    def _launch_direct(self, mesh, st: _MeshState, values: dict, stream: int) -> bool:
        """Launch the already compiled kernel without Triton's per-call dispatch (which costs tens
        of microseconds for a kernel with this many arguments). Only where the binary is known to
        fit: every pointer 16-byte aligned as when it was compiled, and no profiler hook set."""
        k = st.compiled
        if k is None or hooks_active():
            return False
        flat = st.shape.direct_args(values)
        if flat is None:
            return False
        k.run(st.programs, 1, 1, stream, k.function,
              k.packed_metadata, None, None, None, *flat, st.programs, True)
        return True

    def _new_state(self, mesh) -> _MeshState:
        if self.interpreted:  # the interpreter runs programs one after another: one per rank
            return _MeshState(programs=1, device=mesh.device)
        slots = torch.cuda.get_device_properties(mesh.device).multi_processor_count
        word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        return _MeshState(programs=min(self.programs or slots, slots), error_word=word, error_np=word.numpy(),
                          device=mesh.device)

    def check(self, mesh) -> None:
        """Wait for the launches so far and raise if any of their waits timed out (on any rank), in
        any state (graph replays included)."""
        calls = getattr(mesh, "calls", None)
        if calls is not None and not stream_capturing(mesh.device):
            if calls.owed:
                calls.pay_owed()
            _sync(mesh)
            calls.raise_pending()   # a launch the ranks disagreed on (of this kernel or any other)
        states = [st for st in self._states(mesh) if st.arena is not None]
        if not states:
            return
        _sync(mesh)
        for st in states:
            self._raise_if_this_call_failed(mesh, st)

    def trace(self, mesh, gather: bool = True) -> list[tuple]:
        """The last launch's tasks as (rank, SM, label, start us, end us) rows, every rank's when
        gather=True (collective: call it on every rank). Each GPU's timer has its own origin (2x H200:
        ~0.24 s apart): every rank measures its own against the host clock (fusion/trace.py) and the
        rows are on that clock, from the earliest program entry of any rank (gather=False: of this rank);
        besides the tasks, each program's phases: `agree` (entry to the call agreed), `finish` (its tasks
        done to its end).
        Needs compile(..., trace=True). Write them with et.fusion.trace.write_chrome(rows, path, track="SM")."""
        if not self.trace_on:
            raise GraphError(f"graph {self.ir.name!r} was compiled without trace=True: nothing was recorded")
        st = self.state(mesh)
        if st is None or st.shape is None:
            raise GraphError(f"graph {self.ir.name!r} has not been launched on this mesh yet")
        self.check(mesh)  # waits for the launch and raises if it failed
        env = {**st.shape.sizes, RANK_NAME: mesh.rank}
        buf = st.shape.fixed["trace_buf"].cpu().tolist()
        offset, _ = measure_offset(mesh.device)           # this GPU's timer less the host clock
        mine = earliest(buf, task_count(self.ir, env))
        start = None if mine is None else mine - offset   # on the host clock
        starts = [s for s in (mesh.comm.allgather(start) if gather else [start]) if s is not None]
        origin = min(starts, default=0) + offset          # the common origin, on this GPU's timer
        rows = gpu_rows(self.ir, env, buf, mesh.rank, origin_ns=origin)
        return [row for part in mesh.comm.allgather(rows) for row in part] if gather else rows

    def _bind(self, mesh, inputs, sizes) -> dict:
        world = mesh.world_size
        for name, t in inputs.items():
            if isinstance(t, torch.Tensor):
                if t.device != mesh.device:
                    raise InputError(f"graph {self.ir.name!r} input {name!r} is on {t.device}, the mesh on {mesh.device}")
                if not t.is_contiguous():
                    raise InputError(f"graph {self.ir.name!r} input {name!r} is not contiguous: pass .contiguous()")
        return bind_inputs(self.ir, {mesh.rank: inputs}, sizes, world=world, device_type=None)

    def _output_shapes(self, bound: dict, rank: int) -> dict:
        """name -> (shape, dtype) of this rank's outputs at the bound sizes."""
        env = {**bound, RANK_NAME: rank}
        return {s.name: (tuple(evaluate(d, env) for d in s.shape), s.dtype) for s in self.ir.tensors
                if s.role is Role.OUTPUT}

    def _check_out(self, mesh, out, outputs: Mapping[str, tuple]) -> None:
        for name, (shape, dtype) in outputs.items():
            given = (out or {}).get(name)
            if given is not None and (not isinstance(given, torch.Tensor) or tuple(given.shape) != shape or
                                      given.dtype != dtype or not given.is_contiguous() or
                                      given.device != mesh.device):
                got = (f"{list(given.shape)} {given.dtype} on {given.device}"
                       f"{'' if given.is_contiguous() else ', not contiguous'}"
                       if isinstance(given, torch.Tensor) else type(given).__name__)
                raise InputError(f"out[{name!r}]: need a contiguous {dtype} tensor "
                                 f"of shape {list(shape)} on {mesh.device}, got {got}")

    def _agree(self, mesh, inputs, sizes, out=None, captured=()) -> tuple[dict, set]:
        """Bind this rank's inputs (and check its `out` tensors) and swap the outcome with every rank
        before anything launches: a rank whose inputs are refused makes every rank raise (rather than
        leaving peers waiting, or pairing their launch with its next call). Also swaps the serials
        of the states this rank captured in CUDA graphs: returns (sizes, every rank's serials)."""
        try:
            bound, mine = self._bind(mesh, inputs, sizes), None
            self._check_out(mesh, out, self._output_shapes(bound, mesh.rank))
        except InputError as e:
            bound, mine = None, str(e)
        everyone = mesh.comm.allgather(mine if mine is not None else
                                       {"sizes": sorted(bound.items()), "captured": list(captured)})
        if mine is not None:
            raise InputError(mine)
        refused = [(r, e) for r, e in enumerate(everyone) if isinstance(e, str)]
        if refused:
            raise InputError(f"graph {self.ir.name!r}: rank {refused[0][0]} refused its inputs: {refused[0][1]}")
        if any(e["sizes"] != everyone[0]["sizes"] for e in everyone):
            listing = "; ".join(f"rank {r}: {dict(e['sizes'])}" for r, e in enumerate(everyone))
            raise InputError(f"graph {self.ir.name!r}: ranks disagree on sizes ({listing})")
        return bound, {serial for e in everyone for serial in e["captured"]}

    def _prepare(self, mesh, st: _MeshState, bound: dict) -> None:
        """New sizes (agreed by every rank): (re)allocate, zero the counters, barrier."""
        # No layout until this completes: growing frees buffers first, and if an allocation then
        # fails (heap exhausted) a call at the old sizes would launch over the freed ones
        st.shape = st.bind_key = st.hot = None
        world = mesh.world_size
        scratch = {}
        for s in self.ir.tensors:
            if s.role is not Role.SCRATCH:
                continue
            shape = tuple(evaluate(d, {**bound, RANK_NAME: mesh.rank}) for d in s.shape)
            scratch[s.name] = self._buffer(mesh, st, s, shape)
            if s.zeroed:                 # a new view, or new memory: zero (the launches keep it so)
                scratch[s.name].zero_()
        event_shapes = {e.name: tuple(evaluate(d, bound) for d in e.shape) for e in self.ir.events}
        offsets, at = {}, ArenaLayout(world).events
        for e in self.ir.events:
            offsets[e.name] = at
            at += math.prod(event_shapes[e.name])
        if st.arena is None or st.arena.numel() < at:
            _sync(mesh)
            if st.arena is not None:
                mesh.free(st.arena)
                st.arena = None
            st.arena = mesh.empty((max(at, 4096),), torch.int32)
            st.arena_peers = mesh.peer_ptrs(st.arena)
        _sync(mesh)
        st.arena[ArenaLayout(world).ev_epoch:].zero_()  # counters and ev_epoch; errors, exit lanes, epoch kept
        env = {**bound, RANK_NAME: mesh.rank}
        ctrl, ctrl_peers, call_error = control_block(mesh)
        fixed = {**scratch, **bound, RANK_NAME: mesh.rank, "arena": st.arena, "arena_peers": st.arena_peers,
                 "max_spins": mesh.watchdog_spins(), "error_host": self._error_host(st), "mesh_ctrl": ctrl,
                 "mesh_ctrl_peers": ctrl_peers, "call_error_host": call_error}
        fixed.update({f"ev_{e.name}_off": offsets[e.name] for e in self.ir.events})
        fixed.update({f"{name}_peers": mesh.peer_ptrs(t) for name, t in scratch.items()
                      if self.ir.tensor(name).symmetric})
        missing = [f"{s.name}_peers" for s in self.ir.tensors if s.symmetric and f"{s.name}_peers" not in fixed]
        if missing:
            raise InputError(f"graph {self.ir.name!r}: symmetric inputs and outputs are not supported yet "
                             f"({missing}); declare them as scratch")
        outputs = self._output_shapes(bound, mesh.rank)
        if self.dynamic:
            self._prepare_queue(mesh, st, bound, offsets, event_shapes, at, fixed)
        if self.trace_on:
            fixed["trace_buf"] = empty_persistent(max(1, task_count(self.ir, env)) * TRACE_WORDS
                                                  + st.programs * PHASE_WORDS, torch.int64, mesh.device).zero_()
        st.shape = _Shape(dict(bound), event_shapes, outputs, fixed)
        st.shape.lay_out(self.params)
        mesh.barrier()  # every rank zeroed its counters before any rank notifies into them

    def _prepare_queue(self, mesh, st: _MeshState, bound: dict, offsets: dict, event_shapes: dict, at: int,
                       fixed: dict) -> None:
        """The dynamic schedule's tables at these sizes (ready_queue.py's layout): this rank's inverse
        map as CSR over its arena words (each entry with its task's number of waits), the seeded
        tasks (those that wait on nothing, then the early-pushed ones); plus a zeroed queue. One
        symmetric int64 buffer, sized by the largest rank."""
        b = bind(self.table, bound)
        plan = release_plan(b, mesh.rank, self.early)
        env = {**bound, RANK_NAME: mesh.rank}
        waits, initial = list(plan.waits), list(plan.initial)
        by_word: dict = {}
        for (ev, coord), gids in plan.consumers.items():
            if not self.ir.event(ev).count.is_data_dependent and self.table.count(ev, coord, env) == 0:
                for g in gids:   # an element that needs no notify is complete from the start
                    waits[g] -= 1
                    if waits[g] == 0:
                        initial.append(g)
                continue
            word = offsets[ev] + int(np.ravel_multi_index(coord, event_shapes[ev]))
            by_word.setdefault(word, []).extend(gids)
        rowptr, cols = [0] * (at + 1), []
        for w in range(at):   # a consumer's entry carries its number of waits: waits << 32 | task
            cols.extend((waits[g] << 32) | g for g in by_word.get(w, ()))
            rowptr[w + 1] = len(cols)
        T = len(waits)
        if T >= 2 ** 31:   # queue entries and slots carry a task id in 31 bits (take's int32)
            raise GraphError(f"graph {self.ir.name!r}: {T} tasks at these sizes; the dynamic schedule takes < 2**31")
        queued = b.tail - b.pinned   # pinned and tail tasks run by the static formula, never queued
        seeded = sorted(initial) + plan.early   # claimed in this order, before anything pushed
        shared = mesh.comm.allgather((T, len(cols), len(seeded), queued, tuple(sorted(self.early)), (b.pinned, b.tail)))
        if len({row[4] for row in shared}) > 1:   # a walk one rank expects would never come from another
            raise GraphError(f"graph {self.ir.name!r}: the ranks disagree on which tasks are pushed early "
                             f"({[list(row[4]) for row in shared]}); compile with the same early_push on every rank")
        if len({row[5] for row in shared}) > 1:   # likewise a notify one rank makes plain, another walks
            raise GraphError(f"graph {self.ir.name!r}: the ranks disagree on which tasks are pinned or the tail "
                             f"(first queued and first tail task ids {[row[5] for row in shared]}); build the graph "
                             "alike on every rank (moe_layer: the same pin_router and tail)")
        T_max, C_max, I_max, N_max = (max(v) for v in zip(*(row[:4] for row in shared)))
        Q = 1 << max(0, (N_max - 1).bit_length())
        lay = {"rq_q": Q, "rq_pending": 2 + Q, "rq_rowptr": 2 + Q + T_max}
        lay["rq_cols"] = lay["rq_rowptr"] + at + 1
        lay["rq_init"] = lay["rq_cols"] + max(C_max, 1)
        n = lay["rq_init"] + max(I_max, 1)
        host = torch.zeros(n, dtype=torch.int64)
        host[lay["rq_rowptr"]:lay["rq_rowptr"] + at + 1] = torch.tensor(rowptr, dtype=torch.int64)
        host[lay["rq_cols"]:lay["rq_cols"] + len(cols)] = torch.tensor(cols, dtype=torch.int64)
        host[lay["rq_init"]:lay["rq_init"] + len(seeded)] = torch.tensor(seeded, dtype=torch.int64)
        if st.rq is None or st.rq.numel() < n:
            _sync(mesh)
            if st.rq is not None:
                mesh.free(st.rq)
                st.rq = None
            st.rq = mesh.empty((n,), torch.int64)
            st.rq_peers = mesh.peer_ptrs(st.rq)
        st.rq[:n].copy_(host)
        # seeded ids that run consecutively are computed from the first, not read after each claim
        base = seeded[0] if seeded and seeded == list(range(seeded[0], seeded[0] + len(seeded))) else -1
        fixed.update(lay, rq=st.rq, rq_peers=st.rq_peers, rq_ninit=len(seeded), rq_seed_base=base, rq_total=queued)

    def _error_host(self, st: _MeshState) -> torch.Tensor:
        """Where the kernel leaves its error word: the pinned word on GPUs; under the interpreter
        (CPU tensors, errors read from the arena itself) a word that nothing reads."""
        if self.interpreted:
            return torch.zeros(1, dtype=torch.int32)
        if st.error_word is None:
            raise RuntimeError(f"graph {self.ir.name!r}: no pinned error word for the kernel to store into")
        return st.error_word

    def _buffer(self, mesh, st: _MeshState, spec, shape) -> torch.Tensor:
        n = math.prod(shape)
        have = st.buffers.get(spec.name)
        if have is None or have.numel() < n:
            cap = max(n, 1) if have is None else max(n, 2 * have.numel())
            _sync(mesh)
            if have is not None and spec.symmetric:
                del st.buffers[spec.name]   # freed: not to be reused if the allocation below fails
                mesh.free(have)
            have = (mesh.empty((cap,), spec.dtype) if spec.symmetric
                    else empty_persistent(cap, spec.dtype, mesh.device))
            st.buffers[spec.name] = have
        return have[:n].view(shape)

    def _raise_if_this_call_failed(self, mesh, st: _MeshState) -> None:
        """After the last launch has finished (synced): raise its error, if any."""
        self._raise_if_failed(mesh, st, st.arena[:ERR_WORDS].tolist())

    def _check_pending(self, mesh, st: _MeshState, now: bool = False) -> None:
        """Raise a finished launch's error. Per call only the pinned word is read: it changes only when
        a launch's last program stores it (the launch's end), so nonzero means a finished launch failed; `now`
        (after a sync) and the interpreter (CPU memory) read the record itself."""
        if st.arena is not None and (now or self.interpreted or st.error_np[0] != 0):
            _sync(mesh)
            self._raise_if_failed(mesh, st, st.arena[:ERR_WORDS].tolist())

    def _raise_if_failed(self, mesh, st: _MeshState, words) -> None:
        if int(words[0]) == 0:
            return
        kind, rank, code, observed, expected, peer, epoch = (int(w) for w in words[:7])
        if kind == ERR_CALL:   # the launch ran nothing: forget the record, the kernel stays usable
            _sync(mesh)
            st.arena[:ERR_WORDS].zero_()
            if st.error_np is not None:
                st.error_np[0] = 0
            calls = getattr(mesh, "calls", None)
            if calls is not None:
                raise calls.device_error(epoch, expected, observed, peer)
            raise CallMismatchError(f"graph {self.ir.name!r}: rank {peer} made another call than this one "
                                    f"({describe_word(expected) or expected}) as call {epoch}")
        what = f"event code {code}"
        dec = decode_event_code(code)
        if kind in (ErrorKind.NOTIFY, ErrorKind.OVER) and dec is not None and dec[0] < len(self.ir.events):
            ev = self.ir.events[dec[0]]
            if kind == ErrorKind.NOTIFY:
                raise RuntimeFault(f"graph {self.ir.name!r}: a task on rank {rank} notified {ev.name} at coordinate "
                                   f"{observed} of dimension {peer}, outside its {expected} elements (launch {epoch}; "
                                   "compiled with check_events=True): a notify map is wrong at these sizes")
            coord = (np.unravel_index(dec[1], st.shape.event_shapes[ev.name]) if st.shape is not None else (dec[1],))
            raise RuntimeFault(f"graph {self.ir.name!r}: {ev.name}{[int(c) for c in coord]} on rank {rank} was "
                               f"notified past its count: counter {observed}, at most {expected} after launch "
                               f"{epoch} (compiled with check_events=True): more notifies than the count says")
        alive = getattr(mesh, "_peer_alive", None)
        gone = [s for s in range(mesh.world_size) if alive is not None and not alive(s)]
        gone = f"Ranks {gone} have exited or died (their liveness locks are free)" if gone else None
        if Event.decode(code)[0] == Event.CALL:   # the launch's entry: a peer never made this call
            raise RuntimeFault(
                f"graph {self.ir.name!r}: rank {rank} waited at the launch's entry for rank {peer} to make call "
                f"{expected} (every rank makes the same calls in the same order; its last was {observed}); the "
                f"watchdog expired after ~{mesh.watchdog_s:g} s. "
                + (gone or f"Rank {peer} skipped a call, is stuck before it, or failed"))
        if dec is not None and st.shape is not None:
            e, linear = dec
            if e < len(self.ir.events):
                ev = self.ir.events[e]
                coord = np.unravel_index(linear, st.shape.event_shapes[ev.name])
                what = f"{ev.name}{[int(c) for c in coord]}"
            else:   # the one code past the events a megakernel waits on (no exit rendezvous: d48c809)
                what = "its ready queue (a claimed entry never arrived)"
        raise RuntimeFault(f"graph {self.ir.name!r}: rank {rank} waited on {what} (launch {epoch}): counter "
                           f"{observed}, needed {expected}; the watchdog expired after ~{mesh.watchdog_s:g} s. "
                           + (gone or "A task that should notify it did not run (a peer failed, or the graph is wrong)"))
