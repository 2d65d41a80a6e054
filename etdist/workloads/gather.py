"""The all-gather of ragged row chunks that the AG+GEMM and MLP graphs start with."""
from __future__ import annotations

import etdist.fusion as et   # the graph builder (what `import etdist as et` offers), not the package root
from etdist.kernels import copy_tiles


def gather_rows(g: et.Graph, x, C, owned, block_m: int, block_n: int, name: str, whole: bool = False,
                peers_only: bool = False, pad_rows: int = 0):
    """Every rank's rows of x [owned(me), K] land at rank * C in every rank's `name` [R * C, K]
    (so rows 0..M lie back to back). Each rank sends its tiles to every rank, itself first
    (with peers_only, to every other rank).

    Returns (out, ready): ready[holder, source, i] completes when row tile i of `source` is all at
    `holder`; with whole=True, ready[holder] completes when every row is there (for GEMMs whose
    row tiles span all sources: small M, where reading the weights once matters most).
    peers_only: no copy of a rank's rows into its own `out`, for graphs whose tasks read a rank's
    own rows straight from x: ready[me, me, i] counts 0 (complete at once) while those rows of
    `out` stay unwritten, so nothing may read them through `out`. pad_rows: `out` has that many rows
    more (never written), so that a descriptor over whole row tiles stays inside it
    (gemm_tiles.box_rows)."""
    R, me = g.world, g.rank
    K = x.shape[1]
    m_tiles, k_tiles = et.cdiv(C, block_m), et.cdiv(K, block_n)
    out = g.scratch(name, (R * C + pad_rows, K), x.dtype, symmetric=True)
    first = 1 if peers_only else 0       # the first destination, as an offset from me
    if whole:
        if peers_only:
            raise et.GraphError("gather_rows: peers_only is for per-source readiness (whole=False)")
        ready = g.event(f"{name}_all", (R,), count=R * m_tiles * k_tiles, distributed=True)
        notify = lambda d, i, c: ready[(me + d) % R]  # noqa: E731
    else:
        count = (lambda h, src, i: et.where(et.eq(h, src), 0, k_tiles)) if peers_only else k_tiles  # noqa: E731
        ready = g.event(f"{name}_rows", (R, R, m_tiles), count=count, distributed=True)
        notify = lambda d, i, c: ready[(me + first + d) % R, me, i]  # noqa: E731

    @g.task(grid=(R - first, m_tiles, k_tiles), notify=notify, name=f"{name}_send",
            triton=copy_tiles.copy_tile, constexprs=dict(BLOCK_M=block_m, BLOCK_N=block_n),
            bind=dict(j="c", src=x.name, src_row0=0, dst=name, dst_peers=f"{name}_peers", N=K,
                      to_rank=lambda d, i, c: (me + first + d) % R, dst_row0=me * C, rows=owned(me)))
    def send(t, d, i, c):                                # my tile (i, c) to rank me + first + d
        rows, cols = et.block(i, block_m, t(owned(t.rank))), et.block(c, block_n, t(K))
        to = getattr(t.peer((t.rank + first + d) % t.world), name)
        to[et.shift(rows, t.rank * t(C)), cols] = getattr(t, x.name)[rows, cols]

    return out, ready


def source_order(R, tiles, interleave: bool):
    """The grid of per-source tasks over `tiles` tiles of each source's rows, and the map from its
    index to (source offset s, tile q): source-major (every tile of source me, then me + 1, ...:
    the rows in the order they arrive) or, interleaved, the source fastest, so that the sources'
    tiles q run side by side and read their weight tile once from HBM (the source-major order
    reads all the weights once per source where each source's rows are one row tile)."""
    if interleave:
        return (tiles, R), lambda q, s: (s, q)
    return (R, tiles), lambda s, q: (s, q)


def owner_order(R, tiles, interleave: bool):
    """source_order's two orders as one flat index u over R owners' `tiles` tiles each: the maps
    u -> (owner offset k, tile q) and back; owner-major (u = k * tiles + q) or, interleaved, the
    owner fastest (u = q * R + k)."""
    if interleave:
        return (lambda u: (u % R, u // R)), (lambda k, q: q * R + k)
    return (lambda u: (u // tiles, u % tiles)), (lambda k, q: k * tiles + q)

