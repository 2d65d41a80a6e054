"""Trace the MoE megakernel (qwen3_30b_a3b-sized, or mixtral_8x7b with MIX=1; EP = world, 64-row
tiles) under both schedules: the untraced layer's time, then one traced launch summarised per rank
(span, busy share, per-kind task statistics, gaps between tasks: the scheduling overhead); Chrome
traces in $OUT (default /tmp).

    torchrun --nproc_per_node=2 launch/trace_moe.py [tokens]
"""
import os
import sys

import torch
import torch.distributed as dist

import etdist as et
from etdist.fusion import trace as tr
from etdist.measure.timing import time_ranks
from etdist.workloads import moe as moe_graph

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
H, I, E, K = (4096, 14336, 8, 2) if os.environ.get("MIX") else (2048, 768, 128, 8)
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
out = os.environ.get("OUT", "/tmp")
for sched in ("static", "dynamic"):
    layer = et.nn.MoE(H, I, E, K, schedule=sched)
    x = torch.randn(T, H, device=mesh.device, dtype=torch.bfloat16)
    plain = time_ranks(lambda: layer(x), device=mesh.device)
    g = moe_graph.moe_layer(K, block_m=64, dtype=torch.bfloat16, max_experts=E, block=64, block_n=128, align=16,
                            group_m=et.nn.moe.GROUP_M)   # ETDIST_MOE_GROUP_M, as the layer
    kernel = et.compile(g, schedule=sched, target="cuda", trace=True)
    kernel.num_warps, kernel.num_stages = 8, 3
    args = dict(x=x, wg=layer.router.data, w_gate_up=layer.w_gate_up[0].data, w_down=layer.w_down[0].data)
    for _ in range(3):
        kernel(mesh, **args)
    rows = kernel.trace(mesh)
    if mesh.rank == 0:
        tr.write_chrome(rows, f"{out}/moe_{sched}_{T}.json", track="SM")
        print(f"== {sched} T={T}: untraced layer {plain:.0f} us", flush=True)
        print(tr.summary(rows, 0), flush=True)
mesh.close()
