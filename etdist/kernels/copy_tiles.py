"""Generic Triton tile bodies for collectives inside graphs: move one tile to a peer, sum slots.

Row-major [rows, N] tiles; offsets in elements; `rows` masks a ragged last tile. Fragments bind
their own tensor names to these parameters (g.task(..., bind={...})).
"""
import triton
import triton.language as tl

from .gemm_tiles import aligned_peer


@triton.jit
def copy_tile(i, j, src, src_row0, dst, dst_peers, to_rank, dst_row0, rows, N,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dst@to_rank[dst_row0 + tile rows, tile cols] = src[src_row0 + tile rows, tile cols]."""
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
    v = tl.load(src + (src_row0 + offs_m[:, None]) * N + offs_n[None, :], mask=mask)
    out = aligned_peer(dst, dst_peers, to_rank)
    tl.store(out + (dst_row0 + offs_m[:, None]) * N + offs_n[None, :], v, mask=mask)


@triton.jit
def sum_slots_tile(i, j, slots, n_slots, slot_rows, out, rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[tile] = sum over s < n_slots of slots[s, tile] (slots: [n_slots, slot_rows, N]), in fp32."""
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
    offs = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, n_slots):
        acc += tl.load(slots + s * slot_rows * N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def send_rows(d, src, send_off, send_cnt, dst, dst_peers, dst_counts, dst_counts_peers, RANK, WORLD, cap, H,
              BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """all_to_all, one peer: rows [send_off[to], +send_cnt[to]) of src [S, H] into the peer's
    dst[RANK, :cnt] ([WORLD, cap, H]) and the count into its dst_counts[RANK]."""
    to = (RANK + d) % WORLD
    start = tl.load(send_off + to).to(tl.int32)
    cnt = tl.minimum(tl.load(send_cnt + to).to(tl.int32), cap)
    out = aligned_peer(dst, dst_peers, to) + RANK * cap * H
    offs_h = tl.arange(0, BLOCK_H)
    for r0 in range(0, cnt, BLOCK_M):
        offs_m = r0 + tl.arange(0, BLOCK_M)
        for h0 in range(0, H, BLOCK_H):
            mask = (offs_m[:, None] < cnt) & (h0 + offs_h[None, :] < H)
            v = tl.load(src + (start + offs_m[:, None]) * H + h0 + offs_h[None, :], mask=mask)
            tl.store(out + offs_m[:, None] * H + h0 + offs_h[None, :], v, mask=mask)
    tl.store(aligned_peer(dst_counts, dst_counts_peers, to) + RANK, cnt.to(dst_counts.dtype.element_ty))
