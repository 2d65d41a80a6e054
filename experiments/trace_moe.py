"""Trace the MoE megakernel (qwen3_30b_a3b-sized, or mixtral_8x7b with MIX=1; EP = world; the
layer's own tile class for the token count) under both schedules: the untraced layer's time, then
one traced launch summarised per rank (span, busy share, per-kind task statistics, gaps between
tasks: the scheduling overhead); Chrome traces in $OUT (default /tmp). SKEW=1.5: the benchmark's
Zipf-like routing (etdist.workloads.moe.skew_router, as etdist.bench.gpu.moe_cell builds it).

    torchrun --nproc_per_node=2 experiments/trace_moe.py [tokens]
"""
import os
import sys

import torch
import torch.distributed as dist

import etdist as et
from etdist.fusion import trace as tr
from etdist.bench.measure.shapes import MOE_SHAPES
from etdist.bench.measure.timing import time_ranks
from etdist.workloads import moe as moe_graph

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
_m = MOE_SHAPES["mixtral_8x7b" if os.environ.get("MIX") else "qwen3_30b_a3b"]
H, I, E, K = _m.hidden, _m.expert_intermediate, _m.num_experts, _m.top_k
skew = float(os.environ.get("SKEW", "0"))
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
out = os.environ.get("OUT", "/tmp")
gen = torch.Generator(device=mesh.device).manual_seed(0)
u = torch.randn(H, generator=gen, device=mesh.device)
u = u / u.norm()
router = moe_graph.skew_router(torch.randn(H, E, generator=gen, device=mesh.device), u, skew).to(torch.bfloat16)
gen.manual_seed(1 + mesh.rank)                             # this rank's tokens
x = moe_graph.skew_tokens(torch.randn(T, H, generator=gen, device=mesh.device), u, skew).to(torch.bfloat16)
for sched in ("static", "dynamic"):
    layer = et.nn.MoE(H, I, E, K, schedule=sched)
    layer.router.data = router
    plain = time_ranks(lambda: layer(x), device=mesh.device)
    large = layer.large_tiles(T)
    tiles, align, early = layer._plan("cuda", large)   # the layer's own graph, tiles and early push
    kernel = et.compile(layer._graph("cuda", tiles, align, large), schedule=sched, target="cuda", trace=True,
                        early_push=early)
    kernel.num_warps, kernel.num_stages = tiles.num_warps, tiles.num_stages
    args = dict(x=x, wg=layer.router.data, w_gate_up=layer.w_gate_up[0].data, w_down=layer.w_down[0].data)
    for _ in range(3):
        kernel(mesh, **args)
    rows = kernel.trace(mesh)
    binary = kernel.state(mesh).compiled    # the traced kernel's registers, spills, shared memory
    if mesh.rank == 0:
        print(f"   traced binary: {binary.n_regs} registers, {binary.n_spills} bytes spilled, "
              f"{binary.metadata.shared} B shared", flush=True)
        tr.write_chrome(rows, f"{out}/moe_{sched}_{T}.json", track="SM")
        print(f"== {sched} T={T} tiles {tuple(tiles)}: untraced layer {plain:.0f} us", flush=True)
        print(tr.summary(rows, 0), flush=True)
mesh.close()
