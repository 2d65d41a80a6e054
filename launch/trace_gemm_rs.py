"""Where a gemm_rs call goes, at any M: the op's device kernel time (torch.profiler) against
torch.mm alone, the traced task span per rank (compile(..., trace=True), same tiles as the op) and
per-kind task statistics; a Chrome trace in $OUT (default /tmp).

    torchrun --nproc_per_node=2 launch/trace_gemm_rs.py M N K_full    # e.g. 16 4096 12288
"""
import collections
import os
import re
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
import etdist as et
from etdist import fusion
from etdist.ops import gemm_rs as op
from etdist.workloads import gemm_rs

M, N, KF = (int(a) for a in sys.argv[1:4])
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
R = mesh.world_size
K = KF // R
ws = [torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5 for _ in range(4)]
x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
cfg = op.tile_config(M)
splits = op.skinny_splits(N, op._sm_count(mesh.device.index), cfg.block_n) if cfg is not op.LARGE else 1
for i in range(5):
    op.gemm_reduce_scatter(x, ws[i % 4], mesh=mesh)
torch.cuda.synchronize(); dist.barrier()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(20):
        op.gemm_reduce_scatter(x, ws[i % 4], mesh=mesh)
    torch.cuda.synchronize()
kern = [e for e in prof.key_averages() if "megakernel" in e.key]
k_us = kern[0].device_time_total / kern[0].count if kern else float("nan")
for i in range(3):
    torch.mm(x, ws[i % 4])
s_ev, e_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s_ev.record()
for i in range(20):
    torch.mm(x, ws[i % 4])
e_ev.record()
torch.cuda.synchronize()
mm_us = s_ev.elapsed_time(e_ev) / 20 * 1e3
if cfg is op.LARGE:
    g = gemm_rs.gemm_reduce_scatter(cfg.block_m, cfg.block_n, torch.bfloat16, cfg.block_k, 16)
else:
    g = gemm_rs.gemm_reduce_scatter_skinny(cfg.block_m, cfg.block_n, torch.bfloat16, cfg.block_k, splits, 16)
k = fusion.compile(g, schedule="static", target="cuda", trace=True)
k.num_warps, k.num_stages = cfg.num_warps, cfg.num_stages
for i in range(5):
    k(mesh, x=x, w=ws[i % 4])
rows = k.trace(mesh)
if mesh.rank == 0:
    import etdist.fusion.trace as tr
    path = tr.write_chrome(rows, f"{os.environ.get('OUT', '/tmp')}/gemm_rs_M{M}_N{N}.json", track="SM")
    print(f"== M={M} N={N} K={K} {cfg} splits={splits}: op kernel {k_us:.1f} us/call (profiler), "
          f"torch.mm alone {mm_us:.1f} us; Chrome trace {path}")
    for rk in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == rk]
        print(f"rank {rk}: traced makespan {max(r[4] for r in mine):.1f} us over {len({r[1] for r in mine})} SMs")
    kinds = collections.defaultdict(list)
    for r in rows:
        if r[0] == 0:
            w = float(re.search(r"waited ([-\d.]+) us", r[2]).group(1))
            kinds[r[2].split("@")[0]].append((r[3], r[4], w))
    for name, v in kinds.items():
        d = sorted(b - a for a, b, _ in v)
        print(f"  {name:10} n={len(v):4d} first {min(a for a, _, _ in v):6.1f} last end {max(b for _, b, _ in v):6.1f} "
              f"dur mean {sum(d)/len(d):5.1f} p90 {d[len(d)*9//10]:5.1f}  wait mean {sum(w for *_, w in v)/len(v):5.1f}")
mesh.close()
