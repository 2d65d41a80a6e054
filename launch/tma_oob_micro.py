"""Is a TMA box that runs past the rows slow? One Triton GEMM, x [M, K] @ w [K, N] in 128 x BN x 64 tiles
(one program per tile), x loaded through a descriptor of M rows, of M rounded up to 128 (inside a
padded allocation, so no box runs past its tensor), or through masked pointer loads; torch.mm beside.

    python launch/tma_oob_micro.py K N BN      # e.g. 16384 53248 128 (llama31_405b gate/up, a rank of 2)

Timed as DESIGN.md's protocol (etdist.bench.measure.timing); records in $OUT/tma_oob_micro.jsonl (default /tmp).
"""
import os
import sys

import torch
import triton
import triton.language as tl

from etdist.bench.measure import records
from etdist.bench.measure.timing import time_batched


@triton.jit
def mm(x, w, y, M, K, N, DESC_ROWS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PTR_A: tl.constexpr):
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BM)
    i = pid % m_tiles
    j = pid // m_tiles
    w_d = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    offs_m = i * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    if PTR_A:
        a_ptrs = x + offs_m[:, None] * K + offs_k[None, :]
        for k in range(0, tl.cdiv(K, BK)):
            a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
            acc = tl.dot(a, w_d.load([k * BK, j * BN]), acc)
            a_ptrs += BK
    else:
        x_d = tl.make_tensor_descriptor(x, shape=[DESC_ROWS, K], strides=[K, 1], block_shape=[BM, BK])
        for k in range(0, tl.cdiv(K, BK)):
            acc = tl.dot(x_d.load([i * BM, k * BK]), w_d.load([k * BK, j * BN]), acc)
    offs_n = j * BN + tl.arange(0, BN)
    tl.store(y + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=offs_m[:, None] < M)


def alloc(size, align, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


triton.set_allocator(alloc)
K, N, BN = (int(a) for a in sys.argv[1:4])
torch.manual_seed(0)
xbig = torch.randn(512, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5


env, model = records.env_info(), f"K={K} N={N} tile 128x{BN}x64"
print(f"{model}   us: tma(M rows) | tma(padded rows) | ptr A | torch.mm")
for M in (128, 129, 160, 192, 255, 256):
    x = xbig[:M]
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    grid = (triton.cdiv(M, 128) * triton.cdiv(N, BN),)
    pad = triton.cdiv(M, 128) * 128
    ref = (x.float() @ w.float())
    res = []
    for desc, ptr in ((M, False), (pad, False), (M, True)):
        f = lambda: mm[grid](x, w, y, M, K, N, desc, 128, BN, 64, ptr, num_warps=8, num_stages=4)
        f()
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, err
        res.append(time_batched(f))
    res.append(time_batched(lambda: x @ w))
    print(f"M={M:4d}  " + "  ".join(f"{t:8.1f}" for t in res))
    records.append(f"{os.environ.get('OUT', '/tmp')}/tma_oob_micro.jsonl", records.make_record(
        workload="tma_oob_micro", model=model, M=M, world=1, schedule="static", ours_us=res[0],
        baselines={"tma_rows_exist": res[1], "pointer_rows": res[2], "mm": res[3]}, floor_us=None, rel_err=err,
        env=env, notes="launch/tma_oob_micro.py: ours = x through a descriptor of exactly M rows"))
