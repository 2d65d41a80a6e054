"""Where an eager decode call's host time goes, on the GPU machine, at world 2: wall time per call of
the op, of its CudaKernel call alone, and of Triton's launch alone (back to back, synchronised at
the end), then cProfile of the op's calls (rank 0 prints).

    torchrun --nproc_per_node=2 experiments/host_profile.py [M] [N] [K_full]   # default 16 4096 12288
"""
import cProfile
import pstats
import sys
import time

import torch
import torch.distributed as dist

import etdist as et
from triton.runtime import _allocation as triton_allocation
from etdist.ops import gemm_rs as op

M, N, KF = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (16, 4096, 12288)))
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
K = KF // mesh.world_size
w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5
x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
call = lambda: et.ops.gemm_reduce_scatter(x, w, mesh=mesh)  # noqa: E731
call()
cfg, splits, align, build = op.kernel_plan(M, K, N, x.dtype, op.sm_count(mesh.device.index), mesh.world_size,
                                           et.ops.DEFAULT_PLAN)
kernel = op.cached_kernel(op._KERNELS, et.ops.DEFAULT_PLAN, cfg, "static", build)
st = kernel.state(mesh)
inner = lambda: kernel(mesh, x=x, w=w)  # noqa: E731
y = torch.empty(-(-M // mesh.world_size), N, device=mesh.device, dtype=x.dtype)
flat = st.shape.direct_args({"x": x, "w": w, "y": y, "call_sig": st.word})
stream = torch.cuda.current_stream().cuda_stream
k = st.compiled
launch = lambda: k.run(st.programs, 1, 1, stream, k.function, k.packed_metadata, None, None, None,  # noqa: E731
                       *flat, st.programs, True)


def per_call(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / n * 1e6
    return host, total


triton_allocation._allocator.set(st.allocate_scratch)   # as the runtime sets it around its launches
for name, fn in (("op", call), ("kernel", inner), ("launch", launch)):
    host, total = per_call(fn)
    if mesh.rank == 0:
        print(f"{name:8} host {host:6.1f} us per call (until the last launch was queued), {total:6.1f} with the GPU",
              flush=True)
dist.barrier()
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    call()
pr.disable()
torch.cuda.synchronize()
if mesh.rank == 0:
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
mesh.close()
