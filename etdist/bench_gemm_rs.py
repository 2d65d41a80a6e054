"""GEMM + reduce-scatter benchmark on GPUs (DESIGN.md's protocol), one process per GPU:

    torchrun --nproc_per_node=2 -m etdist.bench_gemm_rs [--models qwen3_8b ...] [--M 16 128 ...]

Per cell (model, M): our fused megakernel and the baselines in the same run on the same operands
(cuBLAS + NCCL eager and in a CUDA graph, the mm alone, optionally torch's symm_mem fused op),
the slowest rank, weights rotated over 4 copies; the relative error against a float32 reference
first. Appends records to bench/results/gemm_rs.jsonl and prints a table. `--startup` also
times the cold compile, the first call at an unseen M, and capturing CUDA graphs for 50 sizes.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import etdist as et
from etdist.measure import baselines as B
from etdist.measure import records as R
from etdist.measure.shapes import MLP_SHAPES, gemm_rs_dims
from etdist.measure.timing import time_ranks

DEFAULT_M = (16, 128, 1024, 8192, 1000)


def rel_err_vs_fp32(mesh, x, w) -> float:
    """Our output (poisoned first) against the float32 sum of every rank's x @ w, this rank's rows."""
    C = -(-x.shape[0] // mesh.world_size)
    rows = max(0, min(C, x.shape[0] - mesh.rank * C))
    out = torch.full((rows, w.shape[1]), float("nan"), device=x.device, dtype=x.dtype)
    y = et.ops.gemm_reduce_scatter(x, w, mesh=mesh, out=out)
    part = (x.float() @ w.float()).contiguous()
    dist.all_reduce(part)
    ref = part[mesh.rank * C:mesh.rank * C + rows]
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item() if ref.numel() else 0.0
    t = torch.tensor(err, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_cell(mesh, model: str, M: int, ceil: B.Ceilings, symm_mem: bool):
    world = mesh.world_size
    K, N = gemm_rs_dims(model, world)
    ops = B.gemm_rs_operands(M, K, N, copies=4, device=mesh.device)
    x = ops.x[:M].contiguous()  # the baselines pad M up to the world; we take it as it is
    err = rel_err_vs_fp32(mesh, x, ops.weights[0])
    k = [0]

    def ours():
        k[0] += 1
        return et.ops.gemm_reduce_scatter(x, ops.weights[k[0] % 4], mesh=mesh)

    ours_us = time_ranks(ours, device=mesh.device)
    base = B.measure_baselines("gemm_rs", M, K, N, copies=4, device=mesh.device, symm_mem=symm_mem)
    floor = B.floor_us(M, K * world, N, world, ceil.copy_TBps, ceil.mm_TFps, workload="gemm_rs")
    return ours_us, base, floor, err


def startup_times(mesh) -> dict:
    """Cold compile + first call, first call at an unseen M, and 50 CUDA-graph captures of the baseline."""
    K, N = gemm_rs_dims("llama31_8b", mesh.world_size)
    w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16)

    def first_call(M):
        x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    out = {"cold_first_call_s": first_call(3000), "unseen_M_first_call_s": first_call(3001)}
    t0 = time.perf_counter()
    for M in range(2048, 2048 + 50 * 16, 16):  # what a graph-captured server does per batch size
        B.gemm_rs_graph(M, K, N, copies=1, device=mesh.device)
    torch.cuda.synchronize()
    out["capture_50_graphs_s"] = time.perf_counter() - t0
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MLP_SHAPES))
    ap.add_argument("--M", nargs="*", type=int, default=list(DEFAULT_M))
    ap.add_argument("--out", default="bench/results/gemm_rs.jsonl")
    ap.add_argument("--symm-mem", action="store_true", help="also time torch's fused_matmul_reduce_scatter")
    ap.add_argument("--startup", action="store_true")
    args = ap.parse_args(argv)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    lead = mesh.rank == 0
    env = R.env_info()
    ceil = B.measure_ceilings(mesh.device)
    if lead:
        print(f"{env['device']} x{mesh.world_size}  torch {env['torch']}  triton {env['triton']}  commit "
              f"{env['commit']}  copy {ceil.copy_TBps:.2f} TB/s  mm {ceil.mm_TFps:.0f} TF/s", flush=True)
        print(f"{'model':>14} {'M':>5} {'ours':>9} {'graph':>9} {'eager':>9} {'mm':>9} {'floor':>9} "
              f"{'best/ours':>9} {'ours/floor':>10} {'rel err':>8}", flush=True)
    if args.startup:  # first, while nothing is compiled yet
        s = startup_times(mesh)
        if lead:
            print("startup: " + "  ".join(f"{k} {v:.2f}" for k, v in s.items()), flush=True)
    for model in args.models:
        for M in args.M:
            ours_us, base, floor, err = bench_cell(mesh, model, M, ceil, args.symm_mem)
            b = base.baselines
            best = min(b["graph"], b["eager"])
            if lead:
                print(f"{model:>14} {M:>5} {ours_us:9.1f} {b['graph']:9.1f} {b['eager']:9.1f} {b['mm']:9.1f} "
                      f"{floor:9.1f} {best / ours_us:9.2f} {ours_us / floor:10.2f} {err:8.1e}", flush=True)
                R.append(args.out, R.make_record(
                    workload="gemm_rs", model=model, M=M, world=mesh.world_size, schedule="static",
                    ours_us=ours_us, baselines=b, floor_us=floor, rel_err=err, notes=base.notes(), env=env))
    mesh.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
