"""Which threads of this process keep a CPU core busy, from /proc (Linux): NVSHMEM's proxy thread
spun one core in every etdist process until the mesh turned it off (records host_path)."""
from __future__ import annotations

import os
import time


def thread_ticks() -> dict[int, tuple[str, int]]:
    """tid -> (name, utime + stime in clock ticks) of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue   # the thread ended
        out[int(tid)] = (name, int(fields[11]) + int(fields[12]))
    return out


def busy_threads(seconds: float = 1.0) -> dict[int, tuple[str, float]]:
    """tid -> (name, share of a core) of every thread over `seconds` while the caller sleeps (a
    thread born meanwhile counts all its ticks)."""
    before, t0 = thread_ticks(), time.perf_counter()
    time.sleep(seconds)
    after, hz, elapsed = thread_ticks(), os.sysconf("SC_CLK_TCK"), time.perf_counter() - t0
    return {tid: (name, (t - before.get(tid, (name, 0))[1]) / hz / elapsed) for tid, (name, t) in after.items()}
