"""The gate/up weight layouts of the SwiGLU layers (etdist.workloads.mlp and .moe).

w_gate_up [..., H, 2I] holds the gate and up projections side by side, [gate | up], or their column
blocks of N interleaved, [gate 0:N | up 0:N | gate N:2N | up N:2N | ...]. Interleaved with N as wide
as a GEMM tile's columns, a tile reads both halves of its columns in one box and runs one dot twice
as wide (etdist.kernels.gemm_tiles.gate_up_cols).
"""
from __future__ import annotations

import torch


def gate_up_columns(c: int, I: int, interleave: int = 0) -> tuple[int, int]:
    """Where gate column c and up column c lie in w_gate_up: [gate | up] (interleave 0), or their
    blocks of `interleave` columns interleaved (c's block holds the columns up to its end)."""
    if not interleave:
        return c, I + c
    g = c // interleave * 2 * interleave + c % interleave
    return g, g + interleave


def interleave_gate_up(w_gate_up: torch.Tensor, block: int) -> torch.Tensor:
    """[..., H, 2I] as [gate | up] -> their column blocks of `block` interleaved (the graphs'
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
