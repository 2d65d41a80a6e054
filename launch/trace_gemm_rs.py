"""Where a gemm_rs call goes, at any M: the op's device kernel time (torch.profiler) against
torch.mm alone, then one traced launch of the same plan (etdist.ops.gemm_rs.kernel_plan, compiled
with trace=True): per rank the span, busy share, per-kind task statistics and gaps; a Chrome trace
in $OUT (default /tmp).

    torchrun --nproc_per_node=2 launch/trace_gemm_rs.py M N K_full    # e.g. 16 4096 12288
"""
import itertools
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import etdist as et
from etdist.fusion import trace as tr
from etdist.measure.timing import time_ranks
from etdist.ops import gemm_rs as op

M, N, KF = (int(a) for a in sys.argv[1:4])
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
K = KF // mesh.world_size
ws = [torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5 for _ in range(4)]
x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
for i in range(5):
    op.gemm_reduce_scatter(x, ws[i % 4], mesh=mesh)
torch.cuda.synchronize()
dist.barrier()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(20):
        op.gemm_reduce_scatter(x, ws[i % 4], mesh=mesh)
    torch.cuda.synchronize()
kern = [e for e in prof.key_averages() if "megakernel" in e.key]
k_us = kern[0].device_time_total / kern[0].count if kern else float("nan")
rotating = itertools.cycle(ws)
mm_us = time_ranks(lambda: torch.mm(x, next(rotating)), device=mesh.device)

cfg, splits, _, build = op.kernel_plan(M, K, N, x.dtype, op._sm_count(mesh.device.index))
kernel = et.compile(build(), schedule="static", target="cuda", trace=True)
kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
for i in range(5):
    kernel(mesh, x=x, w=ws[i % 4])
rows = kernel.trace(mesh)
if mesh.rank == 0:
    path = tr.write_chrome(rows, f"{os.environ.get('OUT', '/tmp')}/gemm_rs_M{M}_N{N}.json", track="SM")
    print(f"== M={M} N={N} K={K} {cfg} splits={splits}: op kernel {k_us:.1f} us/call (profiler), "
          f"torch.mm alone {mm_us:.1f} us; Chrome trace {path}")
    for rank in range(mesh.world_size):
        print(tr.summary(rows, rank), flush=True)
mesh.close()
