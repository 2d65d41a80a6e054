"""All-gather + GEMM.

Rank r holds its rows x_r [rows_r, K] of x [M, K] (rows_r = the r-th chunk of cdiv(M, R), ragged
at the end) and w_r [K, N] (its column shard). Every rank computes x @ w_r [M, N]. Each rank
sends its row tiles to every rank (itself first); a GEMM tile starts as soon as its rows arrive,
own rows first, so the gather overlaps the compute.
"""
from __future__ import annotations

from typing import Optional

import torch

import etdist.fusion as et   # the graph builder (what `import etdist as et` offers), not the package root
from etdist.kernels import gemm_tiles

from .gather import gather_rows, source_order
from .params import positive_int


def all_gather_gemm(block_m: int = 16, block_n: int = 16, dtype: torch.dtype = torch.float32,
                    block_k: int = 64, align: int = 1, group_m: int = 8, own_from_x: bool = False,
                    row_pointers: bool = False, interleave: bool = False) -> et.Graph:
    """own_from_x: this rank's own row tiles read x itself, without a wait, and the gather copies
    rows to the peers only (otherwise they wait for the copy of x into `gathered`). row_pointers:
    the GEMM tiles load their rows through masked pointers, the weights through descriptors
    (gemm_tiles.use_tma). interleave: the sources' tiles side by side (gather.source_order)."""
    g = et.Graph("ag_gemm")
    M = g.size("M")
    K, N = g.size("K", multiple_of=align), g.size("N", multiple_of=align)   # N: this rank's columns
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n)
    R, me = g.world, g.rank
    C, owned = et.row_chunks(M, R)       # rows per owner, ragged at the end
    m_tiles, n_tiles = et.cdiv(C, block_m), et.cdiv(N, block_n)

    x = g.input("x", (owned(me), K), dtype)
    g.input("w", (K, N), dtype)
    g.output("y", (M, N), dtype)
    # with own_from_x my own rows' elements count 0: their tiles wait for nothing
    _, arrived = gather_rows(g, x, C, owned, block_m, block_n, "gathered", peers_only=own_from_x)

    tile = lambda q: et.grouped(q, m_tiles, n_tiles, group_m)  # noqa: E731  (L2 reuse of w)
    grid, sq = source_order(R, m_tiles * n_tiles, interleave)   # index (u, v) -> (s, q)

    @g.task(grid=grid, wait=lambda u, v: arrived[me, (me + sq(u, v)[0]) % R, tile(sq(u, v)[1])[0]],
            triton=gemm_tiles.ag_matmul,
            constexprs=dict(tiles, BLOCK_K=block_k, TMA=gemm_tiles.use_tma(align, row_pointers),
                            OWN_FROM_X=bool(own_from_x)),
            bind=dict(s=lambda u, v: (me + sq(u, v)[0]) % R, i=lambda u, v: tile(sq(u, v)[1])[0],
                      j=lambda u, v: tile(sq(u, v)[1])[1]))
    def matmul(t, u, v):                                 # rows of source me + s (mine first, or side by side)
        s, q = sq(u, v)
        i, j = t(tile(q)[0]), t(tile(q)[1])
        src = (t.rank + s) % t.world
        rows = et.block(i, block_m, t(owned(src)))
        cols = et.block(j, block_n, t.N)
        a = t.x[rows] if own_from_x and s == 0 else t.gathered[et.shift(rows, src * t(C))]
        t.y[et.shift(rows, src * t(C)), cols] = a @ t.w[:, cols]

    g.sample(M=5, K=3, N=7)
    g.sample(M=37, K=4, N=33)
    return g


def all_gather_gemm_whole(block_m: int = 64, block_n: int = 64, dtype: torch.dtype = torch.float32,
                          block_k: int = 128, align: int = 1, group_m: int = 8,
                          gemm_n: Optional[int] = None, swap_ab: bool = False,
                          row_pointers: bool = False, tail_m: int = 0, ragged_tiles: int = 0,
                          ragged_splits: int = 1, tail_row_tma: bool = False) -> et.Graph:
    """The small-M variant: the (small) gather completes first, then GEMM tiles run over all M
    rows at once, so the weights are read once (the graph above reads them once per source).
    gemm_n: the GEMM tiles' width (default block_n, which the gather's copy tiles keep): narrower
    where the tiles would be fewer than the SMs. swap_ab: the GEMM tiles computed transposed (the
    weights on the MMA's M side: gemm_tiles.mm_acc_tma), for tiles of fewer than 64 rows.
    row_pointers: as in all_gather_gemm. tail_m: up to block_m + tail_m rows, each GEMM task takes
    every row, block_m of them in one accumulator and the tail_m after them in a second, over one
    load of each weight tile (gemm_tiles.matmul_rows_and_tail; aligned sizes only): just past a
    tile of rows, the weights are read once without padding the MMAs to two whole tiles.
    tail_row_tma: the tail tasks' first block_m rows load through a descriptor (rows_and_tail_acc).
    ragged_tiles, ragged_splits: the last ragged_tiles GEMM tiles of the order (the ragged last
    wave the op's plan counts) each run in ragged_splits contraction slices, fp32 boxes that one
    task per tile sums into y, so the last wave's tiles keep every SM busy for a fraction of a tile
    instead of a few SMs for a whole one (not with tail_m)."""
    positive_int("all_gather_gemm_whole", "gemm_n", gemm_n, optional=True)
    positive_int("all_gather_gemm_whole", "ragged_splits", ragged_splits)
    if isinstance(ragged_tiles, bool) or not isinstance(ragged_tiles, int) or ragged_tiles < 0 or \
            (ragged_tiles and (ragged_splits < 2 or tail_m)):
        raise et.GraphError(f"all_gather_gemm_whole: ragged_tiles must be an int >= 0, and with tiles ragged_splits "
                            f">= 2 and no tail_m; got ragged_tiles={ragged_tiles!r}, ragged_splits={ragged_splits!r}, "
                            f"tail_m={tail_m!r}")
    if tail_m and (tail_m & (tail_m - 1) or tail_m < 16 or align % 16):
        raise et.GraphError(f"all_gather_gemm_whole: tail_m must be 0 or a power of two >= 16, with align 16 "
                            f"(the weights load through a descriptor), got tail_m={tail_m!r}, align={align}")
    gemm_n = block_n if gemm_n is None else gemm_n
    g = et.Graph("ag_gemm_whole")
    M = g.size("M")
    K, N = g.size("K", multiple_of=align), g.size("N", multiple_of=align)
    R, me = g.world, g.rank
    C, owned = et.row_chunks(M, R)
    m_tiles, n_tiles = et.cdiv(M, block_m), et.cdiv(N, gemm_n)
    x = g.input("x", (owned(me), K), dtype)
    g.input("w", (K, N), dtype)
    g.output("y", (M, N), dtype)
    _, all_in = gather_rows(g, x, C, owned, block_m, block_n, "gathered", whole=True)
    tile = lambda q: et.grouped(q, m_tiles, n_tiles, group_m)  # noqa: E731
    if tail_m:
        g.check(M <= block_m + tail_m, f"this variant holds at most block_m + tail_m = {block_m + tail_m} rows")

        @g.task(grid=(n_tiles,), wait=lambda j: all_in[me], triton=gemm_tiles.matmul_rows_and_tail,
                constexprs=dict(BLOCK_M=block_m, TAIL_M=tail_m, BLOCK_N=gemm_n, BLOCK_K=block_k,
                                ROW_TMA=bool(tail_row_tma)), bind=dict(a="gathered"))
        def matmul_with_tail(t, j):
            cols = et.block(j, gemm_n, t.N)
            t.y[:, cols] = t.gathered[:t.M] @ t.w[:, cols]

        g.sample(M=5, K=16, N=32)
        g.sample(M=block_m + tail_m, K=16, N=gemm_n + 16)
        return g

    gemm = dict(BLOCK_M=block_m, BLOCK_N=gemm_n, BLOCK_K=block_k, TMA=gemm_tiles.use_tma(align, row_pointers),
                SWAP_AB=bool(swap_ab))
    T, S = ragged_tiles, ragged_splits
    Q = m_tiles * n_tiles                # GEMM tiles, the last T of them in S slices

    def box(t, ij):                      # the rows and columns of tile ij = (i, j)
        return et.block(t(ij[0]), block_m, t.M), et.block(t(ij[1]), gemm_n, t.N)

    @g.task(grid=(Q - T,), wait=lambda q: all_in[me], triton=gemm_tiles.matmul_all_rows, constexprs=gemm,
            bind=dict(i=lambda q: tile(q)[0], j=lambda q: tile(q)[1], a="gathered"))
    def matmul(t, q):
        rows, cols = box(t, tile(q))
        t.y[rows, cols] = t.gathered[rows] @ t.w[:, cols]

    if T:
        g.check(Q >= T, f"this variant slices the last {T} GEMM tiles: it needs at least that many")
        g.scratch("slices", (T * S, block_m, gemm_n), torch.float32)   # [tile k, slice s]: fp32 boxes
        sliced = g.event("sliced", (T,), count=S)
        last = lambda k: tile(Q - T + k)   # noqa: E731

        @g.task(grid=(T, S), wait=lambda k, s: all_in[me], notify=lambda k, s: sliced[k],
                triton=gemm_tiles.matmul_all_rows_slice, constexprs=dict(gemm, SPLITS=S),
                bind=dict(i=lambda k, s: last(k)[0], j=lambda k, s: last(k)[1], a="gathered"))
        def matmul_slice(t, k, s):                           # slice s of the k-th of the last T tiles
            rows, cols = box(t, last(k))
            ks = et.block(s, t(et.cdiv(K, S * block_k) * block_k), t.K)   # whole steps, as the GPU body
            part = t.gathered[rows, ks].float() @ t.w[ks, cols].float()
            t.slices[k * S + s] = 0.0
            t.slices[k * S + s, :rows.stop - rows.start, :cols.stop - cols.start] = part

        @g.task(grid=(T,), wait=lambda k: sliced[k], triton=gemm_tiles.sum_slices_tile,
                constexprs=dict(BLOCK_M=block_m, BLOCK_N=gemm_n, SPLITS=S),
                bind=dict(i=lambda k: last(k)[0], j=lambda k: last(k)[1]))
        def sum_slices(t, k):
            rows, cols = box(t, last(k))
            t.y[rows, cols] = t.slices[k * S:(k + 1) * S, :rows.stop - rows.start, :cols.stop - cols.start].sum(0)

    g.sample(M=5, K=3, N=7 + 3 * gemm_n * T)
    g.sample(M=37, K=4, N=33 + gemm_n * T)
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
