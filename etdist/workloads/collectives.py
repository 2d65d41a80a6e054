"""Collectives as graph fragments: tile tasks and event tensors added to any graph.

    out, done = reduce_scatter(g, partial, after=lambda chunk, i, j: computed[chunk, i, j])
    gathered, arrived = all_gather(g, out, after=lambda i, j: done[i, j])   # = all_reduce

Each fragment takes the graph, a source tensor and (optionally) `after(...)`: the event element
that guards a source tile (for a graph input, None). It returns its result tensor and
an event that later tasks wait on, so the collective overlaps with what comes before and after
it tile by tile. Point-to-point stores into peers' symmetric buffers (no NVLink multicast). The
standalone ops on torch tensors are etdist.collectives.{reduce_scatter, all_gather, all_reduce}.
"""
from __future__ import annotations

from typing import Callable, Optional

import etdist.fusion as et   # the graph builder (what `import etdist as et` offers), not the package root
from etdist.kernels import copy_tiles

Guard = Optional[Callable]  # (i, j) -> the event element guarding a source tile


def reduce_scatter(g: et.Graph, x, *, block_m: int = 16, block_n: int = 16, after: Guard = None,
                   name: str = "rs"):
    """x [M, N] on every rank -> the sum over ranks, rows split in chunks of C = cdiv(M, R): rank r's
    chunk in `out` [C, N] (its first min(C, M - r*C) rows are meaningful; ragged at the end).

    after(chunk, i, j): the element guarding x's rows of tile i of `chunk`, columns tile j.
    Returns (out, done): done[i, j] completes when out's tile (i, j) holds its sum.
    """
    R, me = g.world, g.rank
    M, N = x.shape
    C, owned = et.row_chunks(M, R)       # rows per owner, ragged at the end
    mt, nt = et.cdiv(C, block_m), et.cdiv(N, block_n)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n)
    buf = g.scratch(f"{name}_buf", (R, C, N), x.dtype, symmetric=True)      # on the owner: [src]
    out = g.scratch(f"{name}_out", (C, N), x.dtype)
    arrived = g.event(f"{name}_arrived", (R, mt, nt), count=R, distributed=True)
    done = g.event(f"{name}_done", (mt, nt))

    @g.task(grid=(R, mt, nt), wait=None if after is None else (lambda d, i, j: after((me + d) % R, i, j)),
            notify=lambda d, i, j: arrived[(me + d) % R, i, j], name=f"{name}_send",
            triton=copy_tiles.copy_tile, constexprs=tiles,
            bind=dict(src=x.name, dst=buf.name, dst_peers=f"{buf.name}_peers",
                      to_rank=lambda d, i, j: (me + d) % R, src_row0=lambda d, i, j: ((me + d) % R) * C,
                      dst_row0=lambda d, i, j: me * C, rows=lambda d, i, j: owned((me + d) % R)))
    def send(t, d, i, j):                     # my rows of rank (me + d)'s chunk, tile (i, j)
        dst = (t.rank + d) % t.world
        rows, cols = et.block(i, block_m, t(owned(dst))), et.block(j, block_n, t(N))
        getattr(t.peer(dst), buf.name)[t.rank, rows, cols] = getattr(t, x.name)[et.shift(rows, dst * t(C)), cols]

    @g.task(grid=(mt, nt), wait=lambda i, j: arrived[me, i, j], notify=lambda i, j: done[i, j],
            name=f"{name}_sum", triton=copy_tiles.sum_slots_tile, constexprs=tiles,
            bind=dict(slots=buf.name, n_slots=R, slot_rows=C, out=out.name, rows=owned(me)))
    def sum_(t, i, j):
        rows, cols = et.block(i, block_m, t(owned(me))), et.block(j, block_n, t(N))
        getattr(t, out.name)[rows, cols] = getattr(t, buf.name)[:, rows, cols].sum(0)

    return out, done


def all_gather(g: et.Graph, x, *, block_m: int = 16, block_n: int = 16, after: Guard = None,
               name: str = "ag"):
    """x [C, N] on every rank -> out [R * C, N] on every rank (rank r's rows at r * C).

    Returns (out, arrived): arrived[me, src, i, j] completes when src's tile (i, j) is here.
    """
    R, me = g.world, g.rank
    C, N = x.shape
    mt, nt = et.cdiv(C, block_m), et.cdiv(N, block_n)
    out = g.scratch(f"{name}_out", (R * C, N), x.dtype, symmetric=True)
    arrived = g.event(f"{name}_arrived", (R, R, mt, nt), distributed=True)   # [holder, source, i, j]

    @g.task(grid=(R, mt, nt), wait=None if after is None else (lambda d, i, j: after(i, j)),
            notify=lambda d, i, j: arrived[(me + d) % R, me, i, j], name=f"{name}_send",
            triton=copy_tiles.copy_tile, constexprs=dict(BLOCK_M=block_m, BLOCK_N=block_n),
            bind=dict(src=x.name, dst=out.name, dst_peers=f"{out.name}_peers", src_row0=0,
                      to_rank=lambda d, i, j: (me + d) % R, dst_row0=me * C, rows=C))
    def send(t, d, i, j):                     # my tile (i, j) to rank me + d (myself first)
        rows, cols = et.block(i, block_m, t(C)), et.block(j, block_n, t(N))
        getattr(t.peer((t.rank + d) % t.world), out.name)[et.shift(rows, t.rank * t(C)), cols] = \
            getattr(t, x.name)[rows, cols]

    return out, arrived


def all_to_all(g: et.Graph, x, send_off, send_cnt, *, capacity, block_m: int = 16, block_h: int = 64,
               after: Guard = None, name: str = "a2a"):
    """Per-peer counts: rank r sends rows [send_off[p], + send_cnt[p]) of x [S, H] to rank p.

    send_off, send_cnt: int64 [R] tensors of the graph (inputs, or written by earlier tasks that
    `after(p)` guards). capacity: rows each receiver keeps per source (a size expression); more is
    refused at run time. Returns (recv [R, capacity, H], recv_cnt [R], arrived): after
    arrived[me, src] completes, recv[src, :recv_cnt[src]] holds src's rows for this rank.
    One task per peer: the receiver learns a count only with the data, so the signal follows both.
    """
    R, me = g.world, g.rank
    S, H = x.shape
    recv = g.scratch(f"{name}_recv", (R, capacity, H), x.dtype, symmetric=True)
    recv_cnt = g.scratch(f"{name}_recv_cnt", (R,), send_cnt.dtype, symmetric=True)
    arrived = g.event(f"{name}_arrived", (R, R), distributed=True)    # [receiver, source]

    @g.task(grid=(R,), wait=None if after is None else (lambda d: after((me + d) % R)),
            notify=lambda d: arrived[(me + d) % R, me], name=f"{name}_send",
            triton=copy_tiles.send_rows, constexprs=dict(BLOCK_M=block_m, BLOCK_H=block_h),
            bind=dict(src=x.name, send_off=send_off.name, send_cnt=send_cnt.name, dst=recv.name,
                      dst_peers=f"{recv.name}_peers", dst_counts=recv_cnt.name,
                      dst_counts_peers=f"{recv_cnt.name}_peers", cap=capacity, H=H))
    def send(t, d):                            # to rank me + d (myself first)
        to = (t.rank + d) % t.world
        start, cnt = int(getattr(t, send_off.name)[to]), int(getattr(t, send_cnt.name)[to])
        if cnt > t(capacity):
            raise ValueError(f"all_to_all {name!r}: {cnt} rows for rank {to}, capacity {t(capacity)}")
        peer = t.peer(to)
        getattr(peer, recv.name)[t.rank, :cnt] = getattr(t, x.name)[start:start + cnt]
        getattr(peer, recv_cnt.name)[t.rank] = cnt

    return recv, recv_cnt, arrived
