"""Host-side messages between ranks: broadcast/allgather small Python objects, and a barrier.

Used only to set a mesh up and to check agreement (run ids, NVSHMEM's unique id, device ids,
shapes); data never moves through here. Under torchrun/srun it is torch.distributed (gloo for
objects; a process group created here is destroyed at close, or at exit if nobody closed it),
under mpirun mpi4py, and a single process needs nothing. A mesh over a sub-group (init_mesh(group=
...)) talks over that group (or a gloo group of its ranks, made here and destroyed at close).

Re-creating meshes: a world group that etdist creates meets its peers through one key-value store
per process, made at the first mesh and kept (rank 0 serves it, or torchrun's agent does), each
mesh's keys under a prefix of its own (etdist/<n>: the n-th group this process created, the same
count on every rank). Re-made from the environment each time, the second mesh read the first
one's keys (torchrun's agent store outlives a group) and dialled ports long closed.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import weakref
from typing import Any, List

from .errors import MeshError, PeerTimeoutError
from .launch import Launch, Launcher


class HostComm:
    rank: int = 0
    world_size: int = 1

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather(self, obj: Any) -> List[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class LocalComm(HostComm):
    """One process: nothing to exchange."""


_STORE = None                    # the process's key-value store for the groups etdist creates
_GROUPS = itertools.count(1)     # groups this process created: each one's store prefix
_LIVE: "weakref.WeakSet[TorchComm]" = weakref.WeakSet()   # closed at exit if their owner did not


def _group_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """A fresh prefix of the process's store (made at the first call, from the environment)."""
    global _STORE
    import torch.distributed as dist

    if _STORE is None:
        _STORE, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    return dist.PrefixStore(f"etdist/{next(_GROUPS)}/", _STORE)


@atexit.register
def _close_live() -> None:
    # A gloo group still alive when the interpreter tears down aborts the process about one exit
    # in three ("terminate called without an active exception", SIGABRT, seen with torch 2.13)
    for comm in list(_LIVE):
        comm.close()


class TorchComm(HostComm):
    def __init__(self, launch: Launch, timeout_s: float, want_nccl: bool, group=None):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = launch.rank, launch.world_size
        self.timeout_s = max(timeout_s, 1.0)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.owns_group, self._closed = group is None and not dist.is_initialized(), False
        self._own_subgroup = False
        if self.owns_group:
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                hint = ("under srun: export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) "
                        "MASTER_PORT=29500" if launch.launcher is Launcher.SLURM else "launch with torchrun")
                raise MeshError(f"cannot reach the other ranks: {', '.join(missing)} not set ({hint})")
            backend = "cpu:gloo,cuda:nccl" if want_nccl else "gloo"
            dist.init_process_group(backend, store=_group_store(self.rank, self.world_size, timeout),
                                    rank=self.rank, world_size=self.world_size, timeout=timeout)
        elif group is None and (dist.get_world_size() != self.world_size or dist.get_rank() != self.rank):
            raise MeshError(f"torch.distributed is initialised as rank {dist.get_rank()} of "
                            f"{dist.get_world_size()} but the mesh is rank {self.rank} of {self.world_size}")
        _LIVE.add(self)
        # Objects travel through a gloo group so that no CUDA stream or NCCL comm is involved (with
        # the mesh's timeout: a new group's default is gloo's 30 minutes). A user's gloo sub-group
        # serves as it is; for another, one of its ranks, made by them alone.
        if group is not None and dist.get_backend(group) == "gloo":
            self.group = group
        elif group is not None:
            self.group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo", timeout=timeout,
                                        use_local_synchronization=True)
            self._own_subgroup = True
        elif want_nccl or not self.owns_group:
            self.group = dist.new_group(backend="gloo", timeout=timeout)
            self._own_subgroup = True
        else:
            self.group = None

    def broadcast(self, obj, root=0):
        box = [obj]
        with self._peers_answer("broadcast"):
            self.dist.broadcast_object_list(box, group=self.group, group_src=root)
        return box[0]

    def allgather(self, obj):
        out = [None] * self.world_size
        with self._peers_answer("allgather"):
            self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self):
        with self._peers_answer("barrier"):
            self.dist.barrier(group=self.group)

    @contextlib.contextmanager
    def _peers_answer(self, what: str):
        """gloo's own errors when a peer never joins (a timeout) or has exited (connection closed)
        say nothing of why: name the likely cause."""
        try:
            yield
        except RuntimeError as e:
            raise PeerTimeoutError(
                f"rank {self.rank}: the ranks' host {what} failed: a peer did not make the same call "
                f"within {self.timeout_s:g} s, or it has exited (every rank must make the same calls in the "
                f"same order; the first call at a new shape agrees on it across ranks). gloo: {e}") from e

    def close(self):
        """Destroy the groups this comm made (its gloo sub-group, the world group if it made that);
        never raises: it also runs after faults, where a peer may be gone."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        try:
            if self._own_subgroup and self.dist.is_initialized():
                self.dist.destroy_process_group(self.group)
            if self.owns_group and self.dist.is_initialized():
                self.dist.destroy_process_group()
        except Exception:   # noqa: BLE001 (teardown after a fault: nothing left to save)
            pass
        self.group = None   # its sockets and threads go with the last reference


class MpiComm(HostComm):
    def __init__(self, launch: Launch):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise MeshError(f"launched by mpirun ({launch.launcher.value}) but mpi4py is missing: "
                            f"pip install mpi4py (CPU machines: pip install mpi4py mpich) [{e}]") from None
        self.comm = MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        if (self.rank, self.world_size) != (launch.rank, launch.world_size):
            raise MeshError(f"MPI says rank {self.rank} of {self.world_size} but the environment said "
                            f"rank {launch.rank} of {launch.world_size}: mpi4py is built against another "
                            f"MPI than the mpirun that started this process")

    def broadcast(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()


def make_host_comm(launch: Launch, timeout_s: float, want_nccl: bool = False, group=None) -> HostComm:
    """The host comm of a mesh: over `group` (a torch ProcessGroup) where given, else the world's."""
    if launch.world_size == 1:
        return LocalComm()
    if group is None and launch.launcher.is_mpi:
        return MpiComm(launch)
    return TorchComm(launch, timeout_s, want_nccl, group)
