"""A/B the decode-sized tile configs (the ops' small-M paths) on this node's GPUs:

    torchrun --nproc_per_node=2 experiments/tune_decode.py [block_m,block_n,block_k,warps,stages[,tasks_per_sm] ...]

For each config: ag_gemm and mlp (the whole-gather variants: etdist.ops.ag_gemm.WHOLE_TILES, every class) and
gemm_rs (the skinny split-K variant: etdist.ops.gemm_rs.SKINNY_CLASSES, M <= its block_m) at M in
{16, 128} on two shapes; us per call (batched, slowest rank). Pick by the geometric mean. Configs
are block_m,block_n,block_k,warps,stages and, for gemm_rs, the split-K tasks per SM (last field).
OPS=gemm_rs (a comma list) times only those ops. Every cell is first checked against a float32 reference (relative error, worst rank): a config
whose error exceeds 2e-2 anywhere is printed as WRONG and left out of the ranking.
"""
import itertools
import math
import os
import sys

import torch
import triton
import torch.distributed as dist

import etdist as et
from etdist.bench.gpu import _chunk, _gather_rows, _max_over_ranks, _rel_err
from etdist.bench.measure.baselines import rotating, swiglu
from etdist.bench.measure.shapes import MLP_SHAPES
from etdist.bench.measure.timing import time_ranks
from etdist.ops import ag_gemm as ag_op, gemm_rs as rs_op
from etdist.ops.gemm_rs import TileConfig

CONFIGS = [TileConfig(64, 64, 128, 4, 4), TileConfig(16, 64, 256, 4, 4), TileConfig(32, 64, 128, 4, 6),
           TileConfig(64, 128, 64, 4, 4), TileConfig(16, 128, 128, 4, 5), TileConfig(128, 64, 64, 4, 4)]
TASKS_PER_SM = [rs_op.skinny_tasks_per_sm(c) for c in CONFIGS]   # gemm_rs skinny split-K aim
if sys.argv[1:]:   # configs given on the command line replace the list above (sixth field: tasks per SM;
    # a trailing ",swap": gemm_rs's skinny tile multiplies transposed, weights on the MMA's M side)
    fields = [[v for v in a.split(",") if v != "swap"] for a in sys.argv[1:]]
    CONFIGS = [TileConfig.parse(",".join(f[:5] + (["swap"] if a.endswith(",swap") else [])))
               for f, a in zip(fields, sys.argv[1:])]
    TASKS_PER_SM = [float(f[5]) if len(f) > 5 else rs_op.skinny_tasks_per_sm(c) for f, c in zip(fields, CONFIGS)]
OPS = tuple(op.strip() for op in os.environ.get("OPS", "gemm_rs,ag_gemm,mlp").split(",") if op.strip())
if not OPS or set(OPS) - {"gemm_rs", "ag_gemm", "mlp"}:
    raise SystemExit(f"OPS={os.environ.get('OPS')!r}: name some of gemm_rs, ag_gemm, mlp (comma-separated)")
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
R, dev, bf16 = mesh.world_size, mesh.device, torch.bfloat16


def cell(op, model, M):
    """(a call of the op that rotates 4 weight copies, its output's relative error against float32
    on copy 0, worst rank)."""
    H, I = MLP_SHAPES[model].hidden, MLP_SHAPES[model].intermediate
    lo, hi = _chunk(M, R, mesh.rank)
    x_rs = torch.randn(M, I // R, device=dev, dtype=bf16)
    x = torch.randn(hi - lo, H, device=dev, dtype=bf16)
    if op == "gemm_rs":
        ws = [torch.randn(I // R, H, device=dev, dtype=bf16) for _ in range(4)]
        full = x_rs.float() @ ws[0].float()
        dist.all_reduce(full)
        got, want = et.ops.gemm_reduce_scatter(x_rs, ws[0], mesh=mesh), full[lo:hi]
        call = rotating(lambda i: et.ops.gemm_reduce_scatter(x_rs, ws[i], mesh=mesh), 4)
    elif op == "ag_gemm":
        ws = [torch.randn(H, 2 * I // R, device=dev, dtype=bf16) for _ in range(4)]
        got = et.ops.all_gather_gemm(x, ws[0], mesh=mesh, total_rows=M)
        want = _gather_rows(x, M, R) @ ws[0].float()
        call = rotating(lambda i: et.ops.all_gather_gemm(x, ws[i], mesh=mesh, total_rows=M), 4)
    else:
        ws = [(torch.randn(H, 2 * I // R, device=dev, dtype=bf16), torch.randn(I // R, H, device=dev, dtype=bf16))
              for _ in range(4)]
        got = et.ops.tensor_parallel_mlp(x, *ws[0], mesh=mesh, total_rows=M)
        full = swiglu(_gather_rows(x, M, R) @ ws[0][0].float()) @ ws[0][1].float()
        dist.all_reduce(full)
        want = full[lo:hi]
        call = rotating(lambda i: et.ops.tensor_parallel_mlp(x, *ws[i], mesh=mesh, total_rows=M), 4)
    return call, _max_over_ranks(_rel_err(got, want), dev)


rows = []
for cfg, tasks_per_sm in zip(CONFIGS, TASKS_PER_SM):
    ag_op.WHOLE_32 = ag_op.WHOLE_AG = ag_op.WHOLE_MLP = ag_op.WHOLE_128 = cfg   # every whole-gather class
    rs_op.SKINNY_CLASSES = (cfg,)
    rs_op.SKINNY_TASKS_PER_SM = {cfg: tasks_per_sm}
    et.ops.clear_plan_caches()   # the ops' cached plans hold the previous config's tiles
    label = (f"{cfg.block_m},{cfg.block_n},{cfg.block_k},{cfg.num_warps},{cfg.num_stages},{tasks_per_sm:g}"
             + (",swap" if cfg.swap_ab else ""))
    times, worst = {}, 0.0
    for op, model, M in itertools.product(OPS, ("qwen3_8b", "llama31_70b"), (16, 128)):
        if op == "gemm_rs" and M > cfg.block_m:
            continue
        try:
            call, err = cell(op, model, M)
        except triton.runtime.errors.OutOfResources:   # same on every rank: all skip together
            break
        worst = max(worst, err)
        times[op, model, M] = time_ranks(call, device=dev)
    if not worst <= 2e-2:   # bf16 over K of thousands: ~5e-3 when right
        label += " WRONG"
    else:
        rows.append((label, times))
    if mesh.rank == 0:
        print(f"{label} (rel err <= {worst:.1e}): " + "  ".join(f"{o}/{m[:6]}/{M} {t:.0f}"
                                                         for (o, m, M), t in times.items()), flush=True)
if mesh.rank == 0:
    for op in OPS:
        for M in (16, 128):
            ranked = sorted((math.exp(sum(math.log(t) for (o, _, m), t in times.items() if o == op and m == M) /
                                      max(1, sum(1 for (o, _, m) in times if o == op and m == M))), label)
                            for label, times in rows if any(o == op and m == M for (o, _, m) in times))
            print(f"best {op} M={M}: " + "; ".join(f"{label} {g:.0f} us" for g, label in ranked[:3]), flush=True)
mesh.close()
