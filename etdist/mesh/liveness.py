"""Which peers on this host are still there: a lock file per rank, held while its mesh lives.

Rank r holds an exclusive flock on <dir>/alive.r<r> from mesh start to close. The kernel drops
the lock when the process dies, however it dies (SIGKILL included), before the process is even
reaped, so a peer that can take the lock knows rank r is gone: it exited, died, or closed its
mesh. Waits on the host (the cpu backend's spins, the call agreement) ask every few tens of
milliseconds, so a dead peer is named at once instead of after the watchdog; GPU ranks ask when
a watchdog fires, to say why. Ranks on other hosts (no shared /dev/shm) are never judged dead.
"""
from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import uuid
from typing import List, Optional

SHM_DIR: Optional[str] = None   # a directory to use instead (tests set it to keep their files apart)


def shm_root() -> str:
    """Where run dirs live: SHM_DIR where set, else /dev/shm where writable, else the temp dir."""
    if SHM_DIR:
        return SHM_DIR
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def for_mesh(comm, rank: int, world_size: int) -> "Liveness":
    """Collective: a run dir of the mesh's own (its id from the mesh's rank 0) and this rank's lock in
    it, every rank's held before this returns; ranks on other hosts are never judged."""
    run_id = comm.broadcast(uuid.uuid4().hex[:16] if rank == 0 else None)
    run_dir = os.path.join(shm_root(), f"etdist-{run_id}")
    os.makedirs(run_dir, exist_ok=True)
    hosts = comm.allgather(socket.gethostname())
    live = Liveness(run_dir, rank, world_size, [h == hosts[rank] for h in hosts])
    comm.barrier()
    return live


class Liveness:
    def __init__(self, run_dir: str, rank: int, world_size: int, local: Optional[List[bool]] = None):
        """local[s]: whether rank s shares this host (default: every rank does)."""
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.local = local or [True] * world_size
        self._fd: Optional[int] = os.open(self.path(rank), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)   # free, nobody else takes it: never blocks
        self._dead: set = set()

    def path(self, rank: int) -> str:
        return os.path.join(self.run_dir, f"alive.r{rank}")

    def _probe(self, rank: int) -> str:
        """'held' (rank `rank` is there, or is never judged: ourselves, another host's rank, no rank
        of this mesh), 'closed' (its lock file removed: it closed its mesh) or 'died' (the file
        left, its lock free: it exited or was killed)."""
        if rank == self.rank or not 0 <= rank < len(self.local) or not self.local[rank]:
            return "held"
        try:
            fd = os.open(self.path(rank), os.O_RDONLY)
        except FileNotFoundError:
            return "closed"
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "held"
        finally:
            os.close(fd)   # drops our shared lock too
        return "died"

    def alive(self, rank: int) -> bool:
        """False once rank `rank` (on this host) has exited, died or closed its mesh."""
        if rank in self._dead:
            return False
        if self._probe(rank) == "held":
            return True
        self._dead.add(rank)
        return False

    def died(self, rank: int) -> bool:
        """True once rank `rank` (on this host) is gone without closing its mesh. A rank that closed
        its mesh removed its lock file first: it is in (or through) the same collective close as
        we are, so our close must take part in it."""
        return self._probe(rank) == "died"

    def dead(self) -> List[int]:
        """The ranks known gone (asking about every peer)."""
        return [s for s in range(self.world_size) if not self.alive(s)]

    def close(self, remove_dir: bool = False) -> None:
        """Let go of our lock (peers then know we are gone) and remove our lock file (remove_dir: and
        the run dir, where it holds nothing else: the last rank out removes it)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path(self.rank))
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        if remove_dir:
            try:
                os.rmdir(self.run_dir)
            except OSError:
                pass
