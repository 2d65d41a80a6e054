"""init_mesh / close many times in one process on the cpu backend, with a collective every tenth
time; fails if descriptors, threads or memory grow (issue 45: the second to sixth init hung or
failed where etdist owned the process group; each cycle leaked descriptors and threads where the
user owned it).

    torchrun --nproc_per_node=2 tests/cpu_mesh/reinit_worker.py [--user-group] [--cycles 100]
    mpiexec -n 2 python tests/cpu_mesh/reinit_worker.py
    python tests/cpu_mesh/reinit_worker.py          (one process)
"""
import argparse
import os
import threading

import torch

import etdist as et
from etdist.mesh import liveness

liveness.SHM_DIR = os.environ.get("TEST_SHM_DIR")   # the test's own directory, checked empty after


def usage():
    rss_mib = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), rss_mib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--user-group", action="store_true", help="the script owns torch.distributed's group")
    args = ap.parse_args()
    if args.user_group:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    base = None
    for i in range(args.cycles):
        mesh = et.init_mesh(backend="cpu", watchdog_s=10)
        if i % 10 == 0:
            y = et.all_reduce(torch.ones(4), mesh=mesh)
            assert y.tolist() == [float(mesh.world_size)] * 4, y
        rank = mesh.rank
        mesh.close()
        if i == 10:
            base = usage()
    fds, threads, rss = usage()
    grown = (fds - base[0], threads - base[1], rss - base[2])
    assert grown[0] <= 0 and grown[1] <= 0 and grown[2] < 32, f"after cycle 10 {base}, at the end {usage()}"
    print(f"OK reinit rank {rank}: {args.cycles} cycles, fds {fds}, threads {threads}, rss {rss:.0f} MiB "
          f"(growth since cycle 10: {grown[0]} fds, {grown[1]} threads, {grown[2]:.1f} MiB)", flush=True)


if __name__ == "__main__":
    main()
