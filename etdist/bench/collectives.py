"""Benchmark the collectives against NCCL (eager and in a CUDA graph), same run, same inputs.

    torchrun --nproc_per_node=2 -m etdist.bench.collectives [--sizes 4K,64K,1M,16M,128M] [--out DIR]

For each op and size (bytes of the full tensor: reduce_scatter's input, all_gather's output,
all_reduce's buffer; bf16): check ours against NCCL (fp32 sums of integers exactly, bf16 within
rounding), then time: warm up, barrier, a batch of 20 calls between two CUDA events, median of 7
batches, the slowest rank; ours eager and replayed from a CUDA graph, NCCL eager and in a graph.
Appends one record per cell to DIR/<op>.jsonl (docs/design.md's record schema) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.distributed as dist

from ..collectives import all_gather, all_reduce, reduce_scatter
from ..mesh import init_mesh, timing_refused
from .measure import records

SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "128M": 128 << 20}
MARKS = {"symmetric_out": "*", "two_shot": "+"}   # the variants' marks in the printed table
BATCH, REPS = 20, 7


def time_batch(fn, stream, calls: int = BATCH) -> float:
    """Median over REPS batches of `calls` back-to-back calls of fn, us per BATCH, slowest rank.
    (A CUDA graph holding BATCH ops is timed with calls=1.)"""
    times = []
    for _ in range(REPS):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(calls):
            fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / BATCH)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def single_call(fn) -> float:
    ts = []
    for _ in range(REPS):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    t = torch.tensor([statistics.median(ts)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def graphed(fn):
    """Capture BATCH calls of fn into a CUDA graph; return a callable replaying it (BATCH calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(BATCH):
            fn()
    torch.cuda.synchronize()
    return g


def time_graph(g, stream) -> float:
    return time_batch(g.replay, stream, calls=1)


def make_ops(mesh, op: str, nbytes: int, dtype, variant: str = ""):
    """(x, out, ref, ours, nccl, link bytes, bus bytes) of one cell; variant "symmetric_out"
    (all_gather into a symmetric out) or "two_shot" (all_reduce as reduce_scatter + all_gather)."""
    w, es = mesh.world_size, torch.empty((), dtype=dtype).element_size()
    total = nbytes // es
    if op == "reduce_scatter":
        x = torch.empty(total, dtype=dtype, device=mesh.device)
        out, ref = (torch.empty(total // w, dtype=dtype, device=mesh.device) for _ in range(2))
        ours = lambda: reduce_scatter(x, out, mesh=mesh, check=False)  # noqa: E731
        nccl = lambda: dist.reduce_scatter_tensor(ref, x)  # noqa: E731
        link_bytes = nbytes * (w - 1) / w
        bus_bytes = link_bytes
    elif op == "all_gather":
        x = torch.empty(total // w, dtype=dtype, device=mesh.device)
        out, ref = (torch.empty(total, dtype=dtype, device=mesh.device) for _ in range(2))
        if variant == "symmetric_out":  # peers write it directly (collectives/ops.py: DIRECT)
            out = mesh.empty((total,), dtype)
        ours = lambda: all_gather(x, out, mesh=mesh, check=False)  # noqa: E731
        nccl = lambda: dist.all_gather_into_tensor(ref, x)  # noqa: E731
        link_bytes = nbytes * (w - 1) / w
        bus_bytes = link_bytes
    else:
        x = torch.empty(total, dtype=dtype, device=mesh.device)
        out, ref = (torch.empty(total, dtype=dtype, device=mesh.device) for _ in range(2))

        def nccl():
            ref.copy_(x)
            dist.all_reduce(ref)

        two = variant == "two_shot"
        ours = lambda: all_reduce(x, out, mesh=mesh, check=False, two_shot=two)  # noqa: E731
        link_bytes = 2 * nbytes * (w - 1) / w if two else nbytes * (w - 1)  # one shot: all of x to every peer
        bus_bytes = 2 * nbytes * (w - 1) / w  # NCCL's busbw convention
    return x, out, ref, ours, nccl, link_bytes, bus_bytes


def correctness(mesh, op, nbytes, variant="") -> float:
    """fp32 integer sums must match NCCL exactly; returns bf16 max relative error vs NCCL."""
    x, out, ref, ours, nccl, _, _ = make_ops(mesh, op, nbytes, torch.float32, variant)
    x.copy_(torch.randint(-64, 65, x.shape, device=x.device, dtype=torch.float32))
    out.fill_(float("nan"))
    ours()
    mesh.check()
    nccl()
    torch.cuda.synchronize()
    if not torch.equal(out, ref):
        raise RuntimeError(f"{op} {nbytes} B fp32: differs from NCCL (max abs {(out - ref).abs().max().item()})")
    x, out, ref, ours, nccl, _, _ = make_ops(mesh, op, nbytes, torch.bfloat16, variant)
    x.copy_(torch.randn(x.shape, device=x.device))
    out.fill_(float("nan"))
    ours()
    mesh.check()
    nccl()
    torch.cuda.synchronize()
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
    if not err <= 1e-2:
        raise RuntimeError(f"{op} {nbytes} B bf16: relative error {err} vs NCCL")
    return err


def peer_copy_gbps(mesh, nbytes=128 << 20) -> float:
    """Copy-engine peer write bandwidth (cudaMemcpy into the peer's symmetric buffer), GB/s."""
    src = torch.randn(nbytes // 4, device=mesh.device)
    dst_sym = mesh.empty((nbytes // 4,), torch.float32)
    peer = mesh.peer(dst_sym, (mesh.rank + 1) % mesh.world_size)
    t = time_batch(lambda: peer.copy_(src), torch.cuda.current_stream())
    mesh.barrier()
    return nbytes / t / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,64K,1M,16M,128M")
    ap.add_argument("--ops", default="reduce_scatter,all_gather,all_reduce")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-symmetric", action="store_true", help="skip all_gather into a symmetric out (*)")
    ap.add_argument("--no-two-shot", action="store_true", help="skip all_reduce as reduce_scatter + all_gather (+)")
    args = ap.parse_args(argv)
    mesh = init_mesh()
    if why := timing_refused():   # its own CUDA-event timing, not etdist.bench.measure's (and NCCL refuses shared GPUs)
        raise SystemExit(f"etdist.bench.collectives: {why}")
    r, w = mesh.rank, mesh.world_size
    stream = torch.cuda.current_stream()
    ce = peer_copy_gbps(mesh)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                commit=records.git_commit(), date=datetime.date.today().isoformat())
    rows = []
    cells = [(op, "") for op in args.ops.split(",")]
    if "all_gather" in args.ops and not args.no_symmetric:
        cells.append(("all_gather", "symmetric_out"))
    if "all_reduce" in args.ops and not args.no_two_shot and w > 1:
        cells.append(("all_reduce", "two_shot"))
    for op, variant in cells:
        for label in args.sizes.split(","):
            nbytes = SIZES[label]
            err = correctness(mesh, op, nbytes, variant)
            x, out, ref, ours, nccl, link, bus = make_ops(mesh, op, nbytes, torch.bfloat16, variant)
            x.copy_(torch.randn(x.shape, device=x.device))
            for _ in range(3):
                ours()
                nccl()
            mesh.barrier()
            t_ours = time_batch(ours, stream)
            t_eager = time_batch(nccl, stream)
            t_single = single_call(ours)
            t_nccl_single = single_call(nccl)
            t_ours_graph = t_graph = float("nan")
            if not args.no_graph:
                t_graph = time_graph(graphed(nccl), stream)
                t_ours_graph = time_graph(graphed(ours), stream)
                mesh.barrier()
            mesh.check()
            floor = link / (ce * 1e3)
            rec = dict(workload=op, model=f"bytes_{variant}" if variant else "bytes", M=nbytes, world=w,
                       schedule="n/a", ours_us=round(t_ours, 2),
                       baselines=dict(eager=round(t_eager, 2), graph=round(t_graph, 2)),
                       floor_us=round(floor, 2), rel_err=err,
                       extra=dict(ours_graph_us=round(t_ours_graph, 2), ours_single_us=round(t_single, 2),
                                  nccl_single_us=round(t_nccl_single, 2), peer_copy_GBps=round(ce, 1),
                                  link_bytes=int(link), busbw_GBps=round(bus / t_ours / 1e3, 1), nccl_busbw_GBps=round(bus / t_eager / 1e3, 1), dtype="bfloat16"), **meta)
            rows.append(rec)
            if r == 0:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"{op}.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
                best = min(t_eager, t_graph) if t_graph == t_graph else t_eager
                ours_best = min(t_ours, t_ours_graph) if t_ours_graph == t_ours_graph else t_ours
                print(f"{op + MARKS.get(variant, ''):15s} {label:>5s} ours {t_ours:8.1f} us "
                      f"(graph {t_ours_graph:8.1f}, single {t_single:7.1f}) "
                      f"| nccl eager {t_eager:8.1f} graph {t_graph:8.1f} single {t_nccl_single:7.1f} "
                      f"| best/best {best / ours_best:5.2f}x eager/eager {t_eager / t_ours:5.2f}x | busbw {bus / t_ours / 1e3:6.1f} vs {bus / t_eager / 1e3:6.1f} GB/s | rel_err {err:.1e}",
                      flush=True)
    if r == 0:
        print(f"* = out allocated with mesh.empty (peers write it directly); + = all_reduce(two_shot=True); "
              f"peer copy (copy engine) {ce:.1f} GB/s; device {meta['device']}; torch {meta['torch']}")
    mesh.close()


if __name__ == "__main__":
    main()
