"""One rank refuses a call at a shape every rank has prepared (its x is not contiguous), under
Triton's interpreter over a cpu mesh: no rank may return another call's data; every rank raises
(the peers a CallMismatchError naming the refusal, from their launch's entry check), and the next
call runs on every rank (nothing ran for the refused one: kernel and mesh stay usable).

    TRITON_INTERPRET=1 torchrun --nproc_per_node=2 tests/interp/refusal_worker.py   -> 'OK refusal rank r'

--local-first: the skinny graph whose slices are summed locally, compiled with local_first: the
refused call's peers ran their local matmuls during the agreement, notified nothing, and the next
call still finds every counter where it was.
"""
import sys
import time

import torch

import etdist as et
from etdist.workloads import gemm_rs


class _SlowLaunch:
    """The interpreted launch, then a pause: the peer finishes the same call, refuses its next one
    and posts the refusal before this rank reads its error record (a race CI once lost: this rank's
    first call raised the peer's second call's refusal)."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.fn[grid](*args, **kwargs)
            time.sleep(3)
        return launch


def slow_after_launch(kernel):
    kernel.module.megakernel = _SlowLaunch(kernel.module.megakernel)


def main():
    mesh = et.init_mesh(backend="cpu", watchdog_s=20)
    R, r = mesh.world_size, mesh.rank
    if "--local-first" in sys.argv[1:]:
        kernel = et.compile(gemm_rs.gemm_reduce_scatter_skinny(16, 16, torch.float32, 16, splits=2, local_sums=True),
                            target="cuda", local_first=True)
    else:
        kernel = et.compile(gemm_rs.gemm_reduce_scatter(16, 16, torch.float32, 16, group_m=2), target="cuda")
    if r == 0:
        slow_after_launch(kernel)
    ins = gemm_rs.make_inputs(R, 9, 24, 40, seed=1)
    want = gemm_rs.reference([i["x"] for i in ins], [i["w"] for i in ins])[r]
    y = kernel(mesh, x=ins[r]["x"], w=ins[r]["w"])["y"]          # the shape is prepared on every rank
    assert torch.allclose(y.double(), want, rtol=1e-4, atol=1e-4)
    kernel.check(mesh)   # rank 0 (paused) reads the peer's refusal of call 2 here: not this call's error
    x = ins[r]["x"] * 2
    if r == R - 1:
        x = x.t().contiguous().t()                                 # same shape, not contiguous
    t0 = time.monotonic()
    try:
        kernel(mesh, x=x, w=ins[r]["w"])
        outcome = "returned"
    except et.InputError as e:
        outcome = "InputError" if r == R - 1 and "not contiguous" in str(e) else f"wrong InputError: {e}"
    except et.ShapeMismatchError as e:
        outcome = ("CallMismatchError" if r != R - 1 and f"rank {R - 1} refused its arguments" in str(e)
                   and "not contiguous" in str(e) else f"wrong error: {e}")
    assert outcome == ("InputError" if r == R - 1 else "CallMismatchError"), outcome
    assert time.monotonic() - t0 < 15, "stopped by the watchdog, not by the refusal"
    y = kernel(mesh, x=ins[r]["x"], w=ins[r]["w"])["y"]             # the kernel and the mesh stay usable
    assert torch.allclose(y.double(), want, rtol=1e-4, atol=1e-4)
    print(f"OK refusal rank {r}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
