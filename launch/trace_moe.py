"""Trace the MoE megakernel (qwen3_30b_a3b-sized, or mixtral_8x7b with MIX=1; EP = world, 64-row
tiles) under both schedules: the untraced layer's time, the traced span, SM busy share, per-task-kind
statistics and the gaps between tasks on an SM (the scheduling overhead); Chrome traces in $OUT.

    torchrun --nproc_per_node=2 launch/trace_moe.py [tokens]
"""
import collections
import os
import re
import sys

import torch
import torch.distributed as dist
import etdist as et
from etdist import fusion
from etdist.workloads import moe as moe_graph

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
H, I, E, K = (4096, 14336, 8, 2) if os.environ.get("MIX") else (2048, 768, 128, 8)
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
out = os.environ.get("OUT", "/tmp")
for sched in ("static", "dynamic"):
    layer = et.nn.MoE(H, I, E, K, schedule=sched)
    x = torch.randn(T, H, device=mesh.device, dtype=torch.bfloat16)
    for _ in range(3):
        layer(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        layer(x)
    e.record(); torch.cuda.synchronize()
    plain = s.elapsed_time(e) / 10 * 1e3
    g = moe_graph.moe_layer(K, block_m=64, dtype=torch.bfloat16, max_experts=E, block=64, block_n=128, align=16)
    k = fusion.compile(g, schedule=sched, target="cuda", trace=True)
    k.num_warps, k.num_stages = 8, 3
    args = dict(x=x, wg=layer.router.data, w_gate_up=layer.w_gate_up[0].data, w_down=layer.w_down[0].data)
    for _ in range(3):
        k(mesh, **args)
    rows = k.trace(mesh)
    if mesh.rank == 0:
        import etdist.fusion.trace as tr
        tr.write_chrome(rows, f"{out}/moe_{sched}_{T}.json", track="SM")
        span = max(r[4] for r in rows if r[0] == 0)
        sms = len({r[1] for r in rows if r[0] == 0})
        busy = sum(r[4] - r[3] for r in rows if r[0] == 0)
        print(f"== {sched} T={T}: untraced {plain:.0f} us; traced rank0 makespan {span:.0f} us, {sms} SMs, "
              f"busy {busy / (span * sms):.0%}, tasks {sum(1 for r in rows if r[0] == 0)}", flush=True)
        kinds = collections.defaultdict(list)
        for r in rows:
            if r[0] == 0:
                w = float(re.search(r"waited ([-\d.]+) us", r[2]).group(1))
                kinds[r[2].split("@")[0]].append((r[3], r[4], w))
        print(f"{'task':12} {'n':>6} {'first':>8} {'last end':>9} {'mean us':>8} {'mean wait':>9} {'sum ms':>7}")
        for name, v in kinds.items():
            n = len(v)
            print(f"{name:12} {n:6d} {min(a for a, _, _ in v):8.0f} {max(b for _, b, _ in v):9.0f} "
                  f"{sum(b - a for a, b, _ in v) / n:8.1f} {sum(w for *_, w in v) / n:9.1f} {sum(b - a for a, b, _ in v) / 1e3:7.1f}")
        # gaps between consecutive tasks of a program (SM): the scheduling overhead
        by_sm = collections.defaultdict(list)
        for r in rows:
            if r[0] == 0:
                by_sm[r[1]].append((r[3], r[4]))
        gaps = [b[0] - a[1] for v in by_sm.values() for a, b in zip(sorted(v), sorted(v)[1:])]
        gaps.sort()
        if gaps:
            print(f"gaps between tasks on an SM: median {gaps[len(gaps)//2]:.2f} us, p90 {gaps[int(len(gaps)*.9)]:.2f}, "
                  f"sum {sum(gaps)/1e3:.1f} ms over {len(by_sm)} SMs", flush=True)
mesh.close()
