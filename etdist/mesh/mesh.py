"""The Mesh: ranks that found each other, symmetric memory, a control block, and errors.

    mesh = init_mesh()                    # reads torchrun / mpirun / srun from the environment
    x = mesh.empty((1024,), torch.bfloat16)   # symmetric: every rank holds one, same shape
    y = mesh.peer(x, 1)                   # rank 1's copy, writable from here
    ptrs = mesh.peer_ptrs(x)              # int64 [world] on mesh.device: base address per rank
    mesh.barrier(); mesh.close()          # or `with init_mesh() as mesh:`
"""
from __future__ import annotations

import itertools
import math
import numbers
import os
import socket
import time
import weakref
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import torch

from .. import knobs
from .control import ERR_WORDS, ControlLayout, ErrorKind, ErrorRecord, Event
from .calls import BOARD_BYTES, CallAgreement
from .errors import MeshError, PeerTimeoutError, ShapeMismatchError
from .hostcomm import HostComm, make_host_comm
from .launch import Launch, Launcher, detect_launch, resolve_launch
from .persistent import empty_persistent
from .stream_order import StreamOrder

_CURRENT: Optional["Mesh"] = None
_ALIGN = 256  # bytes; every symmetric allocation starts aligned for 16-byte vector access
_LIVENESS_S = 0.05   # how often a host wait asks whether the rank it waits on is still there


# Meshes by key: torch custom ops (collectives/compiled.py) take plain values, so a mesh travels as its key,
# a string (torch.compile(dynamic=True) would make an int key symbolic). The key names the rank and the
# world: inductor's FX graph cache (on disk, across runs) keys a compiled graph on its constants, and
# the ops' output shapes depend on both (a world-1 run's graph, found by a later world-2 run whose
# mesh had the same key, expected all M rows where the op returned its rank's half)
_BY_KEY: "weakref.WeakValueDictionary[str, Mesh]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def _back_off(turns: int) -> None:
    """A host spin's turn `turns`: spin, then yield the core (the peer it waits on may need it: two
    ranks on two busy cores took ~0.7 ms a lock-step call with sleeps from the 200th turn), then sleep."""
    if turns > 20_000:
        time.sleep(min(1e-3, 1e-8 * turns))
    elif turns > 50:
        os.sched_yield()


def remember(mesh) -> str:
    """Give `mesh` a key that mesh_by_key finds it by while it lives (Mesh.__init__ does; test fakes may)."""
    mesh.key = f"mesh{next(_KEYS)}-rank{mesh.rank}-of{mesh.world_size}"
    _BY_KEY[mesh.key] = mesh
    return mesh.key


def compile_token(device) -> torch.Tensor:
    """What the mesh's torch custom ops declare they write (collectives/compiled.py): so torch.compile keeps
    each call even where its result goes unused on some rank (a pure op would be dropped there, and
    its peers would wait for it), in call order. A static address: inductor's CUDA graphs take it."""
    token = torch.zeros(1, dtype=torch.int32, device=device)
    # what torch._dynamo.mark_static_address(token, guard=False) sets, without importing Dynamo at
    # every mesh start (~1 s) for programs that never compile
    token._dynamo_static_input_type = "unguarded"
    return token


def mesh_by_key(key: str) -> "Mesh":
    mesh = _BY_KEY.get(key)
    if mesh is None:
        raise MeshError(f"no mesh with key {key}: it was closed or garbage-collected")
    return mesh


def timing_refused() -> Optional[str]:
    """Why times taken now would mean nothing (the current mesh's ranks share a GPU), or None."""
    if _CURRENT is not None and _CURRENT.shares_gpu:
        return ("the mesh's ranks share a GPU (init_mesh(share_gpu=True) / ETDIST_SHARE_GPU=1): their kernels take "
                "turns on it, so a time measures the turns, not the op; it serves correctness checks only")
    return None


def current_mesh() -> "Mesh":
    """The mesh of the last init_mesh() not yet closed, for ops that take mesh=None."""
    if _CURRENT is None:
        raise MeshError("no mesh: call etdist.init_mesh() first (or pass mesh=...)")
    return _CURRENT


@dataclass(eq=False)  # compared by identity: fields hold tensors
class _Alloc:
    views: List[torch.Tensor]  # flat uint8, one per rank
    base: int  # own data_ptr
    nbytes: int


class Mesh:
    """Use init_mesh() to make one."""

    def __init__(self, launch: Launch, backend: str, device: torch.device, comm: HostComm, impl,
                 watchdog_s: float, shares_gpu: bool = False, workspace_mb: Optional[float] = None):
        self.launch, self.backend, self.device, self.comm, self.impl = launch, backend, device, comm, impl
        self.shares_gpu = shares_gpu   # init_mesh(share_gpu=True): ranks take turns on a GPU, times mean nothing
        self.workspace_mb = workspace_mb   # init_mesh(workspace_mb=...); None: the collectives' default
        self.rank, self.world_size, self.local_rank = launch.rank, launch.world_size, launch.local_rank
        self.watchdog_s = watchdog_s
        self.layout = ControlLayout(self.world_size)
        self._allocs: List[_Alloc] = []
        self._ptr_cache: Dict[tuple, torch.Tensor] = {}
        self._epochs: Dict[str, int] = {}
        self._failed: Optional[MeshError] = None
        self.cache: Dict[str, object] = {}  # per-mesh state of the layers above (e.g. collective workspaces)
        self.stream_order = StreamOrder(device)   # launches run in call order across streams
        remember(self)
        self.token = compile_token(device)
        self._closed = False
        # Test hook: the rank named here skips its data notifies in collectives (fault injection).
        self.fault_skip_notify_rank: Optional[int] = None
        self.ctrl = self.empty((self.layout.size,), torch.int32)
        self._ctrl_np = self.ctrl.numpy() if backend == "cpu" else None
        self._ctrl_peers_np = ([self.peer(self.ctrl, r).numpy() for r in range(self.world_size)]
                               if backend == "cpu" else None)
        # what each rank's last calls were, as text (mesh/calls.py names a disagreeing call with it)
        self.board = self.empty((2, BOARD_BYTES), torch.uint8)
        self._board_np = ([self.peer(self.board, r).numpy() for r in range(self.world_size)]
                          if backend == "cpu" else None)
        # where a kernel leaves the record of a call the ranks disagreed on (pinned: the host reads it at
        # this rank's next call of any op without a sync; mesh/calls.py)
        self.call_error = torch.zeros(ERR_WORDS, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._call_error_np = self.call_error.numpy()
        self.calls = CallAgreement(self)

    # ---- symmetric memory -------------------------------------------------------------------
    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a tensor of `shape` in symmetric memory (zero-filled). Same shape on all ranks."""
        if self._closed:
            raise MeshError("the mesh is closed")
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        mine = (shape, str(dtype))
        # A rank whose mesh failed still takes part and says so, and every rank refuses: refusing
        # alone left the peers that had not seen the fault yet waiting here (gloo timeout, or forever)
        told = self.comm.allgather((mine, None if self._failed is None else str(self._failed)))
        self._check_usable()
        failed = [(r, f) for r, (_, f) in enumerate(told) if f is not None]
        if failed:
            raise MeshError(f"rank {failed[0][0]}'s mesh failed earlier and cannot be used: {failed[0][1]}")
        if any(s < 0 for s in shape):
            raise MeshError(f"mesh.empty: negative size in shape {shape}")
        everyone = [e for e, _ in told]
        if any(e != mine for e in everyone):
            listing = ", ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(everyone))
            raise ShapeMismatchError(f"mesh.empty called with different shapes across ranks ({listing}): "
                                     f"symmetric tensors must have the same shape and dtype everywhere")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        nbytes = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        views = self.impl.alloc(nbytes)
        base = views[self.rank].data_ptr()
        if any((v.data_ptr() - base) % _ALIGN for v in views):
            # the kernels address a peer's copy as a multiple of 256 bytes from their own
            # (gemm_tiles.aligned_peer: what lets Triton vectorise the stores): never silently wrong
            self.impl.free(views)
            raise MeshError(f"mesh.empty: the ranks' copies of a symmetric allocation are not {_ALIGN}-byte "
                            f"congruent ({[hex(v.data_ptr()) for v in views]}); the backend must align them")
        self._allocs.append(_Alloc(views, base, nbytes))
        return views[self.rank].view(dtype)[: math.prod(shape)].view(shape)

    def symmetric_capacity(self) -> Optional[int]:
        """Bytes of symmetric memory this mesh may hold in all, where it is bounded by its own region
        (a group mesh: init_mesh(group_heap_mb=...)); None where it draws on the process's whole heap."""
        heap = getattr(self.impl, "heap", None)
        return None if heap is None else heap.capacity

    def _find(self, t: torch.Tensor):
        p = t.data_ptr()
        for a in self._allocs:
            if a.base <= p < a.base + a.nbytes or (p == a.base and a.nbytes == 0):
                return a, p - a.base
        raise MeshError("tensor is not in symmetric memory: allocate it with mesh.empty(shape, dtype)")

    def is_symmetric(self, t: torch.Tensor) -> bool:
        try:
            self._find(t)
            return True
        except MeshError:
            return False

    def peer(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """A view of `rank`'s copy of symmetric tensor t (t itself for our own rank)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"peer rank {rank} outside the world of {self.world_size}")
        a, off = self._find(t)
        if rank == self.rank:
            return t
        es = t.element_size()
        if off % es:
            raise MeshError("symmetric view is not aligned to its element size")
        flat = a.views[rank][: a.nbytes - a.nbytes % es].view(t.dtype)
        return torch.as_strided(flat, t.shape, t.stride(), off // es)

    def peer_ptrs(self, t: torch.Tensor) -> torch.Tensor:
        """int64 [world] on mesh.device: the address of t's first element on every rank."""
        key = (t.data_ptr(),)
        hit = self._ptr_cache.get(key)
        if hit is None:
            a, off = self._find(t)
            hit = empty_persistent(len(a.views), torch.int64, self.device)   # cached: outside graph pools
            hit.copy_(torch.tensor([v.data_ptr() + off for v in a.views], dtype=torch.int64))
            self._ptr_cache[key] = hit
        return hit

    def free(self, t: torch.Tensor) -> None:
        """Collective: give back a tensor from mesh.empty (same order on every rank)."""
        a, _ = self._find(t)
        self._allocs.remove(a)
        self._ptr_cache = {k: v for k, v in self._ptr_cache.items() if not a.base <= k[0] < a.base + a.nbytes}
        self.impl.free(a.views)

    # ---- epochs, errors, barrier ------------------------------------------------------------
    def next_epoch(self, stream: str) -> int:
        """Every rank calls collectives in the same order, so these counters agree across ranks."""
        e = self._epochs.get(stream, 0) + 1
        self._epochs[stream] = e
        return e

    def watchdog_spins(self) -> int:
        from .nvshmem_backend import SPINS_PER_SECOND

        return max(1000, int(self.watchdog_s * SPINS_PER_SECOND))

    def error_record(self) -> Optional[ErrorRecord]:
        words = self._ctrl_np[:ERR_WORDS] if self._ctrl_np is not None else self.ctrl[:ERR_WORDS].cpu().tolist()
        return None if int(words[0]) == 0 else ErrorRecord.from_words(words)

    def check(self, op_names=None) -> None:
        """Raise if any wait on this rank (or a peer that propagated its error) failed."""
        if self._failed is not None:
            raise self._failed
        self.calls.raise_pending()
        rec = self.error_record()
        if rec is None:
            return
        if rec.kind is ErrorKind.CALL:   # a kernel found the peers' call differing: nothing ran, usable
            self.clear_error()
            raise self.calls.device_error(rec.epoch, rec.expected, rec.observed, rec.peer)
        msg = f"rank {self.rank}: " + rec.describe(self.watchdog_s, op_names)
        if rec.kind is ErrorKind.TIMEOUT and not self._peer_alive(rec.peer):
            msg += f". Rank {rec.peer} has exited or died (its liveness lock is free)"
        cls = ShapeMismatchError if rec.kind is ErrorKind.SHAPE else PeerTimeoutError
        self._failed = cls(msg)
        raise self._failed

    def _check_usable(self) -> None:
        if self._closed:
            raise MeshError("the mesh is closed")
        if self._failed is not None:
            raise MeshError(f"the mesh failed earlier and cannot be used: {self._failed}")

    def record_error(self, kind: ErrorKind, event: int, observed: int, expected: int, peer: int,
                     epoch: int) -> None:
        """Host-side error record: ours, then every peer's if still empty."""
        words = [int(kind), self.rank, event, observed, expected, peer, epoch, 0]
        for r in [self.rank] + [s for s in range(self.world_size) if s != self.rank]:
            if self._ctrl_peers_np is not None:
                slot = self._ctrl_peers_np[r]
                if int(slot[0]) == 0:
                    slot[1:ERR_WORDS] = words[1:]
                    slot[0] = words[0]
            else:   # GPUs (a host slow path): through the peer's view, the kind last
                self.impl.synchronize()
                slot = self.peer(self.ctrl, r)
                if int(slot[0].item()) == 0:
                    slot[1:ERR_WORDS].copy_(torch.tensor(words[1:], dtype=torch.int32))
                    self.impl.synchronize()
                    slot[0].fill_(words[0])
                    self.impl.synchronize()

    def clear_error(self) -> None:
        """Forget this rank's error record (after raising an error that leaves the mesh usable)."""
        if self._ctrl_np is not None:
            self._ctrl_np[:ERR_WORDS] = 0
        else:
            self.impl.synchronize()
            self.ctrl[:ERR_WORDS].zero_()
            self.impl.synchronize()

    def wait_word(self, read, target: int, peer: int, event: int, epoch: int) -> None:
        """Host side: spin until read() >= target, the word rank `peer` sets; past the watchdog record
        a timeout here and on every peer, and raise it (as for a peer that recorded an error first)."""
        deadline = time.monotonic() + self.watchdog_s
        turns, asked = 0, time.monotonic()
        while read() < target:
            if self.error_record() is not None:
                self.check()
            turns += 1
            _back_off(turns)
            now = time.monotonic()
            if now - asked > _LIVENESS_S:
                asked = now
                if not self._peer_alive(peer):
                    self.record_error(ErrorKind.GONE, event, read(), target, peer, epoch)
                    self.check()
            if now > deadline:
                self.record_error(ErrorKind.TIMEOUT, event, read(), target, peer, epoch)
                self.check()

    def spin_until(self, lanes, lanes_off: int, sources, target: int, event: int, epoch: int,
                   timeout_s: float) -> bool:
        """cpu backend: wait until lanes[lanes_off + s] >= target for every s (lanes: a numpy view of
        symmetric int32 memory). On expiry, or once rank s is gone (liveness), record it here and on
        every peer; False."""
        deadline = time.monotonic() + timeout_s
        turns, asked = 0, time.monotonic()
        for s in sources:
            while int(lanes[lanes_off + s]) < target:
                if int(self._ctrl_np[0]) != 0:
                    return False  # a peer already failed and told us: stop waiting
                turns += 1
                _back_off(turns)
                now = time.monotonic()
                if now - asked > _LIVENESS_S:
                    asked = now
                    if not self._peer_alive(s):
                        self.record_error(ErrorKind.GONE, event, int(lanes[lanes_off + s]), target, s, epoch)
                        return False
                if now > deadline:
                    self.record_error(ErrorKind.TIMEOUT, event, int(lanes[lanes_off + s]), target, s, epoch)
                    return False
        return True

    def _peer_alive(self, rank: int) -> bool:
        live = getattr(self.impl, "liveness", None)
        return live is None or live.alive(rank)

    def barrier(self) -> None:
        """All ranks reach this point (and, on GPUs, their queued work is done) or every rank raises."""
        self._check_usable()
        self.impl.synchronize()
        self.check()
        if self.world_size == 1:
            return
        if self.backend == "cpu":
            epoch = self.next_epoch("barrier")
            lay = self.layout
            for d in range(self.world_size):
                self._ctrl_peers_np[d][lay.barrier + self.rank] = epoch
            self.spin_until(self._ctrl_np, lay.barrier, range(self.world_size), epoch, Event.encode(Event.BARRIER, 0),
                            epoch, self.watchdog_s)
            self.check()
        else:
            self.comm.barrier()

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Free symmetric memory and finalize; collective on GPUs (NVSHMEM frees collectively). Safe to
        call twice, and after a fault: it then cleans up what this rank holds and never raises."""
        global _CURRENT
        if self._closed:
            return
        self._closed = True
        if _CURRENT is self:
            _CURRENT = None
        failed = self._failed is not None or (self._ctrl_np is not None and int(self._ctrl_np[0]) not in
                                              (0, int(ErrorKind.CALL)))
        # a fault only where a peer died without closing, not where it is closing its mesh as we are:
        # on GPUs close is collective, and judging such a peer gone left it waiting in the close
        live = getattr(self.impl, "liveness", None)
        failed = failed or (live is not None and any(live.died(s) for s in range(self.world_size)))
        try:
            if self.device.type == "cuda":
                # kernels still running may store into host words the cache owns (a megakernel's
                # pinned error word): freed now, the pinned allocator could hand them out again
                torch.cuda.synchronize(self.device)
        except Exception:   # noqa: BLE001 (a faulted device: nothing to wait for)
            failed = True
        self.cache.clear()
        self._allocs.clear()
        self._ptr_cache.clear()
        self._ctrl_np = self._ctrl_peers_np = self._board_np = None
        try:
            self.impl.close(failed=failed)
        except Exception:   # noqa: BLE001 (teardown after a fault: release what is ours, say nothing)
            pass
        finally:
            self.comm.close()

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Mesh(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device}, launcher={self.launch.launcher.value})")


def dist_ranks(group) -> List[int]:
    """The global ranks of a torch ProcessGroup's members, in group-rank order."""
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def _pick_device(launch: Launch, backend: str, device, share_gpu: bool = False) -> torch.device:
    if backend == "cpu":
        if device is not None and torch.device(device).type != "cpu":
            raise MeshError(f"device {device} with backend 'cpu': the cpu backend runs on the CPU; "
                            "drop device= or use backend='nvshmem' for GPUs")
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if device is None and share_gpu:     # ranks dealt over the GPUs, several to a GPU
        device = torch.device("cuda", launch.local_rank % n)
    if device is None:
        if launch.local_world_size > n:
            how = (f"torchrun --nproc_per_node={n}" if launch.launcher is Launcher.TORCHRUN
                   else f"mpirun -n {n}" if launch.launcher.is_mpi else f"{n} ranks per node")
            raise MeshError(f"world size {launch.world_size} with {launch.local_world_size} ranks on this node "
                            f"but only {n} GPU(s) here: run {how} (or init_mesh(backend='cpu'); for correctness "
                            f"checks only, ranks may share GPUs: init_mesh(share_gpu=True) or ETDIST_SHARE_GPU=1)")
        device = torch.device("cuda", launch.local_rank)
    device = torch.device(device)
    if device.type != "cuda" or device.index is None or not 0 <= device.index < n:
        raise MeshError(f"device {device} is not one of this node's {n} GPUs")
    return device


def _ranks_share_a_gpu(comm: HostComm, device: torch.device, share_gpu: bool) -> bool:
    """Collective: whether two ranks landed on one GPU; refused unless share_gpu was asked for."""
    ident = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    everyone = comm.allgather(ident)
    seen: Dict[tuple, int] = {}
    for r, i in enumerate(everyone):
        if i in seen:
            if share_gpu:
                return True
            raise MeshError(f"ranks {seen[i]} and {r} are both on GPU {i[1]} of host {i[0]}: one rank per GPU "
                            f"(set the device from LOCAL_RANK, or don't pin CUDA_VISIBLE_DEVICES to one GPU; "
                            f"for correctness checks only: init_mesh(share_gpu=True) or ETDIST_SHARE_GPU=1)")
        seen[i] = r
    return False


def _group_of(group, device_mesh, dim):
    """The torch ProcessGroup a mesh spans (None: the whole world), from init_mesh's arguments."""
    if device_mesh is not None:
        if group is not None:
            raise MeshError("init_mesh: pass group= or device_mesh= (with dim=), not both")
        if dim is None and device_mesh.ndim != 1:
            raise MeshError(f"init_mesh(device_mesh=...): a {device_mesh.ndim}-D DeviceMesh needs dim= (one of "
                            f"{device_mesh.mesh_dim_names}), e.g. init_mesh(device_mesh=dm, dim='tp')")
        return device_mesh.get_group(dim)
    if dim is not None:
        raise MeshError("init_mesh(dim=...) names a dimension of device_mesh=, which was not given")
    if group is not None and hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):
        if group.ndim != 1:   # a DeviceMesh passed as the group: one dimension of it
            raise MeshError(f"init_mesh(group=...): a {group.ndim}-D DeviceMesh; pass one dimension "
                            f"(device_mesh['tp']) or init_mesh(device_mesh=dm, dim='tp')")
        return group.get_group()
    return group


def _group_launch(launch: Launch, group, world_size, rank) -> Launch:
    """The launch record of a mesh over `group`: its rank and size in the group (the process's local
    rank still picks its GPU)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise MeshError("init_mesh(group=...): torch.distributed is not initialised; call "
                        "torch.distributed.init_process_group first (the group belongs to it)")
    g_rank, g_size = dist.get_rank(group), dist.get_world_size(group)
    if g_rank < 0:
        raise MeshError(f"init_mesh(group=...): this process (global rank {dist.get_rank()}) is not in the group "
                        f"(ranks {dist.get_process_group_ranks(group)}); each process passes a group it belongs to")
    for name, given, have in (("world_size", world_size, g_size), ("rank", rank, g_rank)):
        if given is not None and given != have:
            raise MeshError(f"init_mesh({name}={given}) but the group gives {have}: drop the argument")
    return replace(launch, rank=g_rank, world_size=g_size,
                   run_id=f"{launch.run_id}:{dist.get_process_group_ranks(group)}" if launch.run_id else None)


def _check_mb(name: str, value) -> None:
    """Refuse a size in MiB that is not a positive number (None: the default), naming the argument."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"init_mesh({name}=...) wants a positive number of MiB (or None for the default), "
                         f"got {value!r}")


def init_mesh(backend: Optional[str] = None, world_size: Optional[int] = None, rank: Optional[int] = None,
              local_rank: Optional[int] = None, device=None, watchdog_s: Optional[float] = None,
              share_gpu: Optional[bool] = None, *, group=None, device_mesh=None, dim=None,
              workspace_mb: Optional[float] = None, group_heap_mb: Optional[float] = None) -> Mesh:
    """Find the other ranks and set up symmetric memory.

    group: a torch ProcessGroup (or a 1-D DeviceMesh) the mesh spans instead of the whole world, e.g.
    a tensor-parallel group; or device_mesh= with dim= (init_mesh(device_mesh=dm, dim="tp")). Several
    groups' meshes may live at once in one job, each of its own: its rank and world_size are the
    group's, ops and collectives on it involve its ranks only. torch.distributed must be initialised
    by then. On GPUs, NVSHMEM spans the whole world once per process: create (and close) group meshes
    on every process in the same order, as torch's groups (nvshmem_backend.py says why).

    backend: "nvshmem" (GPUs, nvshmem4py) or "cpu" (memory-mapped files); default nvshmem when CUDA
    is available, cpu otherwise. world_size/rank/local_rank/device override what the launcher set.
    watchdog_s: how long any cross-rank wait may spin before every rank raises (default
    ETDIST_WATCHDOG_S or 30).
    share_gpu: several ranks on one GPU (default ETDIST_SHARE_GPU=1 / 0), ranks dealt over the GPUs by
    local rank: NVSHMEM's multi-process-per-GPU mode, for correctness checks of more ranks than a
    machine has GPUs. Where ranks do land on one GPU (mesh.shares_gpu), their kernels take turns on
    it, so etdist.bench.measure refuses to time, and NCCL (torch.distributed's CUDA collectives) refuses
    two ranks on one GPU. No effect with backend 'cpu' (a bad ETDIST_SHARE_GPU is still refused).
    workspace_mb: MiB of symmetric scratch the collectives exchange through, made at the mesh's first
    collective (default 1024 on GPUs, 64 with backend 'cpu', at most a quarter of a group mesh's
    region); bigger messages go in rounds. Alike on every rank of the mesh (mesh.empty checks it).
    group_heap_mb: MiB of NVSHMEM's heap a group mesh takes for all its symmetric tensors (default
    1024). Alike in every process (each allocates every group's region, over the whole world):
    compared across the world when a region is allocated. NVSHMEM_SYMMETRIC_SIZE (4G unless set)
    must hold every group's region. No effect on a whole-world mesh or with backend 'cpu'.
    Both are refused (ValueError) unless a positive number, before anything is set up.
    """
    global _CURRENT
    _check_mb("workspace_mb", workspace_mb)   # before any process group or file exists
    _check_mb("group_heap_mb", group_heap_mb)
    group = _group_of(group, device_mesh, dim)
    if group is not None:
        world = resolve_launch(detect_launch(), None, None, local_rank)
        launch = _group_launch(world, group, world_size, rank)
    else:
        world = launch = resolve_launch(detect_launch(), world_size, rank, local_rank)
    if group is None and launch.launcher is Launcher.SINGLE and launch.world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise MeshError(f"world_size={launch.world_size} with no launcher: run `torchrun --nproc_per_node="
                        f"{launch.world_size} your_script.py` or `mpirun -n {launch.world_size} python "
                        f"your_script.py` (or set MASTER_ADDR/MASTER_PORT with explicit ranks)")
    if backend is None:
        backend = "nvshmem" if torch.cuda.is_available() else "cpu"
    if backend not in ("nvshmem", "cpu"):
        raise MeshError(f"unknown backend {backend!r}: use 'nvshmem' (GPUs) or 'cpu'")
    if backend == "nvshmem":
        if not torch.cuda.is_available():
            raise MeshError("backend 'nvshmem' needs CUDA GPUs and none are visible: use init_mesh(backend='cpu')")
        from .nvshmem_backend import import_nvshmem

        import_nvshmem()  # fail before any rank talks to another
    if watchdog_s is None:
        text = knobs.text("ETDIST_WATCHDOG_S", "30")
        try:
            watchdog_s = float(text)
        except ValueError:
            raise MeshError(f"ETDIST_WATCHDOG_S={text!r} is not a number of seconds") from None
    # NaN would never expire (every wait on a missing peer would spin forever), inf neither
    if isinstance(watchdog_s, bool) or not isinstance(watchdog_s, (int, float)) or not math.isfinite(watchdog_s) \
            or watchdog_s <= 0:
        raise MeshError(f"watchdog_s must be a finite number of seconds > 0 (init_mesh(watchdog_s=...) or "
                        f"ETDIST_WATCHDOG_S), got {watchdog_s!r}")
    if share_gpu is None:
        try:
            share_gpu = knobs.now("ETDIST_SHARE_GPU", knobs.flag, False)
        except knobs.KnobError as e:
            raise MeshError(str(e)) from None
    if not isinstance(share_gpu, bool):
        raise MeshError(f"share_gpu must be True or False, got {share_gpu!r}")
    dev = _pick_device(launch, backend, device, share_gpu)
    comm = make_host_comm(launch, timeout_s=max(60.0, 4 * watchdog_s), want_nccl=backend == "nvshmem", group=group)
    shared, impl = False, None
    try:
        if backend == "cpu":
            from .cpu_backend import CpuBackend

            impl = CpuBackend(launch.rank, launch.world_size, comm)
        else:
            torch.cuda.set_device(dev)
            shared = _ranks_share_a_gpu(comm, dev, share_gpu)   # what times may be taken: see timing_refused
            from .nvshmem_backend import NvshmemBackend

            pes = None if group is None else dist_ranks(group)
            impl = NvshmemBackend(launch.rank, launch.world_size, launch.local_world_size, dev, comm, watchdog_s,
                                  world=world, pes=pes, group_heap_mb=group_heap_mb)
        mesh = Mesh(launch, backend, dev, comm, impl, watchdog_s, shares_gpu=shared, workspace_mb=workspace_mb)
    except BaseException:
        if impl is not None:   # its files (or symmetric memory) go too
            try:
                impl.close(failed=True)
            except Exception:   # noqa: BLE001
                pass
        comm.close()
        raise
    _CURRENT = mesh
    return mesh
