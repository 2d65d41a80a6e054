"""Where the time of a decode-sized GEMM+RS call goes: host enqueue vs GPU kernel (torch.profiler).

    torchrun --nproc_per_node=2 launch/profile_gemm_rs.py
"""
import itertools
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import etdist as et
from etdist.measure.shapes import gemm_rs_dims
from etdist.measure.timing import time_ranks

dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
for model in ("qwen3_8b", "llama31_70b"):
    K, N = gemm_rs_dims(model, mesh.world_size)
    ws = [torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) for _ in range(4)]
    for M in (16, 128):
        x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
        weights = itertools.cycle(ws)  # rotate copies so weights stream from HBM
        call = lambda: et.ops.gemm_reduce_scatter(x, next(weights), mesh=mesh)
        batched = time_ranks(call, device=mesh.device)
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
        other = sorted(((e.key[:40], e.device_time_total / 20) for e in prof.key_averages()
                        if "megakernel" not in e.key and e.device_time_total > 0), key=lambda t: -t[1])[:3]
        k_us = kern[0].device_time_total / max(1, kern[0].count) if kern else float("nan")
        if mesh.rank == 0:
            print(f"{model:>12} M={M:<4} batched {batched:7.1f} us  host enqueue {host:7.1f} us  "
                  f"kernel {k_us:7.1f} us  other GPU work per call {other}", flush=True)
mesh.close()
