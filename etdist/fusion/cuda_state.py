"""A CudaKernel's per-shape state on a mesh (arena, buffers, ready queue, error word), prepared at a new shape."""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..mesh.calls import Signature
from ..mesh.persistent import empty_persistent
from .bind import bind
from .codegen_triton import ArenaLayout
from .cuda_agreement import control_block
from .cuda_layout import _HotLaunch, _Shape
from .errors import GraphError, InputError
from .expr import RANK_NAME, evaluate
from .ir import Role
from .schedule_dynamic import release_plan
from .trace import PHASE_WORDS, TRACE_WORDS, task_count


def _sync(mesh) -> None:
    if mesh.device.type == "cuda":
        torch.cuda.synchronize(mesh.device)


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


class StateMixin:
    """CudaKernel's states on a mesh: made, found and prepared (a mixin: uses self.ir, self.table,
    self.params, self.programs, self.dynamic, self.early, self.trace_on, self.interpreted, self._key
    and AgreementMixin._output_shapes)."""

    def _states(self, mesh) -> list:
        """Every state of this kernel on `mesh`."""
        states = mesh.cache.get(self._key)
        return list(states.by_key.values()) if states is not None else []

    def state(self, mesh) -> Optional[_MeshState]:
        """The state of this kernel's last call on `mesh` (its buffers, its compiled binary), or None."""
        states = mesh.cache.get(self._key)
        return states.last if states is not None else None

    def _new_state(self, mesh) -> _MeshState:
        if self.interpreted:  # the interpreter runs programs one after another: one per rank
            return _MeshState(programs=1, device=mesh.device)
        slots = torch.cuda.get_device_properties(mesh.device).multi_processor_count
        word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        return _MeshState(programs=min(self.programs or slots, slots), error_word=word, error_np=word.numpy(),
                          device=mesh.device)

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
                             "alike on every rank (the same TaskSpec.pinned and tail)")
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
