"""All-gather + GEMM.

Rank r holds its rows x_r [rows_r, K] of x [M, K] (rows_r = the r-th chunk of cdiv(M, R), ragged
at the end) and w_r [K, N] (its column shard). Every rank computes x @ w_r [M, N]. Each rank
sends its row tiles to every rank (itself first); a GEMM tile starts as soon as its rows arrive,
own rows first, so the gather overlaps the compute.
"""
from __future__ import annotations

import torch

import etdist as et
from etdist.kernels import copy_tiles, gemm_tiles


def all_gather_gemm(block_m: int = 16, block_n: int = 16, dtype: torch.dtype = torch.float32,
                    block_k: int = 64, align: int = 1) -> et.Graph:
    g = et.Graph("ag_gemm")
    M = g.size("M")
    K, N = g.size("K", multiple_of=align), g.size("N", multiple_of=align)   # N: this rank's columns
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n)
    R, me = g.world, g.rank
    C, owned = et.row_chunks(M, R)       # rows per owner, ragged at the end
    m_tiles, n_tiles = et.cdiv(C, block_m), et.cdiv(N, block_n)

    g.input("x", (owned(me), K), dtype)
    g.input("w", (K, N), dtype)
    g.scratch("gathered", (R * C, K), dtype, symmetric=True)  # all of x, on every rank
    g.output("y", (M, N), dtype)
    k_tiles = et.cdiv(K, block_n)
    arrived = g.event("arrived", (R, R, m_tiles), count=k_tiles, distributed=True)  # [holder, source, row tile]

    @g.task(grid=(R, m_tiles, k_tiles), notify=lambda d, i, c: arrived[(me + d) % R, me, i],
            triton=copy_tiles.copy_tile, constexprs=tiles,
            bind=dict(j="c", src="x", src_row0=0, dst="gathered", dst_peers="gathered_peers", N="K",
                      to_rank=lambda d, i, c: (me + d) % R, dst_row0=me * C, rows=owned(me)))
    def send(t, d, i, c):                                # my tile (i, c) to rank me + d, myself first
        rows, cols = et.block(i, block_m, t(owned(t.rank))), et.block(c, block_n, t.K)
        t.peer((t.rank + d) % t.world).gathered[et.shift(rows, t.rank * t(C)), cols] = t.x[rows, cols]

    @g.task(grid=(R, m_tiles, n_tiles), wait=lambda s, i, j: arrived[me, (me + s) % R, i],
            triton=gemm_tiles.ag_matmul, constexprs=dict(tiles, BLOCK_K=block_k),
            bind=dict(s=lambda s, i, j: (me + s) % R))
    def matmul(t, s, i, j):                              # rows of source me + s, as they arrive
        src = (t.rank + s) % t.world
        rows = et.shift(et.block(i, block_m, t(owned(src))), src * t(C))
        cols = et.block(j, block_n, t.N)
        t.y[rows, cols] = t.gathered[rows] @ t.w[:, cols]

    g.sample(M=5, K=3, N=7)
    g.sample(M=37, K=4, N=33)
    return g


def reference(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> list[torch.Tensor]:
    x = torch.cat([x.double() for x in xs])
    return [x @ w.double() for w in ws]


def make_inputs(world: int, M: int, K: int, N: int, seed: int = 0, dtype=torch.float32) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    chunk = -(-M // world)
    x = torch.randn(M, K, generator=gen).to(dtype)
    return [{"x": x[r * chunk:(r + 1) * chunk].clone(), "w": torch.randn(K, N, generator=gen).to(dtype)}
            for r in range(world)]
