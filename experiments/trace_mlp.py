"""Where a fused MLP call goes (the graph, tiles and slices the op plans: etdist.ops.mlp.kernel_plan):
the op's time, its two GEMMs alone (torch.mm), then one traced launch of the same graph queued
behind calls, summarised per rank (span, busy share, per task kind: time, wait, gap before it) with
each GEMM kind's rate per SM against what 132 SMs at torch.mm's rate would give. Chrome trace in
$OUT (default /tmp).

    torchrun --nproc_per_node=2 experiments/trace_mlp.py M H I_full      # e.g. 1024 16384 53248
"""
import os
import sys

import torch
import torch.distributed as dist

import etdist as et
from etdist.bench.measure.ranks import chunk
from etdist.fusion import trace as tr
from etdist.bench.measure.timing import time_ranks
from etdist.ops import mlp as mlp_op

M, H, IF = (int(a) for a in sys.argv[1:4])
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
R, dev, bf16 = mesh.world_size, mesh.device, torch.bfloat16
I = IF // R
lo, hi = chunk(M, R, mesh.rank)   # this rank's rows of x
x = torch.randn(hi - lo, H, device=dev, dtype=bf16)
wgu = torch.randn(H, 2 * I, device=dev, dtype=bf16) / H ** 0.5
wd = torch.randn(I, H, device=dev, dtype=bf16) / I ** 0.5
xa, h = torch.randn(M, H, device=dev, dtype=bf16), torch.randn(M, I, device=dev, dtype=bf16)

op_us = time_ranks(lambda: et.ops.tensor_parallel_mlp(x, wgu, wd, mesh=mesh, total_rows=M), device=dev)
up_us = time_ranks(lambda: xa @ wgu, device=dev)
down_us = time_ranks(lambda: h @ wd, device=dev)

sms = torch.cuda.get_device_properties(dev).multi_processor_count
cfg, build, sizes = mlp_op.kernel_plan(M, H, I, bf16, sms, R, et.ops.DEFAULT_PLAN)   # the op's plan
down_n = build.keywords.get("down_n", cfg.block_n)
graph = build()
kernel = et.compile(graph, schedule="static", target="cuda", trace=True)
kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
trace_rows = tr.queued_trace(kernel, mesh, x=x, w_gate_up=wgu, w_down=wd, sizes=sizes)
if mesh.rank == 0:
    path = tr.write_chrome(trace_rows, f"{os.environ.get('OUT', '/tmp')}/mlp_M{M}_H{H}.json", track="SM")
    print(f"== mlp M={M} H={H} I={I} per rank, {graph.name} tiles {cfg}, down {cfg.block_m}x{down_n}: op {op_us:.1f} us; torch.mm gate/up "
          f"{up_us:.1f} us + down {down_us:.1f} us = {up_us + down_us:.1f} us; Chrome trace {path}", flush=True)
    # a task's work: gate/up tiles up_n wide (narrowed at decode sizes), whole-gather down tiles in slices of I
    up_n, slices = build.keywords.get("up_n", cfg.block_n), build.keywords.get("down_splits", 1)
    flops = {"gate_up": 2 * cfg.block_m * 2 * up_n * H, "down": 2 * cfg.block_m * down_n * I / slices}
    mm_rate = {"gate_up": 2 * M * 2 * I * H / up_us / sms, "down": 2 * M * I * H / down_us / sms}  # flop/us per SM
    for rank in range(R):
        print(tr.summary(trace_rows, rank), flush=True)
        for kind, f in flops.items():
            body = tr.median_body_us(trace_rows, rank, kind)
            if body:
                print(f"  {kind}: median tile {body:.1f} us less its wait: {f / body / 1e6:.2f} TF/s per SM, "
                      f"torch.mm {mm_rate[kind] / 1e6:.2f} (whole-GPU rate / {sms})", flush=True)
mesh.close()
