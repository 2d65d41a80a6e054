"""Host time of each step of an eager gemm_rs call at a prepared shape, on the GPU machine at world 2
(each step alone, 300 times back to back, best of 7): where the op's host path goes.

    torchrun --nproc_per_node=2 experiments/host_pieces.py [M] [N] [K_full]   # default 16 4096 12288
"""
import sys
import time

import torch
import torch.distributed as dist

import etdist as et
from etdist.ops import common
from etdist.ops import gemm_rs as op

M, N, KF = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (16, 4096, 12288)))
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
K = KF // mesh.world_size
w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5
x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
plan = et.ops.DEFAULT_PLAN
cfg, splits, align, build = op.kernel_plan(M, K, N, x.dtype, op.sm_count(mesh.device.index), mesh.world_size, plan)
kernel = op.cached_kernel(op._KERNELS, plan, cfg, "static", build)


def ctx():
    with common.refusal_reaches_peers(mesh, op._KERNELS):
        pass


steps = [
    ("op (launches)", lambda: et.ops.gemm_reduce_scatter(x, w, mesh=mesh)),
    ("kernel() (launches)", lambda: kernel(mesh, x=x, w=w)),
    ("is_compiling", torch.compiler.is_compiling),
    ("plan_config", lambda: common.plan_config("g", None)),
    ("check_operands", lambda: common.check_operands("g", "h", x, w, mesh)),
    ("kernel_plan", lambda: op.kernel_plan(M, K, N, x.dtype, 132, mesh.world_size, plan)),
    ("sm_count", lambda: op.sm_count(mesh.device.index)),
    ("cached_kernel", lambda: op.cached_kernel(op._KERNELS, plan, cfg, "static", build)),
    ("refusal ctx", ctx),
    ("torch.empty", lambda: torch.empty((M // 2, N), dtype=x.dtype, device=mesh.device)),
    ("x.new_empty", lambda: x.new_empty((M // 2, N))),
    ("t.device != dev", lambda: x.device != mesh.device),
    ("is_contiguous", x.is_contiguous),
    ("data_ptr", x.data_ptr),
    ("getDevice", torch._C._cuda_getDevice),
    ("capturing", torch._C._cuda_isCurrentStreamCapturing),
    ("raw stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
    ("shape key", lambda: (x.shape, x.dtype) == (x.shape, x.dtype)),
    ("op (launches)", lambda: et.ops.gemm_reduce_scatter(x, w, mesh=mesh)),
]
rows = []
for name, f in steps:
    best = 1e9
    for _ in range(7):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(300):
            f()
        best = min(best, (time.perf_counter() - t0) / 300 * 1e6)
    rows.append((name, best))
torch.cuda.synchronize()
out = [None] * mesh.world_size
dist.all_gather_object(out, rows)
if mesh.rank == 0:
    print(f"gemm_rs M={M} N={N} K={K}: host us per step (best of 7 x 300), rank 0 | rank 1")
    for (name, a), (_, b) in zip(out[0], out[1]):
        print(f"  {name:20} {a:7.2f} | {b:7.2f}")
mesh.close()
