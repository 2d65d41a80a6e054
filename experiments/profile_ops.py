"""Where the time of a decode-sized call of each fused op goes: host enqueue vs GPU kernel
(torch.profiler), and the host path's top Python functions (cProfile, rank 0).

    torchrun --nproc_per_node=2 experiments/profile_ops.py [M ...]      (default M: 16 128)
"""
import cProfile
import io
import itertools
import pstats
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import etdist as et
from etdist.bench.measure.shapes import MLP_SHAPES
from etdist.bench.measure.timing import time_ranks

dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
R, dev, bf16 = mesh.world_size, mesh.device, torch.bfloat16


def op_call(op, model, M):
    H, I = MLP_SHAPES[model].hidden, MLP_SHAPES[model].intermediate
    rows = min(M, max(0, M - mesh.rank * -(-M // R)), -(-M // R))
    if op == "gemm_rs":
        x, ws = torch.randn(M, I // R, device=dev, dtype=bf16), [torch.randn(I // R, H, device=dev, dtype=bf16) for _ in range(4)]
        return lambda w: et.ops.gemm_reduce_scatter(x, w, mesh=mesh), ws
    if op == "ag_gemm":
        x, ws = torch.randn(rows, H, device=dev, dtype=bf16), [torch.randn(H, 2 * I // R, device=dev, dtype=bf16) for _ in range(4)]
        return lambda w: et.ops.all_gather_gemm(x, w, mesh=mesh, total_rows=M), ws
    x = torch.randn(rows, H, device=dev, dtype=bf16)
    ws = [(torch.randn(H, 2 * I // R, device=dev, dtype=bf16), torch.randn(I // R, H, device=dev, dtype=bf16)) for _ in range(4)]
    return lambda w: et.ops.tensor_parallel_mlp(x, *w, mesh=mesh, total_rows=M), ws


for op, model in itertools.product(("gemm_rs", "ag_gemm", "mlp"), ("qwen3_8b", "llama31_70b")):
    for M in [int(a) for a in sys.argv[1:]] or (16, 128):
        fn, ws = op_call(op, model, M)
        weights = itertools.cycle(ws)   # rotate copies so weights stream from HBM
        call = lambda: fn(next(weights))  # noqa: E731
        batched = time_ranks(call, device=dev)
        torch.cuda.synchronize(); dist.barrier()
        t0 = time.perf_counter()
        for _ in range(50):
            call()
        host = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize(); dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        kern = [e for e in prof.key_averages() if "megakernel" in e.key]
        k_us = kern[0].device_time_total / max(1, kern[0].count) if kern else float("nan")
        other = sum(e.device_time_total for e in prof.key_averages() if "megakernel" not in e.key) / 20
        torch.cuda.synchronize(); dist.barrier()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            call()
        pr.disable()
        torch.cuda.synchronize(); dist.barrier()
        if mesh.rank == 0:
            print(f"{op:>8} {model:>12} M={M:<4} batched {batched:7.1f} us  host enqueue {host:6.1f} us  "
                  f"kernel {k_us:7.1f} us  other GPU work {other:5.1f} us/call", flush=True)
            if M == 16 and model == "qwen3_8b":
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(12)
                text = buf.getvalue()
                print(text[text.index("ncalls"):].rstrip(), flush=True)   # per 200 calls
mesh.close()
