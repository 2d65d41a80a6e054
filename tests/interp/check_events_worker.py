"""compile(..., check_events=True) on the GPU codegen (under Triton's interpreter): graphs whose maps
validation was told to skip. A notify outside its event raises naming the event and coordinate, one
past an element's count raises naming the element; a correct graph runs (launch after launch).

    TRITON_INTERPRET=1 torchrun --nproc_per_node=2 tests/interp/check_events_worker.py
"""
import torch
import triton
import triton.language as tl

import etdist as et
from etdist.fusion.bind import MapTable
from etdist.fusion.cuda_runtime import CudaKernel


@triton.jit
def copy_body(i, x, y):
    tl.store(y + i, tl.load(x + i) + 1)


@triton.jit
def read_body(i, y, z):
    tl.store(z + i, 2 * tl.load(y + i))


def graph(bug: str):
    """a(i) writes y[i] and notifies done; b(i) waits on done[i] and writes z[i]. bug 'oob': the last
    a notifies done[n] (outside its n elements)."""
    g = et.Graph(f"check_{bug}")
    n = g.size("n")
    g.input("x", (n,), torch.float32)
    g.output("y", (n,), torch.float32)
    g.output("z", (n,), torch.float32)
    done = g.event("done", (n,))

    def notify(i):
        return done[et.where(i >= n - 1, n, i)] if bug == "oob" else done[i]

    @g.task(grid=(n,), notify=notify, triton=copy_body)
    def a(t, i):
        t.y[i] = t.x[i] + 1

    @g.task(grid=(n,), wait=lambda i: done[i], triton=read_body)
    def b(t, i):
        t.z[i] = 2 * t.y[i]

    return g


def over_graph():
    """Every a(i) notifies done[0], whose count is 1: n - 1 notifies too many (nobody waits on it)."""
    g = et.Graph("check_over")
    n = g.size("n")
    g.input("x", (n,), torch.float32)
    g.output("y", (n,), torch.float32)
    done = g.event("done", (1,))

    @g.task(grid=(n,), notify=lambda i: done[0], triton=copy_body)
    def a(t, i):
        t.y[i] = t.x[i] + 1

    return g


def unchecked(g) -> CudaKernel:
    """The GPU kernel of `g` with validation skipped (at compile and at the call's sizes)."""
    return CudaKernel(MapTable.build(g.to_ir()), "static", check_events=True, check_sizes=False)


def main():
    mesh = et.init_mesh(backend="cpu", watchdog_s=20)
    x = torch.arange(5, dtype=torch.float32)
    good = et.compile(graph("none"), target="cuda", check_events=True)
    for _ in range(3):   # counters re-arm by epoch: launch after launch stays within the counts
        out = good(mesh, x=x, sizes={"n": 5})
        assert torch.equal(out["z"], 2 * (x + 1)), out
    try:
        unchecked(graph("oob"))(mesh, x=x, sizes={"n": 5})
        raise AssertionError("an out-of-bounds notify ran")
    except et.RuntimeFault as e:
        assert "notified done at coordinate 5 of dimension 0, outside its 5 elements" in str(e), e
        print(f"OK check-events oob rank {mesh.rank}: {e}", flush=True)
    mesh.close()
    mesh = et.init_mesh(backend="cpu", watchdog_s=20)
    try:
        unchecked(over_graph())(mesh, x=x, sizes={"n": 5})
        raise AssertionError("an over-notified element went unnoticed")
    except et.RuntimeFault as e:
        assert "done[0]" in str(e) and "notified past its count: counter 5, at most 1" in str(e), e
        print(f"OK check-events over rank {mesh.rank}: {e}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
