"""The cpu backend: R real processes sharing memory-mapped files, with the same API as NVSHMEM.

Symmetric allocation k of rank r is the file <run dir>/a<k>.r<r>; every rank maps every rank's
file, so `peer(t, s)` is a plain tensor over rank s's file and stores into it are seen by rank s.
The run dir is keyed by a run id that the mesh's rank 0 broadcasts (a mesh over a sub-group has
its own) and lives in /dev/shm where there is one. Beside the files, each rank's liveness lock
(liveness.py): peers waiting on a rank that died name it at once.

Files go on every way out: `close()` (also after a fault: it never waits on a peer and never
raises) unlinks this rank's files and those of peers known dead, and the last one out removes the
directory (mappings stay valid until dropped, so no rank waits for another to unlink); a process
that forgot to close cleans up at exit, and on SIGTERM or SIGINT where the signal would end it
(handlers chain to those installed before). Only a rank killed outright (SIGKILL) leaves files:
its peers remove them at their close, and where every rank was killed (mpiexec kills the rest
of a job with SIGKILL), the next mesh started on the host removes the directory (no rank's
liveness lock held).
"""
from __future__ import annotations

import fcntl
import glob
import os
import shutil
import signal
import threading
import time
import uuid
import weakref
from typing import List, Optional

import torch

from .errors import MeshError
from .hostcomm import HostComm
from .liveness import Liveness, shm_root


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_CLEANING = [0]    # cleanups under way in this process (a signal then waits for them: _PENDING)
_PENDING: List[int] = []


def _cleanup(paths: List[str], run_dir: str, liveness: List) -> None:
    """This rank's files, its liveness lock, the files of peers known dead, and the directory if
    nothing else is left in it. Never raises (it runs at exit and from signal handlers). A SIGTERM or
    SIGINT arriving meanwhile is delivered again once it is done (torchrun sends SIGTERM to every
    rank when one dies, while they clean up)."""
    _CLEANING[0] += 1
    try:
        _remove(paths, run_dir, liveness)
    finally:
        _CLEANING[0] -= 1
        if not _CLEANING[0] and _PENDING:
            os.kill(os.getpid(), _PENDING.pop())


def _remove(paths: List[str], run_dir: str, liveness: List) -> None:
    try:
        # one rank's cleanup at a time (a lock on the directory itself): two ranks cleaning up at once
        # each saw the other still there, neither removed the directory
        held = os.open(run_dir, os.O_RDONLY)
    except OSError:
        held = None
    try:
        if held is not None:
            fcntl.flock(held, fcntl.LOCK_EX)
        for p in paths:
            _unlink(p)
        paths.clear()
        live = liveness[0] if liveness else None
        if live is not None:
            dead = live.dead()
            live.close()
            liveness.clear()
            for s in dead:   # a rank killed outright left its files: nobody else will remove them
                for p in glob.glob(os.path.join(run_dir, f"a*.r{s}")) + [os.path.join(run_dir, f"alive.r{s}")]:
                    _unlink(p)
        os.rmdir(run_dir)
    except OSError:
        pass  # another rank still has files there; the last one removes it
    finally:
        if held is not None:
            os.close(held)   # drops the lock


_BACKENDS: "weakref.WeakSet[CpuBackend]" = weakref.WeakSet()
_HANDLERS_SET = False


def _install_signal_handlers() -> None:
    """Once per process, from the main thread: on SIGTERM / SIGINT whose handler (the one installed
    before ours) would end the process without unwinding (SIG_DFL), remove every live mesh's files
    first, then let the signal do what it did. A Python handler (KeyboardInterrupt's, a user's) is
    called as before: the process then unwinds and cleans up at exit, or carries on with its mesh."""
    global _HANDLERS_SET
    if _HANDLERS_SET or threading.current_thread() is not threading.main_thread():
        return
    _HANDLERS_SET = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if previous is None:   # installed from C: leave it alone
            continue

        def handler(signum, frame, previous=previous):
            if _CLEANING[0]:   # interrupting a cleanup would leave files: delivered again after it
                _PENDING.append(signum)
                return
            if previous == signal.SIG_IGN:
                return
            if callable(previous):
                previous(signum, frame)
                return
            for b in list(_BACKENDS):
                b.cleanup()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


STALE_S = 60.0   # a run dir untouched this long, with no liveness lock held: every rank of it is gone


def sweep_stale(root: str, now: Optional[float] = None) -> List[str]:
    """Remove the run dirs under `root` whose ranks were all killed (liveness locks there, none held,
    nothing changed for STALE_S). Dirs without locks (another etdist's) are left alone."""
    now = time.time() if now is None else now
    removed = []
    for d in glob.glob(os.path.join(root, "etdist-*")):
        try:
            locks = glob.glob(os.path.join(d, "alive.r*"))
            if not locks or now - os.stat(d).st_mtime < STALE_S:
                continue
            held = False
            for lock in locks:
                fd = os.open(lock, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    held = True
                finally:
                    os.close(fd)
                if held:
                    break
            if not held:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        except OSError:
            continue   # another process removed it meanwhile
    return removed


class CpuBackend:
    name = "cpu"

    def __init__(self, rank: int, world_size: int, comm: HostComm):
        self.rank, self.world_size, self.comm = rank, world_size, comm
        self.device = torch.device("cpu")
        run_id = comm.broadcast(uuid.uuid4().hex[:16] if rank == 0 else None)
        if rank == 0:
            sweep_stale(shm_root())
        self.run_dir = os.path.join(shm_root(), f"etdist-{run_id}")
        os.makedirs(self.run_dir, exist_ok=True)
        self._own: List[str] = []
        self._count = 0
        self._live: List[Liveness] = [Liveness(self.run_dir, rank, world_size)]
        # at exit (weakref.finalize runs its pending calls then) if nobody closed the mesh
        self._finalizer = weakref.finalize(self, _cleanup, self._own, self.run_dir, self._live)
        _BACKENDS.add(self)
        _install_signal_handlers()
        comm.barrier()   # every rank's liveness lock is held: from here on a missing one means gone

    @property
    def liveness(self) -> Optional[Liveness]:
        return self._live[0] if self._live else None

    def alloc(self, nbytes: int) -> List[torch.Tensor]:
        """Collective. Returns one flat uint8 tensor per rank (index = rank), own one included."""
        k, self._count = self._count, self._count + 1
        path = lambda r: os.path.join(self.run_dir, f"a{k}.r{r}")  # noqa: E731
        size = max(nbytes, 1)
        self._own.append(path(self.rank))
        own = torch.from_file(path(self.rank), shared=True, size=size, dtype=torch.uint8)
        own.zero_()
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
                                f"Ranks must share a filesystem at {self.run_dir}: the cpu backend runs on "
                                f"one node") from None
        return views

    def free(self, views: List[torch.Tensor]) -> None:
        pass  # files go at close: unlinking now would not return memory while peers map them

    def synchronize(self) -> None:
        pass

    def cleanup(self) -> None:
        """Remove this rank's files now (close, exit, or a signal that ends the process)."""
        self._finalizer()

    def close(self, failed: bool = False) -> None:
        """Never waits on a peer (mappings outlive the names) and never raises."""
        _BACKENDS.discard(self)
        self.cleanup()
