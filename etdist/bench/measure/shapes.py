"""The shapes we measure: the paper's eight dense MLPs (ANCHORS.md), the two MoE layers
and the token counts M.

Names and sizes match etdist/bench/conf/model/<name>.yaml (tests/test_measure.py checks that they agree).
Sharding over `world` tensor-parallel ranks (BASELINES.md):
  gemm_rs  h [M, I/world] @ w_down [I/world, H] -> reduce-scatter over M -> [M/world, H]
  ag_gemm  x [M/world, H] all-gather -> [M, H] @ w_gate_up [H, 2*I/world]
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlpShape:
    hidden: int          # H
    intermediate: int    # I, whole (before sharding)


MLP_SHAPES: dict[str, MlpShape] = {
    "qwen3_8b": MlpShape(4096, 12288),
    "llama31_8b": MlpShape(4096, 14336),
    "gemma2_9b": MlpShape(3584, 14336),
    "gemma2_27b": MlpShape(4608, 36864),
    "qwen3_32b": MlpShape(5120, 25600),
    "llama31_70b": MlpShape(8192, 28672),
    "gpt3_175b": MlpShape(12288, 49152),
    "llama31_405b": MlpShape(16384, 53248),
}



@dataclass(frozen=True)
class MoeShape:
    hidden: int                # H
    expert_intermediate: int   # I, per expert
    num_experts: int           # E
    top_k: int


MOE_SHAPES: dict[str, MoeShape] = {
    "qwen3_30b_a3b": MoeShape(2048, 768, 128, 8),
    "mixtral_8x7b": MoeShape(4096, 14336, 8, 2),
}

M_VALUES: tuple[int, ...] = (16, 128, 1024, 8192)   # decode .. prefill tokens
RAGGED_M = 1000                                     # not a multiple of the tile or of world
ALL_M: tuple[int, ...] = tuple(sorted(M_VALUES + (RAGGED_M,)))


def _shard(size: int, world: int, what: str) -> int:
    if size % world:
        raise ValueError(f"{what}={size} does not split over world={world}")
    return size // world


def gemm_rs_dims(model: str, world: int) -> tuple[int, int]:
    """(K_local, N) of the down projection on one rank: K_local = I / world, N = H."""
    s = MLP_SHAPES[model]
    return _shard(s.intermediate, world, "intermediate"), s.hidden


def ag_gemm_dims(model: str, world: int) -> tuple[int, int]:
    """(K, N_local) of the gate/up projection on one rank: K = H, N_local = 2 * I / world."""
    s = MLP_SHAPES[model]
    return s.hidden, _shard(2 * s.intermediate, world, "2*intermediate")
