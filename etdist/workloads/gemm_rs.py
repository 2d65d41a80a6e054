"""Tensor-parallel GEMM + reduce-scatter.

Rank r holds x_r [M, K] (its shard of the contraction) and w_r [K, N]. The result sum_r x_r @ w_r
is scattered by rows: rank r owns rows [r*C, min((r+1)*C, M)), C = cdiv(M, R), so with a ragged M
the last ranks own fewer rows (or none).
"""
from __future__ import annotations

import torch

import etdist.fusion as et   # the graph builder (what `import etdist as et` offers), not the package root
from etdist.kernels import gemm_tiles

from .gather import owner_order
from .params import positive_int


def gemm_reduce_scatter(block_m: int = 16, block_n: int = 16, dtype: torch.dtype = torch.float32,
                        block_k: int = 64, align: int = 1, group_m: int = 8, splits: int = 1,
                        wave: int = 0, row_pointers: bool = False, interleave: bool = False) -> et.Graph:
    """The graph; tile sizes are compile-time constants (the GPU bodies need block_m >= 16).
    align: K and N are promised multiples of it (16 lets the GPU kernel vectorise). group_m: the
    matmul tiles run in groups of that many row tiles per weight column (et.grouped). splits: a
    tile's contraction in that many slices (split-K: more, shorter tasks where whole tiles would
    leave SMs idle), each slice its own partial on the owner, who sums them all.
    wave: tasks per wave (the programs that run the kernel; the op passes the SM count). Given, only
    the tiles past the last whole wave are split: the tiles that fill whole waves run whole (no
    extra partials to store and sum), and the ragged last wave's tiles run in `splits` slices.
    Without it (0), every tile is split.
    row_pointers: the matmul tiles load x's rows through masked pointers, the weights through
    descriptors (gemm_tiles.use_tma).
    interleave: the owners' tiles q side by side (u = q * R + owner, as gather.source_order), so
    that they read each weight tile once from HBM where each owner's rows are one row tile (owner by
    owner, every owner's tiles read all the weights again)."""
    positive_int("gemm_reduce_scatter", "splits", splits)
    if isinstance(wave, bool) or not isinstance(wave, int) or wave < 0:
        raise et.GraphError(f"gemm_reduce_scatter: wave must be a non-negative int, got {wave!r}")
    g = et.Graph("gemm_rs")
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n)
    M, K, N = g.size("M"), g.size("K", multiple_of=align), g.size("N", multiple_of=align)
    R, me = g.world, g.rank
    C, owned = et.row_chunks(M, R)       # rows per owner, ragged at the end
    m_tiles, n_tiles = et.cdiv(C, block_m), et.cdiv(N, block_n)
    mn = m_tiles * n_tiles
    count = R * mn                       # tile u = k * mn + q (interleaved: q * R + k): my partial of owner k's tile q
    head = count // wave * wave if wave else 0   # the tiles of whole waves, run whole

    def parts(u):                        # contraction slices of tile u
        return et.where(u < head, 1, splits) if wave else splits

    kq_of, u_of = owner_order(R, mn, interleave)   # tile u <-> (my k-th owner, its tile q)

    def at(u):                           # tile u as (dst, row tile, column tile)
        k, q = kq_of(u)
        return (k, *et.grouped(q, m_tiles, n_tiles, group_m))

    g.input("x", (M, K), dtype)
    g.input("w", (K, N), dtype)
    g.scratch("partial", (R * splits, C, N), dtype, symmetric=True)   # on the owner: partial[src, slice]
    g.output("y", (owned(me), N), dtype)
    q_of = lambda i, j: et.ungrouped(i, j, m_tiles, n_tiles, group_m)  # noqa: E731
    # tile q of owner d is u_of(d, q) on every source
    own_parts = lambda i, j: parts(u_of(me, q_of(i, j)))  # noqa: E731
    arrivals = lambda d, i, j: R * parts(u_of(d, q_of(i, j)))  # noqa: E731
    arrived = g.event("arrived", (R, m_tiles, n_tiles), count=arrivals, distributed=True)  # per source and slice

    def partial_slice(t, u, s, n):       # slice s of n of my partial of tile u, into its owner's partial
        dst, i, j = (t(e) for e in at(u))
        rows, cols = et.block(i, block_m, t(owned(dst))), et.block(j, block_n, t.N)
        ks = et.block(s, t(et.cdiv(K, n * block_k) * block_k), t.K)   # whole steps, as the GPU body
        t.peer(dst).partial[t.rank * splits + s, rows, cols] = t.x[et.shift(rows, dst * t(C)), ks] @ t.w[ks, cols]

    def matmul_body(n, tile_of, **bind):  # the GPU body of tiles tile_of(*index), cut in n slices
        coords = {name: (lambda *k, d=d: at(tile_of(*k))[d]) for d, name in enumerate(("dst", "i", "j"))}
        return dict(notify=lambda *k: arrived[at(tile_of(*k))], triton=gemm_tiles.gemm_rs_matmul_slice,
                    constexprs=dict(tiles, BLOCK_K=block_k, TMA=gemm_tiles.use_tma(align, row_pointers), SPLITS=splits,
                                    PARTS=n),
                    bind=dict(coords, **bind))

    if wave:   # the head's tiles whole, wave after wave
        @g.task(grid=(head,), **matmul_body(1, lambda u: u, s=0))
        def matmul_whole(t, u):
            partial_slice(t, u, 0, 1)

    # the other tiles in slices; a tile's slices run side by side (the last index walks fastest)
    @g.task(grid=(count - head, splits), **matmul_body(splits, lambda k, s: head + k))
    def matmul(t, k, s):                 # slice s of tile head + k
        partial_slice(t, head + k, s, splits)

    reduce_partials(g, lambda i, j: arrived[me, i, j], owned, m_tiles, n_tiles, block_m, block_n, splits,
                    own_parts)

    g.sample(M=5, K=3, N=7)
    g.sample(M=37, K=4, N=33)
    return g


def reduce_partials(g, wait, owned, m_tiles, n_tiles, block_m, block_n, splits=1, parts=None, split_src=-1,
                    cols="N"):
    """The owner's y tile (i, j) = the sum of the partials every rank stored for it, after `wait(i, j)`
    (gemm_tiles.gemm_rs_reduce): parts(i, j) contraction slices from rank split_src (from every rank
    when it is -1), one from the others. cols: the size that counts y's columns."""
    me = g.rank
    parts = parts or (lambda i, j: 1)

    @g.task(grid=(m_tiles, n_tiles), wait=wait, triton=gemm_tiles.gemm_rs_reduce,
            constexprs=dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=splits),
            bind=dict(N=cols, parts=parts, split_src=split_src))
    def reduce(t, i, j):                                 # y = sum over sources and slices
        rows, cs = et.block(i, block_m, t(owned(me))), et.block(j, block_n, getattr(t, cols))
        src_of, n = t(split_src), t(parts(i, j))
        slots = [src * splits + s for src in range(t.world) for s in range(n if src_of < 0 or src == src_of else 1)]
        t.y[rows, cs] = t.partial[slots, rows, cs].sum(0)


def reference(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """float64 sum over ranks, split by rows like the graph."""
    total = sum(x.double() @ w.double() for x, w in zip(xs, ws))
    chunk = -(-total.shape[0] // len(xs))
    return [total[r * chunk:(r + 1) * chunk] for r in range(len(xs))]


def make_inputs(world: int, M: int, K: int, N: int, seed: int = 0, dtype=torch.float32) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(M, K, generator=gen).to(dtype), "w": torch.randn(K, N, generator=gen).to(dtype)}
            for _ in range(world)]


def gemm_reduce_scatter_skinny(block_m: int = 64, block_n: int = 64, dtype: torch.dtype = torch.float32,
                               block_k: int = 128, splits: int = 4, align: int = 1,
                               swap_ab: bool = False, reduce_n: int | None = None,
                               local_sums: bool = False, tail_m: int = 0, x_partials: bool = False,
                               tail_row_tma: bool = False) -> et.Graph:
    """The decode-sized variant (M <= block_m): one tile holds every row, so each rank reads its
    weights once (the graph above reads them once per destination rank). The contraction is
    split in `splits` slices to give every SM work; fp32 partials, summed by the owner.
    swap_ab: the GPU tile multiplies transposed (weights on the MMA's M side; aligned sizes only,
    where the operands load through TMA: gemm_tiles.gemm_rs_skinny_matmul).
    reduce_n: the owner sums column tiles of that width (default block_n; a divisor of it): a
    reduce task reads R x splits fp32 partials of every row, so narrower ones end sooner after the
    matmuls (ops.gemm_rs.skinny_reduce_n; records gemm_rs_w1_ab.jsonl).
    local_sums: the slices stay on their GPU and a combine task per owner and column tile sums
    them before one partial goes to the owner: R partials per tile cross the links instead of
    R x splits (at 128 rows, 4 slices of qwen3_8b put 4 MB on the links per rank).
    tail_m (with local_sums, align 16): up to block_m + tail_m rows, each matmul task's first
    block_m rows in one accumulator and the tail_m after them, transposed, in another, over one
    load of each weight tile (gemm_tiles.gemm_rs_skinny_matmul_local_tail); each owner's rows must
    still fit one block_m tile (the combine and reduce tiles): two ranks or more. tail_row_tma: the
    first block_m rows load through a descriptor (rows_and_tail_acc).
    x_partials: the partials that cross the links are in x's dtype (half the bytes of fp32 for
    bf16/fp16, as the large graph's are), still summed in fp32 by the owner."""
    if tail_m and (tail_m & (tail_m - 1) or tail_m < 16 or align % 16 or not local_sums):
        raise et.GraphError(f"gemm_reduce_scatter_skinny: tail_m must be 0 or a power of two >= 16, with align 16 "
                            f"and local_sums, got tail_m={tail_m!r}, align={align}, local_sums={local_sums}")
    reduce_n = reduce_n or block_n
    if isinstance(reduce_n, bool) or not isinstance(reduce_n, int) or reduce_n < 1 or block_n % reduce_n:
        raise et.GraphError(f"gemm_reduce_scatter_skinny: reduce_n must divide block_n={block_n}, got {reduce_n!r}")
    sub = block_n // reduce_n            # reduce tasks per matmul column tile
    g = et.Graph("gemm_rs_skinny")
    M, K, N = g.size("M"), g.size("K", multiple_of=align), g.size("N", multiple_of=align)
    R, me = g.world, g.rank
    g.check(M <= block_m + tail_m, f"this variant holds every row in one tile: M must be <= {block_m + tail_m}")
    C, owned = et.row_chunks(M, R)       # rows per owner, ragged at the end
    if tail_m:
        g.check(C <= block_m, f"an owner's rows must fit one {block_m}-row tile (the tail needs two ranks or more)")
    KB = et.cdiv(et.cdiv(K, splits), block_k) * block_k   # contraction per slice
    n_tiles = et.cdiv(N, block_n)
    consts = dict(SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n)
    mm = dict(consts, BLOCK_K=block_k, TMA=gemm_tiles.use_tma(align), SWAP_AB=swap_ab)
    per_owner = 1 if local_sums else splits   # partials from each source, on the owner

    g.input("x", (M, K), dtype)
    g.input("w", (K, N), dtype)
    g.scratch("partial", (R * per_owner, C, N), dtype if x_partials else torch.float32, symmetric=True)  # [src, slice]
    g.output("y", (owned(me), N), dtype)
    if not local_sums:
        arrived = g.event("arrived", (R, n_tiles), count=R * splits, distributed=True)
        ready = lambda j: arrived[me, j // sub]   # noqa: E731  (the reduce's columns j: part of tile j // sub)

        @g.task(grid=(splits, n_tiles), notify=lambda s, j: arrived[et.every(0, R), j],
                triton=gemm_tiles.gemm_rs_skinny_matmul, constexprs=mm)
        def matmul(t, s, j):                                 # every owner's rows of slice s, tile j
            cols, ks = et.block(j, block_n, t.N), et.block(s, t(KB), t.K)
            part = t.x[:, ks].float() @ t.w[ks, cols].float()
            for d in range(t.world):
                rows = et.block(d, t(C), t.M)
                t.peer(d).partial[t.rank * splits + s, :rows.stop - rows.start, cols] = part[rows]
    else:
        g.scratch("slices", (splits, M, N), torch.float32)   # this rank's slices, every row
        sliced = g.event("sliced", (n_tiles,), count=splits)
        arrived = g.event("arrived", (R, n_tiles * sub), count=R, distributed=True)
        ready = lambda j: arrived[me, j]   # noqa: E731

        body = dict(triton=gemm_tiles.gemm_rs_skinny_matmul_local, constexprs=mm)
        if tail_m:   # a row tile and a tail over one load of each weight tile
            body = dict(triton=gemm_tiles.gemm_rs_skinny_matmul_local_tail,
                        constexprs=dict(consts, BLOCK_K=block_k, TAIL_M=tail_m, ROW_TMA=bool(tail_row_tma)))

        @g.task(grid=(splits, n_tiles), notify=lambda s, j: sliced[j], **body)
        def matmul(t, s, j):                                 # slice s of tile j, every row, kept here
            cols, ks = et.block(j, block_n, t.N), et.block(s, t(KB), t.K)
            t.slices[s, :, cols] = t.x[:, ks].float() @ t.w[ks, cols].float()

        @g.task(grid=(R, n_tiles * sub), wait=lambda d, j: sliced[j // sub], notify=lambda d, j: arrived[d, j],
                triton=gemm_tiles.gemm_rs_skinny_combine, constexprs=dict(consts, BLOCK_N=reduce_n))
        def combine(t, d, j):                                # owner d's rows of columns j, summed over slices
            cols, rows = et.block(j, reduce_n, t.N), et.block(d, t(C), t.M)
            t.peer(d).partial[t.rank, :rows.stop - rows.start, cols] = t.slices[:, rows, cols].sum(0)

    @g.task(grid=(n_tiles * sub,), wait=ready,
            triton=gemm_tiles.gemm_rs_skinny_reduce, constexprs=dict(consts, SPLITS=per_owner, BLOCK_N=reduce_n))
    def reduce(t, j):                                    # columns j of reduce_n: part of tile j // sub
        cols, rows = et.block(j, reduce_n, t.N), t(owned(me))
        t.y[:, cols] = t.partial[:, :rows, cols].float().sum(0).to(t.y.dtype)

    g.sample(M=5, K=3, N=7)
    g.sample(M=block_m + tail_m, K=block_k + 1, N=block_n + 3)
    return g
