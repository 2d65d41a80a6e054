"""Triton tile bodies for GEMM-shaped work: one output tile of A @ B with fp32 accumulation.

`mm_tile` is the building block the graph bodies call. Rows past `rows` and columns past N are
masked (ragged M and N need no padding). Row-major, contiguous operands; offsets in elements.

TMA=True (graphs whose sizes are promised multiples of 16, so every row starts 16-byte aligned)
loads the operands through tensor descriptors made on the device per tile: the copy engine
fetches whole boxes and fills out-of-bounds rows and columns with zeros, so no masks, and keeps
pace with torch.mm where cp.async pointer loads fall behind.
Descriptors live in Triton's per-program global scratch (the runtime provides it).
"""
import triton
import triton.language as tl

from .sync import async_proxy_fence


def use_tma(align: int, row_pointers: bool = False, padded: bool = False) -> int:
    """The GEMM bodies' TMA constexpr for a graph whose sizes are promised multiples of `align`
    (row strides must be multiples of 16 bytes; 16 elements covers every dtype): 0, pointer loads;
    1, tensor descriptors; 2 (row_pointers), descriptors for the weights and masked pointer loads
    for the rows (x, gathered rows, h), whose boxes run past the rows in ragged tiles; 3 (padded,
    which wins; the SwiGLU tiles of tp_mlp only: their gathered rows lie in a buffer padded to whole
    row tiles), descriptors that declare the rows rounded up to whole tiles (box_rows), so that no
    box runs past them. A descriptor's box zero-fills the rows past its tensor slowly (records
    tma_oob_micro.jsonl)."""
    if align % 16:
        return 0
    return 3 if padded else 2 if row_pointers else 1


@triton.jit
def box_rows(rows, BLOCK_M: tl.constexpr, TMA: tl.constexpr):
    """The rows a descriptor over a tile's row buffer declares: with TMA 3 (use_tma: a buffer
    padded to whole row tiles) the rows rounded up to whole tiles, so that a ragged tile's box
    reads rows that exist (past the real ones, rows whose results no store keeps); else the rows."""
    return tl.cdiv(rows, BLOCK_M) * BLOCK_M if TMA == 3 else rows


@triton.jit
def rows_box(a, rows, K, r0, k0, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """a[r0 : r0 + BLOCK_M, k0 : k0 + BLOCK_K] of a [rows, K] by masked pointer loads (zeros past
    the rows and K): what a descriptor's box loads, without its slow fill past the rows."""
    offs_m = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(a + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < rows) & (offs_k[None, :] < K),
                   other=0.0)


@triton.jit
def row_tile(a_d, a, rows, K, r0, k0, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TMA: tl.constexpr):
    """a[r0 : r0 + BLOCK_M, k0 : k0 + BLOCK_K] through the descriptor a_d (ROW_TMA) or masked
    pointer loads (rows_box; a_d is then unused)."""
    if ROW_TMA:
        return a_d.load([r0, k0])
    return rows_box(a, rows, K, r0, k0, BLOCK_M, BLOCK_K)


@triton.jit
def row_descriptor(a, rows, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TMA: tl.constexpr):
    """With ROW_TMA a descriptor over the [rows, K] buffer `a` in boxes of BLOCK_M x BLOCK_K (at
    least one row declared: a descriptor needs one), else `a` itself: row_tile's first argument."""
    a_d = a
    if ROW_TMA:
        a_d = tl.make_tensor_descriptor(a, shape=[tl.maximum(rows, 1), K], strides=[K, 1],
                                        block_shape=[BLOCK_M, BLOCK_K])
    return a_d


@triton.jit
def slice_steps(s, K, BLOCK_K: tl.constexpr, PARTS: tl.constexpr):
    """[lo, hi) of the BLOCK_K contraction steps of slice s of PARTS: cdiv(cdiv(K, BLOCK_K), PARTS)
    steps each, the last ones shorter or empty."""
    steps = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(steps, PARTS)
    return s * per, tl.minimum(steps, (s + 1) * per)


@triton.jit
def mm_acc(a, rows, b, K, N, i, j, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           TMA: tl.constexpr = False, USE_ASM: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
    """fp32 accumulator of tile (i, j) of a[rows, K] @ b[K, N] (a offset to row 0)."""
    return mm_acc_steps(a, rows, b, K, N, i, j, 0, tl.cdiv(K, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM,
                        SWAP_AB)


@triton.jit
def mm_acc_steps(a, rows, b, K, N, i, j, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TMA: tl.constexpr, USE_ASM: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """mm_acc over the contraction steps [k_lo, k_hi) of BLOCK_K each (a split-K slice). SWAP_AB:
    with TMA, computed transposed (see mm_acc_tma); the same result."""
    if TMA:
        return mm_acc_tma(a, rows, b, K, N, i, j, k_lo, k_hi, BLOCK_M, BLOCK_N, BLOCK_K, USE_ASM, SWAP_AB, TMA)
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m[:, None] < rows
    col_ok = offs_n[None, :] < N
    a_ptrs = a + offs_m[:, None] * K + (k_lo * BLOCK_K + offs_k)[None, :]
    b_ptrs = b + (k_lo * BLOCK_K + offs_k)[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi):
        k_ok = offs_k < K - k * BLOCK_K
        a_t = tl.load(a_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        b_t = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        acc = tl.dot(a_t, b_t, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    return acc


@triton.jit
def mm_acc_tma(a, rows, b, K, N, i, j, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, SWAP_AB: tl.constexpr = False,
               TMA: tl.constexpr = 1):
    """mm_acc_steps with the weights through a tensor descriptor, the rows as TMA says (use_tma).
    A rank that owns no rows (ragged M) loads nothing (its base may lie past the tensor's end; a
    descriptor needs a non-empty shape). SWAP_AB: the tile computed transposed, b_tile^T @
    a_tile^T, so that BLOCK_N is the MMA's M side: a wgmma's M is 64, and a tile of fewer rows
    (decode sizes) otherwise runs on the older mma.sync path."""
    async_proxy_fence(USE_ASM)   # `a` may have been written in this launch (gathered rows, h)
    b_d = tl.make_tensor_descriptor(b, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    k_end = tl.where(rows > 0, k_hi, k_lo)
    return mm_loop_tma(a, rows, b_d, K, i, j, k_lo, k_end, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, TMA != 2)


@triton.jit
def mm_loop_tma(a, rows, b_d, K, i, j, k_lo, k_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, ROW_TMA: tl.constexpr):
    """mm_acc_tma's steps [k_lo, k_end): the weights through b_d, the rows through a descriptor
    (ROW_TMA) or masked pointer loads (rows_box)."""
    a_d = row_descriptor(a, rows, K, BLOCK_M, BLOCK_K, ROW_TMA)
    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_lo, k_end):
            a_t = row_tile(a_d, a, rows, K, i * BLOCK_M, k * BLOCK_K, BLOCK_M, BLOCK_K, ROW_TMA)
            acc_t = tl.dot(tl.trans(b_d.load([k * BLOCK_K, j * BLOCK_N])), tl.trans(a_t), acc_t)
        return tl.trans(acc_t)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_end):
        a_t = row_tile(a_d, a, rows, K, i * BLOCK_M, k * BLOCK_K, BLOCK_M, BLOCK_K, ROW_TMA)
        acc = tl.dot(a_t, b_d.load([k * BLOCK_K, j * BLOCK_N]), acc)
    return acc


@triton.jit
def mm_tile(a, rows, b, K, N, c, ldc, i, j,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            TMA: tl.constexpr = False, USE_ASM: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
    """c[i-th BLOCK_M rows, j-th BLOCK_N cols] = a[rows, K] @ b[K, N] (a, c offset to row 0)."""
    acc = mm_acc(a, rows, b, K, N, i, j, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM, SWAP_AB)
    store_tile(acc, c, ldc, rows, N, i, j, BLOCK_M, BLOCK_N)


@triton.jit
def grouped_tile(t, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of tile t in grouped order, as et.grouped orders the graphs' tiles:
    GROUP_M row tiles per column, so the programs of a wave share weight tiles in L2."""
    width = GROUP_M * n_tiles
    first_m = (t // width) * GROUP_M
    size = tl.minimum(m_tiles - first_m, GROUP_M)
    return first_m + (t % width) % size, (t % width) // size


@triton.jit
def store_tile(acc, c, ldc, rows, N, i, j, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """c[tile (i, j)] = acc, in c's dtype, rows past `rows` and columns past N left alone."""
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c + offs_m[:, None] * ldc + offs_n[None, :], acc.to(c.dtype.element_ty),
             mask=(offs_m[:, None] < rows) & (offs_n[None, :] < N))


@triton.jit
def aligned_peer(local, table, rank):
    """Rank `rank`'s copy of the symmetric tensor whose local copy is `local`, as an offset from
    `local`: symmetric allocations are 256-byte aligned everywhere, and writing the offset as a
    multiple of 256 bytes lets Triton prove alignment and vectorise (a pointer made from a loaded
    integer would be stored one element at a time)."""
    ELEM: tl.constexpr = local.dtype.element_ty.primitive_bitwidth // 8
    delta = tl.load(table + rank) - local.to(tl.int64, bitcast=True)
    return local + (delta // 256) * (256 // ELEM)


@triton.jit
def owned_rows(M, WORLD, r):
    """Rows of M that rank r owns when split in chunks of cdiv(M, WORLD) (ragged at the end)."""
    C = (M + WORLD - 1) // WORLD
    return tl.maximum(0, tl.minimum(C, M - r * C))


@triton.jit
def store_to_owners(acc, offs_m, offs_n, partial, partial_peers, slot, M, N, WORLD):
    """Rows offs_m (of all M) of the tile acc, each into its owner's partial[slot] (peer stores):
    a row tile spanning several owners is computed once."""
    C = (M + WORLD - 1) // WORLD
    col_ok = offs_n[None, :] < N
    for d in range(0, WORLD):
        rows = offs_m - d * C
        ok = (rows[:, None] >= 0) & (rows[:, None] < owned_rows(M, WORLD, d)) & col_ok
        out = aligned_peer(partial, partial_peers, d) + slot * C * N
        tl.store(out + rows[:, None] * N + offs_n[None, :], acc.to(partial.dtype.element_ty), mask=ok)


@triton.jit
def gemm_rs_matmul_slice(dst, i, j, s, x, w, partial, partial_peers, M, K, N, RANK, WORLD, SPLITS: tl.constexpr,
                         PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, TMA: tl.constexpr, USE_ASM: tl.constexpr):
    """Contraction slice s of PARTS (cdiv(cdiv(K, BLOCK_K), PARTS) steps each, the last ones shorter
    or empty) of my partial of rank dst's tile (i, j), into dst's partial[RANK * SPLITS + s]: each
    source has SPLITS slots per tile, of which a tile cut in PARTS <= SPLITS slices fills the first."""
    C = (M + WORLD - 1) // WORLD
    lo, hi = slice_steps(s, K, BLOCK_K, PARTS)
    rows = owned_rows(M, WORLD, dst)
    acc = mm_acc_steps(x + dst * C * K, rows, w, K, N, i, j, lo, hi, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM)
    out = aligned_peer(partial, partial_peers, dst) + (RANK * SPLITS + s) * C * N
    store_tile(acc, out, N, rows, N, i, j, BLOCK_M, BLOCK_N)


@triton.jit
def gemm_rs_reduce(i, j, parts, split_src, partial, y, M, N, RANK, WORLD, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """y[tile] = sum over sources of their partial[src * SPLITS + s][tile], in fp32: `parts` slices
    from source split_src (every source when it is -1), one from the others."""
    C = (M + WORLD - 1) // WORLD
    sum_slots(i, j, parts, split_src, partial, C * N, owned_rows(M, WORLD, RANK), y, N, WORLD,
              BLOCK_M, BLOCK_N, SPLITS)


@triton.jit
def sum_slots(i, j, parts, split_src, partial, slot_elems, rows, y, N, WORLD, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """y[tile (i, j) of `rows` rows] = the fp32 sum of partial's slots src * SPLITS + s (each
    slot_elems long): `parts` slices from source split_src (every source when it is -1), one from
    the others."""
    acc, offs, mask = slots_sum(i, j, parts, split_src, partial, slot_elems, rows, N, WORLD, BLOCK_M, BLOCK_N, SPLITS)
    tl.store(y + offs, acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def slots_sum(i, j, parts, split_src, partial, slot_elems, rows, N, WORLD, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """sum_slots' fp32 sum of tile (i, j), with its offsets and mask: (acc, offs, mask)."""
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
    offs = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for src in range(0, WORLD):
        for s in range(0, tl.where((split_src < 0) | (src == split_src), parts, 1)):
            acc += tl.load(partial + (src * SPLITS + s) * slot_elems + offs, mask=mask, other=0.0).to(tl.float32)
    return acc, offs, mask


@triton.jit
def gemm_rs_skinny_matmul(s, j, x, w, partial, partial_peers, M, K, N, RANK, WORLD, SPLITS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          TMA: tl.constexpr, USE_ASM: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """All M rows (M <= BLOCK_M) x K-slice s x column tile j; each owner's rows go to its
    partial[RANK * SPLITS + s] in fp32 (peer stores). The weights are read once in total.

    SWAP_AB (with TMA): the tile is computed transposed, w_tile^T @ x^T, so the weights are the
    MMA's M side and the few token rows its N side, which may be as small as 16 (a wgmma's M is
    64): the x stage shrinks to BLOCK_M x BLOCK_K and the shared memory goes to deeper weight
    stages (16x128x128 takes 6 stages, 160 KiB of weights in flight, against 48 KiB for 64x64x128
    at 4 stages). gemm_rs's 32- and 128-row classes use it (records gemm_rs_skinny_ab.jsonl)."""
    acc, offs_m, offs_n = skinny_slice(s, j, x, w, M, K, N, SPLITS, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM,
                                       SWAP_AB)
    store_to_owners(acc, offs_m, offs_n, partial, partial_peers, RANK * SPLITS + s, M, N, WORLD)


@triton.jit
def gemm_rs_skinny_matmul_local(s, j, x, w, slices, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                                USE_ASM: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """gemm_rs_skinny_matmul's tile, kept on this GPU: every row into slices[s] (fp32), which
    gemm_rs_skinny_combine sums per owner before anything crosses the links."""
    acc, offs_m, offs_n = skinny_slice(s, j, x, w, M, K, N, SPLITS, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM,
                                       SWAP_AB)
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(slices + s * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=ok)


@triton.jit
def gemm_rs_skinny_matmul_local_tail(s, j, x, w, slices, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                                     TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                     USE_ASM: tl.constexpr, ROW_TMA: tl.constexpr = False):
    """gemm_rs_skinny_matmul_local for BLOCK_M < M <= BLOCK_M + TAIL_M: contraction slice s of
    column tile j over every row, each weight tile loaded once (a descriptor) for the first BLOCK_M
    rows and, transposed, the TAIL_M after them (rows_and_tail_acc), into slices[s] (fp32)."""
    steps = tl.cdiv(tl.cdiv(K, SPLITS), BLOCK_K)   # a slice's steps, as skinny_slice's KB
    acc, acc_t = rows_and_tail_acc(x, w, M, K, N, j, s * steps, tl.minimum(tl.cdiv(K, BLOCK_K), (s + 1) * steps),
                                   BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K, ROW_TMA)
    store_rows_and_tail(acc, acc_t, slices + s * M * N, M, N, j, BLOCK_M, TAIL_M, BLOCK_N)


@triton.jit
def gemm_rs_skinny_combine(d, j, slices, partial, partial_peers, M, N, RANK, WORLD, SPLITS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Owner d's rows of columns tile j summed over this rank's SPLITS slices, into d's
    partial[RANK] (fp32, a peer store): one partial per source crosses the links, not SPLITS."""
    C = (M + WORLD - 1) // WORLD
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_m[:, None] < owned_rows(M, WORLD, d)) & (offs_n[None, :] < N)
    at = (d * C + offs_m[:, None]) * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(slices + s * M * N + at, mask=ok, other=0.0)
    out = aligned_peer(partial, partial_peers, d) + RANK * C * N
    tl.store(out + offs_m[:, None] * N + offs_n[None, :], acc.to(partial.dtype.element_ty), mask=ok)


@triton.jit
def skinny_slice(s, j, x, w, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TMA: tl.constexpr, USE_ASM: tl.constexpr, SWAP_AB: tl.constexpr):
    """x[:, slice s] @ w[slice s, column tile j] for all M (<= BLOCK_M) rows: (acc fp32, rows, columns)."""
    KB = tl.cdiv(tl.cdiv(K, SPLITS), BLOCK_K) * BLOCK_K
    k_end = tl.minimum(K, (s + 1) * KB)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = s * KB + tl.arange(0, BLOCK_K)
    col_ok = offs_n[None, :] < N
    a_ptrs = x + offs_m[:, None] * K + offs_k[None, :]
    b_ptrs = w + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:   # slices end at a multiple of BLOCK_K or at K, where the descriptor zero-fills
        # the steps as mm_loop_tma's, which counts them in BLOCK_K: k = s * KB + step * BLOCK_K
        b_d = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
        lo, hi = s * (KB // BLOCK_K), tl.cdiv(k_end, BLOCK_K)
        acc = mm_loop_tma(x, M, b_d, K, 0, j, lo, hi, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, TMA == 1)
    else:
        for k in range(s * KB, k_end, BLOCK_K):
            k_ok = offs_k < k_end - (k - s * KB)
            a_t = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
            b_t = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
            acc = tl.dot(a_t, b_t, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * N
    return acc, offs_m, offs_n


@triton.jit
def gemm_rs_skinny_reduce(j, partial, y, M, N, RANK, WORLD, SPLITS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[:, tile j] = sum (in fp32) of the WORLD x SPLITS partials of this rank's rows."""
    C = (M + WORLD - 1) // WORLD
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < owned_rows(M, WORLD, RANK)) & (offs_n[None, :] < N)
    offs = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, WORLD * SPLITS):
        acc += tl.load(partial + r * C * N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + offs, acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def gate_up_descriptors(w_gate_up, H, I, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Descriptors over the gate and up halves of w_gate_up = [w_gate | w_up] ([H, 2I]): two [H, I]
    views with row stride 2I, in BLOCK_K x BLOCK_N boxes."""
    g_d = tl.make_tensor_descriptor(w_gate_up, shape=[H, I], strides=[2 * I, 1], block_shape=[BLOCK_K, BLOCK_N])
    u_d = tl.make_tensor_descriptor(w_gate_up + I, shape=[H, I], strides=[2 * I, 1], block_shape=[BLOCK_K, BLOCK_N])
    return g_d, u_d


@triton.jit
def swiglu_rows(a, rows, box, w_gate_up, h, H, I, i, j,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                TMA: tl.constexpr = False, USE_ASM: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
    """h[tile i of `rows` rows; cols tile j] = silu(a @ w_gate) * (a @ w_up), with
    w_gate_up = [w_gate | w_up] ([H, 2I]); a, h offset to row 0: two accumulators, one pass. box:
    the rows a descriptor over `a` declares (box_rows)."""
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m[:, None] < rows
    col_ok = offs_n[None, :] < I
    a_ptrs = a + offs_m[:, None] * H + offs_k[None, :]
    g_ptrs = w_gate_up + offs_k[:, None] * (2 * I) + offs_n[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:   # gate and up as two [H, I] views with row stride 2I
        async_proxy_fence(USE_ASM)   # `a` holds rows gathered in this launch
        g_d, u_d = gate_up_descriptors(w_gate_up, H, I, BLOCK_N, BLOCK_K)
        acc_g, acc_u = swiglu_loop_tma(a, rows, box, g_d, u_d, H, i, j, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB,
                                       TMA != 2)
    else:
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            k_ok = offs_k < H - k * BLOCK_K
            a_t = tl.load(a_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
            g_t = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
            u_t = tl.load(g_ptrs + I, mask=k_ok[:, None] & col_ok, other=0.0)
            acc_g = tl.dot(a_t, g_t, acc_g)
            acc_u = tl.dot(a_t, u_t, acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * 2 * I
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h + offs_m[:, None] * I + offs_n[None, :], act.to(h.dtype.element_ty), mask=row_ok & col_ok)


@triton.jit
def swiglu_loop_tma(a, rows, box, g_d, u_d, H, i, j, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, ROW_TMA: tl.constexpr):
    """swiglu_rows' gate and up accumulators, the weights through g_d / u_d and the rows through a
    descriptor (ROW_TMA, declaring `box` rows) or masked pointer loads (rows_box); SWAP_AB:
    transposed (mm_acc_tma)."""
    a_d = row_descriptor(a, box, H, BLOCK_M, BLOCK_K, ROW_TMA)
    steps = tl.where(rows > 0, tl.cdiv(H, BLOCK_K), 0)
    if SWAP_AB:
        g_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        u_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, steps):
            a_t = tl.trans(row_tile(a_d, a, rows, H, i * BLOCK_M, k * BLOCK_K, BLOCK_M, BLOCK_K, ROW_TMA))
            g_t = tl.dot(tl.trans(g_d.load([k * BLOCK_K, j * BLOCK_N])), a_t, g_t)
            u_t = tl.dot(tl.trans(u_d.load([k * BLOCK_K, j * BLOCK_N])), a_t, u_t)
        return tl.trans(g_t), tl.trans(u_t)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, steps):
        a_t = row_tile(a_d, a, rows, H, i * BLOCK_M, k * BLOCK_K, BLOCK_M, BLOCK_K, ROW_TMA)
        acc_g = tl.dot(a_t, g_d.load([k * BLOCK_K, j * BLOCK_N]), acc_g)
        acc_u = tl.dot(a_t, u_d.load([k * BLOCK_K, j * BLOCK_N]), acc_u)
    return acc_g, acc_u


@triton.jit
def swiglu_tile(s, i, j, ag_out, x, w_gate_up, h, M, H, I, RANK, WORLD,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                TMA: tl.constexpr, USE_ASM: tl.constexpr, OWN_FROM_X: tl.constexpr = False):
    """SwiGLU tile (i, j) of the rows that source rank s sent (gathered at s * C); OWN_FROM_X: this
    rank's own rows read from x (one body for both, so the kernel holds one copy of its code)."""
    C = (M + WORLD - 1) // WORLD
    a = ag_out + s * C * H
    rows = owned_rows(M, WORLD, s)
    box = box_rows(rows, BLOCK_M, TMA)
    if OWN_FROM_X:
        if s == RANK:
            a = x
            box = rows   # x is the caller's: not padded
    swiglu_rows(a, rows, box, w_gate_up, h + s * C * I, H, I, i, j,
                BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM)


@triton.jit
def swiglu_all_rows(i, j, ag_out, w_gate_up, h, M, H, I,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    TMA: tl.constexpr, USE_ASM: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """SwiGLU tile (i, j) over all M gathered rows (the chunks lie back to back: rows 0..M)."""
    swiglu_rows(ag_out, M, M, w_gate_up, h, H, I, i, j, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM, SWAP_AB)


@triton.jit
def matmul_all_rows(i, j, a, w, y, M, K, N,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    TMA: tl.constexpr, USE_ASM: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """y tile (i, j) = a[M rows] @ w: a GEMM tile over every gathered row."""
    mm_tile(a, M, w, K, N, y, N, i, j, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM, SWAP_AB)


@triton.jit
def matmul_all_rows_slice(k, s, i, j, a, w, slices, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr, USE_ASM: tl.constexpr,
                          SWAP_AB: tl.constexpr = False):
    """Contraction slice s of SPLITS (cdiv(cdiv(K, BLOCK_K), SPLITS) steps each, the last ones
    shorter or empty) of tile (i, j) of a[M rows] @ w, in fp32 into slices[k * SPLITS + s] (a
    BLOCK_M x BLOCK_N box): the k-th of the ragged last wave's tiles, summed by sum_slices_tile."""
    lo, hi = slice_steps(s, K, BLOCK_K, SPLITS)
    acc = mm_acc_steps(a, M, w, K, N, i, j, lo, hi, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM, SWAP_AB)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    tl.store(slices + ((k * SPLITS + s) * BLOCK_M + offs_m[:, None]) * BLOCK_N + offs_n[None, :], acc)


@triton.jit
def sum_slices_tile(k, i, j, slices, y, M, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y tile (i, j) = the sum of its SPLITS fp32 slices (matmul_all_rows_slice's boxes k * SPLITS ...)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(slices + ((k * SPLITS + s) * BLOCK_M + offs_m[:, None]) * BLOCK_N + offs_n[None, :])
    store_tile(acc, y, N, M, N, i, j, BLOCK_M, BLOCK_N)


@triton.jit
def rows_and_tail_acc(a, w, M, K, N, j, k_lo, k_hi, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TMA: tl.constexpr = False):
    """fp32 accumulators of a[M rows] @ w[:, column tile j] over steps [k_lo, k_hi), each weight
    tile loaded once (a descriptor): rows [0, BLOCK_M) and, transposed, the TAIL_M after them.
    The rows load through masked pointers, or with ROW_TMA the first BLOCK_M through a descriptor
    (past BLOCK_M rows, where the ops' tail classes mostly run, that box lies within them; rows past
    M are zero-filled, slowly). No rows (M = 0), no steps: the descriptor needs a row to exist."""
    b_d = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    a_d = row_descriptor(a, M, K, BLOCK_M, BLOCK_K, ROW_TMA)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_N, TAIL_M), dtype=tl.float32)
    for k in range(k_lo, tl.where(M > 0, k_hi, k_lo)):
        b = b_d.load([k * BLOCK_K, j * BLOCK_N])
        acc = tl.dot(row_tile(a_d, a, M, K, 0, k * BLOCK_K, BLOCK_M, BLOCK_K, ROW_TMA), b, acc)
        acc_t = tl.dot(tl.trans(b), tl.trans(rows_box(a, M, K, BLOCK_M, k * BLOCK_K, TAIL_M, BLOCK_K)), acc_t)
    return acc, acc_t


@triton.jit
def matmul_rows_and_tail(j, a, w, y, M, K, N, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, ROW_TMA: tl.constexpr = False):
    """y[all M rows, column tile j] = a[M rows] @ w for BLOCK_M < M <= BLOCK_M + TAIL_M, each weight
    tile loaded once (through a descriptor) for two accumulators: rows [0, BLOCK_M) on the MMA's M
    side, the TAIL_M rows after them transposed (the weights on the M side, as SWAP_AB): a 128-row
    tile and a 32-row one do 160 rows of work where two 128-row tiles would do 256, or read the
    weights twice. The rows load through masked pointers (a ragged tail), or as ROW_TMA says
    (rows_and_tail_acc)."""
    async_proxy_fence(USE_ASM)   # `a` holds rows gathered in this launch
    acc, acc_t = rows_and_tail_acc(a, w, M, K, N, j, 0, tl.cdiv(K, BLOCK_K), BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K,
                                   ROW_TMA)
    store_rows_and_tail(acc, acc_t, y, M, N, j, BLOCK_M, TAIL_M, BLOCK_N)


@triton.jit
def store_rows_and_tail(acc, acc_t, c, M, N, j, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """c[all M rows, column tile j] (row-major [M, N], in c's dtype) from rows_and_tail_acc's two
    accumulators: rows [0, BLOCK_M) and, transposed back, the TAIL_M after them."""
    store_tile(acc, c, N, M, N, 0, j, BLOCK_M, BLOCK_N)
    offs_m = BLOCK_M + tl.arange(0, TAIL_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c + offs_m[:, None] * N + offs_n[None, :], tl.trans(acc_t).to(c.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def swiglu_rows_and_tail(j, ag_out, w_gate_up, h, M, H, I, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
                         ROW_TMA: tl.constexpr = False):
    """swiglu_rows over every M rows (BLOCK_M < M <= BLOCK_M + TAIL_M), column tile j: the gate and
    up tiles loaded once for the first BLOCK_M rows and, transposed, the TAIL_M after them
    (rows_and_tail_acc's scheme, two accumulators each; ROW_TMA as there)."""
    async_proxy_fence(USE_ASM)   # `ag_out` holds rows gathered in this launch
    g_d, u_d = gate_up_descriptors(w_gate_up, H, I, BLOCK_N, BLOCK_K)
    a_d = row_descriptor(ag_out, M, H, BLOCK_M, BLOCK_K, ROW_TMA)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tail_g = tl.zeros((BLOCK_N, TAIL_M), dtype=tl.float32)
    tail_u = tl.zeros((BLOCK_N, TAIL_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        g_t = g_d.load([k * BLOCK_K, j * BLOCK_N])
        u_t = u_d.load([k * BLOCK_K, j * BLOCK_N])
        a_t = row_tile(a_d, ag_out, M, H, 0, k * BLOCK_K, BLOCK_M, BLOCK_K, ROW_TMA)
        r_t = tl.trans(rows_box(ag_out, M, H, BLOCK_M, k * BLOCK_K, TAIL_M, BLOCK_K))
        acc_g = tl.dot(a_t, g_t, acc_g)
        acc_u = tl.dot(a_t, u_t, acc_u)
        tail_g = tl.dot(tl.trans(g_t), r_t, tail_g)
        tail_u = tl.dot(tl.trans(u_t), r_t, tail_u)
    store_rows_and_tail(acc_g * tl.sigmoid(acc_g) * acc_u, tail_g * tl.sigmoid(tail_g) * tail_u, h, M, I, j,
                        BLOCK_M, TAIL_M, BLOCK_N)


@triton.jit
def matmul_scatter_rows_and_tail_slice(j, s, x, w, partial, partial_peers, M, K, N, RANK, WORLD,
                                       SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr,
                                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
                                       ROW_TMA: tl.constexpr = False):
    """matmul_scatter_rows_slice over every M rows (BLOCK_M < M <= BLOCK_M + TAIL_M): contraction
    slice s of column tile j (cdiv(cdiv(K, BLOCK_K), SPLITS) steps each), each weight tile loaded
    once for the first BLOCK_M rows and, transposed, the TAIL_M after them; each owner's rows into
    its partial[RANK * SPLITS + s]."""
    async_proxy_fence(USE_ASM)   # `x` (h) was written in this launch
    lo, hi = slice_steps(s, K, BLOCK_K, SPLITS)
    acc, acc_t = rows_and_tail_acc(x, w, M, K, N, j, lo, hi, BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K, ROW_TMA)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    store_to_owners(acc, tl.arange(0, BLOCK_M), offs_n, partial, partial_peers, RANK * SPLITS + s, M, N, WORLD)
    store_to_owners(tl.trans(acc_t), BLOCK_M + tl.arange(0, TAIL_M), offs_n, partial, partial_peers,
                    RANK * SPLITS + s, M, N, WORLD)


@triton.jit
def matmul_scatter_rows_slice(i, j, s, x, w, partial, partial_peers, M, K, N, RANK, WORLD, SPLITS: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              TMA: tl.constexpr, USE_ASM: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """Contraction slice s of SPLITS (cdiv(cdiv(K, BLOCK_K), SPLITS) steps each, the last ones
    shorter or empty) of tile (i, j) of x[M rows] @ w; each owner's rows go to its
    partial[RANK * SPLITS + s] (peer stores), so a row tile spanning several owners reads the
    weights once."""
    lo, hi = slice_steps(s, K, BLOCK_K, SPLITS)
    acc = mm_acc_steps(x, M, w, K, N, i, j, lo, hi, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM, SWAP_AB)
    store_to_owners(acc, i * BLOCK_M + tl.arange(0, BLOCK_M), j * BLOCK_N + tl.arange(0, BLOCK_N),
                    partial, partial_peers, RANK * SPLITS + s, M, N, WORLD)


@triton.jit
def matmul_broadcast_slice(i, j, s, x, w, partial, partial_peers, M, K, N, RANK, WORLD, SPLITS: tl.constexpr,
                           PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, TMA: tl.constexpr, USE_ASM: tl.constexpr,
                           SWAP_AB: tl.constexpr = False):
    """Contraction slice s of PARTS (cdiv(cdiv(K, BLOCK_K), PARTS) steps each, the last ones shorter
    or empty) of tile (i, j) of x[M rows] @ w, into every rank's partial[RANK * SPLITS + s] (all M
    rows; the peers first, this rank last): an all-reduce's push, which every rank then sums for
    itself (sum_partials)."""
    lo, hi = slice_steps(s, K, BLOCK_K, PARTS)
    acc = mm_acc_steps(x, M, w, K, N, i, j, lo, hi, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM, SWAP_AB)
    for k in range(1, WORLD + 1):
        out = aligned_peer(partial, partial_peers, (RANK + k) % WORLD) + (RANK * SPLITS + s) * M * N
        store_tile(acc, out, N, M, N, i, j, BLOCK_M, BLOCK_N)


@triton.jit
def matmul_owner_slice(i, j, s, x, w, partial, partial_peers, M, K, N, RANK, WORLD, SPLITS: tl.constexpr,
                       PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, TMA: tl.constexpr, USE_ASM: tl.constexpr,
                       SWAP_AB: tl.constexpr = False):
    """matmul_broadcast_slice's slice, into the partial[RANK * SPLITS + s] of tile (i, j)'s owner
    alone (rank j % WORLD), who sums it and sends the sum to every rank (sum_partials_to_all)."""
    lo, hi = slice_steps(s, K, BLOCK_K, PARTS)
    acc = mm_acc_steps(x, M, w, K, N, i, j, lo, hi, BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM, SWAP_AB)
    out = aligned_peer(partial, partial_peers, j % WORLD) + (RANK * SPLITS + s) * M * N
    store_tile(acc, out, N, M, N, i, j, BLOCK_M, BLOCK_N)


@triton.jit
def sum_partials_to_all(i, j, parts, partial, y_all, y_all_peers, M, N, RANK, WORLD, SPLITS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The owner's sum of tile (i, j) (sum_partials' slots, fp32), into every rank's y_all (the
    peers first, this rank last)."""
    acc, offs, mask = slots_sum(i, j, parts, -1, partial, M * N, M, N, WORLD, BLOCK_M, BLOCK_N, SPLITS)
    for k in range(1, WORLD + 1):
        out = aligned_peer(y_all, y_all_peers, (RANK + k) % WORLD)
        tl.store(out + offs, acc.to(y_all.dtype.element_ty), mask=mask)


@triton.jit
def copy_rows_tile(i, j, src, dst, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dst[tile (i, j)] = src[tile (i, j)], both [M, N] on this GPU."""
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    offs = offs_m[:, None] * N + offs_n[None, :]
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def sum_partials(i, j, parts, partial, y, M, N, WORLD, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """y[tile (i, j) of all M rows] = the sum of the `parts` slices every rank stored for it
    (partial[src * SPLITS + s]), in fp32."""
    sum_slots(i, j, parts, -1, partial, M * N, M, y, N, WORLD, BLOCK_M, BLOCK_N, SPLITS)


@triton.jit
def ag_matmul(s, i, j, gathered, x, w, y, M, K, N, RANK, WORLD,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              TMA: tl.constexpr, USE_ASM: tl.constexpr, OWN_FROM_X: tl.constexpr = False):
    """y[rows of source s, tile i; cols tile j] = gathered[same rows] @ w (s: the source rank);
    OWN_FROM_X: this rank's own rows read from x."""
    C = (M + WORLD - 1) // WORLD
    a = gathered + s * C * K
    if OWN_FROM_X:
        if s == RANK:
            a = x
    mm_tile(a, owned_rows(M, WORLD, s), w, K, N, y + s * C * N, N, i, j,
            BLOCK_M, BLOCK_N, BLOCK_K, TMA, USE_ASM)
