"""The fused TP ops on every GPU of one node, at world = the GPUs (not a one-GPU stand-in): a
fixed grid of cells (op x shape x M), each plan variant of ours against cuBLAS+NCCL (eager and in
a CUDA graph), alternated in one process, then every cell compared with the last committed records.

    torchrun --nproc_per_node=2 launch/regress.py                       # the regression grid
    torchrun --nproc_per_node=2 launch/regress.py --ops ag_gemm,mlp --models qwen3_8b --ms 129,160,256 \
        --variants "base;whole_max_m=256"                               # a two-GPU A/B of a plan change
    torchrun --nproc_per_node=4 launch/regress.py --tp 2                # TP=2 x DP=2: two groups at once

A variant is a PlanConfig override (`field=value` joined by `+`, etdist.ops.PlanConfig.override;
`base` is DEFAULT_PLAN) that its contender passes to the op as `config=`: its own plans and compiled
kernels beside the others', nothing patched. Every variant
is checked against a float32 reference (its output written over NaN) before anything is timed, and
its CUDA-graph replay against its eager call. Each round times every contender once (a barrier,
warm-up, 2 batches of back-to-back calls sized to ~2 ms, weights rotated over 4 copies), the
order turning every round (etdist.bench.measure.timing.turns); a time is the median over the rounds'
batches on the slower rank. Contenders per cell: ours (eager) and ours_graph per variant, the
baselines eager and graph (and mm alone).

Records (DESIGN.md's schema; `extra.ours_graph_us`, `extra.variant`) go to $OUT/<op>.jsonl for
the first variant (the tree as it is, unless --variants says otherwise) and to $OUT/<op>_ab.jsonl,
model "<shape> [<variant>]", for the others (default $OUT /tmp/regress). With --tp N the world splits
into groups of N consecutive ranks (sub-group meshes, init_mesh(group=...)), each running every
cell at once with its own baselines (NCCL in the group), timed as one (the slowest rank of all):
records go to $OUT/<op>_groups.jsonl, model "<shape> [tpN x G]". With --against DIR
(default bench/results), every cell
whose speedup over the best baseline moved by more than --tolerance (3%) from the newest record
of the same cell there is printed, and a short table closes the run.
"""
from __future__ import annotations

import argparse
import functools
import math
import os

import torch
import torch.distributed as dist

import etdist as et
from etdist.bench.measure import baselines as B
from etdist.bench.measure import records
from etdist.bench.measure.ranks import chunk, gather_rows, rel_err
from etdist.bench.measure.shapes import MLP_SHAPES
from etdist.bench.measure.timing import slowest_rank, time_alternated
from etdist.bench.measure.timing import slowest_rank as max_over_ranks

COPIES = 4
# the dense M sweep: decode, ragged and round sizes, up to a long prefill
DEFAULT_MS = [16, 128, 129, 160, 192, 256, 320, 384, 511, 640, 768, 896, 1000, 1024, 1536, 2048, 2500, 3072,
              4096, 6144, 8192]


def variants(text: str) -> dict:
    """`base;whole_max_m=256` -> {"base": DEFAULT_PLAN, "whole_max_m=256": its PlanConfig}: every
    variant parsed (and a bad one refused) before anything runs."""
    return {v: et.ops.DEFAULT_PLAN.override(v) for v in text.split(";") if v}


def cell(op: str, mesh, H: int, I: int, M: int, group=None):
    """(ours: step(i, out=None, config=DEFAULT_PLAN) on weight copy i, this rank's float32 reference
    of copy 0, output shape, baselines' Measured, floor args): the operands as etdist.bench.gpu's
    cells make them. group: the mesh's process group (None: the world)."""
    R, dev, rank = mesh.world_size, mesh.device, mesh.rank
    lo, hi = chunk(M, R, rank)
    if op == "gemm_rs":
        ops = B.gemm_rs_operands(M, I // R, H, group=group, copies=COPIES, device=dev)
        x = ops.x[:M].contiguous()
        ref = x.float() @ ops.weights[0].float()
        dist.all_reduce(ref, group=group)
        step = lambda i, out=None, config=None: et.ops.gemm_reduce_scatter(  # noqa: E731
            x, ops.weights[i], mesh=mesh, out=out, config=config)
        base = B.baseline_fns(op, M, I // R, H, group=group, copies=COPIES, device=dev, symm_mem=False,
                              operands=ops)
        return step, ref[lo:hi], (hi - lo, H), base, (M, I, H)
    if op == "ag_gemm":
        ops = B.ag_gemm_operands(M, H, 2 * I // R, group=group, copies=COPIES, device=dev)
        x = ops.x[:hi - lo].contiguous()
        ref = gather_rows(x, M, R, group) @ ops.weights[0].float()
        step = lambda i, out=None, config=None: et.ops.all_gather_gemm(  # noqa: E731
            x, ops.weights[i], mesh=mesh, total_rows=M, out=out, config=config)
        base = B.baseline_fns(op, M, H, 2 * I // R, group=group, copies=COPIES, device=dev, symm_mem=False,
                              operands=ops)
        return step, ref, (M, 2 * I // R), base, (M, H, 2 * I)
    seq = op == "mlp"
    ops = (B.mlp_operands if seq else B.mlp_replicated_operands)(M, H, I // R, group=group, copies=COPIES, device=dev)
    x = ops.x[:hi - lo].contiguous() if seq else ops.x
    full = B.swiglu((gather_rows(x, M, R, group) if seq else x.float()) @ ops.gate_up[0].float()) @ ops.down[0].float()
    dist.all_reduce(full, group=group)
    step = lambda i, out=None, config=None: et.ops.tensor_parallel_mlp(  # noqa: E731
        x, ops.gate_up[i], ops.down[i], mesh=mesh, total_rows=M if seq else None, sequence_parallel=seq, out=out,
        config=config)
    base = B.baseline_fns(op, M, H, I // R, group=group, copies=COPIES, device=dev, symm_mem=False, operands=ops)
    return step, (full[lo:hi] if seq else full), ((hi - lo) if seq else M, H), base, (M, H, I)


def timed(contenders: dict, dev, rounds: int, calls: int = 0) -> dict:
    """us per call of each contender (name -> zero-arg call): timing.time_alternated's rounds of
    turning order, each a barrier, 2 warm-ups and 2 batches of `calls` calls (0: each contender's
    timing.batch_calls, ~10 ms of it); the slower rank's median."""
    return time_alternated(contenders, rounds=rounds, calls=calls or None, batches=2, warmup=2, device=dev)


def newest(folder: str) -> dict:
    """The newest committed record per (workload, model, M, world, schedule) under `folder`."""
    out = {}
    if not folder or not os.path.isdir(folder):
        return out
    for name in os.listdir(folder):
        if name.endswith(".jsonl"):
            for rec in records.newest_per_cell(records.load(os.path.join(folder, name))):
                out[rec.cell] = rec
    return out


def best(baselines: dict) -> float:
    return min(v for k, v in baselines.items() if k in ("eager", "graph"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="gemm_rs,ag_gemm,mlp")
    ap.add_argument("--models", default=",".join(MLP_SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--variants", default="base",
                    help="';'-separated PlanConfig overrides, e.g. 'base;whole_max_m=256'")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--against", default="bench/results")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/regress"))
    ap.add_argument("--notes", default="")
    ap.add_argument("--calls", type=int, default=0,
                    help="calls per timed batch (default: timing.batch_calls, ~10 ms worth, 3 to 200)")
    ap.add_argument("--tp", type=int, default=0, help="tensor-parallel group size (default: every rank in one)")
    args = ap.parse_args()
    configs = variants(args.variants)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    W = dist.get_world_size()
    tp = args.tp or W
    if tp < 1 or W % tp:
        ap.error(f"--tp {args.tp}: a group size that divides the world ({W} ranks)")
    group = None
    if tp < W:   # every rank makes every group, in the same order (torch.distributed's rule)
        groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(W // tp)]
        group = groups[dist.get_rank() // tp]
    mesh = et.init_mesh(group=group)
    lead = dist.get_rank() == 0
    dev = mesh.device
    names = list(configs)
    env = records.env_info()
    ceil = B.measure_ceilings(dev)
    ceil = B.Ceilings(copy_TBps=-slowest_rank(-ceil.copy_TBps), mm_TFps=-slowest_rank(-ceil.mm_TFps))
    before = newest(args.against) if lead else {}
    os.makedirs(args.out, exist_ok=True)
    if lead:
        print(f"{torch.cuda.get_device_name(dev)} x{W}" + (f" as {W // tp} groups of {tp}" if group else "")
              + f": copy {ceil.copy_TBps:.2f} TB/s, mm {ceil.mm_TFps:.0f} TF/s; variants {names}", flush=True)
    table, moved = [], []
    for op in args.ops.split(","):
        for model in args.models.split(","):
            H, I = MLP_SHAPES[model].hidden, MLP_SHAPES[model].intermediate
            for M in (int(m) for m in args.ms.split(",")):
                step, ref, shape, base, fl = cell(op, mesh, H, I, M, group)
                contenders, errs, good = {}, {}, []
                for v in names:
                    ours = functools.partial(step, config=configs[v])
                    out = torch.full(shape, float("nan"), device=dev, dtype=torch.bfloat16)
                    got = ours(0, out=out)
                    errs[v] = max_over_ranks(rel_err(got, ref))   # every rank sees the same
                    replay = B.graphed(ours, COPIES, dev)
                    g_err = max_over_ranks(rel_err(replay(), ours(0).float()))
                    if not (errs[v] < 2e-2 and g_err < 1e-3):   # reported and left out, never timed
                        if lead:
                            print(f"WRONG {op} {model} M={M} variant {v}: rel err {errs[v]:.1e}, "
                                  f"graph replay against eager {g_err:.1e}", flush=True)
                        continue
                    good.append(v)
                    contenders[f"ours[{v}]"] = B.rotating(ours, COPIES)
                    contenders[f"graph[{v}]"] = replay
                contenders.update(base.fns)
                t = timed(contenders, dev, args.rounds, args.calls)
                floor = B.floor_us(*fl, mesh.world_size, ceil.copy_TBps, ceil.mm_TFps, workload=op)
                bl = {k: t[k] for k in base.fns}
                for n, v in enumerate(names):
                    if v not in good:
                        continue
                    tag = [f"tp{tp} x {W // tp}"] if group else []
                    rec = records.make_record(
                        workload=op + ("_ab" if n else "") + ("_groups" if group else ""),
                        model=f"{model} [{', '.join(tag + ([v] if n else []))}]" if n or group else model,
                        M=M, world=mesh.world_size, schedule="static",
                        ours_us=t[f"ours[{v}]"], baselines=bl, floor_us=floor, rel_err=errs[v], env=env,
                        notes=(f"launch/regress.py variant {v}, {args.rounds} rounds turning order; "
                               + args.notes).strip(),
                        extra={"ours_graph_us": t[f"graph[{v}]"], "variant": v,
                               **({"groups": W // tp} if group else {})})
                    if lead:
                        records.append(os.path.join(args.out, f"{rec.workload}.jsonl"), rec)
                if lead:
                    b = best(bl)
                    row = (op, model, M, b, floor, {v: (t[f"ours[{v}]"], t[f"graph[{v}]"]) for v in good})
                    table.append(row)
                    old = before.get((op, model, M, mesh.world_size, "static"))
                    now = b / t[f"ours[{names[0]}]"] if names[0] in good else float("nan")
                    was = best(old.baselines) / old.ours_us if old else None
                    mark = ""
                    if was is not None and abs(now / was - 1) > args.tolerance:
                        moved.append((op, model, M, was, now, old.commit))
                        mark = f"  MOVED {was:.2f}x -> {now:.2f}x (was {old.commit})"
                    print(f"{op} {model} M={M}: best baseline {b:.1f} (eager {bl['eager']:.1f}, graph "
                          f"{bl.get('graph', float('nan')):.1f}, mm {bl['mm']:.1f}) floor {floor:.1f} | " + "  ".join(
                              f"{v}: {t[f'ours[{v}]']:.1f} / graph {t[f'graph[{v}]']:.1f} ({b / t[f'ours[{v}]']:.2f}x)"
                              for v in good) + mark, flush=True)
                del step, ref, base, contenders
                torch.cuda.empty_cache()
    if lead:
        print(f"\n{len(moved)} cells moved by more than {args.tolerance:.0%} against {args.against}:")
        for op, model, M, was, now, commit in moved:
            print(f"  {op} {model} M={M}: {was:.2f}x -> {now:.2f}x (newest record: {commit})")
        print("\nop | variant | cells | geomean speedup eager (graph) | worst | geomean ours/floor")
        for op in args.ops.split(","):
            rows = [r for r in table if r[0] == op]
            for v in names:
                rows = [r for r in table if r[0] == op and v in r[5]]
                if not rows:
                    continue
                sp = [r[3] / r[5][v][0] for r in rows]
                sg = [r[3] / r[5][v][1] for r in rows]
                fl = [r[5][v][0] / r[4] for r in rows]
                g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
                print(f"{op} | {v} | {len(rows)} | {g(sp):.3f} ({g(sg):.3f}) | {min(sp):.2f} | {g(fl):.2f}")
    # no destroy_process_group: with NCCL work captured in the baselines' CUDA graphs it hung at exit
    mesh.close()


if __name__ == "__main__":
    main()
