"""The tensor-parallel SwiGLU MLP as one graph: sequence-parallel (tp_mlp, and tp_mlp_whole for
small M), or with replicated input and output (tp_mlp_replicated, whose docstring says how).

Rank r holds its rows x_r [rows_r, H] of x [M, H] (chunks of C = cdiv(M, R), ragged at the end),
its columns of the gate and up projections w_gate_up_r = [w_gate_r | w_up_r] [H, 2 I_r], and its
rows of the down projection w_down_r [I_r, H]. Every rank returns its rows of

    y = sum_r (silu(x @ w_gate_r) * (x @ w_up_r)) @ w_down_r          [rows_r, H]

Sequence-parallel, tile by tile: the all-gather of x releases the gate/up tiles of the rows that arrived (own rows
first); a finished row tile of h releases the down-projection tiles of those rows, which store
their partial straight into the owner's buffer; the owner sums the partials.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import etdist.fusion as et   # the graph builder (what `import etdist as et` offers), not the package root
from etdist.kernels import gemm_tiles

from .gather import gather_rows, owner_order, source_order
from .gemm_rs import reduce_partials
from .params import positive_int


def tp_mlp(block_m: int = 16, block_n: int = 16, dtype: torch.dtype = torch.float32, block_k: int = 64,
           align: int = 1, group_m: int = 8, down_n: int | None = None, tail_splits: int = 1,
           own_from_x: bool = False, row_pointers: bool = False, padded: bool = False,
           interleave: bool = False) -> et.Graph:
    """The graph; gate/up tiles are block_m x block_n of both projections (two accumulators), down
    tiles block_m x down_n (default block_n): one accumulator, so it can be twice as wide.
    tail_splits > 1: the last TAIL down tiles of each rank's order (a size bound at every call, at
    most one owner's tiles, or all R of them) run in that many contraction slices, so that the long
    down tiles do not leave a ragged last wave, or, all in slices, SMs idle where they are fewer than
    the SMs (the op plans TAIL from the tasks each program is dealt).
    own_from_x: this rank's own gate/up tiles read x itself, first and without a wait, and the
    gather copies rows to the peers only. row_pointers: the GEMM tiles load their rows (x, h)
    through masked pointers, the weights through descriptors (gemm_tiles.use_tma). padded: the
    gathered rows are padded to whole row tiles (block_m rows more) and the gate/up tiles read them
    through descriptors over whole tiles (x, with own_from_x, through one over its rows).
    interleave: the sources' gate/up tiles side by side (gather.source_order), and the owners' down
    tiles likewise (then TAIL is 0 or every down tile)."""
    positive_int("tp_mlp", "tail_splits", tail_splits)
    g = et.Graph("mlp")
    M = g.size("M")
    H, I = g.size("H", multiple_of=align), g.size("I", multiple_of=align)   # I: this rank's share
    R, me = g.world, g.rank
    C, owned = et.row_chunks(M, R)       # rows per owner, ragged at the end
    DN = down_n or block_n
    m_tiles, i_tiles, h_tiles = et.cdiv(C, block_m), et.cdiv(I, block_n), et.cdiv(H, DN)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n)
    gemm = dict(tiles, BLOCK_K=block_k, TMA=gemm_tiles.use_tma(align, row_pointers))   # the GEMM bodies' constexprs
    up_tma = gemm_tiles.use_tma(align, row_pointers, padded)   # the gate/up tiles'

    x = g.input("x", (owned(me), H), dtype)
    g.input("w_gate_up", (H, 2 * I), dtype)
    g.input("w_down", (I, H), dtype)
    g.scratch("h", (R * C, I), dtype)                       # SwiGLU activations, all rows
    S = tail_splits
    mn = m_tiles * h_tiles               # down tiles per owner, mine in owner_order: v = d * mn + q or q * R + d
    TAIL = g.size("TAIL") if S > 1 else 0   # the last TAIL of them in S slices: all of owner me + R - 1
    every = et.eq(TAIL, R * mn) if S > 1 else False   # or all of them: every source's tiles in slices
    if S > 1:
        g.check(et.logical_or(TAIL <= mn, every),
                "TAIL (down tiles in slices) must be at most one owner's down tiles, or all of them")
        if interleave:   # the last tiles of the order are no longer one owner's
            g.check(et.logical_or(et.eq(TAIL, 0), every),
                    "TAIL (down tiles in slices) must be 0 or every down tile with interleaved owners")
    g.scratch("partial", (R * S, C, H), dtype, symmetric=True)  # on the owner: partial[src, slice]
    g.output("y", (owned(me), H), dtype)
    h_ready = g.event("h_ready", (R, m_tiles), count=i_tiles)             # [source chunk, row tile]
    # an owner's tile q arrives from every source, in S slices from the one whose order ends on it
    # (from every source when all are sliced: -1)
    split_src = et.where(every, -1, (me + 1) % R) if S > 1 else (me + 1) % R

    def parts(q):                        # slices from split_src of its owner's tile q
        return et.where(q >= mn - TAIL, S, 1) if S > 1 else 1

    tile_parts = lambda i, j: parts(et.ungrouped(i, j, m_tiles, h_tiles, group_m))  # noqa: E731
    arrived = g.event("arrived", (R, m_tiles, h_tiles), distributed=True,
                      count=(lambda d, i, j: et.where(every, R * S, R - 1 + tile_parts(i, j))) if S > 1 else R)

    # with own_from_x my own rows' elements count 0: their tiles wait for nothing
    _, rows_in = gather_rows(g, x, C, owned, block_m, block_n, "ag_out", peers_only=own_from_x,
                             pad_rows=block_m if padded else 0)

    up_tile = lambda q: et.grouped(q, m_tiles, i_tiles, group_m)    # noqa: E731  (L2 reuse of weights)
    down_tile = lambda q: et.grouped(q, m_tiles, h_tiles, group_m)  # noqa: E731

    grid, sq = source_order(R, m_tiles * i_tiles, interleave)   # index (u, v) -> (s, q)

    @g.task(grid=grid, wait=lambda u, v: rows_in[me, (me + sq(u, v)[0]) % R, up_tile(sq(u, v)[1])[0]],
            notify=lambda u, v: h_ready[(me + sq(u, v)[0]) % R, up_tile(sq(u, v)[1])[0]],
            triton=gemm_tiles.swiglu_tile, constexprs=dict(gemm, TMA=up_tma, OWN_FROM_X=bool(own_from_x)),
            bind=dict(s=lambda u, v: (me + sq(u, v)[0]) % R, i=lambda u, v: up_tile(sq(u, v)[1])[0],
                      j=lambda u, v: up_tile(sq(u, v)[1])[1]))
    def gate_up(t, u, v):                                   # rows of source me + s (mine first, or side by side)
        s, q = sq(u, v)
        i, j = t(up_tile(q)[0]), t(up_tile(q)[1])
        src = (t.rank + s) % t.world
        rows = et.block(i, block_m, t(owned(src)))
        cols = et.block(j, block_n, t.I)
        a = t.x[rows] if own_from_x and s == 0 else t.ag_out[et.shift(rows, src * t(C))]
        t.h[et.shift(rows, src * t(C)), cols] = _swiglu(t, a, cols)

    owner_tile, _ = owner_order(R, mn, interleave)   # down tile v of my order -> (d, q): rank me + d's tile q

    def down_slice(t, v, s, n):          # slice s of n of my partial of rank me + d's tile q
        d, q = t(owner_tile(v)[0]), t(owner_tile(v)[1])
        i, j = t(down_tile(q)[0]), t(down_tile(q)[1])
        dst = (t.rank + d) % t.world
        rows, cols = et.block(i, block_m, t(owned(dst))), et.block(j, DN, t.H)
        ks = et.block(s, t(et.cdiv(I, n * block_k) * block_k), t.I)   # whole steps, as the GPU body
        t.peer(dst).partial[t.rank * S + s, rows, cols] = t.h[et.shift(rows, dst * t(C)), ks] @ t.w_down[ks, cols]

    def down_body(n, v_of, **bind):      # the GPU body of down tiles v_of(*index), in n slices
        dq = lambda *k: owner_tile(v_of(*k))   # noqa: E731
        return dict(wait=lambda *k: h_ready[(me + dq(*k)[0]) % R, down_tile(dq(*k)[1])[0]],
                    notify=lambda *k: arrived[((me + dq(*k)[0]) % R, *down_tile(dq(*k)[1]))],
                    triton=gemm_tiles.gemm_rs_matmul_slice, constexprs=dict(gemm, BLOCK_N=DN, SPLITS=S, PARTS=n),
                    bind=dict(bind, dst=lambda *k: (me + dq(*k)[0]) % R, i=lambda *k: down_tile(dq(*k)[1])[0],
                              j=lambda *k: down_tile(dq(*k)[1])[1], x="h", w="w_down", K="I", N="H"))

    @g.task(grid=(R * mn - TAIL,), **down_body(1, lambda v: v, s=0))
    def down(t, v):                                         # my partial of a tile, whole
        down_slice(t, v, 0, 1)

    if S > 1:
        @g.task(grid=(TAIL, S), **down_body(S, lambda k, s: R * mn - TAIL + k))
        def down_tail(t, k, s):                             # slice s of one of the last TAIL tiles
            down_slice(t, t(R * mn - TAIL) + k, s, S)

    reduce_partials(g, lambda i, j: arrived[me, i, j], owned, m_tiles, h_tiles, block_m, DN, S, tile_parts, split_src,
                    cols="H")

    tail = [{"TAIL": 1}, {"TAIL": 0}] if S > 1 else [{}]   # one tile in slices, or none
    for sizes in tail:
        g.sample(M=5, H=3, I=2, **sizes)
        g.sample(M=37, H=20, I=17, **sizes)
    for world in range(1, 5) if S > 1 else ():              # or every tile
        rows = -(-37 // world)
        g.sample(M=37, H=20, I=17, TAIL=world * -(-rows // block_m) * -(-20 // DN), WORLD=world)
    return g


def tp_mlp_whole(block_m: int = 64, block_n: int = 64, dtype: torch.dtype = torch.float32, block_k: int = 128,
                 align: int = 1, group_m: int = 8, down_splits: int = 1, up_n: Optional[int] = None,
                 swap_ab: bool = False, row_pointers: bool = False, tail_m: int = 0,
                 tail_row_tma: bool = False) -> et.Graph:
    """The small-M variant: the (small) gather completes first; gate/up and down tiles then run
    over all M rows at once, so each weight is read once (the graph above reads them once per
    source and per destination rank). Down tiles store each owner's rows into its partial.
    down_splits: each down tile's contraction (I) in that many slices, each its own partial on the
    owner, who sums them all: at decode sizes the down tiles are few (H / block_n: 32 on qwen3_8b's
    shape) and would leave most SMs idle. up_n: the gate/up tiles' width (default block_n, which the
    gather's copy tiles and the down tiles keep): narrower where they would be fewer than the SMs.
    swap_ab: the GEMM tiles computed transposed (the weights on the MMA's M side:
    gemm_tiles.mm_acc_tma), for tiles of fewer than 64 rows. row_pointers: as in tp_mlp.
    tail_m (align 16): up to block_m + tail_m rows, each gate/up and down task takes every row,
    block_m in one accumulator and the tail_m after them in another, over one load of each weight
    tile (as ag_gemm.all_gather_gemm_whole's tail_m); each down slice waits only for the gate/up
    tiles of its part of h (up_n must divide block_k). tail_row_tma: the first block_m rows of
    both load through descriptors (gemm_tiles.rows_and_tail_acc)."""
    positive_int("tp_mlp_whole", "down_splits", down_splits)
    positive_int("tp_mlp_whole", "up_n", up_n, optional=True)
    S, up_n = down_splits, block_n if up_n is None else up_n
    if tail_m and (tail_m & (tail_m - 1) or tail_m < 16 or align % 16 or block_k % up_n):
        raise et.GraphError(f"tp_mlp_whole: tail_m must be 0 or a power of two >= 16, with align 16 (the weights "
                            f"load through descriptors) and up_n dividing block_k, got tail_m={tail_m!r}, "
                            f"align={align}, up_n={up_n}, block_k={block_k}")
    g = et.Graph("mlp_whole")
    M = g.size("M")
    H, I = g.size("H", multiple_of=align), g.size("I", multiple_of=align)
    R, me = g.world, g.rank
    C, owned = et.row_chunks(M, R)
    m_all, own_tiles = et.cdiv(M, block_m), et.cdiv(C, block_m)   # row tiles of the GEMMs
    i_tiles, h_tiles = et.cdiv(I, up_n), et.cdiv(H, block_n)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n)
    gemm = dict(tiles, BLOCK_K=block_k, TMA=gemm_tiles.use_tma(align, row_pointers), SWAP_AB=bool(swap_ab))

    x = g.input("x", (owned(me), H), dtype)
    g.input("w_gate_up", (H, 2 * I), dtype)
    g.input("w_down", (I, H), dtype)
    g.scratch("h", (M, I), dtype)
    g.scratch("partial", (R * S, C, H), dtype, symmetric=True)     # on the owner: partial[src, slice]
    g.output("y", (owned(me), H), dtype)
    _, all_in = gather_rows(g, x, C, owned, block_m, block_n, "ag_out", whole=True)
    if tail_m:
        g.check(M <= block_m + tail_m, f"this variant holds at most block_m + tail_m = {block_m + tail_m} rows")
        arrived = _whole_tail_tasks(g, block_m, block_n, block_k, tail_m, up_n, S, C, owned, all_in,
                                    bool(tail_row_tma))
        reduce_partials(g, lambda i, j: arrived[me, j], owned, own_tiles, h_tiles, block_m, block_n, S,
                        lambda i, j: S, cols="H")
        g.sample(M=5, H=32, I=32)
        g.sample(M=block_m + tail_m, H=48, I=up_n + 16)
        return g
    h_ready = g.event("h_ready", (m_all,), count=i_tiles)
    arrived = g.event("arrived", (R, h_tiles), count=R * m_all * S, distributed=True)   # [owner, column tile]
    up_tile = lambda q: et.grouped(q, m_all, i_tiles, group_m)     # noqa: E731
    down_tile = lambda q: et.grouped(q, m_all, h_tiles, group_m)   # noqa: E731

    @g.task(grid=(m_all * i_tiles,), wait=lambda q: all_in[me], notify=lambda q: h_ready[up_tile(q)[0]],
            triton=gemm_tiles.swiglu_all_rows, constexprs=dict(gemm, BLOCK_N=up_n),
            bind=dict(i=lambda q: up_tile(q)[0], j=lambda q: up_tile(q)[1]))
    def gate_up(t, q):
        rows, cols = et.block(t(up_tile(q)[0]), block_m, t.M), et.block(t(up_tile(q)[1]), up_n, t.I)
        t.h[rows, cols] = _swiglu(t, t.ag_out[rows], cols)

    # a tile's slices run side by side (the last index walks fastest)
    @g.task(grid=(m_all * h_tiles, S), wait=lambda q, s: h_ready[down_tile(q)[0]],
            notify=lambda q, s: arrived[et.every(0, R), down_tile(q)[1]],
            triton=gemm_tiles.matmul_scatter_rows_slice, constexprs=dict(gemm, SPLITS=S),
            bind=dict(i=lambda q, s: down_tile(q)[0], j=lambda q, s: down_tile(q)[1], x="h", w="w_down", K="I",
                      N="H"))
    def down(t, q, s):                                     # slice s of every owner's rows of row tile i
        i, cols = t(down_tile(q)[0]), et.block(t(down_tile(q)[1]), block_n, t.H)
        ks = et.block(s, t(et.cdiv(I, S * block_k) * block_k), t.I)   # whole steps, as the GPU body
        part = t.h[et.block(i, block_m, t.M), ks] @ t.w_down[ks, cols]
        _to_owners(t, part, i * block_m, t.rank * S + s, cols, C, owned)

    reduce_partials(g, lambda i, j: arrived[me, j], owned, own_tiles, h_tiles, block_m, block_n, S,
                    lambda i, j: S, cols="H")

    g.sample(M=5, H=3, I=2)
    g.sample(M=37, H=20, I=17)
    return g


def _whole_tail_tasks(g, block_m, block_n, block_k, tail_m, up_n, S, C, owned, all_in, row_tma):
    """tp_mlp_whole's gate/up and down tasks with every row in one task (tail_m). Down slice s
    (its cdiv(cdiv(I, block_k), S) contraction steps) waits for the gate/up tiles of its columns
    of h alone (h_ready[s]), so the first slices start while the last gate/up tiles run."""
    R, me = g.world, g.rank
    H, I = g.size("H"), g.size("I")
    P = et.cdiv(et.cdiv(I, block_k), S) * block_k       # h columns per down slice (whole steps, as the body)
    h_ready = g.event("h_ready", (S,), count=lambda s: et.cdiv(et.maximum(et.minimum(I, (s + 1) * P) - s * P, 0), up_n))
    arrived = g.event("arrived", (R, et.cdiv(H, block_n)), count=R * S, distributed=True)   # [owner, column tile]

    @g.task(grid=(et.cdiv(I, up_n),), wait=lambda j: all_in[me], notify=lambda j: h_ready[j * up_n // P],
            triton=gemm_tiles.swiglu_rows_and_tail,
            constexprs=dict(BLOCK_M=block_m, TAIL_M=tail_m, BLOCK_N=up_n, BLOCK_K=block_k, ROW_TMA=row_tma))
    def gate_up_with_tail(t, j):
        cols = et.block(j, up_n, t.I)
        t.h[:t.M, cols] = _swiglu(t, t.ag_out[:t.M], cols)

    @g.task(grid=(et.cdiv(H, block_n), S), wait=lambda j, s: h_ready[s],
            notify=lambda j, s: arrived[et.every(0, R), j], triton=gemm_tiles.matmul_scatter_rows_and_tail_slice,
            constexprs=dict(BLOCK_M=block_m, TAIL_M=tail_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=S,
                            ROW_TMA=row_tma),
            bind=dict(x="h", w="w_down", K="I", N="H"))
    def down_with_tail(t, j, s):                           # slice s of every row, each owner's rows to it
        cols, ks = et.block(j, block_n, t.H), et.block(s, t(P), t.I)
        part = t.h[:t.M, ks] @ t.w_down[ks, cols]
        _to_owners(t, part, 0, t.rank * S + s, cols, C, owned)

    return arrived


def _to_owners(t, part, r0, slot, cols, C, owned):
    """The CPU bodies' store of `part` (rows r0, r0 + 1, ... of the M rows) into each owner's
    partial[slot]: owner d gets the rows [d C, d C + owned(d)) among them."""
    for d in range(t.world):
        lo, hi = max(r0, d * t(C)), min(r0 + part.shape[0], d * t(C) + t(owned(d)))
        if lo < hi:
            t.peer(d).partial[slot, lo - d * t(C):hi - d * t(C), cols] = part[lo - r0:hi - r0]


def tp_mlp_replicated(block_m: int = 64, block_n: int = 64, dtype: torch.dtype = torch.float32, block_k: int = 128,
                      align: int = 1, group_m: int = 8, down_splits: int = 1, up_n: Optional[int] = None,
                      swap_ab: bool = False, row_pointers: bool = False, owners: bool = False) -> et.Graph:
    """The MLP with replicated input and output (Megatron's tensor-parallel MLP, for models that are
    not sequence-parallel): every rank holds the whole x [M, H] and returns the whole y [M, H].
    Nothing is gathered: gate/up and down tiles run over all M rows (each weight read once), and
    each down tile pushes its partial into every rank's buffer (an all-reduce in one hop, as the
    tile finishes), where every rank sums the partials of that tile into its y. x must be the same
    on every rank (not checked: a rank's x that differs gives every rank a wrong y, not a hang).
    down_splits > 1: the last TAIL down tiles (a size bound at every call: all of them at decode
    sizes, where the down tiles are fewer than the SMs; the few past the last whole wave above) run
    in that many contraction slices side by side. up_n, swap_ab, row_pointers: as in tp_mlp_whole.
    owners: each down tile's partials go to one owner rank (column tile j: rank j % R), who sums
    them and sends the sum to every rank (y_all, copied into y): R x down_splits partial tiles
    cross the links per output tile instead of R x R x down_splits, for one more hop."""
    positive_int("tp_mlp_replicated", "down_splits", down_splits)
    positive_int("tp_mlp_replicated", "up_n", up_n, optional=True)
    S, up_n = down_splits, block_n if up_n is None else up_n
    g = et.Graph("mlp_replicated")
    M = g.size("M")
    H, I = g.size("H", multiple_of=align), g.size("I", multiple_of=align)
    R, me = g.world, g.rank
    m_tiles, i_tiles, h_tiles = et.cdiv(M, block_m), et.cdiv(I, up_n), et.cdiv(H, block_n)
    mh = m_tiles * h_tiles               # down tiles, walked q = 0 .. mh - 1; the last TAIL in S slices
    TAIL = g.size("TAIL") if S > 1 else 0
    if S > 1:
        g.check(TAIL <= mh, "TAIL (down tiles in slices) must be at most the down tiles, cdiv(M, block_m) x "
                            "cdiv(H, block_n)")
    gemm = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TMA=gemm_tiles.use_tma(align, row_pointers),
                SWAP_AB=bool(swap_ab))

    g.input("x", (M, H), dtype)
    g.input("w_gate_up", (H, 2 * I), dtype)
    g.input("w_down", (I, H), dtype)
    g.scratch("h", (M, I), dtype)
    g.scratch("partial", (R * S, M, H), dtype, symmetric=True)     # on every rank: partial[src, slice]
    g.output("y", (M, H), dtype)
    up_tile = lambda q: et.grouped(q, m_tiles, i_tiles, group_m)     # noqa: E731
    down_tile = lambda q: et.grouped(q, m_tiles, h_tiles, group_m)   # noqa: E731
    parts = (lambda q: et.where(q >= mh - TAIL, S, 1)) if S > 1 else (lambda q: 1)   # noqa: E731
    tile_parts = lambda i, j: parts(et.ungrouped(i, j, m_tiles, h_tiles, group_m))  # noqa: E731
    h_ready = g.event("h_ready", (m_tiles,), count=i_tiles)
    owner = lambda j: j % R if owners else me   # noqa: E731  (the rank that sums column tile j)
    arrived = g.event("arrived", (R, m_tiles, h_tiles), distributed=True,   # [rank, tile]: every source's slices
                      count=lambda r, i, j: et.where(et.eq(owner(j), r), R * tile_parts(i, j), 0) if owners
                      else R * tile_parts(i, j))

    @g.task(grid=(m_tiles * i_tiles,), notify=lambda q: h_ready[up_tile(q)[0]],
            triton=gemm_tiles.swiglu_all_rows, constexprs=dict(gemm, BLOCK_N=up_n),
            bind=dict(i=lambda q: up_tile(q)[0], j=lambda q: up_tile(q)[1], ag_out="x"))
    def gate_up(t, q):
        rows, cols = et.block(t(up_tile(q)[0]), block_m, t.M), et.block(t(up_tile(q)[1]), up_n, t.I)
        t.h[rows, cols] = _swiglu(t, t.x[rows], cols)

    def down_slice(t, q, s, n):          # slice s of n of tile q, to every rank
        rows = et.block(t(down_tile(q)[0]), block_m, t.M)
        cols = et.block(t(down_tile(q)[1]), block_n, t.H)
        ks = et.block(s, t(et.cdiv(I, n * block_k) * block_k), t.I)   # whole steps, as the GPU body
        part = t.h[rows, ks] @ t.w_down[ks, cols]
        for d in ([t(owner(down_tile(q)[1]))] if owners else range(t.world)):
            t.peer(d).partial[t.rank * S + s, rows, cols] = part

    def down_body(n, q_of, **bind):      # the GPU body of down tiles q_of(*index), in n slices
        to = (lambda *k: owner(down_tile(q_of(*k))[1])) if owners else (lambda *k: et.every(0, R))   # noqa: E731
        return dict(wait=lambda *k: h_ready[down_tile(q_of(*k))[0]],
                    notify=lambda *k: arrived[(to(*k), *down_tile(q_of(*k)))],
                    triton=gemm_tiles.matmul_owner_slice if owners else gemm_tiles.matmul_broadcast_slice,
                    constexprs=dict(gemm, SPLITS=S, PARTS=n),
                    bind=dict(bind, i=lambda *k: down_tile(q_of(*k))[0], j=lambda *k: down_tile(q_of(*k))[1],
                              x="h", w="w_down", K="I", N="H"))

    @g.task(grid=(mh - TAIL,), **down_body(1, lambda q: q, s=0))
    def down(t, q):
        down_slice(t, q, 0, 1)

    if S > 1:   # a tile's slices run side by side (the last index walks fastest)
        @g.task(grid=(TAIL, S), **down_body(S, lambda k, s: mh - TAIL + k))
        def down_tail(t, k, s):
            down_slice(t, t(mh - TAIL) + k, s, S)

    def tile_sum(t, i, j):                                 # over ranks and their slices
        rows, cols = et.block(i, block_m, t.M), et.block(j, block_n, t.H)
        n = t(tile_parts(i, j))
        return rows, cols, t.partial[[src * S + s for src in range(t.world) for s in range(n)], rows, cols].sum(0)

    if not owners:
        @g.task(grid=(m_tiles, h_tiles), wait=lambda i, j: arrived[me, i, j], triton=gemm_tiles.sum_partials,
                constexprs=dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=S), bind=dict(N="H", parts=tile_parts))
        def reduce(t, i, j):                               # y = the sum, on every rank
            rows, cols, total = tile_sum(t, i, j)
            t.y[rows, cols] = total
    else:
        g.scratch("y_all", (M, H), dtype, symmetric=True)   # the owners' sums, on every rank
        summed = g.event("summed", (R, m_tiles, h_tiles), count=1, distributed=True)

        @g.task(grid=(m_tiles, h_tiles), wait=lambda i, j: arrived[me, i, j], when=lambda i, j: et.eq(owner(j), me),
                notify=lambda i, j: summed[et.every(0, R), i, j], triton=gemm_tiles.sum_partials_to_all,
                constexprs=dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=S), bind=dict(N="H", parts=tile_parts))
        def reduce(t, i, j):                               # the owner's sum, to every rank
            rows, cols, total = tile_sum(t, i, j)
            for d in range(t.world):
                t.peer(d).y_all[rows, cols] = total

        @g.task(grid=(m_tiles, h_tiles), wait=lambda i, j: summed[me, i, j], triton=gemm_tiles.copy_rows_tile,
                constexprs=dict(BLOCK_M=block_m, BLOCK_N=block_n), bind=dict(src="y_all", dst="y", N="H"))
        def take(t, i, j):                                 # y = the owner's sum
            rows, cols = et.block(i, block_m, t.M), et.block(j, block_n, t.H)
            t.y[rows, cols] = t.y_all[rows, cols]

    for sizes in ([{"TAIL": 1}, {"TAIL": 0}] if S > 1 else [{}]):
        g.sample(M=5, H=3, I=2, **sizes)
        g.sample(M=37, H=20, I=17, **sizes)
    return g


def reference_replicated(x, w_gate_up, w_down):
    """float64: the whole y from the whole x and every rank's shards (all ranks return it)."""
    return reference([x], w_gate_up, w_down)[0]


def _swiglu(t, xs, cols):
    """silu(xs @ w_gate[:, cols]) * (xs @ w_up[:, cols]), with w_gate_up = [w_gate | w_up]."""
    I_ = t.I
    return F.silu(xs @ t.w_gate_up[:, cols]) * (xs @ t.w_gate_up[:, I_ + cols.start:I_ + cols.stop])


def reference(xs, w_gate_up, w_down):
    """float64: xs per rank (row chunks), w_gate_up/w_down per rank (shards). Each rank's rows of y."""
    x = torch.cat([t.double() for t in xs])
    y = 0
    for wg, wd in zip(w_gate_up, w_down):
        gate, up = x @ wg.double()[:, :wg.shape[1] // 2], x @ wg.double()[:, wg.shape[1] // 2:]
        y = y + (F.silu(gate) * up) @ wd.double()
    C = -(-x.shape[0] // len(xs))
    return [y[r * C:(r + 1) * C] for r in range(len(xs))]


def shard(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, world: int):
    """Dense [H, I], [H, I], [I, H] -> per rank ([H, 2 I/R] gate|up, [I/R, H])."""
    I = w_gate.shape[1]
    H = w_gate.shape[0]
    if w_up.shape != w_gate.shape or tuple(w_down.shape) != (I, H):
        raise ValueError(f"shard: w_gate {list(w_gate.shape)}, w_up {list(w_up.shape)}, w_down "
                         f"{list(w_down.shape)}: expected [H, I], [H, I], [I, H] with H={H}, I={I}")
    if I % world:
        raise ValueError(f"intermediate size {I} does not split over {world} ranks")
    n = I // world
    return ([torch.cat([w_gate[:, r * n:(r + 1) * n], w_up[:, r * n:(r + 1) * n]], 1).contiguous()
             for r in range(world)], [w_down[r * n:(r + 1) * n].contiguous() for r in range(world)])


def make_inputs(world: int, M: int, H: int, I: int, seed: int = 0, dtype=torch.float32, replicated: bool = False):
    """Per-rank inputs of a random MLP with intermediate size I (whole, split over the ranks);
    replicated: every rank holds the whole x (tp_mlp_replicated), else its rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=gen)
    wg, wu = torch.randn(H, I, generator=gen) / H ** 0.5, torch.randn(H, I, generator=gen) / H ** 0.5
    wd = torch.randn(I, H, generator=gen) / I ** 0.5
    gu, dn = shard(wg, wu, wd, world)
    C = -(-M // world)
    return [{"x": (x if replicated else x[r * C:(r + 1) * C]).to(dtype).contiguous(), "w_gate_up": gu[r].to(dtype),
             "w_down": dn[r].to(dtype)} for r in range(world)]
