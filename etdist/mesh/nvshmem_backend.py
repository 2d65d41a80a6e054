"""The nvshmem backend: symmetric GPU memory from nvshmem4py, bootstrapped with a unique id.

Under torchrun (or srun) rank 0's NVSHMEM unique id travels over torch.distributed; under mpirun
nvshmem4py's `emulated_mpi` method broadcasts it over mpi4py. NVSHMEM is initialised once per
process over the whole world (`_Process`) and stays up until exit; meshes over the world or over
groups live on it. Allocation and free are collective over every PE of the world, in the same
order on every rank: a whole-world mesh's calls keep that order; a group mesh allocates one region
when created (every process creates and closes its group meshes in the same order, checked) and
lays its buffers out inside it.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import List, Optional

import torch

from .errors import MeshError
from .hostcomm import HostComm, MpiComm, make_host_comm
from .launch import Launch, Launcher
from .liveness import for_mesh

# Turns of a sys-scope acquire poll per second, to turn watchdog seconds into a spin bound. Checked
# on 2x H200: with a 2 s watchdog the skip-notify selfcheck raised on both ranks ~2.6 s after start.
SPINS_PER_SECOND = 2_000_000


def import_nvshmem():
    try:
        import nvshmem.core as nvshmem  # noqa: F401
        from cuda.core import Device  # noqa: F401
    except ImportError as e:
        raise MeshError(f"the nvshmem backend needs nvshmem4py: pip install nvshmem4py-cu13 "
                        f"(or init_mesh(backend='cpu') to run without GPUs) [{e}]") from None
    return nvshmem


class _Deadline:
    """Kill the process with a clear message if a step that cannot be interrupted hangs."""

    def __init__(self, seconds: float, what: str, rank: int):
        self.timer = threading.Timer(seconds, self._expire, args=(seconds, what, rank))
        self.timer.daemon = True

    @staticmethod
    def _expire(seconds, what, rank):
        sys.stderr.write(f"etdist: rank {rank}: {what} did not finish within {seconds:g} s; exiting. "
                         f"Check NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME (lo on one node) and that every rank "
                         f"called init_mesh.\n")
        sys.stderr.flush()
        os._exit(70)

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()


def env_defaults(env, *, one_node: bool) -> None:
    """NVSHMEM's settings for our machines, where the user has not set them (read at init)."""
    if one_node:
        env.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")  # init hangs without it
        # Peers through NVLink only: NVSHMEM's proxy thread has no work yet spins a core, slowing eager calls
        # (records host_path); off, it takes device-side global exit and NVSHMEM's wait timeouts: we use neither
        env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        env.setdefault("NVSHMEM_DISABLE_LOCAL_ONLY_PROXY", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # no NVLink multicast on our machines
    env.setdefault("NVSHMEM_SYMMETRIC_SIZE", "4G")   # NVSHMEM's own variable sets it


class SubHeap:
    """First-fit offsets in a region of `capacity` bytes (a group mesh's share of the symmetric heap).
    Every rank of a group makes the same allocations in the same order (the Mesh sees to it), so
    their offsets agree and a peer's copy lies at the same offset in the peer's region."""

    def __init__(self, capacity: int, align: int = 256):
        self.capacity, self.align = capacity, align
        self.free_list: List[tuple] = [(0, capacity)]   # (offset, size), by offset
        self.used: dict = {}                             # offset -> size

    def alloc(self, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // self.align) * self.align
        for k, (off, room) in enumerate(self.free_list):
            if room >= size:
                self.free_list[k:k + 1] = [(off + size, room - size)] if room > size else []
                self.used[off] = size
                return off
        raise MeshError(f"a group mesh's symmetric region of {self.capacity / 2**20:.0f} MiB has no room for "
                        f"{nbytes / 2**20:.1f} MiB more ({sum(self.used.values()) / 2**20:.1f} MiB in use): pass a "
                        f"larger init_mesh(group_heap_mb=...) (every process alike; NVSHMEM_SYMMETRIC_SIZE must hold "
                        f"every group mesh's region)")

    def free(self, offset: int) -> None:
        size = self.used.pop(offset)
        spans = sorted(self.free_list + [(offset, size)])
        merged = [spans[0]]
        for off, room in spans[1:]:
            last_off, last_room = merged[-1]
            if last_off + last_room == off:
                merged[-1] = (last_off, last_room + room)
            else:
                merged.append((off, room))
        self.free_list = merged


class _Process:
    """The one NVSHMEM owner of this process: initialised over the whole world at the first mesh and
    kept until exit (meshes come and go, whole-world or over groups; finalize once, at exit, unless
    a mesh failed, where a peer may be gone and finalize's barrier would hang). Symmetric allocation
    is collective over every PE of the world: `alloc` is the one place that allocates, and it checks
    (a host exchange over the world) that every process asks for the same size at the same turn."""

    def __init__(self, world: Launch, device: torch.device, timeout_s: float, comm: Optional[HostComm]):
        self.nvshmem = nvshmem = import_nvshmem()
        from cuda.core import Device

        env_defaults(os.environ, one_node=world.local_world_size == world.world_size)
        torch.cuda.set_device(device)
        self.cu_device = Device(device.index)
        self.cu_device.set_current()
        self.device, self.rank, self.world_size = device, world.rank, world.world_size
        self.world, self.timeout_s, self._comm = world, timeout_s, None
        # the bootstrap goes over the first mesh's comm where that mesh spans the world
        boot = comm if comm is not None else self.comm
        try:
            with _Deadline(max(4 * timeout_s, 20.0), "NVSHMEM bootstrap", world.rank):
                if isinstance(boot, MpiComm):
                    nvshmem.init(device=self.cu_device, mpi_comm=boot.comm, initializer_method="emulated_mpi")
                else:
                    uid = nvshmem.get_unique_id() if world.rank == 0 else nvshmem.get_unique_id(empty=True)
                    uid = boot.broadcast(uid if world.rank == 0 else None)
                    nvshmem.init(device=self.cu_device, uid=uid, rank=world.rank, nranks=world.world_size,
                                 initializer_method="uid")
        except MeshError:
            raise
        except Exception as e:  # nvshmem4py raises its own error types
            raise MeshError(f"rank {world.rank}: NVSHMEM bootstrap failed: {type(e).__name__}: {e}. On one node "
                            f"set NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo; see NVSHMEM_DEBUG=INFO for details") from None
        if nvshmem.n_pes() != world.world_size or nvshmem.my_pe() != world.rank:
            raise MeshError(f"NVSHMEM placed this process as PE {nvshmem.my_pe()} of {nvshmem.n_pes()}, "
                            f"the launch says rank {world.rank} of {world.world_size}")
        self.healthy = True
        self.turn = 0
        self.open_meshes = 0   # finalize (a barrier over every PE) only once all closed cleanly
        atexit.register(self.finalize)

    @property
    def comm(self) -> HostComm:
        """A host comm over the whole world, of this process's own (made when first needed: at a
        group mesh's creation, which every process makes at the same turn; kept until exit, so it
        outlives the meshes and a world group that a closed mesh destroyed)."""
        if self._comm is None or getattr(self._comm, "_closed", False):
            self._comm = make_host_comm(self.world, timeout_s=max(60.0, 4 * self.timeout_s))
        return self._comm

    def alloc(self, nbytes: int, what: str, check_world: bool) -> torch.Tensor:
        """Collective over the world: a symmetric uint8 tensor of `nbytes` (zeroed). check_world: first
        agree over the world's host comm that every process asks for the same (a group mesh's
        region: its group alone cannot tell whether the other groups are at the same turn)."""
        self.turn += 1
        if check_world and self.world_size > 1:
            asks = self.comm.allgather((self.turn, nbytes, what))
            if any(a[:2] != asks[0][:2] for a in asks):   # each group's own region: sizes and turns agree
                listing = "; ".join(f"PE {pe}: turn {t}, {n} bytes for {w}" for pe, (t, n, w) in enumerate(asks))
                raise MeshError(f"symmetric allocations out of step across processes ({listing}): NVSHMEM "
                                f"allocates collectively over every PE, so every process must create (and close) "
                                f"its group meshes in the same order, with the same init_mesh(group_heap_mb=...)")
        own = self.nvshmem.tensor((max(nbytes, 16),), dtype=torch.uint8)
        own.zero_()
        return own

    def peer(self, own: torch.Tensor, pe: int) -> torch.Tensor:
        return own if pe == self.rank else self.nvshmem.get_peer_tensor(own, pe)

    def free(self, own: torch.Tensor) -> None:
        self.nvshmem.free_tensor(own)

    def finalize(self) -> None:
        global _PROCESS
        if _PROCESS is self:
            _PROCESS = None
        # meshes still open at exit (an error left uncaught, a peer gone): finalize's barrier could wait
        # for a process that never comes; the exit itself releases what NVSHMEM holds
        if self.healthy and self.open_meshes == 0:
            try:
                torch.cuda.synchronize(self.device)
                self.nvshmem.finalize()
            except Exception:   # noqa: BLE001 (at exit: nothing left to save)
                pass
        if self._comm is not None:
            self._comm.close()


_PROCESS: Optional[_Process] = None
GROUP_HEAP_MB = 1024   # a group mesh's share of the symmetric heap, unless init_mesh(group_heap_mb=...)


def nvshmem_process(world: Launch, device: torch.device, timeout_s: float, comm: Optional[HostComm]) -> _Process:
    """The process's NVSHMEM owner, initialised (over the whole world) at the first call."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = _Process(world, device, timeout_s, comm)
    elif _PROCESS.device != device:
        raise MeshError(f"NVSHMEM runs on {_PROCESS.device} in this process; a mesh on {device} cannot share it "
                        f"(one GPU per process)")
    return _PROCESS


class NvshmemBackend:
    """A mesh's symmetric memory on NVSHMEM. A whole-world mesh allocates straight from the heap (in
    the same order on every rank, which its collective calls guarantee). A mesh over a group takes
    one region at creation (group_heap_mb MiB, allocated over the whole world: every process
    creates its group meshes in the same order) and lays its allocations out in it (SubHeap): a
    rank's peer copy is at the same offset of the peer's region, reached through the peer's global
    PE (`pes`: the group's global ranks in group-rank order)."""

    name = "nvshmem"

    def __init__(self, rank: int, world_size: int, local_world_size: int, device: torch.device,
                 comm: HostComm, timeout_s: float, world: Optional[Launch] = None, pes: Optional[List[int]] = None,
                 group_heap_mb: Optional[float] = None):
        self.rank, self.world_size, self.comm, self.device = rank, world_size, comm, device
        world = world or Launch(Launcher.SINGLE, rank, world_size, rank, local_world_size)
        self.process = proc = nvshmem_process(world, device, timeout_s, comm if pes is None else None)
        proc.open_meshes += 1
        self.nvshmem = proc.nvshmem
        self.pes = list(range(world_size)) if pes is None else list(pes)
        if pes is not None and proc.rank != self.pes[rank]:
            raise MeshError(f"group rank {rank} is global rank {self.pes[rank]}, NVSHMEM says PE {proc.rank}")
        self._owned: List[torch.Tensor] = []
        self._closed = False
        self.heap: Optional[SubHeap] = None
        # peers on this host that exited or died are named when a watchdog fires (liveness.py)
        self.liveness = for_mesh(comm, rank, world_size)
        if pes is not None:   # a group: its region, over the whole world
            nbytes = int((GROUP_HEAP_MB if group_heap_mb is None else group_heap_mb) * 2**20)
            # the size takes part in the world's check: a process with another group_heap_mb is named
            self.region = proc.alloc(nbytes, f"a group mesh of PEs {self.pes}", check_world=True)
            self.region_views = [proc.peer(self.region, pe) for pe in self.pes]
            self.heap = SubHeap(nbytes)
            torch.cuda.synchronize(device)
            proc.comm.barrier()   # every region zeroed before any group signals into it

    def alloc(self, nbytes: int) -> List[torch.Tensor]:
        if self.heap is not None:
            off = self.heap.alloc(nbytes)
            views = [v[off:off + max(nbytes, 16)] for v in self.region_views]
            views[self.rank].zero_()
        else:
            own = self.process.alloc(nbytes, "a whole-world mesh", check_world=False)
            self._owned.append(own)
            views = [self.process.peer(own, pe) for pe in self.pes]
        torch.cuda.synchronize(self.device)
        self.comm.barrier()  # every rank's copy is zeroed before anyone signals into it
        return views

    def free(self, views: List[torch.Tensor]) -> None:
        own = views[self.rank]
        if self.heap is not None:
            self.heap.free(own.data_ptr() - self.region.data_ptr())
            return
        for i, t in enumerate(self._owned):
            if t.data_ptr() == own.data_ptr():
                self._owned.pop(i)
                self.process.free(t)
                return

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self, failed: bool = False) -> None:
        """Collective: free this mesh's symmetric memory (newest first, the same order everywhere; a
        group's region over the whole world). NVSHMEM itself stays up until the process exits. After
        a fault (failed: Mesh.close found a peer that died) nothing collective is tried, and NVSHMEM is
        not finalized."""
        if self._closed:
            return
        self._closed = True
        self.process.open_meshes -= 1
        self.liveness.close(remove_dir=True)
        if failed:
            self.process.healthy = False
            self._owned.clear()
            return
        torch.cuda.synchronize(self.device)
        self.comm.barrier()
        while self._owned:  # collective, same order on every rank: newest first
            self.process.free(self._owned.pop())
        if self.heap is not None:
            self.process.comm.barrier()   # every group done with its region: freed over the whole world
            self.process.free(self.region)
            self.region = self.region_views = None
