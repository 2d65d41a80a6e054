"""Relaunch soak: many launches of each fused op, back to back, at random M with fresh random inputs,
every Nth checked against a float32 reference; any mismatch or hang (the watchdog raises) fails.

    torchrun --nproc_per_node=2 launch/soak.py                                 # GPUs: 10,000 launches per op
    torchrun --nproc_per_node=2 launch/soak.py --launches 300 --hidden 64 --intermediate 128   # the cpu mesh

Every rank draws the same M sequence (one seed) and its own inputs; weights stay (as a model's
do), inputs change every launch. Prints progress per op and a table last; exits 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

import etdist as et
from etdist.bench.measure.ranks import chunk, gather_rows, rel_err
from etdist.bench.measure.shapes import MLP_SHAPES
from etdist.bench.measure.timing import slowest_rank as max_over_ranks

OPS = ("gemm_rs", "ag_gemm", "mlp", "mlp_replicated")


def summed(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


class Op:
    """One op's weights (this rank's shards, float32 masters kept for the reference) and a call."""

    def __init__(self, name: str, mesh, H: int, I: int, max_m: int, dtype: torch.dtype):
        R, dev = mesh.world_size, mesh.device
        self.name, self.mesh, self.dtype = name, mesh, dtype
        g = torch.Generator(device="cpu").manual_seed(1000 + mesh.rank)   # this rank's shards
        w = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(dev)   # noqa: E731
        if name == "gemm_rs":      # x [M, I/R] @ w [I/R, H], summed: the down projection
            self.w = w(I // R, H)
            self.k = I // R
        elif name == "ag_gemm":    # gathered x [M, H] @ w [H, 2I/R]: the gate/up projection
            self.w = w(H, 2 * I // R)
            self.k = H
        else:                      # the SwiGLU MLP: gate | up [H, 2I/R], down [I/R, H]
            self.gate_up, self.down = w(H, 2 * I // R), w(I // R, H)
            self.k = H
        self.weights = [t.to(dtype) for t in ((self.w,) if name in ("gemm_rs", "ag_gemm") else (self.gate_up, self.down))]
        self.x = torch.empty(max_m, self.k, device=dev, dtype=dtype)

    def rows(self, M: int) -> int:
        """Rows of x this rank passes for M tokens."""
        if self.name in ("gemm_rs", "mlp_replicated"):
            return M
        lo, hi = chunk(M, self.mesh.world_size, self.mesh.rank)
        return hi - lo

    def __call__(self, M: int) -> torch.Tensor:
        x = self.x[:self.rows(M)]
        x.normal_()
        m = self.mesh
        if self.name == "gemm_rs":
            return et.ops.gemm_reduce_scatter(x, self.weights[0], mesh=m)
        if self.name == "ag_gemm":
            return et.ops.all_gather_gemm(x, self.weights[0], mesh=m, total_rows=M)
        seq = self.name == "mlp"
        return et.ops.tensor_parallel_mlp(x, *self.weights, mesh=m, total_rows=M if seq else None,
                                          sequence_parallel=seq)

    def reference(self, M: int) -> torch.Tensor:
        """This rank's float32 result for the x of the last call (collective: every rank calls it)."""
        R, r = self.mesh.world_size, self.mesh.rank
        x = self.x[:self.rows(M)].float()
        w = [t.float() for t in self.weights]
        lo, hi = chunk(M, R, r)
        if self.name == "gemm_rs":
            return summed(x @ w[0])[lo:hi]
        if self.name == "ag_gemm":
            return gather_rows(x, M, R) @ w[0]
        full = gather_rows(x, M, R) if self.name == "mlp" else x
        gate_up = full @ w[0]
        n = gate_up.shape[1] // 2
        y = summed((F.silu(gate_up[:, :n]) * gate_up[:, n:]) @ w[1])
        return y[lo:hi] if self.name == "mlp" else y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--model", default="qwen3_8b", help=f"an MLP shape: {', '.join(MLP_SHAPES)}")
    ap.add_argument("--hidden", type=int, help="H instead of the model's (small runs on the cpu mesh)")
    ap.add_argument("--intermediate", type=int, help="I instead of the model's")
    ap.add_argument("--launches", type=int, default=10_000, help="per op")
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--max-m", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad or args.launches < 1 or args.check_every < 1 or args.max_m < 1:
        ap.error(f"ops from {OPS} (got {bad}), --launches, --check-every and --max-m >= 1")
    gpu = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo")
    mesh = et.init_mesh()
    shape = MLP_SHAPES[args.model]
    H, I = args.hidden or shape.hidden, args.intermediate or shape.intermediate
    if I % mesh.world_size:
        ap.error(f"intermediate {I} does not split over {mesh.world_size} ranks")
    dtype = torch.bfloat16 if gpu else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    lead = mesh.rank == 0
    if lead:
        print(f"soak: {mesh.world_size} ranks ({'GPUs' if gpu else 'cpu mesh'}), H={H} I={I} {dtype}, "
              f"{args.launches} launches per op at M in 1..{args.max_m}, every {args.check_every}th checked",
              flush=True)
    rows, failed = [], False
    for name in ops:
        op, rng = Op(name, mesh, H, I, args.max_m, dtype), random.Random(args.seed)
        checks, worst, wrong, t0 = 0, 0.0, [], time.monotonic()
        for i in range(1, args.launches + 1):
            M = rng.randint(1, args.max_m)
            y = op(M)
            if i % args.check_every == 0 or i == args.launches:
                err = max_over_ranks(rel_err(y, op.reference(M)))   # every rank counts the same
                checks, worst = checks + 1, max(worst, err)
                if not err < tol:
                    wrong.append((i, M, err))
            if lead and i % max(1, args.launches // 10) == 0:
                print(f"  {name}: {i}/{args.launches} launches, {checks} checked, worst rel err {worst:.1e}",
                      flush=True)
        mesh.barrier()
        rows.append((name, args.launches, checks, len(wrong), worst, time.monotonic() - t0))
        failed = failed or bool(wrong)
        if lead and wrong:
            print(f"  {name} MISMATCH at (launch, M, rel err): {wrong[:5]}", flush=True)
    if lead:
        print("op | launches | checked | mismatches | worst rel err | seconds")
        for name, n, c, w, e, s in rows:
            print(f"{name} | {n} | {c} | {w} | {e:.1e} | {s:.1f}")
    mesh.close()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
