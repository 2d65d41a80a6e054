"""Where a decode GEMM loses HBM bandwidth, without the megakernel: split-K kernels for
x [M, K] @ w [K, N] (M <= 64, bf16, fp32 partials) on one GPU, each one step away from the last,
checked against float32 and timed next to torch.mm (weights rotated over 4 copies so every call
streams HBM; DESIGN.md's batches):

    plain    the megakernel's skinny gemm_rs tile alone: descriptors made per task, x padded to a
             64-row wgmma M side (today: 64x64x128, 4 stages; and the 64x128x128 A/B winner)
    swap     swap-AB: weights on the wgmma M side, the token rows on N (16 of them), so a deeper
             weight ring fits (6 stages: 160 KiB in flight per SM); descriptors made once per program
    flat     swap + one (task, k) loop per program: the next task's loads are issued before this
             task's epilogue, so the pipeline never drains between tasks
    packed   swap on weights pre-packed per column tile (each stage one contiguous block)

If swap is not faster than plain, weight bytes in flight are not the limit. From a reading of the
generated sm_90 code (BENCHMARKS.md, sixth session); nothing here has been timed yet.

    python launch/decode_ladder.py                                # qwen3_8b's gemm_rs at M=16
    python launch/decode_ladder.py --M 16 --K 14336 --N 8192      # llama31_70b
    TRITON_INTERPRET=1 python launch/decode_ladder.py --M 5 --K 512 --N 256 --dtype float32   # CPU check
"""
import argparse
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _unit(t, K, N, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Work unit t: (K-slice s, column tile j) and the slice's K range."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    s, j = t // n_tiles, t % n_tiles
    KB = tl.cdiv(tl.cdiv(K, SPLITS), BLOCK_K) * BLOCK_K
    return s, j, s * KB, tl.minimum(K, (s + 1) * KB)


@triton.jit
def _store(acc_t, part, s, j, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """part[s][:, tile j] = acc_t^T ([BLOCK_N, BLOCK_M] accumulator of a swapped tile)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(part + s * M * N + offs_m[None, :] * N + offs_n[:, None], acc_t,
             mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


@triton.jit
def plain(x, w, part, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    for t in range(tl.program_id(0), SPLITS * tl.cdiv(N, BLOCK_N), NUM_PROGRAMS):
        s, j, k0, k1 = _unit(t, K, N, SPLITS, BLOCK_N, BLOCK_K)
        a_d = tl.make_tensor_descriptor(x, shape=[tl.maximum(M, 1), K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        b_d = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k1, BLOCK_K):
            acc = tl.dot(a_d.load([0, k]), b_d.load([k, j * BLOCK_N]), acc)
        _store(tl.trans(acc), part, s, j, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def swap(x, w, part, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    a_d = tl.make_tensor_descriptor(x, shape=[tl.maximum(M, 1), K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_d = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    for t in range(tl.program_id(0), SPLITS * tl.cdiv(N, BLOCK_N), NUM_PROGRAMS):
        s, j, k0, k1 = _unit(t, K, N, SPLITS, BLOCK_N, BLOCK_K)
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k0, k1, BLOCK_K):
            acc_t = tl.dot(tl.trans(b_d.load([k, j * BLOCK_N])), tl.trans(a_d.load([0, k])), acc_t)
        _store(acc_t, part, s, j, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def flat(x, w, part, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """K a multiple of SPLITS * BLOCK_K (every unit has k_iters steps). The unit and step come from
    the induction variable alone: carried across iterations (or a tl.debug_barrier in the loop),
    they stop Triton 3.6's pipeliner."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    a_d = tl.make_tensor_descriptor(x, shape=[tl.maximum(M, 1), K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_d = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    k_iters = K // SPLITS // BLOCK_K
    mine = tl.cdiv(SPLITS * n_tiles - pid, NUM_PROGRAMS)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(0, mine * k_iters):
        t, kk = pid + (it // k_iters) * NUM_PROGRAMS, it % k_iters
        s, j = t // n_tiles, t % n_tiles
        k = (s * k_iters + kk) * BLOCK_K
        acc_t = tl.dot(tl.trans(b_d.load([k, j * BLOCK_N])), tl.trans(a_d.load([0, k])), acc_t)
        if kk == k_iters - 1:
            _store(acc_t, part, s, j, M, N, BLOCK_M, BLOCK_N)
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)


@triton.jit
def packed(x, w, part, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """swap on w packed as [N / BLOCK_N, K, BLOCK_N]: column tile j's K-slab is contiguous."""
    a_d = tl.make_tensor_descriptor(x, shape=[tl.maximum(M, 1), K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_d = tl.make_tensor_descriptor(w, shape=[tl.cdiv(N, BLOCK_N) * K, BLOCK_N], strides=[BLOCK_N, 1],
                                    block_shape=[BLOCK_K, BLOCK_N])
    for t in range(tl.program_id(0), SPLITS * tl.cdiv(N, BLOCK_N), NUM_PROGRAMS):
        s, j, k0, k1 = _unit(t, K, N, SPLITS, BLOCK_N, BLOCK_K)
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k0, k1, BLOCK_K):
            acc_t = tl.dot(tl.trans(b_d.load([j * K + k, 0])), tl.trans(a_d.load([0, k])), acc_t)
        _store(acc_t, part, s, j, M, N, BLOCK_M, BLOCK_N)


# kernel, block_m, block_n, block_k, warps, stages, tasks per SM (split-K slices are chosen so)
LADDER = [(plain, 64, 64, 128, 4, 4, 2),     # the megakernel's skinny tile today
          (plain, 64, 128, 128, 4, 4, 1),    # the decode A/B winner (ETDIST_GEMM_RS_SKINNY=64,128,128,4,4)
          (swap, 16, 128, 128, 4, 6, 1), (swap, 16, 64, 128, 4, 10, 2),
          (flat, 16, 128, 128, 4, 6, 1), (flat, 16, 128, 128, 4, 6, 2), (flat, 16, 64, 128, 4, 10, 2),
          (packed, 16, 128, 128, 4, 6, 1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--M", type=int, default=16)
    ap.add_argument("--K", type=int, default=6144)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", help="float32 under TRITON_INTERPRET=1 (its bf16 descriptors misread)")
    a = ap.parse_args()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if interp:
        from etdist.kernels.interpret import patch_interpreter
        patch_interpreter()
    from etdist.ops.gemm_rs import skinny_splits
    dev = "cpu" if interp else "cuda"
    sms = 132 if interp else torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, a.dtype)
    x = torch.randn(a.M, a.K, generator=gen).to(dtype).to(dev)
    ws = [(torch.randn(a.K, a.N, generator=gen) / a.K ** 0.5).to(dtype).to(dev) for _ in range(4)]
    want = x.float() @ ws[0].float()
    wbytes = ws[0].numel() * ws[0].element_size()
    if not interp:
        from etdist.bench.measure.baselines import rotating
        from etdist.bench.measure.timing import time_batched
        us = time_batched(rotating(lambda i: torch.mm(x, ws[i]), 4), device=dev)
        print(f"{'torch.mm':34s} {us:8.1f} us  {wbytes / us / 1e6:.2f} TB/s", flush=True)
    for kernel, bm, bn, bk, warps, stages, tps in LADDER:
        n_tiles = -(-a.N // bn)
        splits = skinny_splits(a.N, sms, bn, tps)   # as the op plans them
        name = f"{kernel.fn.__name__} {bm}x{bn}x{bk} s{stages} {splits}x{n_tiles} tasks"
        if a.M > bm or (kernel is flat and a.K % (splits * bk)) or (kernel is packed and a.N % bn):
            print(f"{name:34s} skipped at this shape")
            continue
        w_in = [w.reshape(a.K, n_tiles, bn).permute(1, 0, 2).contiguous() for w in ws] if kernel is packed else ws
        part = torch.zeros(splits, a.M, a.N, dtype=torch.float32, device=dev)
        progs = min(sms, splits * n_tiles)

        def call(i):
            kernel[(progs,)](x, w_in[i], part, a.M, a.K, a.N, SPLITS=splits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             NUM_PROGRAMS=progs, num_warps=warps, num_stages=stages)
        call(0)
        err = ((part.sum(0) - want).abs().max() / want.abs().max()).item()
        line = f"{name:34s} rel err {err:.1e}"
        if not interp:
            us = time_batched(rotating(call, 4), device=dev)
            line += f"  {us:8.1f} us  {wbytes / us / 1e6:.2f} TB/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
