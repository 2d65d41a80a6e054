"""The cpu backend: R real processes sharing memory-mapped files, with the same API as NVSHMEM.

Symmetric allocation k of rank r is the file <run dir>/a<k>.r<r>; every rank maps every rank's
file, so `peer(t, s)` is a plain tensor over rank s's file and stores into it are seen by rank s.
The run dir is keyed by a run id that rank 0 broadcasts and lives in /dev/shm where there is one.
Each rank unlinks its own files at close (mappings stay valid until dropped); the last one out
removes the directory, and an atexit hook does the same for a process that forgot to close.
"""
from __future__ import annotations

import atexit
import os
import tempfile
import uuid
import weakref
from typing import List

import torch

from .errors import MeshError
from .hostcomm import HostComm


def _shm_root() -> str:
    root = os.environ.get("ETDIST_SHM_DIR")
    if root:
        return root
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _cleanup(paths: List[str], run_dir: str) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    paths.clear()
    try:
        os.rmdir(run_dir)
    except OSError:
        pass  # another rank still has files there; the last one removes it


class CpuBackend:
    name = "cpu"

    def __init__(self, rank: int, world_size: int, comm: HostComm):
        self.rank, self.world_size, self.comm = rank, world_size, comm
        self.device = torch.device("cpu")
        run_id = comm.broadcast(uuid.uuid4().hex[:16] if rank == 0 else None)
        self.run_dir = os.path.join(_shm_root(), f"etdist-{run_id}")
        os.makedirs(self.run_dir, exist_ok=True)
        self._own: List[str] = []
        self._count = 0
        self._finalizer = weakref.finalize(self, _cleanup, self._own, self.run_dir)
        atexit.register(self._finalizer)

    def alloc(self, nbytes: int) -> List[torch.Tensor]:
        """Collective. Returns one flat uint8 tensor per rank (index = rank), own one included."""
        k, self._count = self._count, self._count + 1
        path = lambda r: os.path.join(self.run_dir, f"a{k}.r{r}")  # noqa: E731
        size = max(nbytes, 1)
        own = torch.from_file(path(self.rank), shared=True, size=size, dtype=torch.uint8)
        own.zero_()
        self._own.append(path(self.rank))
        self.comm.barrier()  # every rank's file exists
        views = []
        for r in range(self.world_size):
            if r == self.rank:
                views.append(own)
                continue
            try:
                views.append(torch.from_file(path(r), shared=True, size=size, dtype=torch.uint8))
            except RuntimeError as e:
                raise MeshError(f"rank {self.rank} cannot map rank {r}'s symmetric buffer {path(r)}: {e}. "
                                f"Ranks must share a filesystem at {self.run_dir} (one node), or set "
                                f"ETDIST_SHM_DIR to a shared directory") from None
        return views

    def free(self, views: List[torch.Tensor]) -> None:
        pass  # files go at close: unlinking now would not return memory while peers map them

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.comm.barrier()  # nobody maps a file any more after this (all ranks are closing)
        self._finalizer()
