"""The MoE layer as a serving stack writes it in torch: the MoE benchmark's baseline.

route (softmax top-k, renormalised) -> (token, k) slots sorted by expert -> for expert-parallel
ranks, the rows travel to the rank owning their expert with all_to_all_single -> SwiGLU experts
-> back with all_to_all_single -> weighted sum per token. Two ways to run the experts:

  experts="grouped"  every local expert in one torch._grouped_mm per projection (what TorchTitan-
                     style code does; BASELINES.md measured it 2-45x faster than the loop)
  experts="loop"     one mm pair per local expert (a host sync per expert; any dtype, so it is
                     also the float32 reference on GPUs, where _grouped_mm takes bf16 only)

  experts="fused"    a serving engine's fused MoE (etdist.bench.measure.fused_moe): slots aligned per
                     expert, one Triton grouped-GEMM launch per projection; on one rank it also
                     gathers the tokens and weighs the slots in the kernel, as engines do

and two ways to dispatch across ranks:

  dispatch="exact"   split sizes exchanged first, then exactly the routed rows (one host sync)
  dispatch="padded"  every rank sends every rank a fixed T*top_k rows, the unused ones marked
                     (as low-latency EP kernels do with fixed buffers): no host sync, so with
                     experts="grouped" the whole layer can be captured in a CUDA graph

One rank with experts="grouped" or "fused" never syncs the host either way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .fused_moe import experts as fused_experts, fused_moe, pick_config


def torch_moe(x: torch.Tensor, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
              group=None, experts: str = "grouped", dispatch: str = "exact") -> torch.Tensor:
    """x [T, H] this rank's tokens; router [H, E]; w_gate_up [E_local, H, 2I] (gate columns first),
    w_down [E_local, I, H] this rank's experts (expert e lives on rank e // E_local). Returns y [T, H]."""
    if experts not in ("grouped", "loop", "fused") or dispatch not in ("exact", "padded"):
        raise ValueError(f"experts must be 'grouped', 'loop' or 'fused' and dispatch 'exact' or 'padded', "
                         f"got {experts!r}, {dispatch!r}")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    el = w_gate_up.shape[0]
    probs = torch.softmax(x.float() @ router.float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    if experts == "fused" and world == 1:
        return fused_moe(x, ids, w, w_gate_up, w_down)
    flat = ids.reshape(-1)                                   # (token, k) slots
    order = torch.argsort(flat, stable=True)                 # slots sorted by expert, so by rank
    rows = x.repeat_interleave(top_k, dim=0)[order]          # [S, H], S = T * top_k
    expert = flat[order]
    run = {"grouped": _grouped_experts, "loop": _looped_experts, "fused": _fused_experts}[experts]
    if world == 1:
        back = run(rows, expert % el, w_gate_up, w_down)
    elif dispatch == "exact":
        back = _exact_exchange(rows, expert, el, world, group, run, w_gate_up, w_down)
    else:
        back = _padded_exchange(rows, expert, el, world, group, run, w_gate_up, w_down)
    y_slots = torch.empty_like(back)
    y_slots[order] = back
    return (y_slots.view(-1, top_k, x.shape[1]) * w.unsqueeze(-1)).sum(1)


def _swiglu_rows(rows: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(rows.dtype)


def _looped_experts(rows, local, w_gate_up, w_down) -> torch.Tensor:
    """rows [n, H] with their local expert ids (-1: padding, left unwritten) -> [n, H]."""
    out = torch.empty_like(rows)
    for e in range(w_gate_up.shape[0]):
        sel = (local == e).nonzero().flatten()
        if sel.numel():
            out[sel] = _swiglu_rows(rows, rows[sel] @ w_gate_up[e]) @ w_down[e]
    return out


def _grouped_experts(rows, local, w_gate_up, w_down) -> torch.Tensor:
    """The same with one grouped mm per projection: rows sorted by expert (padding, -1, last and
    outside every group), group ends as a device tensor, so nothing here waits for the host."""
    el = w_gate_up.shape[0]
    key = torch.where(local < 0, el, local)
    perm = torch.argsort(key, stable=True)
    counts = torch.zeros(el + 1, dtype=torch.int32, device=rows.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    ends = counts[:el].cumsum(0, dtype=torch.int32)
    act = _swiglu_rows(rows, torch._grouped_mm(rows[perm], w_gate_up, offs=ends))
    out = torch.empty_like(rows)
    out[perm] = torch._grouped_mm(act, w_down, offs=ends)   # rows past the last group: unused
    return out


def _fused_experts(rows, local, w_gate_up, w_down) -> torch.Tensor:
    """The same with the serving engine's kernels: each row one slot (k = 1), unweighted."""
    ids = local.view(-1, 1)
    return fused_experts(rows, ids, None, w_gate_up, w_down, pick_config(rows, ids, None, w_gate_up, w_down))


def _exact_exchange(rows, expert, el, world, group, run, w_gate_up, w_down) -> torch.Tensor:
    send = torch.bincount(expert // el, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    s, r = send.tolist(), recv.tolist()                      # the host sync
    got = rows.new_empty(sum(r), rows.shape[1])
    dist.all_to_all_single(got, rows, r, s, group=group)
    got_e = expert.new_empty(sum(r))
    dist.all_to_all_single(got_e, expert, r, s, group=group)
    out = run(got, got_e % el, w_gate_up, w_down)
    back = torch.empty_like(rows)
    dist.all_to_all_single(back, out, s, r, group=group)
    return back


def _padded_exchange(rows, expert, el, world, group, run, w_gate_up, w_down) -> torch.Tensor:
    """Slot i (sorted by expert, so by destination) goes to row `pos` of destination `dst`'s block
    of S rows: every block is S long whatever the routing, so the sizes never reach the host."""
    S, H = rows.shape
    dst = expert // el
    counts = torch.zeros(world, dtype=torch.int64, device=rows.device)
    counts.scatter_add_(0, dst, torch.ones_like(dst))
    starts = counts.cumsum(0) - counts
    pos = torch.arange(S, device=rows.device) - starts[dst]
    send = rows.new_zeros(world, S, H)
    send[dst, pos] = rows
    send_e = torch.full((world, S), -1, dtype=expert.dtype, device=rows.device)
    send_e[dst, pos] = expert % el
    got, got_e = torch.empty_like(send), torch.empty_like(send_e)
    dist.all_to_all_single(got, send, group=group)
    dist.all_to_all_single(got_e, send_e, group=group)
    out = run(got.view(world * S, H), got_e.view(-1), w_gate_up, w_down).view(world, S, H)
    back = torch.empty_like(out)
    dist.all_to_all_single(back, out, group=group)
    return back[dst, pos]
