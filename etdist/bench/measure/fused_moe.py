"""A fused MoE of the kind serving engines run (the MoE benchmark's third baseline), written here in Triton.

Serving engines (vLLM, SGLang) run a bf16 MoE layer as: route -> *align* (each expert's (token, k)
slots sorted together and padded to a multiple of the row block BM, so that every row block of the
sorted list belongs to one expert) -> one grouped GEMM launch for gate/up whose A rows are gathered
from the tokens by slot -> SwiGLU -> one grouped GEMM launch for down that scales each row by its
routing weight -> the sum over each token's k slots. No host sync anywhere, so the whole layer
replays from a CUDA graph. No such engine installs on the device machines (no network), so this is
our own kernel of that design (ANCHORS.md's lesson: read theirs, write ours), tuned per shape on
the device the way their per-GPU config tables are: `pick_config` times every entry of CONFIGS on
the layer itself the first time a (shape, slot count) is seen, outside graph capture.

    y = fused_moe(x, ids, weights, w_gate_up, w_down)   # x [T, H], ids/weights [T, k]

Weights in etdist's layout: w_gate_up [E, H, 2I] (gate columns first), w_down [E, I, H]. The
kernel takes strides, so it needs no copy of them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ... import knobs
from .baselines import graphed
from .timing import time_batched


class Config(NamedTuple):
    block_m: int      # slots per row block (the per-expert padding)
    block_n: int
    block_k: int
    group_m: int      # row blocks walked per column block (L2 reuse of the weight block)
    num_warps: int
    num_stages: int

    @property
    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{self.num_warps} s{self.num_stages}"


# Decode (a few slots per expert) wants short row blocks and deep K blocks; prefill wants the
# 128-row tiles of a dense GEMM. Every entry fits sm_90's 227 KB of shared memory in bf16.
CONFIGS = (
    Config(16, 64, 128, 1, 4, 4), Config(16, 128, 128, 1, 4, 3), Config(16, 64, 256, 1, 4, 3),
    Config(32, 64, 128, 1, 4, 4), Config(32, 128, 64, 8, 4, 4),
    Config(64, 64, 64, 8, 4, 4), Config(64, 128, 64, 8, 4, 4), Config(64, 128, 128, 8, 8, 3),
    Config(64, 256, 64, 8, 8, 4),
    Config(128, 128, 64, 8, 8, 4), Config(128, 256, 64, 8, 8, 3), Config(128, 128, 64, 16, 4, 4),
)
# the interpreter (CPU tests) runs every program in Python: small blocks keep it quick
INTERPRETER_CONFIG = Config(16, 32, 32, 2, 4, 1)
_CHOSEN: dict = {}      # tuning_key(...) -> Config


def tuning_key(hidden: int, inter: int, experts: int, top_k: int, slots: int, dtype, device) -> tuple:
    """What a tuned config is kept under: the layer's shape and its slot count (tokens x k)."""
    return hidden, inter, experts, top_k, slots, dtype, torch.device(device)


def tuned(*key) -> Optional[Config]:
    """The config pick_config chose for tuning_key(*key), if it ran."""
    return _CHOSEN.get(tuning_key(*key))


class Aligned(NamedTuple):
    """The slot list sorted by expert and padded per expert to block_m (a slot is token * k + j;
    padding holds `slots`, past every real one), the expert of each row block, and how many rows of
    the list are used: a device scalar, so nothing here reaches the host."""
    slot_of_row: torch.Tensor     # [max_rows] int32
    expert_of_block: torch.Tensor  # [max_rows / block_m] int32
    rows_used: torch.Tensor       # [1] int32
    slots: int


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """ids [T, k] expert per slot; -1 marks a slot no local expert takes (left out)."""
    flat = ids.reshape(-1).long()
    S, E, dev = flat.numel(), num_experts, flat.device
    key = torch.where(flat < 0, E, flat)                                   # left-out slots sort last
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(key, stable=True)
    expert = key[order]
    live = expert < E
    e = expert.clamp(max=E - 1)
    pos = (padded_end - padded)[e] + torch.arange(S, device=dev) - (counts.cumsum(0) - counts)[e]
    # the most rows any routing can need: every expert's last block padded, or every slot alone in one
    max_rows = triton.cdiv(min(S + E * (block_m - 1), S * block_m), block_m) * block_m
    slot_of_row = torch.full((max_rows + 1,), S, dtype=torch.int32, device=dev)
    slot_of_row[torch.where(live, pos, max_rows)] = order.to(torch.int32)  # left-out slots land in the spare row
    blocks = torch.arange(max_rows // block_m, device=dev)
    expert_of_block = torch.searchsorted(padded_end // block_m, blocks, right=True).to(torch.int32)
    return Aligned(slot_of_row[:max_rows], expert_of_block, padded_end[-1:].to(torch.int32), S)


@triton.jit
def _expert_gemm(a_ptr, b_ptr, c_ptr, scale_ptr, slot_ptr, expert_ptr, rows_used_ptr,
                 max_rows, N, K: tl.constexpr, slots, sa_m, sa_k, sb_e, sb_k, sb_n, sc_m, sc_n,
                 A_ROWS_PER_TOKEN: tl.constexpr, SCALED: tl.constexpr, EVEN_K: tl.constexpr,
                 PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """C[slot] = A[slot // A_ROWS_PER_TOKEN] @ B[expert] (times scale[slot] if SCALED) for the slots of
    one BM x BN block of the aligned list; row blocks past the used rows return at once."""
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(max_rows, BM), tl.cdiv(N, BN)
    # row blocks in groups of GROUP_M per column block: consecutive programs share a weight block
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(blocks_m - first_m, GROUP_M)
    bm = first_m + (pid % per_group) % size_m
    bn = (pid % per_group) // size_m
    if bm * BM >= tl.load(rows_used_ptr):
        return
    slot = tl.load(slot_ptr + bm * BM + tl.arange(0, BM))
    live = slot < slots
    expert = tl.load(expert_ptr + bm).to(tl.int64)
    cols = bn * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    a_rows = (slot // A_ROWS_PER_TOKEN).to(tl.int64)
    a = a_ptr + a_rows[:, None] * sa_m + ks[None, :] * sa_k
    # columns past N wrap onto real ones (loads stay in bounds, no mask); their results are not stored
    b = b_ptr + expert * sb_e + ks[:, None] * sb_k + (cols % N)[None, :] * sb_n
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):     # K a constexpr: the interpreter cannot loop to a run-time int
        if EVEN_K:
            at = tl.load(a, mask=live[:, None], other=0.0)
            bt = tl.load(b)
        else:
            kin = ks < K - kb * BK
            at = tl.load(a, mask=live[:, None] & kin[None, :], other=0.0)
            bt = tl.load(b, mask=kin[:, None], other=0.0)
        acc = tl.dot(at, bt, acc, input_precision=PRECISION)
        a += BK * sa_k
        b += BK * sb_k
    if SCALED:
        acc = acc * tl.load(scale_ptr + slot, mask=live, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + slot.to(tl.int64)[:, None] * sc_m + cols[None, :] * sc_n
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=live[:, None] & (cols < N)[None, :])


@triton.jit
def _swiglu(src_ptr, dst_ptr, inter, s_src, s_dst, BLOCK: tl.constexpr):
    """dst[r, :] = silu(src[r, :I]) * src[r, I:] for one row block of columns, in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    gate = tl.load(src_ptr + row * s_src + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(src_ptr + row * s_src + inter + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(dst_ptr + row * s_dst + cols, (gate * tl.sigmoid(gate) * up).to(dst_ptr.dtype.element_ty), mask=m)


def _gemm(a, b, c, al: Aligned, cfg: Config, a_rows_per_token: int, scale: Optional[torch.Tensor]):
    E, K, N = b.shape
    grid = (triton.cdiv(al.slot_of_row.numel(), cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _expert_gemm[grid](a, b, c, scale if scale is not None else c, al.slot_of_row, al.expert_of_block,
                       al.rows_used, al.slot_of_row.numel(), N, K, al.slots, a.stride(0), a.stride(1),
                       b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
                       A_ROWS_PER_TOKEN=a_rows_per_token, SCALED=scale is not None, EVEN_K=K % cfg.block_k == 0,
                       PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                       BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def experts(x: torch.Tensor, ids: torch.Tensor, weights: Optional[torch.Tensor], w_gate_up: torch.Tensor,
            w_down: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Per slot: weights[slot] * SwiGLU expert ids[slot] of token slot // k -> [T * k, H] (rows of
    left-out slots, id -1, are not written). weights None: unscaled."""
    T, H = x.shape
    k, I = ids.shape[1], w_down.shape[1]
    al = align(ids, w_gate_up.shape[0], cfg.block_m)
    gate_up = x.new_empty(T * k, 2 * I)
    _gemm(x, w_gate_up, gate_up, al, cfg, k, None)
    act = x.new_empty(T * k, I)
    block = min(1024, triton.next_power_of_2(I))
    _swiglu[(T * k, triton.cdiv(I, block))](gate_up, act, I, gate_up.stride(0), act.stride(0), BLOCK=block)
    out = x.new_empty(T * k, H)
    _gemm(act, w_down, out, al, cfg, 1, None if weights is None else weights.reshape(-1))
    return out


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, cfg: Optional[Config] = None) -> torch.Tensor:
    """y [T, H] = sum over j of weights[t, j] * SwiGLU expert ids[t, j] (x[t]). cfg None: the tuned
    one (pick_config), which times CONFIGS on this very call the first time its shape is seen."""
    cfg = cfg or pick_config(x, ids, weights, w_gate_up, w_down)
    T, H = x.shape
    return experts(x, ids, weights, w_gate_up, w_down, cfg).view(T, ids.shape[1], H).sum(1)


def pick_config(x, ids, weights, w_gate_up, w_down) -> Config:
    """The fastest of CONFIGS for this layer shape and slot count, timed on the device (a config
    that fails to build is skipped); under the Triton interpreter, INTERPRETER_CONFIG."""
    if knobs.triton_interpreted() or x.device.type != "cuda":
        return INTERPRETER_CONFIG
    key = tuning_key(x.shape[1], w_down.shape[1], w_gate_up.shape[0], ids.shape[1], ids.numel(), x.dtype, x.device)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fused_moe: this shape was never tuned; call it once before capturing a CUDA graph")
    times = {}
    for cfg in CONFIGS:
        # timed replayed from a CUDA graph, as the sweep times this baseline (eager, its dozen small
        # launches made the host the bottleneck and the pick noisy)
        step = lambda _, cfg=cfg: fused_moe(x, ids, weights, w_gate_up, w_down, cfg)   # noqa: E731
        try:
            replay = graphed(step, 1, x.device)                       # builds and warms it first
        except (triton.runtime.errors.OutOfResources, triton.CompilationError):
            continue
        times[cfg] = time_batched(replay, calls=10, batches=3, warmup=1, device=x.device)
    if not times:
        raise RuntimeError("fused_moe: no config of CONFIGS builds on this device")
    _CHOSEN[key] = min(times, key=times.get)
    return _CHOSEN[key]

