"""Where a fused MLP call goes (the graph and tiles the op plans: tp_mlp above 128 rows, tp_mlp_whole
at or below; the tail plan's slices are left out):
the op's time, its two GEMMs alone (torch.mm), then one traced launch of the same graph queued
behind calls, summarised per rank (span, busy share, per task kind: time, wait, gap before it) with
each GEMM kind's rate per SM against what 132 SMs at torch.mm's rate would give. Chrome trace in
$OUT (default /tmp).

    torchrun --nproc_per_node=2 launch/trace_mlp.py M H I_full      # e.g. 1024 16384 53248
"""
import os
import sys

import torch
import torch.distributed as dist

import etdist as et
from etdist.fusion import trace as tr
from etdist.measure.timing import time_ranks
from etdist.ops import mlp as mlp_op
from etdist.workloads import mlp as mlp_graph

M, H, IF = (int(a) for a in sys.argv[1:4])
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
R, dev, bf16 = mesh.world_size, mesh.device, torch.bfloat16
I = IF // R
C = -(-M // R)
own = max(0, min(C, M - mesh.rank * C))   # this rank's rows of x
x = torch.randn(own, H, device=dev, dtype=bf16)
wgu = torch.randn(H, 2 * I, device=dev, dtype=bf16) / H ** 0.5
wd = torch.randn(I, H, device=dev, dtype=bf16) / I ** 0.5
xa, h = torch.randn(M, H, device=dev, dtype=bf16), torch.randn(M, I, device=dev, dtype=bf16)

op_us = time_ranks(lambda: et.ops.tensor_parallel_mlp(x, wgu, wd, mesh=mesh, total_rows=M), device=dev)
up_us = time_ranks(lambda: xa @ wgu, device=dev)
down_us = time_ranks(lambda: h @ wd, device=dev)

whole = M <= mlp_op._ag_gemm.WHOLE_MAX_M
cfg = mlp_op._ag_gemm.whole_tile("tensor_parallel_mlp", M) if whole else mlp_op.TILES
down_n = cfg.block_n if whole else mlp_op.DOWN_N
align = 16 if H % 16 == 0 and I % 16 == 0 else 1
sms = torch.cuda.get_device_properties(dev).multi_processor_count
graph = (mlp_graph.tp_mlp_whole(cfg.block_m, cfg.block_n, bf16, cfg.block_k, align,
                                down_splits=mlp_op.whole_down_splits(M, H, cfg, sms)) if whole else
         mlp_graph.tp_mlp(cfg.block_m, cfg.block_n, bf16, cfg.block_k, align, down_n=down_n))
kernel = et.compile(graph, schedule="static", target="cuda", trace=True)
kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
args = dict(x=x, w_gate_up=wgu, w_down=wd, sizes={"M": M})
for _ in range(3):
    kernel(mesh, **args)
torch.cuda.synchronize()
dist.barrier()
for _ in range(5):   # queued ahead of the GPU: both ranks start the traced launch back to back
    kernel(mesh, **args)
trace_rows = kernel.trace(mesh)
if mesh.rank == 0:
    path = tr.write_chrome(trace_rows, f"{os.environ.get('OUT', '/tmp')}/mlp_M{M}_H{H}.json", track="SM")
    print(f"== mlp M={M} H={H} I={I} per rank, {graph.name} tiles {cfg}, down {cfg.block_m}x{down_n}: op {op_us:.1f} us; torch.mm gate/up "
          f"{up_us:.1f} us + down {down_us:.1f} us = {up_us + down_us:.1f} us; Chrome trace {path}", flush=True)
    flops = {"gate_up": 2 * cfg.block_m * 2 * cfg.block_n * H, "down": 2 * cfg.block_m * down_n * I}
    mm_rate = {"gate_up": 2 * M * 2 * I * H / up_us / sms, "down": 2 * M * I * H / down_us / sms}  # flop/us per SM
    for rank in range(R):
        print(tr.summary(trace_rows, rank), flush=True)
        for kind, f in flops.items():
            mine = [(e - s, float(lab.rsplit("waited ", 1)[1].split(" ")[0])) for r, _, lab, s, e in trace_rows
                    if r == rank and lab.startswith(kind + "@")]
            if mine:
                body = sorted(d - w for d, w in mine)[len(mine) // 2]
                print(f"  {kind}: median tile {body:.1f} us less its wait: {f / body / 1e6:.2f} TF/s per SM, "
                      f"torch.mm {mm_rate[kind] / 1e6:.2f} (whole-GPU rate / {sms})", flush=True)
mesh.close()
