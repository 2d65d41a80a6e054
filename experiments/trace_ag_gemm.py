"""Where an all_gather_gemm call goes (the graph and tiles the op plans: etdist.ops.ag_gemm.kernel_plan):
the op's time, torch.mm on the gathered rows alone, then one traced launch of the same graph queued
behind calls, summarised per rank (span, busy share, per task kind: time, wait, gap before it) with
the GEMM tiles' rate per SM against what all SMs at torch.mm's rate would give. Chrome trace in $OUT
(default /tmp).

    torchrun --nproc_per_node=2 experiments/trace_ag_gemm.py M K N_full      # e.g. 16 4096 24576 (qwen3_8b's gate/up)

N_full is split over the ranks (each multiplies the gathered rows by its N_full / R columns); on one
GPU pass a rank's N to see a rank of that size.
"""
import os
import sys

import torch
import torch.distributed as dist

import etdist as et
from etdist.bench.measure.ranks import chunk
from etdist.fusion import trace as tr
from etdist.bench.measure.timing import time_ranks
from etdist.ops import ag_gemm as ag_op

M, K, NF = (int(a) for a in sys.argv[1:4])
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
R, dev, bf16 = mesh.world_size, mesh.device, torch.bfloat16
N = NF // R
lo, hi = chunk(M, R, mesh.rank)   # this rank's rows of x
x = torch.randn(hi - lo, K, device=dev, dtype=bf16)
w = torch.randn(K, N, device=dev, dtype=bf16) / K ** 0.5
xa = torch.randn(M, K, device=dev, dtype=bf16)

op_us = time_ranks(lambda: et.ops.all_gather_gemm(x, w, mesh=mesh, total_rows=M), device=dev)
mm_us = time_ranks(lambda: xa @ w, device=dev)

sms = torch.cuda.get_device_properties(dev).multi_processor_count
cfg, build = ag_op.kernel_plan(M, K, N, bf16, sms, R, et.ops.DEFAULT_PLAN)   # the op's plan
graph = build()
kernel = et.compile(graph, schedule="static", target="cuda", trace=True)
kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
rows = tr.queued_trace(kernel, mesh, x=x, w=w, sizes={"M": M})
if mesh.rank == 0:
    path = tr.write_chrome(rows, f"{os.environ.get('OUT', '/tmp')}/ag_gemm_M{M}_K{K}.json", track="SM")
    width = build.keywords.get("gemm_n", cfg.block_n)
    print(f"== ag_gemm M={M} K={K} N={N} per rank, {graph.name} tiles {cfg}, GEMM tiles {cfg.block_m}x{width}: "
          f"op {op_us:.1f} us; torch.mm {mm_us:.1f} us; Chrome trace {path}", flush=True)
    flops, mm_rate = 2 * cfg.block_m * width * K, 2 * M * N * K / mm_us / sms   # flop per tile; flop/us per SM
    for rank in range(R):
        print(tr.summary(rows, rank), flush=True)
        body = tr.median_body_us(rows, rank, "matmul_with_tail" if "tail_m" in build.keywords else "matmul")
        if body:
            print(f"  matmul: median tile {body:.1f} us less its wait: {flops / body / 1e6:.2f} TF/s per SM, "
                  f"torch.mm {mm_rate / 1e6:.2f} (whole-GPU rate / {sms})", flush=True)
mesh.close()
