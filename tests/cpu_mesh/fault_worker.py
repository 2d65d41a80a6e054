"""A rank that goes away mid-job, on the cpu backend: the others must raise naming it, close
without raising, leave nothing in TEST_SHM_DIR, and (the error left uncaught) make the job exit
non-zero.

    torchrun --nproc_per_node=2 tests/cpu_mesh/fault_worker.py CASE
    mpiexec -n 2 python tests/cpu_mesh/fault_worker.py CASE

CASE (what the last rank does before the second all_reduce): kill (SIGKILL), exit (sys.exit(0)),
term (SIGTERM, default handler), close (closes its mesh and waits), skip (skips the call, stays:
the others' watchdog fires). Prints 'RAISED <error> in <s>s: <message>' and 'CLOSED' per survivor.
"""
import os
import signal
import sys
import time

import torch

import etdist as et
from etdist.mesh import liveness

liveness.SHM_DIR = os.environ.get("TEST_SHM_DIR")   # the test's own directory, checked empty after


def main():
    case = sys.argv[1]
    mesh = et.init_mesh(backend="cpu", watchdog_s=float(os.environ.get("ETDIST_WATCHDOG_S", "20")))
    r, last = mesh.rank, mesh.world_size - 1
    et.all_reduce(torch.ones(4), mesh=mesh)
    if r == last:
        if case == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif case == "exit":
            sys.exit(0)
        elif case == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        elif case in ("close", "skip"):
            if case == "close":
                mesh.close()
            time.sleep(4)
            print("WAITED", flush=True)
            return
    t0 = time.monotonic()
    try:
        et.all_reduce(torch.ones(4), mesh=mesh)
        print("RETURNED", flush=True)
    except et.MeshError as e:
        print(f"RAISED {type(e).__name__} in {time.monotonic() - t0:.2f}s: {e}", flush=True)
        raise
    finally:
        mesh.close()   # after a fault: cleans up, never raises
        print("CLOSED", flush=True)


if __name__ == "__main__":
    main()
