"""Where a gemm_rs call goes, at any M, with calls back to back as a model makes them.

1. The op replayed from CUDA graphs (one per call, as the sweep's `ours graph`), then torch.mm alone
   and mm + NCCL reduce-scatter (the `graph` baseline), each under torch.profiler: the period (time
   per call) and, per device activity (kernels, copies), how many per call and their median time.
2. One traced launch queued behind replays of the same traced kernel, so both ranks start it as
   they do in a run (a lone launch after a sync starts up to ~30 us apart on the two ranks): per rank
   the span, busy share and per-kind statistics; the kernel's time minus the span is what program
   start, the call agreement and the launch cost (each program's phases are rows of their own:
   `agree`, entry to the call agreed; `finish`, its tasks done to its end). Chrome trace in $OUT.

    torchrun --nproc_per_node=2 experiments/trace_gemm_rs.py M N K_full    # e.g. 16 4096 12288
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import etdist as et
from etdist.fusion import trace as tr
from etdist.bench.measure import baselines as B
from etdist.ops import gemm_rs as op

M, N, KF = (int(a) for a in sys.argv[1:4])
CALLS = 20
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
K = KF // mesh.world_size
ws = [torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5 for _ in range(4)]
x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)


def timeline(replay):
    """(us per call, [(device activity, count per call, median us)]) over CALLS replays."""
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            replay()
        torch.cuda.synchronize()
    acts = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not acts:
        return float("nan"), []
    by_name: dict = {}
    for e in acts:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    period = (max(e.time_range.end for e in acts) - min(e.time_range.start for e in acts)) / CALLS
    return period, [(n[:48], len(d) / CALLS, statistics.median(d)) for n, d in by_name.items()]


def show(what, rank, period, rows):
    print(f"rank {rank} {what}: {period:.1f} us per call", flush=True)
    for name, n, us in rows:
        print(f"    {name:48} {n:4.1f}/call {us:8.1f} us", flush=True)


out = torch.empty(M, N, device=mesh.device, dtype=torch.bfloat16)
cases = {
    "ours (CUDA graph per call)": B.graphed(lambda i: op.gemm_reduce_scatter(x, ws[i], mesh=mesh), 4, mesh.device),
    "torch.mm alone (graph)": B.graphed(lambda i: torch.mm(x, ws[i], out=out), 4, mesh.device),
    "mm + NCCL reduce-scatter (graph)": B.gemm_rs_graph(M, K, N, device=mesh.device),
}
for what, replay in cases.items():
    everyone = mesh.comm.allgather(timeline(replay))   # (period, rows) of every rank, printed by rank 0
    if mesh.rank == 0:
        for rank, (period, rows) in enumerate(everyone):
            show(what, rank, period, rows)

cfg, splits, _, build = op.kernel_plan(M, K, N, x.dtype, op.sm_count(mesh.device.index), mesh.world_size,
                                       et.ops.DEFAULT_PLAN)
kernel = et.compile(build(), schedule="static", target="cuda", trace=True)
kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
traced = B.graphed(lambda i: kernel(mesh, x=x, w=ws[i])["y"], 4, mesh.device)
period, rows = timeline(traced)
kern_us = max((us for name, _, us in rows if "megakernel" in name), default=float("nan"))
for _ in range(CALLS):          # the host queues these ahead of the GPU: both ranks start the
    traced()                    # eager launch below right after the previous exit rendezvous
kernel(mesh, x=x, w=ws[0])
trace_rows = kernel.trace(mesh)
# each rank's own span, from its first program's entry (the ranks' launches may start apart)
spans = [max((r[4] for r in trace_rows if r[0] == rank), default=0.0)
         - min((r[3] for r in trace_rows if r[0] == rank), default=0.0) for rank in range(mesh.world_size)]
kerns = mesh.comm.allgather(kern_us)
if mesh.rank == 0:
    path = tr.write_chrome(trace_rows, f"{os.environ.get('OUT', '/tmp')}/gemm_rs_M{M}_N{N}.json", track="SM")
    print(f"== M={M} N={N} K={K} {cfg} splits={splits}, traced kernel in a graph {period:.1f} us per call; "
          f"Chrome trace {path}")
    for rank in range(mesh.world_size):
        k_us = kerns[rank]
        print(f"rank {rank}: kernel {k_us:.1f} us (profiler, traced build), traced span {spans[rank]:.1f} us "
              f"(its first program's entry to its last program's end; rows agree: entry to the call "
              f"agreed, finish: tasks done to the end), outside the programs {k_us - spans[rank]:.1f} us")
        print(tr.summary(trace_rows, rank), flush=True)
mesh.close()
