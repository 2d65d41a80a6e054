"""The MoE layer as a serving stack writes it in torch: the baseline of issue 7.

route (softmax top-k, renormalised) -> tokens sorted by expert -> for expert-parallel ranks, the
rows travel to the rank owning their expert with all_to_all_single (sizes exchanged first) ->
one mm pair per local expert (SwiGLU) -> back with all_to_all_single -> weighted sum per token.
Routing makes the shapes data-dependent, so it runs eagerly (no CUDA graph).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def torch_moe(x: torch.Tensor, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
              group=None) -> torch.Tensor:
    """x [T, H] this rank's tokens; router [H, E]; w_gate_up [E_local, H, 2I], w_down [E_local, I, H]
    this rank's experts (expert e lives on rank e // E_local). Returns y [T, H]."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    el = w_gate_up.shape[0]
    probs = torch.softmax(x.float() @ router.float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    flat = ids.reshape(-1)                                   # (token, k) slots
    order = torch.argsort(flat, stable=True)                 # slots sorted by expert, so by rank
    rows = x.repeat_interleave(top_k, dim=0)[order]
    experts = flat[order]
    if world > 1:
        send = torch.bincount(experts // el, minlength=world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        s, r = send.tolist(), recv.tolist()
        got = x.new_empty(sum(r), x.shape[1])
        dist.all_to_all_single(got, rows, r, s, group=group)
        got_e = experts.new_empty(sum(r))
        dist.all_to_all_single(got_e, experts, r, s, group=group)
    else:
        got, got_e = rows, experts
    local = got_e % el
    out = torch.empty_like(got)
    for e in range(el):                                      # one mm pair per local expert
        sel = (local == e).nonzero().flatten()
        if sel.numel():
            gate, up = (got[sel] @ w_gate_up[e]).chunk(2, dim=-1)
            out[sel] = (F.silu(gate) * up) @ w_down[e]
    if world > 1:
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, out, s, r, group=group)
    else:
        back = out
    y_slots = torch.empty_like(back)
    y_slots[order] = back
    return (y_slots.view(-1, top_k, x.shape[1]) * w.unsqueeze(-1)).sum(1)
