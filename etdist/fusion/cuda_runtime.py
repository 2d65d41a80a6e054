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

Modules: CudaKernel (here) runs a call and its launches; cuda_agreement.py binds and agrees on a call,
cuda_state.py keeps and prepares the per-shape states, cuda_layout.py lays out the arguments and the
repeat launch, cuda_errors.py raises what a launch recorded.
"""
from __future__ import annotations

import itertools
import logging
from typing import Mapping, Optional

import torch
from triton.runtime import _allocation as triton_allocation

from .. import knobs, log
from ..kernels.launch_hooks import hooks_active
from ..mesh.stream_order import capturing as stream_capturing, capturing_current
from .bind import MapTable
from .codegen_triton import generate, kernel_params
from .cuda_agreement import AgreementMixin, post_refusal
from .cuda_errors import ErrorMixin
from .cuda_layout import LayoutMixin
from .cuda_state import STATES_KEPT, StateMixin, _KernelStates, _MeshState, _sync
from .errors import GraphError, InputError
from .expr import RANK_NAME
from .ir import Role, early_at
from .loader import load_module
from .trace import earliest, gpu_rows, measure_offset, task_count
from .validate import LazyCheck

# Keys of kernels' state in mesh.cache. Not id(kernel): a freed kernel's id is reused by a new one,
# which then found the old state on some ranks and not on others (their collectives desynchronised).
_KERNEL_IDS = itertools.count()
_LOG = logging.getLogger(__name__)   # ETDIST_DEBUG=1: the generated kernel, at debug level


class CudaKernel(AgreementMixin, StateMixin, LayoutMixin, ErrorMixin):
    """A graph compiled for GPUs. Call `kernel(mesh, **inputs)` on every rank; returns its outputs."""

    target = "cuda"

    def __init__(self, table: MapTable, schedule: str, programs: Optional[int] = None,
                 num_warps: int = 4, num_stages: int = 3, trace: bool = False, early_push: int = 1,
                 check_events: bool = False, check_sizes: bool = True, local_first: bool = False):
        """check_events: the kernel checks every notify's coordinates and, at its end, that no counter
        went past its count (codegen's check_events: a debug mode). check_sizes: validate's
        enumeration at each new size class a call uses (LazyCheck); False leaves it to the kernel.
        local_first: the graph's local prefix runs during the call agreement (codegen's)."""
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
        self.interpreted = knobs.triton_interpreted()
        if self.interpreted:
            if trace:
                raise GraphError("trace=True reads GPU timers (inline asm): not under TRITON_INTERPRET=1")
            from ..kernels.interpret import patch_interpreter
            patch_interpreter()
        self.source = generate(self.ir, trace, self.dynamic, self.early, check_events, local_first)
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
