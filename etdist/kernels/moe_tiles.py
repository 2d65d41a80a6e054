"""Triton tile bodies of the expert-parallel MoE graph (etdist/workloads/moe.py), one per task.

Every body works on one block (of tokens, slots or output columns), so the work of a layer spreads
over all the SMs whatever the routing: the experts' GEMMs are tiles over the rows of all local
experts (rows padded per expert to BM, as serving engines' fused MoE kernels do) x BN columns; the
SwiGLU activations are staged in a scratch tensor between the gate/up and the down tiles.
Routing logits are IEEE fp32 (it must pick the experts the float reference picks); expert GEMMs run
on tensor cores in the input dtype, IEEE fp32 for fp32 inputs.
"""
import triton
import triton.language as tl

from .gemm_tiles import aligned_peer


@triton.jit
def _dot(a, b, acc):
    """Tensor-core dot in the operands' dtype (bf16/fp16); IEEE fp32 for fp32 operands."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _i64(x):
    """x as int64 (sizes arrive as int32: products like rank x slots x hidden outgrow them)."""
    return tl.zeros((), tl.int64) + x


@triton.jit
def moe_logits(i, k, x, wg, logits, T, H, E, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
               RH: tl.constexpr, WHOLE: tl.constexpr = False):
    """logits[k, tokens [i*BT, (i+1)*BT)] = x @ wg over hidden slice k (fp32; zero past E), in BK
    steps, or (WHOLE) the whole slice in one load and one dot (moe_layer decides)."""
    cols = tl.arange(0, BE)
    rows = i * BT + tl.arange(0, BT)
    acc = tl.zeros((BT, BE), tl.float32)
    if WHOLE:
        ks = k * RH + tl.arange(0, RH)
        a = tl.load(x + _i64(rows)[:, None] * H + ks[None, :],   # T x H may pass 2**31
                    mask=(rows[:, None] < T) & (ks[None, :] < H), other=0.0)
        b = tl.load(wg + ks[:, None] * E + cols[None, :], mask=(ks[:, None] < H) & (cols[None, :] < E), other=0.0)
        acc = _dot(a, b, acc)
    else:
        ks = tl.arange(0, BK)
        for k0 in range(k * RH, tl.minimum(H, (k + 1) * RH), BK):
            a = tl.load(x + _i64(rows)[:, None] * H + (k0 + ks)[None, :],
                        mask=(rows[:, None] < T) & ((k0 + ks)[None, :] < H), other=0.0)
            b = tl.load(wg + (k0 + ks)[:, None] * E + cols[None, :],
                        mask=((k0 + ks)[:, None] < H) & (cols[None, :] < E), other=0.0)
            acc = _dot(a, b, acc)
    out = logits + (_i64(k) * T + rows)[:, None] * BE + cols[None, :]
    tl.store(out, acc, mask=rows[:, None] < T)


@triton.jit
def _route(i, logits, topk_ids, topk_w, fill, slots, T, H, E, TOP_K: tl.constexpr, KP: tl.constexpr,
           BT: tl.constexpr, BE: tl.constexpr, RH: tl.constexpr, SU: tl.constexpr, PLACE: tl.constexpr):
    """Tokens [i*BT, (i+1)*BT): softmax(sum of the slices' logits) -> top-k experts and their
    weights, renormalised. The slices are loaded SU at a time and summed in order (the same sum
    as one at a time). PLACE (one rank): each (token, k) slot also takes the next place in its
    expert's list, slots[e, fill[e]++] (an atomic per slot: lists in no set order, rows whose
    results do not depend on their neighbours).
    The k picks are kept in registers ([BT, KP], KP = TOP_K rounded up to a power of two) and
    stored once: a pick is one reduction (value and index together), the weights are renormalised
    before their one store, and all slots take their places in one vector atomic (a chain of
    TOP_K atomics, each waiting for the one before, was most of a routing task at one token)."""
    cols = tl.arange(0, BE)
    rows = i * BT + tl.arange(0, BT)
    acc = tl.zeros((BT, BE), tl.float32)
    n_slices = tl.cdiv(H, RH)
    for k0 in range(0, n_slices, SU):
        for u in tl.static_range(SU):
            acc += tl.load(logits + (_i64(k0 + u) * T + rows)[:, None] * BE + cols[None, :],
                           mask=(rows[:, None] < T) & (k0 + u < n_slices), other=0.0)
    acc = tl.where(cols[None, :] < E, acc, float("-inf"))
    p = tl.exp(acc - tl.max(acc, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where(cols[None, :] < E, p, -1.0)
    ks = tl.arange(0, KP)
    ids = tl.zeros((BT, KP), tl.int64)
    ws = tl.zeros((BT, KP), tl.float32)
    for kk in tl.static_range(TOP_K):         # top-k by repeated arg-max (the lowest index of ties)
        val, best = tl.max(p, 1, return_indices=True)
        ids = tl.where(ks[None, :] == kk, best.to(tl.int64)[:, None], ids)
        ws = tl.where(ks[None, :] == kk, val[:, None], ws)
        p = tl.where(cols[None, :] == best[:, None], -1.0, p)
    ok = (rows[:, None] < T) & (ks[None, :] < TOP_K)
    at_k = _i64(rows)[:, None] * TOP_K + ks[None, :]        # T x top_k may pass 2**31
    tl.store(topk_ids + at_k, ids, mask=ok)
    tl.store(topk_w + at_k, (ws / tl.sum(ws, 1)[:, None]).to(topk_w.dtype.element_ty), mask=ok)
    if PLACE:
        at = tl.atomic_add(fill + ids, 1, mask=ok, sem="relaxed")
        tl.store(slots + ids * T + at, at_k, mask=ok)


@triton.jit
def moe_route(i, logits, topk_ids, topk_w, T, H, E, TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
              BE: tl.constexpr, RH: tl.constexpr, SU: tl.constexpr):
    """Tokens [i*BT, (i+1)*BT): softmax(sum of the slices' logits) -> top-k experts and their
    weights, renormalised."""
    _route(i, logits, topk_ids, topk_w, topk_ids, topk_ids, T, H, E, TOP_K, KP, BT, BE, RH, SU, False)   # no fill, slots


@triton.jit
def moe_route_place(i, logits, topk_ids, topk_w, fill, slots, T, H, E, TOP_K: tl.constexpr, KP: tl.constexpr,
                    BT: tl.constexpr, BE: tl.constexpr, RH: tl.constexpr, SU: tl.constexpr):
    """moe_route on one rank, where every expert is local: each slot also goes straight into its
    expert's list (slots[e, fill[e]++]), no dispatch or plan after it; moe_tile_table_take takes
    the counts and leaves fill zero for the next launch."""
    _route(i, logits, topk_ids, topk_w, fill, slots, T, H, E, TOP_K, KP, BT, BE, RH, SU, True)


@triton.jit
def _arrive(counter, n):
    """Whether this program is the n-th to arrive at the int32 counter, which the last leaves zero for
    the next launch. An acq_rel count after a CTA barrier (as a notify): the last to arrive sees
    every store the others made before arriving."""
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n - 1
    if last:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _router(i, k, x, wg, logits, arrived, topk_ids, topk_w, fill, slots, T, H, E, BT: tl.constexpr, BE: tl.constexpr,
            BK: tl.constexpr, RH: tl.constexpr, WHOLE: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
            SU: tl.constexpr, PLACE: tl.constexpr):
    """moe_logits, and the last of the token block's slices to arrive routes it (_route, PLACE as
    there); whether this program routed."""
    moe_logits(i, k, x, wg, logits, T, H, E, BT, BE, BK, RH, WHOLE)
    last = _arrive(arrived + i, tl.cdiv(H, RH))
    if last:
        _route(i, logits, topk_ids, topk_w, fill, slots, T, H, E, TOP_K, KP, BT, BE, RH, SU, PLACE)
    return last


@triton.jit
def moe_router(i, k, x, wg, logits, arrived, topk_ids, topk_w, T, H, E, BT: tl.constexpr, BE: tl.constexpr,
               BK: tl.constexpr, RH: tl.constexpr, WHOLE: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
               SU: tl.constexpr):
    """moe_logits, and the last of the token block's slices to arrive routes it (moe_route)."""
    _router(i, k, x, wg, logits, arrived, topk_ids, topk_w, topk_ids, topk_ids, T, H, E, BT, BE, BK, RH, WHOLE,
            TOP_K, KP, SU, False)   # no fill, slots


@triton.jit
def moe_router_place(i, k, x, wg, logits, arrived, topk_ids, topk_w, fill, slots, counts, tile_end, ntiles, T, H,
                     E, E_local, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, RH: tl.constexpr,
                     WHOLE: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, SU: tl.constexpr,
                     BM: tl.constexpr):
    """moe_router on one rank: the routing places the slots (moe_route_place), and the last token
    block routed builds the tile table (moe_tile_table_take)."""
    if _router(i, k, x, wg, logits, arrived, topk_ids, topk_w, fill, slots, T, H, E, BT, BE, BK, RH, WHOLE, TOP_K,
               KP, SU, True):
        blocks = tl.cdiv(T, BT)
        if _arrive(arrived + blocks, blocks):
            moe_tile_table_take(fill, counts, tile_end, ntiles, E_local, BM, BE)


@triton.jit
def moe_dispatch(d, b, c, x, topk_ids, recv, recv_peers, recv_expert, recv_expert_peers, T, H, E_local, RANK,
                 WORLD, TOP_K: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr, WH: tl.constexpr):
    """My (token, k) slots [b*BS, (b+1)*BS) whose expert lives on rank me + d: their hidden columns
    [c*WH, (c+1)*WH) into its recv[me], and (slab 0) its recv_expert[me] marked with the local
    expert (-1 for slots it does not serve)."""
    dst = (RANK + d) % WORLD
    S = _i64(T) * TOP_K
    # aligned_peer, not peer_base: a pointer loaded from the table is stored through 2 bytes at a
    # time (st.global.b16, one NVLink write each); as an offset from `recv` the stores are 16-byte
    recv_d = aligned_peer(recv, recv_peers, dst) + RANK * S * H
    expert_d = aligned_peer(recv_expert, recv_expert_peers, dst) + RANK * S
    s = b * BS + tl.arange(0, BS).to(tl.int64)
    ok = s < S
    ids = tl.load(topk_ids + s, mask=ok, other=0)
    mine = ((ids // E_local) == dst) & ok
    if c == 0:
        tl.store(expert_d + s, tl.where(mine, ids % E_local, -1), mask=ok)
    tok = s // TOP_K
    for h0 in range(c * WH, tl.minimum(H, (c + 1) * WH), BH):
        h = h0 + tl.arange(0, BH)
        m = mine[:, None] & (h[None, :] < H)
        tl.store(recv_d + s[:, None] * H + h[None, :], tl.load(x + tok[:, None] * H + h[None, :], mask=m), mask=m)


@triton.jit
def moe_plan(e, recv_expert, counts, slots, T, WORLD, TOP_K: tl.constexpr, BS: tl.constexpr):
    """counts[e] = how many received slots expert e serves; slots[e, :counts[e]] = which (stream compaction)."""
    n_all = WORLD * T * TOP_K
    base = tl.zeros((), tl.int64)
    for s0 in range(0, n_all, BS):
        s = s0 + tl.arange(0, BS)
        hit = (tl.load(recv_expert + s, mask=s < n_all, other=-1) == e).to(tl.int64)
        pos = base + tl.cumsum(hit, 0) - 1
        tl.store(slots + e * (WORLD * T) + pos, s.to(tl.int64), mask=hit != 0)
        base += tl.sum(hit, 0)
    tl.store(counts + e, base)


@triton.jit
def moe_plan_table(e, recv_expert, counts, slots, arrived, tile_end, ntiles, T, WORLD, E_local, TOP_K: tl.constexpr,
                   BS: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr):
    """moe_plan, and the last of the experts' plans to arrive builds the tile table (moe_tile_table;
    moe_layer's fuse_router: its count is arrived[cdiv(T, BT)])."""
    moe_plan(e, recv_expert, counts, slots, T, WORLD, TOP_K, BS)
    if _arrive(arrived + tl.cdiv(T, BT), E_local):
        moe_tile_table(counts, tile_end, ntiles, E_local, BM, BE)


@triton.jit
def _tile_table(n_rows, tile_end, ntiles, es, E_local, BM: tl.constexpr):
    n = (n_rows + BM - 1) // BM
    tl.store(tile_end + es, tl.cumsum(n, 0), mask=es < E_local)
    tl.store(ntiles, tl.sum(n, 0))


@triton.jit
def moe_tile_table(counts, tile_end, ntiles, E_local, BM: tl.constexpr, BE: tl.constexpr):
    """Row tiles of BM slots per expert, numbered expert after expert: tile_end[e] = the first tile
    after expert e's (an inclusive prefix sum), ntiles = all of them."""
    es = tl.arange(0, BE)
    _tile_table(tl.load(counts + es, mask=es < E_local, other=0), tile_end, ntiles, es, E_local, BM)


@triton.jit
def moe_tile_table_take(fill, counts, tile_end, ntiles, E_local, BM: tl.constexpr, BE: tl.constexpr):
    """moe_tile_table on one rank: the counts are fill's (moe_route_place), taken into `counts` and
    fill zeroed for the next launch."""
    es = tl.arange(0, BE)
    n = tl.load(fill + es, mask=es < E_local, other=0)
    tl.store(counts + es, n, mask=es < E_local)
    tl.store(fill + es, tl.zeros_like(n), mask=es < E_local)
    _tile_table(n, tile_end, ntiles, es, E_local, BM)


@triton.jit
def _expert_tile(j, counts, tile_end, E_local, BM: tl.constexpr, BE: tl.constexpr):
    """Row tile j of the table: its expert, its first row among the expert's slots, and how many
    rows it has (1..BM)."""
    es = tl.arange(0, BE)
    ends = tl.load(tile_end + es, mask=es < E_local, other=2 ** 40)
    before = ends <= j                                  # experts whose tiles all come before j
    e = tl.sum(before.to(tl.int32), 0).to(tl.int64)
    r0 = (j - tl.max(tl.where(before, ends, 0), 0)) * BM
    return e, r0, tl.minimum(tl.load(counts + e) - r0, BM)


@triton.jit
def _tile_rows(e, r0, n, slots, T, WORLD, ROWS: tl.constexpr):
    """The tile's received-slot rows (ROWS of them, the first n real) and which exist."""
    r = tl.arange(0, ROWS)
    rok = r < n
    return tl.load(slots + e * (WORLD * T) + r0 + r, mask=rok, other=0), rok


@triton.jit
def _token_rows(recv, arows, rok, kk, H):
    """The tile's gathered token rows, contraction columns kk (a gather: pointer loads)."""
    return tl.load(recv + arows[:, None] * H + kk[None, :], mask=rok[:, None] & (kk[None, :] < H), other=0.0)


@triton.jit
def _gate_up_cols(n, I, BN: tl.constexpr, ILV: tl.constexpr):
    """The first weight columns of gate and up block n (BN wide): [gate | up] (ILV = 0), or gate and
    up blocks of ILV columns interleaved (ILV a multiple of BN: block n lies within one of them)."""
    if ILV == 0:
        return n * BN, I + n * BN
    else:
        c = (n * BN) // ILV * (2 * ILV) + (n * BN) % ILV
        return c, c + ILV


@triton.jit
def _gate_up_tile(e, r0, m, n, recv, w_gate_up, slots, act, T, H, I, WORLD, TOP_K: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, ONE_RANK: tl.constexpr,
                  ILV: tl.constexpr, SWAP: tl.constexpr = False, STAGES: tl.constexpr = 0):
    """act[rows, n*BN:(n+1)*BN] for the m rows of expert e's slots from r0 on, in a BM-row body
    (moe_gate_up; the rows are loaded here: a branch's values must keep one shape). SWAP (the one
    descriptor path): computed transposed, the weights on the MMA's M side and BM rows on its N,
    its loop in STAGES pipeline stages (0: the kernel's)."""
    rows, rok = _tile_rows(e, r0, m, slots, T, WORLD, BM)
    arows = rows // TOP_K if ONE_RANK else rows          # one rank: `recv` is x, slot s is token s // k
    wgu = w_gate_up + e * H * 2 * I
    js = n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    gc, uc = _gate_up_cols(n, I, BN, ILV)
    if TMA and ILV == BN:
        # gate and up block n side by side in the weight: one dot 2 x BN wide, split after the loop
        # (one H200, standalone, 128 x 256 x 64 tiles: 5-13% faster than two BN-wide dots)
        w_d = tl.make_tensor_descriptor(wgu, shape=[H, 2 * I], strides=[2 * I, 1], block_shape=[BK, 2 * BN])
        if SWAP:
            acc_t = tl.zeros((2 * BN, BM), tl.float32)
            for k0 in tl.range(0, H, BK, num_stages=STAGES if STAGES > 0 else None):
                acc_t = _dot(tl.trans(w_d.load([k0, gc])), tl.trans(_token_rows(recv, arows, rok, k0 + ks, H)), acc_t)
            acc = tl.trans(acc_t)
        else:
            acc = tl.zeros((BM, 2 * BN), tl.float32)
            for k0 in range(0, H, BK):
                acc = _dot(_token_rows(recv, arows, rok, k0 + ks, H), w_d.load([k0, gc]), acc)
        g, u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    else:
        g = tl.zeros((BM, BN), tl.float32)
        u = tl.zeros((BM, BN), tl.float32)
        if TMA:   # one descriptor over both: columns of a ragged last gate block read up's, stored nowhere
            w_d = tl.make_tensor_descriptor(wgu, shape=[H, 2 * I], strides=[2 * I, 1], block_shape=[BK, BN])
            for k0 in range(0, H, BK):
                a = _token_rows(recv, arows, rok, k0 + ks, H)
                g = _dot(a, w_d.load([k0, gc]), g)
                u = _dot(a, w_d.load([k0, uc]), u)
        else:
            jb = tl.arange(0, BN)
            for k0 in range(0, H, BK):
                kk = k0 + ks
                a = _token_rows(recv, arows, rok, kk, H)
                bm = (kk[:, None] < H) & (js[None, :] < I)
                bg = tl.load(wgu + kk[:, None] * (2 * I) + gc + jb[None, :], mask=bm, other=0.0)
                bu = tl.load(wgu + kk[:, None] * (2 * I) + uc + jb[None, :], mask=bm, other=0.0)
                g = _dot(a, bg, g)
                u = _dot(a, bu, u)
    tl.store(act + rows[:, None] * I + js[None, :], (g * tl.sigmoid(g) * u).to(act.dtype.element_ty),
             mask=rok[:, None] & (js[None, :] < I))


@triton.jit
def moe_gate_up(j, n, recv, w_gate_up, counts, slots, tile_end, ntiles, act, T, H, I, E_local, WORLD,
                TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
                TMA: tl.constexpr, ONE_RANK: tl.constexpr, HALF: tl.constexpr, ILV: tl.constexpr,
                SMALL: tl.constexpr = 0, SMALL_STAGES: tl.constexpr = 0):
    """act[rows of tile j, n*BN:(n+1)*BN] = silu(x @ w_gate) * (x @ w_up); tiles past ntiles do
    nothing (they still notify, so the down tiles of every tile can wait on a fixed element).
    TMA: the expert's weights load through a descriptor (the token rows are a gather: pointers).
    ONE_RANK: `recv` is x itself (the graph binds it), slot s is token s // TOP_K: nothing is copied.
    A compile-time choice: selected at run time, the operand's address lost the alignment Triton
    vectorises and pipelines on (records moe_onerank_ab).
    HALF: a tile with at most BM / 2 rows (an expert's last) runs a BM / 2-row body.
    SMALL: a tile with at most SMALL rows runs a SMALL-row body computed transposed (decode: a
    wgmma is 64 rows, so a one-token tile of 64 did 64x its work; 0: none), its loop in SMALL_STAGES
    pipeline stages (0: the kernel's; its stages take less shared memory than the BM-row body's).
    ILV: w_gate_up's layout, [gate | up] (0) or their column blocks of ILV interleaved (ILV = BN:
    one dot over both)."""
    if j < tl.load(ntiles):
        e, r0, m = _expert_tile(j, counts, tile_end, E_local, BM, BE)
        if SMALL > 0:
            if m <= SMALL:
                _gate_up_tile(e, r0, m, n, recv, w_gate_up, slots, act, T, H, I, WORLD, TOP_K, SMALL, BN, BK, TMA,
                              ONE_RANK, ILV, True, SMALL_STAGES)
            else:
                _gate_up_rows(e, r0, m, n, recv, w_gate_up, slots, act, T, H, I, WORLD, TOP_K, BM, BN, BK, TMA,
                              ONE_RANK, HALF, ILV)
        else:
            _gate_up_rows(e, r0, m, n, recv, w_gate_up, slots, act, T, H, I, WORLD, TOP_K, BM, BN, BK, TMA, ONE_RANK,
                          HALF, ILV)


@triton.jit
def _gate_up_rows(e, r0, m, n, recv, w_gate_up, slots, act, T, H, I, WORLD, TOP_K: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, ONE_RANK: tl.constexpr, HALF: tl.constexpr,
                  ILV: tl.constexpr):
    """_gate_up_tile in a BM-row body, or (HALF) a BM / 2-row one where the m rows fit."""
    if HALF:
        if m <= BM // 2:
            _gate_up_tile(e, r0, m, n, recv, w_gate_up, slots, act, T, H, I, WORLD, TOP_K, BM // 2, BN, BK,
                          TMA, ONE_RANK, ILV)
        else:
            _gate_up_tile(e, r0, m, n, recv, w_gate_up, slots, act, T, H, I, WORLD, TOP_K, BM, BN, BK, TMA,
                          ONE_RANK, ILV)
    else:
        _gate_up_tile(e, r0, m, n, recv, w_gate_up, slots, act, T, H, I, WORLD, TOP_K, BM, BN, BK, TMA, ONE_RANK,
                      ILV)


@triton.jit
def _down_tile(e, r0, m, h, act, w_down, slots, expert_out, T, H, I, WORLD, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, TMA: tl.constexpr, SWAP: tl.constexpr = False, STAGES: tl.constexpr = 0):
    """expert_out[rows, h*BN:(h+1)*BN] for the m rows of expert e's slots from r0 on (moe_down).
    SWAP (with TMA): computed transposed, as _gate_up_tile's, in STAGES stages."""
    rows, rok = _tile_rows(e, r0, m, slots, T, WORLD, BM)
    wd = w_down + e * I * H
    hs = h * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    out = tl.zeros((BM, BN), tl.float32)
    if TMA:
        d_d = tl.make_tensor_descriptor(wd, shape=[I, H], strides=[H, 1], block_shape=[BK, BN])
        if SWAP:
            out_t = tl.zeros((BN, BM), tl.float32)
            for i0 in tl.range(0, I, BK, num_stages=STAGES if STAGES > 0 else None):
                js = i0 + ks
                a = tl.load(act + rows[:, None] * I + js[None, :], mask=rok[:, None] & (js[None, :] < I), other=0.0)
                out_t = _dot(tl.trans(d_d.load([i0, h * BN])), tl.trans(a), out_t)
            out = tl.trans(out_t)
        else:
            for i0 in range(0, I, BK):
                js = i0 + ks
                a = tl.load(act + rows[:, None] * I + js[None, :], mask=rok[:, None] & (js[None, :] < I), other=0.0)
                out = _dot(a, d_d.load([i0, h * BN]), out)
    else:
        for i0 in range(0, I, BK):
            js = i0 + ks
            a = tl.load(act + rows[:, None] * I + js[None, :], mask=rok[:, None] & (js[None, :] < I), other=0.0)
            dn = tl.load(wd + js[:, None] * H + hs[None, :], mask=(js[:, None] < I) & (hs[None, :] < H), other=0.0)
            out = _dot(a, dn, out)
    tl.store(expert_out + rows[:, None] * H + hs[None, :], out.to(expert_out.dtype.element_ty),
             mask=rok[:, None] & (hs[None, :] < H))


@triton.jit
def moe_down(j, h, act, w_down, counts, slots, tile_end, expert_out, T, H, I, E_local, WORLD,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, TMA: tl.constexpr,
             HALF: tl.constexpr, SMALL: tl.constexpr = 0, SMALL_STAGES: tl.constexpr = 0):
    """expert_out[rows of tile j, h*BN:(h+1)*BN] = act[rows] @ w_down[e][:, those columns]
    (HALF, SMALL, SMALL_STAGES: as moe_gate_up's)."""
    e, r0, m = _expert_tile(j, counts, tile_end, E_local, BM, BE)
    if SMALL > 0:
        if m <= SMALL:
            _down_tile(e, r0, m, h, act, w_down, slots, expert_out, T, H, I, WORLD, SMALL, BN, BK, TMA, True,
                       SMALL_STAGES)
        else:
            _down_rows(e, r0, m, h, act, w_down, slots, expert_out, T, H, I, WORLD, BM, BN, BK, TMA, HALF)
    else:
        _down_rows(e, r0, m, h, act, w_down, slots, expert_out, T, H, I, WORLD, BM, BN, BK, TMA, HALF)


@triton.jit
def _down_rows(e, r0, m, h, act, w_down, slots, expert_out, T, H, I, WORLD, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, TMA: tl.constexpr, HALF: tl.constexpr):
    """_down_tile in a BM-row body, or (HALF) a BM / 2-row one where the m rows fit."""
    if HALF:
        if m <= BM // 2:
            _down_tile(e, r0, m, h, act, w_down, slots, expert_out, T, H, I, WORLD, BM // 2, BN, BK, TMA)
        else:
            _down_tile(e, r0, m, h, act, w_down, slots, expert_out, T, H, I, WORLD, BM, BN, BK, TMA)
    else:
        _down_tile(e, r0, m, h, act, w_down, slots, expert_out, T, H, I, WORLD, BM, BN, BK, TMA)


@triton.jit
def moe_send_back(d, b, c, recv_expert, expert_out, back, back_peers, T, H, RANK, WORLD,
                  TOP_K: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr, WH: tl.constexpr):
    """The outputs of rank me + d's slots [b*BS, (b+1)*BS) that my experts served, hidden columns
    [c*WH, (c+1)*WH), into its back[me]."""
    dst = (RANK + d) % WORLD
    S = _i64(T) * TOP_K
    back_d = aligned_peer(back, back_peers, dst) + RANK * S * H   # 16-byte stores (see moe_dispatch)
    s = b * BS + tl.arange(0, BS).to(tl.int64)
    mine = tl.load(recv_expert + dst * S + s, mask=s < S, other=-1) >= 0
    for h0 in range(c * WH, tl.minimum(H, (c + 1) * WH), BH):
        h = h0 + tl.arange(0, BH)
        m = mine[:, None] & (h[None, :] < H)
        v = tl.load(expert_out + (dst * S + s)[:, None] * H + h[None, :], mask=m)
        tl.store(back_d + s[:, None] * H + h[None, :], v, mask=m)


@triton.jit
def _combine_rows(b, c, topk_ids, topk_w, back, y, T, H, E_local, TOP_K: tl.constexpr, KP: tl.constexpr,
                  BM: tl.constexpr, BH: tl.constexpr, WH: tl.constexpr):
    """Token block b (BM tokens), hidden slab c (WH columns, in steps of BH)."""
    S = T * TOP_K
    t = b * BM + tl.arange(0, BM)
    ok = t < T
    ks = tl.arange(0, KP)
    # the routing read once, so each column step waits on one load (the rows), not two
    kmask = ok[:, None] & (ks[None, :] < TOP_K)
    owners = tl.load(topk_ids + t[:, None] * TOP_K + ks[None, :], mask=kmask, other=0) // E_local
    weights = tl.load(topk_w + t[:, None] * TOP_K + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
    for h0 in range(c * WH, tl.minimum(H, (c + 1) * WH), BH):
        h = h0 + tl.arange(0, BH)
        m = ok[:, None] & (h[None, :] < H)
        acc = tl.zeros((BM, BH), tl.float32)
        for kk in tl.static_range(TOP_K):
            owner = tl.sum(tl.where(ks[None, :] == kk, owners, 0), 1)
            w = tl.sum(tl.where(ks[None, :] == kk, weights, 0.0), 1)
            v = tl.load(back + (owner * S + t * TOP_K + kk)[:, None] * H + h[None, :], mask=m, other=0.0)
            acc += w[:, None] * v.to(tl.float32)
        tl.store(y + _i64(t)[:, None] * H + h[None, :], acc.to(y.dtype.element_ty), mask=m)


@triton.jit
def moe_combine(i, c, G, topk_ids, topk_w, back, y, T, H, E_local, TOP_K: tl.constexpr, KP: tl.constexpr,
                BM: tl.constexpr, BH: tl.constexpr, WH: tl.constexpr, STRIDED: tl.constexpr):
    """y[token, slab c] = sum over k of weight[token, k] * back[owner of its k-th expert, its slot]:
    token block i of BM tokens (STRIDED: blocks i, i + G, ..., G the grid's rows, which the graph
    binds), hidden columns [c*WH, (c+1)*WH) (one rank: `back` is expert_out, the same [owner = 0,
    slot] layout)."""
    if STRIDED:
        for b in range(i, tl.cdiv(T, BM), G):
            _combine_rows(b, c, topk_ids, topk_w, back, y, T, H, E_local, TOP_K, KP, BM, BH, WH)
    else:
        _combine_rows(i, c, topk_ids, topk_w, back, y, T, H, E_local, TOP_K, KP, BM, BH, WH)
