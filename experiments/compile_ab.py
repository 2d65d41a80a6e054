"""What torch.compile does to a decode step that calls our ops, on one GPU: the same step eager,
compiled (default mode: the op is a custom-op node, called through the dispatcher) and compiled
with mode="reduce-overhead" (inductor's CUDA graphs replay the whole step, our launch included).

    torchrun --nproc_per_node=1 experiments/compile_ab.py        (records: $OUT/compile_ab.jsonl)

Steps (decode sizes, torch ops around ours as in a model): gemm_rs at M=16 (qwen3_8b's down
projection shard, K=6144, N=4096) + residual add + RMS-style norm; nn.MoE (qwen3_30b_a3b's layer)
at 1 token + residual. Every contender is checked against the eager step first, then timed in
turning order (etdist.bench.measure.timing.time_alternated), eager calls back to back. Records: ours_us =
compiled default, baselines eager and reduce-overhead.
"""
import os

import torch
import torch.distributed as dist

import etdist as et
from etdist.bench.measure import records
from etdist.bench.measure.timing import time_alternated


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main():
    out = os.environ.get("OUT", "/tmp")
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    dev, bf16 = mesh.device, torch.bfloat16
    torch.manual_seed(0)
    w = torch.randn(6144, 4096, device=dev, dtype=bf16) / 6144 ** 0.5
    h = torch.randn(16, 6144, device=dev, dtype=bf16)
    res = torch.randn(16, 4096, device=dev, dtype=bf16)
    moe = et.nn.MoE(2048, 768, 128, 8, mesh=mesh, dtype=bf16)
    tok = torch.randn(1, 2048, device=dev, dtype=bf16)

    def rs_step(h, res):
        y = et.ops.gemm_reduce_scatter(h, w, mesh=mesh) + res
        return y * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(y.dtype)

    def moe_step(t):
        return moe(t) + t

    steps = {"gemm_rs M=16 + norm": (rs_step, (h, res), 16), "moe qwen3_30b_a3b 1 token": (moe_step, (tok,), 1)}
    env = records.env_info()
    rows = []
    for name, (step, args, M) in steps.items():
        variants = {"eager": step, "compiled": torch.compile(step, fullgraph=True),
                    "reduce-overhead": torch.compile(step, fullgraph=True, mode="reduce-overhead")}
        want = step(*args)
        for v, fn in variants.items():
            for _ in range(3):   # compile, warm up, record the CUDA graph
                got = fn(*args)
            err = rel(got, want)
            assert err < 1e-2, (name, v, err)
        us = time_alternated({v: (lambda fn=fn: fn(*args)) for v, fn in variants.items()}, rounds=4, device=dev)
        rows.append((name, us))
        records.append(f"{out}/compile_ab.jsonl", records.make_record(
            workload="compile_ab", model=name, M=M, world=1, schedule="static", ours_us=us["compiled"],
            baselines={"eager": us["eager"], "reduce-overhead": us["reduce-overhead"]}, floor_us=None,
            rel_err=0.0, env=env, notes="experiments/compile_ab.py: the step eager, torch.compile(fullgraph=True) "
            "(ours_us) and mode='reduce-overhead'; each checked against the eager step (rel err < 1e-2); "
            "4 rounds of turning order, 2 batches of 20 back-to-back calls each, median"))
    print("\nstep | eager us | compiled us | reduce-overhead us")
    for name, us in rows:
        print(f"{name} | {us['eager']:.1f} | {us['compiled']:.1f} | {us['reduce-overhead']:.1f}")
    mesh.close()


if __name__ == "__main__":
    main()
