"""The nvshmem backend: symmetric GPU memory from nvshmem4py, bootstrapped with a unique id.

Under torchrun (or srun) rank 0's NVSHMEM unique id travels over torch.distributed; under mpirun
nvshmem4py's `emulated_mpi` method broadcasts it over mpi4py. Allocation and free are collective
and happen in the same order on every rank (the Mesh guarantees the order).
"""
from __future__ import annotations

import os
import sys
import threading
from typing import List

import torch

from .errors import MeshError
from .hostcomm import HostComm, MpiComm

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
        # Peers through NVLink only: NVSHMEM's proxy thread has no work, yet it spins a whole core,
        # and where it shared the main thread's core an eager op call took ~50 us instead of ~24
        # (twenty-fourth session). Off, it takes device-side global exit and NVSHMEM's own wait
        # timeouts with it: we use neither (our watchdog is our own).
        env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        env.setdefault("NVSHMEM_DISABLE_LOCAL_ONLY_PROXY", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # no NVLink multicast on our machines
    env.setdefault("NVSHMEM_SYMMETRIC_SIZE", env.get("ETDIST_SYMMETRIC_SIZE", "4G"))


class NvshmemBackend:
    name = "nvshmem"

    def __init__(self, rank: int, world_size: int, local_world_size: int, device: torch.device,
                 comm: HostComm, timeout_s: float):
        self.rank, self.world_size, self.comm, self.device = rank, world_size, comm, device
        self.nvshmem = nvshmem = import_nvshmem()
        from cuda.core import Device

        env_defaults(os.environ, one_node=local_world_size == world_size)
        torch.cuda.set_device(device)
        self.cu_device = Device(device.index)
        self.cu_device.set_current()
        try:
            with _Deadline(max(4 * timeout_s, 20.0), "NVSHMEM bootstrap", rank):
                if isinstance(comm, MpiComm):
                    nvshmem.init(device=self.cu_device, mpi_comm=comm.comm, initializer_method="emulated_mpi")
                else:
                    uid = nvshmem.get_unique_id() if rank == 0 else nvshmem.get_unique_id(empty=True)
                    uid = comm.broadcast(uid if rank == 0 else None)
                    nvshmem.init(device=self.cu_device, uid=uid, rank=rank, nranks=world_size,
                                 initializer_method="uid")
        except MeshError:
            raise
        except Exception as e:  # nvshmem4py raises its own error types
            raise MeshError(f"rank {rank}: NVSHMEM bootstrap failed: {type(e).__name__}: {e}. On one node "
                            f"set NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo; see NVSHMEM_DEBUG=INFO for details") from None
        if nvshmem.n_pes() != world_size or nvshmem.my_pe() != rank:
            raise MeshError(f"NVSHMEM placed this process as PE {nvshmem.my_pe()} of {nvshmem.n_pes()}, "
                            f"the mesh says rank {rank} of {world_size}")
        self._owned: List[torch.Tensor] = []
        self._closed = False

    def alloc(self, nbytes: int) -> List[torch.Tensor]:
        own = self.nvshmem.tensor((max(nbytes, 16),), dtype=torch.uint8)
        own.zero_()
        self._owned.append(own)
        views = [own if r == self.rank else self.nvshmem.get_peer_tensor(own, r) for r in range(self.world_size)]
        torch.cuda.synchronize(self.device)
        self.comm.barrier()  # every rank's copy is zeroed before anyone signals into it
        return views

    def free(self, views: List[torch.Tensor]) -> None:
        own = views[self.rank]
        for i, t in enumerate(self._owned):
            if t.data_ptr() == own.data_ptr():
                self._owned.pop(i)
                self.nvshmem.free_tensor(t)
                return

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self, failed: bool = False) -> None:
        """Collective: free every symmetric tensor (newest first, the same order everywhere) and
        finalize. After a fault (failed) a peer may be gone: nothing collective is tried."""
        if self._closed:
            return
        self._closed = True
        if failed:
            self._owned.clear()
            return
        torch.cuda.synchronize(self.device)
        self.comm.barrier()
        while self._owned:  # collective, same order on every rank: newest first
            self.nvshmem.free_tensor(self._owned.pop())
        self.nvshmem.finalize()
