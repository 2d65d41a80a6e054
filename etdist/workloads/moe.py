"""A small expert-parallel MoE layer whose routing decides, at run time, which tasks exist.

Every rank holds T tokens x [T, H], the router wg [H, E] and its E_local = E / R experts (SwiGLU:
w_gate_up [E_local, H, 2I], w_down [E_local, I, H]). Per rank:

    route      softmax(x @ wg) -> top-k experts and renormalised weights per token
    dispatch   each (token, k) slot goes to the rank owning its expert (peer stores + a signal)
    plan       per local expert: which received slots it serves -> counts[e]; releases expert e
    expert     tile i of expert e exists only if i * BM < counts[e]   (decided by the routing)
    send_back  expert outputs return to the token's rank, expert by expert
    combine    y[t] = sum_k weight[t, k] * expert_out[t, k]

`done[e]` expects one notify per existing tile of e plus one from its plan task, so an expert
that received no token still completes; its waiters wait on `planned[e]` first, because the count
reads `counts[e]`, which only exists once plan(e) ran.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import etdist as et
from etdist.kernels import moe_tiles


def moe_layer(top_k: int = 2, block_m: int = 4, dtype: torch.dtype = torch.float32, max_experts: int = 128,
              block: int = 16) -> et.Graph:
    """The graph. GPU bodies (etdist.kernels.moe_tiles) use `block`-wide tiles (>= 16) and route
    over up to `max_experts` experts in one block (E must not exceed it)."""
    g = et.Graph("moe")
    T, H, I, E, EL = g.size("T"), g.size("H"), g.size("I"), g.size("E"), g.size("E_local")
    R, me = g.world, g.rank
    S = T * top_k                                      # (token, k) slots per rank
    g.check(et.eq(EL * R, E), "the number of experts must be world size x experts per rank")
    g.check(E >= top_k, f"top_k={top_k} needs at least {top_k} experts")
    BE = max(16, 1 << (max_experts - 1).bit_length())
    g.check(E <= BE, f"the GPU router holds at most {BE} experts (moe_layer(max_experts=...))")
    gpu = dict(TOP_K=top_k, BS=4 * block, BH=block)

    g.input("x", (T, H), dtype)
    g.input("wg", (H, E), dtype)
    g.input("w_gate_up", (EL, H, 2 * I), dtype)
    g.input("w_down", (EL, I, H), dtype)
    g.scratch("topk_ids", (T, top_k), torch.int64)
    g.scratch("topk_w", (T, top_k), dtype)
    g.scratch("recv", (R, S, H), dtype, symmetric=True)            # on the expert's rank: [src, slot]
    g.scratch("recv_expert", (R, S), torch.int64, symmetric=True)  # local expert of a slot, or -1
    counts = g.scratch("counts", (EL,), torch.int64)               # slots each local expert serves
    g.scratch("slots", (EL, R * T), torch.int64)                   # which (flattened [src, slot])
    g.scratch("act", (R * S, I), dtype)                            # SwiGLU activations (GPU body)
    g.scratch("expert_out", (R, S, H), dtype)
    g.scratch("back", (R, S, H), dtype, symmetric=True)            # on the token's rank: [owner, slot]
    g.output("y", (T, H), dtype)

    routed = g.event("routed", (1,))
    dispatched = g.event("dispatched", (R,), count=R, distributed=True)       # one per source rank
    planned = g.event("planned", (EL,))
    done = g.event("done", (EL,), count=lambda e: et.cdiv(counts[e], block_m) + 1)
    returned = g.event("returned", (R,), count=R * EL, distributed=True)      # per (source, expert)

    @g.task(grid=(1,), notify=lambda _: routed[0], triton=moe_tiles.moe_route,
            constexprs=dict(TOP_K=top_k, BT=block, BE=BE, BK=block))
    def route(t, _):
        probs = torch.softmax(t.x @ t.wg, dim=-1)
        w, ids = probs.topk(top_k, dim=-1)
        t.topk_ids[:] = ids
        t.topk_w[:] = w / w.sum(-1, keepdim=True)

    @g.task(grid=(R,), wait=lambda d: routed[0], notify=lambda d: dispatched[(me + d) % R],
            triton=moe_tiles.moe_dispatch, constexprs=gpu)
    def dispatch(t, d):                                  # my slots whose expert lives on rank me + d
        dst, n_local = (t.rank + d) % t.world, t.E_local
        ids = t.topk_ids.reshape(-1)
        mine = ids // n_local == dst
        peer = t.peer(dst)
        peer.recv[t.rank][mine] = t.x.repeat_interleave(top_k, dim=0)[mine]
        peer.recv_expert[t.rank] = torch.where(mine, ids % n_local, -1)

    @g.task(grid=(EL,), wait=lambda e: dispatched[me], notify=lambda e: [planned[e], done[e]],
            triton=moe_tiles.moe_plan, constexprs=dict(TOP_K=top_k, BS=4 * block))
    def plan(t, e):
        found = (t.recv_expert.reshape(-1) == e).nonzero().flatten()
        t.counts[e] = found.numel()
        t.slots[e, :found.numel()] = found

    @g.task(grid=(EL, et.cdiv(R * T, block_m)), wait=lambda e, i: planned[e],
            when=lambda e, i: i * block_m < counts[e], notify=lambda e, i: done[e],
            triton=moe_tiles.moe_expert, constexprs=dict(BM=block_m, BH=block, BI=block, BK=block))
    def expert(t, e, i):                                 # SwiGLU on tile i of expert e's slots
        rows = t.slots[e, et.block(i, block_m, int(t.counts[e]))]
        gate, up = (t.recv.reshape(-1, t.H)[rows] @ t.w_gate_up[e]).chunk(2, dim=-1)
        t.expert_out.reshape(-1, t.H)[rows] = (F.silu(gate) * up) @ t.w_down[e]

    # planned[e] first: done[e]'s count reads counts[e], which plan(e) writes
    @g.task(grid=(R, EL), wait=lambda d, e: [planned[e], done[e]], notify=lambda d, e: returned[(me + d) % R],
            triton=moe_tiles.moe_send_back, constexprs=gpu)
    def send_back(t, d, e):                              # expert e's outputs for rank me + d's tokens
        dst = (t.rank + d) % t.world
        mine = t.recv_expert[dst] == e
        t.peer(dst).back[t.rank][mine] = t.expert_out[dst][mine]

    @g.task(grid=(et.cdiv(T, block_m),), wait=lambda i: returned[me], triton=moe_tiles.moe_combine,
            constexprs=dict(TOP_K=top_k, BM=block_m, BH=block))
    def combine(t, i):
        rows = et.block(i, block_m, t.T)
        owner = t.topk_ids[rows] // t.E_local                            # [rows, k]
        slot = torch.arange(rows.start * top_k, rows.stop * top_k).view(-1, top_k)
        out = t.back[owner, slot]                                        # [rows, k, H]
        t.y[rows] = (t.topk_w[rows].unsqueeze(-1) * out).sum(1)

    for world in (1, 2, 4):
        g.sample(T=3, H=2, I=2, E=2 * world, E_local=2, WORLD=world)
    return g


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


def make_inputs(world: int, T: int, H: int, I: int, E: int, seed: int = 0, skew: float = 0.0,
                dtype=torch.float32):
    """Per-rank inputs plus the full expert stacks for the reference.

    skew > 0 biases the router toward low-numbered experts (Zipf-like routing).
    """
    gen = torch.Generator().manual_seed(seed)
    wg = torch.randn(H, E, generator=gen)
    u = torch.randn(H, generator=gen)
    u = u / u.norm()
    # Skew: tokens share a direction u that the router scores higher for low-numbered experts.
    wg = wg + skew * torch.outer(u, torch.linspace(1, 0, E))
    w1 = torch.randn(E, H, 2 * I, generator=gen) / H ** 0.5
    w2 = torch.randn(E, I, H, generator=gen) / I ** 0.5
    el = E // world
    ranks = [{"x": (torch.randn(T, H, generator=gen) + skew * u).to(dtype), "wg": wg.to(dtype),
              "w_gate_up": w1[r * el:(r + 1) * el].to(dtype).contiguous(),
              "w_down": w2[r * el:(r + 1) * el].to(dtype).contiguous()} for r in range(world)]
    return ranks, (wg, w1, w2)
