"""Why does gemm_rs's megakernel at world 1 run 2-5% slower than the same tile body in a plain
persistent loop? The op's large graph at M rows (one GPU: whole tiles, only its `own` tasks run)
compiled with parts of its generated source cut, against that plain loop and torch.mm:

- `op`: the megakernel as generated;
- `nowait`: without the own tasks' wait (at world 1 it waits for no peer: its count is 0);
- `onebody`: without the matmul tasks' branch (at world 1 there are none: it never runs);
- `cut`: both cuts, the megakernel reduced to the plain loop's work;
- `loop`: the own tile body (gemm_tiles.gemm_rs_matmul_own, the megakernel's) in a plain
  persistent loop, the same tiles in the same order on the same programs.

    torchrun --nproc_per_node=1 launch/megakernel_cut_ab.py        # MODELS=..., M=8192, ROUNDS=6

The cuts are only right at world 1 (a diagnostic, not a kernel to ship). Shapes: gemm_rs's on one
rank of SHARD (K = intermediate / SHARD, N = hidden). Each contender is checked against float32
first, then all are timed alternately (etdist.bench.measure.timing, 4 rotating weight copies). Records
in $OUT/megakernel_cut_ab.jsonl (default /tmp).
"""
import os
import re

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import etdist as et
from etdist.fusion import compile as et_compile
from etdist.fusion import cuda_runtime
from etdist.kernels import gemm_tiles
from etdist.bench.measure import baselines as B
from etdist.bench.measure import records
from etdist.bench.measure.shapes import MLP_SHAPES
from etdist.bench.measure.timing import time_alternated
from etdist.ops import gemm_rs as gemm_rs_op

CUTS = {"op": [],
        "nowait": [(r"\n\s*_et_ok = _et_ok & _et_wait\([^\n]*", "")],
        "onebody": [(r"if _et_gid < _et_end0:", "if False:")]}   # a constant branch: not compiled
CUTS["cut"] = CUTS["nowait"] + CUTS["onebody"]


def generate_cut(cuts: list):
    """cuda_runtime's generate with `cuts` (regex, replacement) applied, each exactly once."""
    generate = cuda_runtime.generate

    def cut(ir, *args, **kwargs):
        src = generate(ir, *args, **kwargs)
        for pattern, replacement in cuts:
            src, n = re.subn(pattern, replacement, src)
            if n != 1:
                raise RuntimeError(f"cut {pattern!r} matched {n} times in the generated source")
        return src
    return cut


@triton.jit
def own_loop(x, w, partial, y, M, N, K, PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GROUP_M: tl.constexpr):
    """The megakernel's own tasks at world 1 in a plain persistent loop: tile t on program
    t % PROGRAMS, in the graph's grouped order (et.grouped)."""
    m_tiles, n_tiles = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for t in range(tl.program_id(0), m_tiles * n_tiles, PROGRAMS):
        i, j = gemm_tiles.grouped_tile(t, m_tiles, n_tiles, GROUP_M)
        gemm_tiles.gemm_rs_matmul_own(i, j, x, w, partial, y, M, K, N, 0, 1, BM, BN, BK, 1, True)


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    models = os.environ.get("MODELS", "qwen3_8b,gemma2_9b,llama31_8b").split(",")
    M, shard = int(os.environ.get("M", "8192")), int(os.environ.get("SHARD", "2"))
    rounds, out_dir = int(os.environ.get("ROUNDS", "6")), os.environ.get("OUT", "/tmp")
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    if mesh.world_size != 1:
        raise SystemExit("megakernel_cut_ab.py runs on one GPU (torchrun --nproc_per_node=1)")
    dev, env, copies = mesh.device, records.env_info(), 4
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    table = []
    for model in models:
        N, K = MLP_SHAPES[model].hidden, MLP_SHAPES[model].intermediate // shard
        cfg, splits, _, build = gemm_rs_op.kernel_plan(M, K, N, torch.bfloat16, programs, 1)
        if splits != 1 or build.keywords.get("wave") or cfg != gemm_rs_op.LARGE:
            raise SystemExit(f"{model} M={M}: the plan is not whole LARGE tiles ({cfg}, {splits} slices)")
        kernels = {}
        for name, cuts in CUTS.items():
            original = cuda_runtime.generate
            cuda_runtime.generate = generate_cut(cuts)
            try:
                kernels[name] = et_compile(build(), target="cuda")
            finally:
                cuda_runtime.generate = original
            kernels[name].num_warps, kernels[name].num_stages = cfg.num_warps, cfg.num_stages
        ops = B.random_operands(M, K, N, copies=copies, device=dev)
        x, ws = ops.x, ops.weights
        y_mm, y_loop = (torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(2))
        unused = torch.empty(1, device=dev, dtype=torch.bfloat16)   # own_loop's partials: no peers

        def loop(i):
            own_loop[(programs,)](x, ws[i], unused, y_loop, M, N, K, PROGRAMS=programs, BM=cfg.block_m,
                                  BN=cfg.block_n, BK=cfg.block_k, GROUP_M=8, num_warps=cfg.num_warps,
                                  num_stages=cfg.num_stages)
            return y_loop
        steps = {"mm": lambda i: torch.mm(x, ws[i], out=y_mm), "loop": loop}
        for name, kernel in kernels.items():
            steps[name] = (lambda k: lambda i: k(mesh, x=x, w=ws[i])["y"])(kernel)
        ref, errs = x.float() @ ws[0].float(), {}
        for name, step in steps.items():          # correct first: every contender against float32
            y = step(0).float()
            torch.cuda.synchronize()
            errs[name] = ((y - ref).abs().max() / ref.abs().max()).item()
            if not errs[name] < 2e-2:
                raise RuntimeError(f"{model} M={M} {name}: rel err {errs[name]:.1e}")
        t = time_alternated({n: B.rotating(s, copies) for n, s in steps.items()}, rounds=rounds, device=dev)
        for name in steps:
            if name != "mm":
                records.append(f"{out_dir}/megakernel_cut_ab.jsonl", records.make_record(
                    workload="megakernel_cut_ab", model=f"{model} {name}", M=M, world=1, schedule="static",
                    ours_us=t[name], baselines={"mm": t["mm"], "loop": t["loop"]}, floor_us=None,
                    rel_err=errs[name], env=env,
                    notes=f"launch/megakernel_cut_ab.py: gemm_rs's world-1 megakernel with parts of its source "
                          f"cut, against its own tile body in a plain persistent loop; x [M, I/{shard}] @ "
                          f"w [I/{shard}, H], {cfg.block_m}x{cfg.block_n}x{cfg.block_k} tiles on {programs} "
                          f"programs; alternated, {rounds} rounds"))
        table.append((model, t))
        print(f"{model} M={M}: " + "  ".join(f"{n} {v:.1f}" for n, v in t.items()), flush=True)
        del ops, steps, ref, kernels
        torch.cuda.empty_cache()
    names = list(table[0][1])
    print("\nmodel | " + " | ".join(f"{n} us (of loop)" for n in names))
    for model, t in table:
        print(f"{model} | " + " | ".join(f"{t[n]:.1f} ({t[n] / t['loop']:.3f})" for n in names))


if __name__ == "__main__":
    main()
