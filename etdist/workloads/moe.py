"""An expert-parallel MoE layer whose routing decides, at run time, which tasks exist.

Every rank holds T tokens x [T, H], the router wg [H, E] and its E_local = E / R experts (SwiGLU:
w_gate_up [E_local, H, 2I], w_down [E_local, I, H]). Per rank, every task one block of work:

    logits     tokens block i x hidden slice k: x @ wg, summed over the slices by route
    route      tokens block i (topk_block): softmax(logits) -> top-k experts and renormalised weights
    dispatch   slot block b of my (token, k) slots -> the rank owning each slot's expert (peer stores)
    plan       per local expert e: which received slots it serves -> counts[e], slots[e]
    tile_table row tiles of BM slots, expert after expert: tile_end[e], ntiles   (the routing decides)
    gate_up    row tile j x column block n of I: act = silu(x @ w_gate) * (x @ w_up)
    down       row tile j x column block h of H: expert_out = act @ w_down      (only j < ntiles)
    send_back  slot block b of rank me + d's slots that my experts served -> back to it
    combine    tokens blocks i, i + G, ... x hidden slab c: y[t] = sum_k weight[t, k] * out[t, k]

Built for one rank (one_rank=True) nothing moves and nothing is planned: route places each slot in
its expert's list itself (slots[e, fill[e]++], an atomic per slot on GPUs; tile_table takes the
counts and leaves `fill` zero), gate/up reads each slot's token from x, the combine reads
expert_out; the graph has no dispatch, plan or send_back tasks.

Fused (fuse_router=True, nn.MoE's small tile class at EP=1) logits and route are one `router` task
kind and tile_table is no task: the last logits slice of a token block to arrive (an acq_rel count
in the zeroed `arrived`) routes the block, and the last block routed (one rank) or the last plan
(more) builds the table; every one of those tasks notifies `tiled`, and `done` counts the down
tiles alone.

The row tiles live in a worst-case grid (cdiv(R*S, BM) + min(E_local, R*S): every expert that
received a slot may end in a partial tile); `done` expects one notify per existing down tile plus
(unfused) one from tile_table, so a rank whose experts received no token still completes, and its waiters wait
on `tiled` first, because the count reads `ntiles`, which only exists once tile_table ran. gate_up
tiles past ntiles run as no-ops that still notify, so every down tile waits on a fixed element (the
dynamic schedule needs that).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import etdist.fusion as et   # the graph builder (what `import etdist as et` offers), not the package root
from etdist.kernels import moe_tiles
from etdist.kernels.gemm_tiles import use_tma

from .params import positive_int


# The routing loads the router slices' logits this many fp32 values at a time at most (64 registers
# a thread at 8 warps; 0: one slice at a time)
ROUTE_SUM_ELEMENTS = 16384

# moe_logits' one-load form takes router slices of at most this many bytes (qwen3's 256 x 128 bf16
# slices: 64 KB; 512 experts, or 256 in float32, would need more shared memory than an SM has)
WHOLE_SLICE_BYTES = 65536

def router_block(num_experts: int) -> int:
    """The router's block of experts (a Triton block: a power of two, at least 16): its logits'
    columns, and what router slice bytes are counted in."""
    return max(16, 1 << (num_experts - 1).bit_length())


# The expert GEMM tiles walk groups of this many row tiles per weight column block (et.grouped;
# records moe_group_ab)
GROUP_M = 8


def moe_layer(top_k: int = 2, block_m: int = 4, dtype: torch.dtype = torch.float32, max_experts: int = 128,
              block: int = 16, block_n: int | None = None, align: int = 1, route_block: int = 16,
              plan_block: int = 1024, one_rank: bool = False, down_block_n: int | None = None,
              half_tails: bool = False, topk_block: int | None = None, combine_block: int | None = None,
              combine_width: int | None = None, combine_tasks: int | None = None,
              gate_up_interleave: int | None = None, small_rows: int = 0,
              router_width: int | None = None, fuse_router: bool = False, small_stages: int = 0) -> et.Graph:
    """The graph. GPU bodies (etdist.kernels.moe_tiles) use `block`-wide blocks (>= 16; `block_n`
    columns per expert GEMM tile, default `block`) and route over up to `max_experts` experts in one
    block (E must not exceed it). align: H and I are promised multiples of it (16 lets the GPU
    kernel vectorise its loads, which is what lets Triton pipeline the expert GEMMs' loops).
    The expert GEMM tiles run in groups of GROUP_M row tiles per weight column block (et.grouped).
    The router's chain (logits to tile_table) is pinned (TaskSpec.pinned: the static formula under
    the dynamic schedule too); the return and the combine are the tail (TaskSpec.tail: under the
    dynamic schedule, dealt by the static formula once the queue is drained, so they spin instead
    of each waiting for a queue hop).
    route_block: tokens per router task (the logits' and the routing's blocks; 16 is tl.dot's
    least, what decode wants); a logits task takes router_width hidden columns (default 4 * block),
    the routing sums the cdiv(H, router_width) slices. plan_block: received slots per step of an
    expert's plan (its stream compaction walks all of them in steps of this many).
    one_rank: a graph for world size 1 only (refused on more) that moves no rows and plans nothing
    (route places the slots in the experts' lists).
    fuse_router: one `router` task kind (token block x hidden slice) in place of logits and route,
    the last slice of a token block to arrive routing it, and no tile_table task: on one rank the
    last block routed builds the table, on more the last plan task (acq_rel counts in `arrived`,
    no event hop between the steps); needs topk_block = route_block.
    small_rows: an expert GEMM tile with at most this many rows runs a body of that many, computed
    transposed on GPUs (the weights on the MMA's 64-row side; 0: none), its loop in small_stages
    pipeline stages (0: the kernel's num_stages).
    down_block_n: columns per down tile (default block_n). half_tails: an expert's last row tile,
    where it has at most block_m / 2 rows, runs a block_m / 2-row GEMM body (needs block_m >= 32).
    topk_block: tokens per routing (softmax top-k) task, at most route_block (default route_block).
    combine_block, combine_width: tokens and hidden columns per combine task (default block_m and
    8 * block): the combine is the launch's tail, so its tasks should cover the SMs. A combine task
    steps over its columns min(block, combine_width) at a time, each step loading its top_k rows.
    combine_tasks: the combine grid has min(token blocks, cdiv(combine_tasks, slabs)) rows (None:
    one per token block), a task taking every rows-th token block: about combine_tasks tasks, never
    fewer than the slabs, however many tokens.
    gate_up_interleave: w_gate_up's layout. None: [gate | up] along its last dimension; N: their
    column blocks of N interleaved, [gate 0:N | up 0:N | gate N:2N | up N:2N | ...]
    (interleave_gate_up; I must be a multiple of N, and N of block_n). Where N = block_n and the
    weights load through TMA (align 16), a GPU gate/up tile reads both halves in one box and runs
    one dot twice as wide."""
    positive_int("moe_layer", "top_k", top_k)
    widths = (("route_block", route_block), ("plan_block", plan_block)) + tuple(
        (name, v) for name, v in (("down_block_n", down_block_n), ("topk_block", topk_block),
                                  ("combine_block", combine_block), ("combine_width", combine_width),
                                  ("router_width", router_width))
        if v is not None)
    for name, v in widths:
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise et.GraphError(f"moe_layer: {name} must be a power of two >= 16 (a Triton block), got {v!r}")
    if combine_tasks is not None and (isinstance(combine_tasks, bool) or not isinstance(combine_tasks, int)
                                      or not 1 <= combine_tasks < 2 ** 31):
        raise et.GraphError(f"moe_layer: combine_tasks must be a positive int (below 2**31), got {combine_tasks!r}")
    if topk_block is not None and topk_block > route_block:
        raise et.GraphError(f"moe_layer: topk_block ({topk_block}) must not exceed route_block ({route_block}): "
                            "a routing task waits on the one logits block that holds its tokens")
    ILV = gate_up_interleave or 0
    if gate_up_interleave is not None:
        if isinstance(ILV, bool) or not isinstance(ILV, int) or ILV < 1 or ILV % (block_n or block):
            raise et.GraphError(f"moe_layer: gate_up_interleave must be a positive multiple of block_n "
                                f"({block_n or block}: a gate/up tile's columns lie in one block), got {ILV!r}")
    if small_rows and (isinstance(small_rows, bool) or not isinstance(small_rows, int) or small_rows < 16
                       or small_rows & (small_rows - 1) or small_rows >= block_m):
        raise et.GraphError(f"moe_layer: small_rows must be 0 or a power of two >= 16 below block_m={block_m} "
                            f"(a tl.dot's least), got {small_rows!r}")
    if fuse_router and topk_block not in (None, route_block):
        raise et.GraphError(f"moe_layer: fuse_router routes whole logits blocks: topk_block must be None or "
                            f"route_block ({route_block}), got {topk_block!r}")
    if (isinstance(small_stages, bool) or not isinstance(small_stages, int) or small_stages < 0
            or (small_stages and not small_rows)):
        raise et.GraphError(f"moe_layer: small_stages must be an int >= 0, and 0 without small_rows (they are the "
                            f"small body's stages), got {small_stages!r}")
    if half_tails and block_m < 32:
        raise et.GraphError(f"moe_layer: half_tails needs block_m >= 32 (half a tile is a tl.dot of >= 16 rows), "
                            f"got block_m={block_m}")
    BN, BND = block_n or block, down_block_n or block_n or block
    g = et.Graph("moe")
    T, E, EL = g.size("T"), g.size("E"), g.size("E_local")
    H, I = g.size("H", multiple_of=align), g.size("I", multiple_of=align)
    R, me = g.world, g.rank
    S = T * top_k                                      # (token, k) slots per rank
    g.check(et.eq(EL * R, E), "the number of experts must be world size x experts per rank")
    if one_rank:
        g.check(et.eq(R, 1), "this MoE graph was built for one rank (moe_layer(one_rank=True))")
    g.check(E >= top_k, f"top_k={top_k} needs at least {top_k} experts")
    # an expert with no hidden units (I = 0) has no gate/up tiles, and those are what order the
    # down tiles after the routing; no features (H = 0) has nothing to route
    g.check(et.logical_and(H >= 1, I >= 1), "H (the hidden size, x [T, H]) and I (the expert "
            "intermediate size, w_down [E_local, I, H]) must be >= 1")
    BE = router_block(max_experts)
    g.check(E <= BE, f"the GPU router holds at most {BE} experts (moe_layer(max_experts=...))")
    if ILV:
        g.check(et.eq(I % ILV, 0), f"w_gate_up's interleaved blocks ({ILV} columns, moe_layer(gate_up_interleave=)) "
                "need I, the expert intermediate size, to be a multiple of them")
    BS = block                                         # slots per dispatch / send_back block
    KP = 1 << (top_k - 1).bit_length()                 # top_k as a Triton block (a power of two)
    # One task over all of H is a long chain of load latencies, even at one token: copies and sums take
    # slabs of WH columns and the router's logits RH-column slices, run side by side (records moe_trace)
    WH, RH = 8 * block, router_width or 4 * block
    slabs, slices = et.cdiv(H, WH), et.cdiv(H, RH)
    one = bool(one_rank)
    copy = dict(TOP_K=top_k, BS=BS, BH=2 * block, WH=WH)
    # weights through TMA where rows are aligned
    expert_gemm = dict(BM=block_m, BK=block, BE=BE, TMA=bool(use_tma(align)), HALF=bool(half_tails),
                       SMALL=small_rows, SMALL_STAGES=small_stages)
    # every expert that received a slot may end in a partial tile (at most min(E_local, R*S) do):
    max_tiles = et.cdiv(R * S, block_m) + et.minimum(EL, R * S)
    slot_blocks = et.cdiv(S, BS)

    g.input("x", (T, H), dtype)
    g.input("wg", (H, E), dtype)
    g.input("w_gate_up", (EL, H, 2 * I), dtype)
    g.input("w_down", (EL, I, H), dtype)
    g.scratch("logits", (slices, T, BE), torch.float32)    # per hidden slice, summed by route
    g.scratch("topk_ids", (T, top_k), torch.int64)
    g.scratch("topk_w", (T, top_k), dtype)
    if one:                                                        # route places the slots itself
        g.scratch("fill", (EL,), torch.int64, zeroed=True)         # slots placed per expert so far
    else:
        g.scratch("recv", (R, S, H), dtype, symmetric=True)            # on the expert's rank: [src, slot]
        g.scratch("recv_expert", (R, S), torch.int64, symmetric=True)  # local expert of a slot, or -1
    g.scratch("counts", (EL,), torch.int64)                        # slots each local expert serves
    g.scratch("slots", (EL, R * T), torch.int64)                   # which (flattened [src, slot])
    g.scratch("tile_end", (EL,), torch.int64)                      # first row tile after expert e's
    ntiles = g.scratch("ntiles", (1,), torch.int64)
    g.scratch("act", (R * S, I), dtype)                            # SwiGLU activations
    g.scratch("expert_out", (R, S, H), dtype)
    if not one:
        g.scratch("back", (R, S, H), dtype, symmetric=True)        # on the token's rank: [owner, slot]
    g.output("y", (T, H), dtype)

    # The router's logits accumulate in fp32 (bf16 products are exact in it; fp32 inputs take an
    # IEEE dot on CUDA cores): it must pick the experts a float32 reference picks. Blocks of 16
    # tokens (route_block), tl.dot's minimum, at decode: a 64-row block did 64x the work of one
    # token; thousands of tokens want larger ones, fewer tasks (records moe_onerank_ab).
    BT = route_block
    # Routing tasks take topk_block tokens each (default route_block): a routing task is a chain of
    # slice loads and top-k steps on one SM, so smaller blocks spread it over more SMs (records moe_route_ab)
    BTK = topk_block or route_block
    # slices summed SU at a time (independent loads in flight, not one load latency per slice); the
    # register budget assumes nn.MoE's 8 warps (at 4 a thread holds twice as many values)
    SU = max(1, min(8, ROUTE_SUM_ELEMENTS // (BTK * BE)))
    fuse, blocks = bool(fuse_router), et.cdiv(T, BT)
    routers = blocks * slices
    if fuse:
        g.scratch("arrived", (blocks + 1,), torch.int32, zeroed=True)   # slices per block, then blocks
        if one:   # no token, no router task: nothing would build the table that done's count reads
            g.check(T >= 1, "the fused router's one-rank graph (moe_layer(fuse_router=True, one_rank=True)) needs "
                    "at least one token")
    else:
        scored = g.event("scored", (blocks,), count=slices)
    if not (fuse and one):
        routed = g.event("routed", (1,), count=routers if fuse else et.cdiv(T, BTK))
    if not one:
        dispatched = g.event("dispatched", (R,), count=R * slot_blocks * slabs, distributed=True)   # per source
        if not fuse:
            planned = g.event("planned", (1,), count=EL)
    # Fused, the table is built by the last router (one rank) or the last plan task (more), and
    # every one of them notifies tiled; done then counts the down tiles alone (its count reads
    # ntiles, which only the last writes; a rank whose experts received nothing expects none)
    tiled = g.event("tiled", (1,), count=(routers if one else EL) if fuse else 1)
    act_ready = g.event("act_ready", (max_tiles,), count=et.cdiv(I, BN))
    done = g.event("done", (1,), count=lambda _: ntiles[0] * et.cdiv(H, BND) + int(not fuse))
    if not one:
        returned = g.event("returned", (R,), count=R * slot_blocks * slabs, distributed=True)

    # The router, dispatch and tile planning run at every routing: pinned (the static formula under
    # the dynamic schedule too), their chain of five steps costs no queue hop (records moe_pin_ab, moe_trace)
    # Blocks of up to 16 tokens (decode) load a router slice at once where its weights take at most
    # WHOLE_SLICE_BYTES (a dot stages them in shared memory): in steps a one-token task waited for
    # one load after another (4-6% of the layer); 64-token blocks step (the one load was 2% slower
    # at 1024-4096 tokens; records moe_decode_ab)
    whole = BT <= 16 and RH * BE * dtype.itemsize <= WHOLE_SLICE_BYTES
    score_consts = dict(BT=BT, BE=BE, BK=min(block, RH), RH=RH, WHOLE=whole)

    def score(t, i, k):                                  # token block i's logits over hidden slice k
        rows, cols = et.block(i, BT, t.T), et.block(k, RH, t.H)
        t.logits[k, rows, :t.E] = t.x[rows, cols].float() @ t.wg[cols].float()

    def route_rows(t, rows):
        probs = torch.softmax(t.logits[:, rows, :t.E].sum(0), dim=-1)
        w, ids = probs.topk(top_k, dim=-1)
        t.topk_ids[rows] = ids
        t.topk_w[rows] = (w / w.sum(-1, keepdim=True)).to(t.topk_w.dtype)
        if one:                                          # slots[e, fill[e]++] = slot
            slot = torch.arange(rows.start * top_k, rows.stop * top_k)
            for e in ids.unique().tolist():
                mine = slot[ids.flatten() == e]
                at = int(t.fill[e])
                t.slots[e, at:at + mine.numel()] = mine
                t.fill[e] = at + mine.numel()

    def build_table(t):
        if one:                                          # the counts route made; fill left zero
            t.counts[:] = t.fill
            t.fill.zero_()
        n = (t.counts + block_m - 1) // block_m
        t.tile_end[:] = n.cumsum(0)
        t.ntiles[0] = n.sum()

    def arrive(t, at, n):
        """Whether this task is the n-th to arrive at arrived[at] (which it leaves zero)."""
        t.arrived[at] += 1
        if int(t.arrived[at]) < n:
            return False
        t.arrived[at] = 0
        return True

    route_consts = dict(TOP_K=top_k, KP=KP, BE=BE, RH=RH, SU=SU)   # BE, RH: as score_consts
    if fuse:
        # One rank: the last routing builds the table (moe_router_place); more: dispatch follows
        @g.task(grid=(blocks, slices), notify=lambda i, k: tiled[0] if one else routed[0],
                triton=moe_tiles.moe_router_place if one else moe_tiles.moe_router,
                constexprs={**score_consts, **route_consts, **({"BM": block_m} if one else {})}, pinned=True)
        def router(t, i, k):
            score(t, i, k)
            if arrive(t, i, t(slices)):
                route_rows(t, et.block(i, BT, t.T))
                if one and arrive(t, t(blocks), t(blocks)):
                    build_table(t)
    else:
        @g.task(grid=(blocks, slices), notify=lambda i, k: scored[i], triton=moe_tiles.moe_logits,
                constexprs=score_consts, pinned=True)
        def logits(t, i, k):
            score(t, i, k)

        # One rank: route places each slot in its expert's list itself (moe_route_place), no dispatch
        # or plan follows: those walk every slot and held the expert tiles back (records moe_route_place_ab)
        @g.task(grid=(et.cdiv(T, BTK),), wait=lambda i: scored[i // (BT // BTK)], notify=lambda i: routed[0],
                triton=moe_tiles.moe_route_place if one else moe_tiles.moe_route,
                constexprs=dict(route_consts, BT=BTK), pinned=True)
        def route(t, i):
            route_rows(t, et.block(i, BTK, t.T))

    if not one:
        @g.task(grid=(R, slot_blocks, slabs), wait=lambda d, b, c: routed[0],
                notify=lambda d, b, c: dispatched[(me + d) % R], triton=moe_tiles.moe_dispatch, constexprs=copy,
                pinned=True)
        def dispatch(t, d, b, c):                        # my slots in block b whose expert lives on rank me + d
            dst, n_local = (t.rank + d) % t.world, t.E_local
            s, hs = et.block(b, BS, t.T * top_k), et.block(c, WH, t.H)
            ids = t.topk_ids.reshape(-1)[s]
            mine = ids // n_local == dst
            peer = t.peer(dst)
            rows = peer.recv[t.rank][s]                  # a view: the slab of columns written in place
            rows[:, hs][mine] = t.x[torch.arange(s.start, s.stop) // top_k][:, hs][mine]
            if c == 0:                                   # the slots' experts, once
                peer.recv_expert[t.rank][s] = torch.where(mine, ids % n_local, -1)

        # fused: the last plan task to arrive builds the table (moe_plan_table)
        @g.task(grid=(EL,), wait=lambda e: dispatched[me], notify=lambda e: tiled[0] if fuse else planned[0],
                triton=moe_tiles.moe_plan_table if fuse else moe_tiles.moe_plan,
                constexprs=dict(TOP_K=top_k, BS=plan_block, **(dict(BT=BT, BM=block_m, BE=BE) if fuse else {})),
                pinned=True)
        def plan(t, e):
            found = (t.recv_expert.reshape(-1) == e).nonzero().flatten()
            t.counts[e] = found.numel()
            t.slots[e, :found.numel()] = found
            if fuse and arrive(t, t(blocks), t.E_local):
                build_table(t)

    if not fuse:
        @g.task(grid=(1,), wait=lambda _: routed[0] if one else planned[0], notify=lambda _: [tiled[0], done[0]],
                triton=moe_tiles.moe_tile_table_take if one else moe_tiles.moe_tile_table,
                constexprs=dict(BM=block_m, BE=BE), pinned=True)
        def tile_table(t, _):
            build_table(t)

    def expert_rows(t, j):
        """Row tile j: its expert and its rows of the received slots (flattened [src, slot])."""
        e = int((t.tile_end <= j).sum())
        first = int(t.tile_end[e - 1]) if e else 0
        return e, t.slots[e, et.block(j - first, block_m, int(t.counts[e]))]

    # The expert GEMM tiles walk groups of GROUP_M row tiles per weight column block (et.grouped):
    # a wave of programs then reads each weight block once per group, not once per row tile. Row
    # tiles are numbered expert after expert, so a group shares one expert's weights wherever the
    # expert has several (mixtral at 4096 tokens: 16 row tiles per expert; walked row tile after row
    # tile, its 112 gate/up column blocks re-read the expert's weights from HBM for every one).
    gu_tiles, h_tiles = et.cdiv(I, BN), et.cdiv(H, BND)
    gu = lambda q: et.grouped(q, max_tiles, gu_tiles, GROUP_M)   # noqa: E731  (row tile j, column block n)
    dn = lambda q: et.grouped(q, max_tiles, h_tiles, GROUP_M)    # noqa: E731  (row tile j, column block h)

    @g.task(grid=(max_tiles * gu_tiles,), wait=lambda q: tiled[0], notify=lambda q: act_ready[gu(q)[0]],
            triton=moe_tiles.moe_gate_up, constexprs=dict(expert_gemm, BN=BN, TOP_K=top_k, ONE_RANK=one, ILV=ILV),
            bind=dict(j=lambda q: gu(q)[0], n=lambda q: gu(q)[1], **({"recv": "x"} if one else {})))
    def gate_up(t, q):
        j, n = t(gu(q)[0]), t(gu(q)[1])
        if j >= int(t.ntiles[0]):
            return                                       # no such tile at this routing: notify only
        e, rows = expert_rows(t, j)
        cols = et.block(n, BN, t.I)
        x = t.x[rows // top_k] if one else t.recv.reshape(-1, t.H)[rows]   # one rank: slot s is token s // k
        (g0, u0), width = gate_up_columns(cols.start, t.I, ILV), cols.stop - cols.start
        gate = x @ t.w_gate_up[e][:, g0:g0 + width]
        up = x @ t.w_gate_up[e][:, u0:u0 + width]
        t.act[rows, cols] = F.silu(gate) * up

    # act_ready[j] comes after tiled (gate_up waits on it): waiting on both would only walk the
    # dynamic queue's consumers of `tiled` once more per down tile
    @g.task(grid=(max_tiles * h_tiles,), wait=lambda q: act_ready[dn(q)[0]],
            when=lambda q: dn(q)[0] < ntiles[0], notify=lambda q: done[0],
            triton=moe_tiles.moe_down, constexprs=dict(expert_gemm, BN=BND),
            bind=dict(j=lambda q: dn(q)[0], h=lambda q: dn(q)[1]))
    def down(t, q):
        j, h = t(dn(q)[0]), t(dn(q)[1])
        e, rows = expert_rows(t, j)
        cols = et.block(h, BND, t.H)
        t.expert_out.reshape(-1, t.H)[rows, cols] = t.act[rows] @ t.w_down[e][:, cols]

    # tiled first: done's count reads ntiles, which tile_table writes. The return and the combine are
    # the tail: they spin on their waits instead of each waiting for a queue hop (records moe_tail_ab)
    if not one:
        @g.task(grid=(R, slot_blocks, slabs), wait=lambda d, b, c: [tiled[0], done[0]],
                notify=lambda d, b, c: returned[(me + d) % R], triton=moe_tiles.moe_send_back, constexprs=copy,
                tail=True)
        def send_back(t, d, b, c):                       # rank me + d's slots in block b that I served
            dst = (t.rank + d) % t.world
            s, hs = et.block(b, BS, t.T * top_k), et.block(c, WH, t.H)
            mine = t.recv_expert[dst][s] >= 0
            back = t.peer(dst).back[t.rank][s]
            back[:, hs][mine] = t.expert_out[dst][s][:, hs][mine]

    # block-wide column steps: 4 * block made the [BM, BH] accumulator and its top_k unrolled
    # loads spill (1.8 KB per thread at top-8, 64 rows), and the whole megakernel shares one allocation.
    # One rank: the outputs are read where the down tiles left them (no send_back; expert_out has
    # back's [owner = 0, slot] layout).
    # The combine is the tail (nothing overlaps it): its tasks should cover the SMs at every T.
    # Task (i, c) sums token blocks i, i + G, ... (G = the grid's rows: one block each up to
    # combine_tasks tasks, strides past it) over hidden slab c.
    CB, CW, CT = combine_block or block_m, combine_width or WH, combine_tasks or 0
    CS = min(block, CW)
    c_blocks, c_slabs = et.cdiv(T, CB), et.cdiv(H, CW)
    c_rows = et.minimum(c_blocks, et.cdiv(CT, c_slabs)) if CT else c_blocks
    @g.task(grid=(c_rows, c_slabs), wait=lambda i, c: [tiled[0], done[0]] if one else returned[me],
            triton=moe_tiles.moe_combine,
            constexprs=dict(TOP_K=top_k, KP=KP, BM=CB, BH=CS, WH=CW,
                            STRIDED=bool(CT)),
            bind=dict(G=c_rows, **({"back": "expert_out"} if one else {})), tail=True)
    def combine(t, i, c):
        stride, hs = t(c_rows), et.block(c, CW, t.H)
        for b in range(i, t(c_blocks), stride):
            rows = et.block(b, CB, t.T)
            owner = t.topk_ids[rows] // t.E_local                            # [rows, k]
            slot = torch.arange(rows.start * top_k, rows.stop * top_k).view(-1, top_k)
            out = (t.expert_out if one else t.back)[owner, slot][..., hs]    # [rows, k, slab]
            t.y[rows, hs] = (t.topk_w[rows].unsqueeze(-1) * out).sum(1)

    I_sample = 2 * math.lcm(align, ILV or 1)       # whole interleaved blocks
    if one:       # enough experts for top_k on the one rank (the ranks below provide them otherwise)
        g.sample(T=3, H=2 * align, I=I_sample, E=max(2, top_k), E_local=max(2, top_k), WORLD=1)
    for world in () if one else (1, 2, 4):
        g.sample(T=3, H=2 * align, I=I_sample, E=2 * world, E_local=2, WORLD=world)
    return g


def gate_up_columns(c: int, I: int, interleave: int = 0) -> tuple[int, int]:
    """Where gate column c and up column c lie in w_gate_up: [gate | up] (interleave 0), or their
    blocks of `interleave` columns interleaved (c's block holds the columns up to its end)."""
    if not interleave:
        return c, I + c
    g = c // interleave * 2 * interleave + c % interleave
    return g, g + interleave


def interleave_gate_up(w_gate_up: torch.Tensor, block: int) -> torch.Tensor:
    """[..., H, 2I] as [gate | up] -> their column blocks of `block` interleaved (moe_layer's
    gate_up_interleave); I must be a multiple of block."""
    *lead, H, two_i = w_gate_up.shape
    I = two_i // 2
    if two_i % 2 or I % block:
        raise ValueError(f"interleave_gate_up: the last dimension ({two_i}) must be 2 I with I a multiple of {block}")
    gate, up = w_gate_up[..., :I], w_gate_up[..., I:]
    blocks = (*lead, H, I // block, block)
    return torch.stack([gate.reshape(blocks), up.reshape(blocks)], dim=-2).reshape(*lead, H, two_i).contiguous()


def deinterleave_gate_up(w_gate_up: torch.Tensor, block: int) -> torch.Tensor:
    """interleave_gate_up's inverse: interleaved blocks of `block` columns -> [gate | up]."""
    *lead, H, two_i = w_gate_up.shape
    if two_i % (2 * block):
        raise ValueError(f"deinterleave_gate_up: the last dimension ({two_i}) must be whole pairs of "
                         f"{block}-column blocks")
    pairs = w_gate_up.reshape(*lead, H, two_i // (2 * block), 2, block)
    return torch.cat([pairs[..., 0, :].reshape(*lead, H, -1), pairs[..., 1, :].reshape(*lead, H, -1)], dim=-1)


def reference(xs, wg, w_gate_up, w_down, top_k: int) -> list[torch.Tensor]:
    """float64 dense-per-expert reference; w_gate_up/w_down are the full [E, ...] stacks."""
    outs = []
    for x in xs:
        x = x.double()
        probs = torch.softmax(x @ wg.double(), dim=-1)
        w, ids = probs.topk(top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(wg.shape[1]):
            tok, k = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                gate, up = (x[tok] @ w_gate_up[e].double()).chunk(2, dim=-1)
                y.index_add_(0, tok, w[tok, k, None] * ((F.silu(gate) * up) @ w_down[e].double()))
        outs.append(y)
    return outs


# Skewed routing: every token carries SKEW_SHIFT along one direction u; the router scores u
# differently per expert, so expert e's logit gets a bias (skew_router). 8: the token's own
# component along u (~N(0, 1)) moves the bias by ~12%.
SKEW_SHIFT = 8.0


def skew_bias(H: int, E: int, skew: float) -> torch.Tensor:
    """Per expert e, what the router adds along u (tokens carry SKEW_SHIFT * u): a logit bias of
    -skew * ln(e + 1) in units of the Gumbel scale of the logits' noise (x @ router with unit
    normal entries: std sqrt(H)). Top-1 routing then follows roughly Zipf(skew) (Gumbel-max),
    e.g. measured 0.52 / 0.20 / 0.11 of first choices for experts 0 / 1 / 2 of 8 at skew 1.5, H =
    4096 (Zipf: 0.52 / 0.18 / 0.10); skew 0 is uniform. Scaled by sqrt(H) because a fixed offset is
    lost in the noise at model sizes (the offset before it, skew * linspace(1, 0, E), left
    mixtral's routing as even as uniform's at H = 4096: max / mean expert load 1.13 against 1.11)."""
    gumbel_scale = math.sqrt(H) * math.sqrt(6) / math.pi
    return -skew * torch.log(torch.arange(E, dtype=torch.float32) + 1) * gumbel_scale / SKEW_SHIFT


def skew_router(router: torch.Tensor, u: torch.Tensor, skew: float) -> torch.Tensor:
    """router [H, E] (unit normal entries) skewed along the unit vector u: its own component along u
    is taken out first, or the shifted tokens would read it as a random per-expert bias of std
    SKEW_SHIFT logits (found by review: at H = 64 it decided the routing even at skew 0.01); then
    skew_bias goes in its place. skew 0 returns the router as it is."""
    if not skew:
        return router
    bias = skew_bias(router.shape[0], router.shape[1], skew).to(router.device)
    return router - torch.outer(u, u @ router) + torch.outer(u, bias)


def skew_tokens(x: torch.Tensor, u: torch.Tensor, skew: float) -> torch.Tensor:
    """Tokens x [T, H] for a router skewed along u (skew_router): shifted by SKEW_SHIFT * u, or as
    they are at skew 0."""
    return x + SKEW_SHIFT * u if skew else x


def make_inputs(world: int, T: int, H: int, I: int, E: int, seed: int = 0, skew: float = 0.0,
                dtype=torch.float32):
    """Per-rank inputs plus the full expert stacks for the reference.

    skew > 0 biases the router toward low-numbered experts (Zipf-like routing: skew_router).
    """
    gen = torch.Generator().manual_seed(seed)
    wg = torch.randn(H, E, generator=gen)
    u = torch.randn(H, generator=gen)
    u = u / u.norm()
    wg = skew_router(wg, u, skew)
    w1 = torch.randn(E, H, 2 * I, generator=gen) / H ** 0.5
    w2 = torch.randn(E, I, H, generator=gen) / I ** 0.5
    el = E // world
    ranks = [{"x": skew_tokens(torch.randn(T, H, generator=gen), u, skew).to(dtype), "wg": wg.to(dtype),
              "w_gate_up": w1[r * el:(r + 1) * el].to(dtype).contiguous(),
              "w_down": w2[r * el:(r + 1) * el].to(dtype).contiguous()} for r in range(world)]
    return ranks, (wg, w1, w2)
