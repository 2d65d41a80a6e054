"""What would stream-K with an in-epilogue fix-up buy gemm_rs's GEMM? A standalone persistent Triton
GEMM, y [M, N] = x [M, K] @ w [K, N] in gemm_rs's LARGE tiles (128x256x64, 8 warps, 4 stages, TMA
loads, grouped order, one program per SM), run three ways, beside torch.mm and etdist's own
gemm_reduce_scatter at world 1 (its plans: whole tiles, slices of every tile, or whole waves and a
sliced tail):

- `dp`: every tile whole, dealt round-robin (a short last wave leaves SMs idle);
- `sk1`: the tiles of whole waves whole, the rest stream-K (Osama et al., PPoPP 2023): their
  contraction steps end to end, cut in one equal share per program;
- `sk2`: as sk1, with one more wave in the stream-K part (CUTLASS's "DP + 2-tile SK": larger pieces
  where the rest is small).

Stream-K's fix-up is CUTLASS's: a share starts inside one tile and ends inside another. The piece it
starts with (later contraction steps of its tile) goes in fp32 to a workspace slot of its program and
is released on the tile's flag; the piece it ends with (its tile's first steps) is the tile's last
to finish, so that program waits for the flag (already set, mostly: the other programs ran their
pieces first), adds the slots in its accumulator and stores the tile. No reduce task, no second pass.
Every wait has a watchdog (an error word the host checks).

    torchrun --nproc_per_node=1 launch/stream_k_micro.py            # MODELS=..., MS=..., SHARD=2, ROUNDS=4

The shapes are gemm_rs's on one rank of SHARD (K = intermediate / SHARD, N = hidden). Each contender
is checked against a float32 reference first, then timed alternately (etdist.bench.measure.timing,
4 rotating weight copies). Records in $OUT/stream_k_micro.jsonl (default /tmp).
"""
import math
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import etdist as et
from etdist.kernels.gemm_tiles import async_proxy_fence, grouped_tile, store_tile
from etdist.kernels.sync import ld_acquire, notify, wait
from etdist.bench.measure import baselines as B
from etdist.bench.measure import records
from etdist.bench.measure.shapes import MLP_SHAPES
from etdist.bench.measure.timing import time_alternated

BM, BN, BK, WARPS, STAGES, GROUP_M = 128, 256, 64, 8, 4, 8
MAX_SPINS = 1 << 22


@triton.jit
def steps(x_d, w_d, pm, pn, k_lo, k_hi, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_hi):
        acc = tl.dot(x_d.load([pm * BM, k * BK]), w_d.load([k * BK, pn * BN]), acc)
    return acc


@triton.jit
def holder(x, total, shares):
    """The program whose share holds step x of the stream-K part: the last p with start(p) <= x."""
    return ((x + 1) * shares - 1) // total


@triton.jit
def sk_gemm(x, w, y, ws, flags, err, err_table, M, N, K, sk_start, max_spins, PROGRAMS: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
            PER_TILE: tl.constexpr = 0):
    """Tiles [0, sk_start) whole, dealt round-robin; tiles [sk_start, tiles) stream-K (see above).
    PER_TILE (the megakernel's per-task costs, in the whole tiles): 1, descriptors made per tile;
    2, also a sys-scope acquire load of an event word and an async-proxy fence per tile."""
    pid = tl.program_id(0)
    x_d = tl.make_tensor_descriptor(x, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_d = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    m_tiles, n_tiles, iters = tl.cdiv(M, BM), tl.cdiv(N, BN), tl.cdiv(K, BK)
    tiles = m_tiles * n_tiles
    for t in range(pid, sk_start, PROGRAMS):
        pm, pn = grouped_tile(t, m_tiles, n_tiles, GROUP_M)
        if PER_TILE == 0:
            acc = steps(x_d, w_d, pm, pn, 0, iters, BM, BN, BK)
        else:
            if PER_TILE == 2:
                ld_acquire(err, "sys", True)       # as the task's wait (never false here)
                async_proxy_fence(True)
                tl.debug_barrier()
            xt = tl.make_tensor_descriptor(x, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
            wt = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
            acc = steps(xt, wt, pm, pn, 0, iters, BM, BN, BK)
        store_tile(acc, y, N, M, N, pm, pn, BM, BN)
    total = (tiles - sk_start) * iters
    shares = tl.minimum(PROGRAMS, total)        # fewer steps than programs: one step each
    lo = tl.minimum(pid, shares) * total // tl.maximum(shares, 1)
    hi = tl.minimum(pid + 1, shares) * total // tl.maximum(shares, 1)
    block = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    s = lo
    while s < hi:
        u = s // iters
        k0 = s - u * iters
        k1 = tl.minimum(hi - u * iters, iters)
        pm, pn = grouped_tile(sk_start + u, m_tiles, n_tiles, GROUP_M)
        acc = steps(x_d, w_d, pm, pn, k0, k1, BM, BN, BK)
        if k0 > 0:   # a later piece of tile u: to my slot, for the tile's first piece to add
            tl.store(ws + pid.to(tl.int64) * (BM * BN) + block, acc)
            notify(flags + u, 1, False, "gpu")
        else:
            if k1 < iters:   # the tile's first piece, my share's last: add the others' pieces
                q_lo = holder(u * iters + k1, total, shares)
                q_hi = holder(u * iters + iters - 1, total, shares)
                # watchdog'd: a timeout records itself in err (sync.wait's error slot, world 1)
                wait(flags + u, q_hi - q_lo + 1, max_spins, err, err_table, 0, 1, u, 0, 0, "gpu", True)
                for q in range(q_lo, q_hi + 1):
                    acc += tl.load(ws + q.to(tl.int64) * (BM * BN) + block)
                tl.atomic_xchg(flags + u, 0)     # re-armed for the next launch (stream order)
            store_tile(acc, y, N, M, N, pm, pn, BM, BN)
        s = u * iters + k1


class Micro:
    """One shape's kernel launches: `dp`, `sk1`, `sk2` (sk_start as the module docstring says)."""

    def __init__(self, M, K, N, device):
        self.M, self.K, self.N = M, K, N
        self.programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
        self.ws = torch.empty(self.programs, BM, BN, device=device, dtype=torch.float32)
        self.flags = torch.zeros(max(self.tiles, 1), device=device, dtype=torch.int32)
        self.err = torch.zeros(8, device=device, dtype=torch.int32)      # sync.wait's error slot
        self.err_table = torch.tensor([self.err.data_ptr()], device=device, dtype=torch.int64)
        self.out = torch.empty(M, N, device=device, dtype=torch.bfloat16)

    def sk_start(self, form: str) -> int:
        P, T = self.programs, self.tiles
        if form.startswith("dp") or T % P == 0:
            return T
        return max(0, (T // P - (1 if form == "sk2" else 0)) * P)

    def __call__(self, form, x, w):
        sk_gemm[(self.programs,)](x, w, self.out, self.ws, self.flags, self.err, self.err_table, self.M, self.N, self.K,
                                  self.sk_start(form), MAX_SPINS, PROGRAMS=self.programs, BM=BM, BN=BN, BK=BK,
                                  GROUP_M=GROUP_M, PER_TILE={"dpd": 1, "dpw": 2}.get(form, 0), num_warps=WARPS,
                                  num_stages=STAGES)
        return self.out


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    models = os.environ.get("MODELS", ",".join(MLP_SHAPES)).split(",")
    Ms = [int(m) for m in os.environ.get("MS", "256,512,768,1000,2048,8192").split(",")]
    shard, rounds = int(os.environ.get("SHARD", "2")), int(os.environ.get("ROUNDS", "4"))
    out_dir = os.environ.get("OUT", "/tmp")
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    if mesh.world_size != 1:
        raise SystemExit("stream_k_micro.py runs on one GPU (torchrun --nproc_per_node=1)")
    dev, env, copies = mesh.device, records.env_info(), 4
    names = os.environ.get("FORMS", "mm,ours,dp,sk1,sk2").split(",")
    table = []
    for model in models:
        N, K = MLP_SHAPES[model].hidden, MLP_SHAPES[model].intermediate // shard
        for M in Ms:
            ops = B.random_operands(M, K, N, copies=copies, device=dev)
            x, ws = ops.x, ops.weights
            micro = Micro(M, K, N, dev)
            mm_out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            steps_of = {"mm": lambda i: torch.mm(x, ws[i], out=mm_out),
                        "ours": lambda i: et.ops.gemm_reduce_scatter(x, ws[i])}
            for form in set(names) - {"mm", "ours"}:
                steps_of[form] = (lambda f: lambda i: micro(f, x, ws[i]))(form)
            ref, errs = x.float() @ ws[0].float(), {}
            for n in names:                      # correct first: every contender against float32
                micro.out.fill_(float("nan"))
                y = steps_of[n](0).float()
                torch.cuda.synchronize()
                errs[n] = ((y - ref).abs().max() / ref.abs().max()).item()
                if micro.err[0].item() or not errs[n] < 2e-2:
                    raise RuntimeError(f"{model} M={M} {n}: rel err {errs[n]:.1e}, watchdog {micro.err[0].item()}")
            t = time_alternated({n: B.rotating(steps_of[n], copies) for n in names}, rounds=rounds, device=dev)
            if micro.err[0].item():
                raise RuntimeError(f"{model} M={M}: a stream-K wait timed out while timing")
            for n in names[1:]:
                records.append(f"{out_dir}/stream_k_micro.jsonl", records.make_record(
                    workload="stream_k_micro", model=f"{model} {n}", M=M, world=1, schedule="static",
                    ours_us=t[n], baselines={"mm": t["mm"]}, floor_us=None, rel_err=errs[n], env=env,
                    notes=f"launch/stream_k_micro.py: y = x [M, I/{shard}] @ w [I/{shard}, H], one GPU; "
                          f"{micro.tiles} tiles of {BM}x{BN}x{BK} on {micro.programs} programs; sk1 starts "
                          f"stream-K at tile {micro.sk_start('sk1')}, sk2 at {micro.sk_start('sk2')}; "
                          f"alternated, {rounds} rounds"))
            table.append((model, M, micro.tiles, t))
            print(f"{model} M={M} ({micro.tiles} tiles): " + "  ".join(f"{n} {t[n]:.1f}" for n in names), flush=True)
            del ops, steps_of, ref
            torch.cuda.empty_cache()
    print("\nmodel | M | tiles | mm us | " + " | ".join(f"{n} us (of mm)" for n in names[1:]))
    for model, M, tiles, t in table:
        print(f"{model} | {M} | {tiles} | {t['mm']:.1f} | " + " | ".join(
            f"{t[n]:.1f} ({t[n] / t['mm']:.3f})" for n in names[1:]))
    for n in names[1:]:
        g = math.exp(sum(math.log(t[n] / t["mm"]) for *_, t in table) / len(table))
        print(f"geomean {n}: {g:.3f} of mm over {len(table)} cells")
    mesh.close()


if __name__ == "__main__":
    main()
