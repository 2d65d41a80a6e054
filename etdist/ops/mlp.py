"""The whole tensor-parallel SwiGLU MLP (all-gather, gate/up GEMM, SwiGLU, down GEMM, reduce-scatter)
as one persistent kernel per GPU."""
from __future__ import annotations

from typing import Optional

import torch

from .. import knobs
from ..fusion.errors import InputError
from ..workloads import mlp as mlp_graph
from . import ag_gemm as _ag_gemm
from .gemm_rs import TILE_KNOBS, TileConfig, cached_kernel, check_operands, fp32_config, refusal_reaches_peers, total_rows_of

TILES = TileConfig(128, 128, 64, 8, 3)   # two accumulators per tile (gate, up): 128 x 256 spills
# The down projection's tiles are twice as wide (one accumulator): traced at M=1024 (llama31_405b,
# qwen3_32b), 128x128 down tiles ran at 4.3 TF/s per SM against torch.mm's 5.1-5.2 and the gate/up
# tiles' 5.6-5.9 (BENCHMARKS.md, eleventh session). Knob: ETDIST_MLP_DOWN_N (128: as before).
DOWN_N = knobs.read("ETDIST_MLP_DOWN_N", knobs.tile_width, 256)
_KERNELS: dict = {}


def tensor_parallel_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, mesh=None,
                        total_rows: Optional[int] = None, out: Optional[torch.Tensor] = None,
                        schedule: str = "static") -> torch.Tensor:
    """This rank's rows of sum_r (silu(x @ gate_r) * (x @ up_r)) @ w_down_r, sequence-parallel.

    x: [rows_r, H] this rank's rows of x [M, H] (chunks of cdiv(M, R), ragged at the end: pass
       `total_rows=M` when M is not R x rows). w_gate_up: [H, 2 I_r], this rank's gate columns then
       its up columns; w_down: [I_r, H] its rows of the down projection (row-major, as
       `etdist.workloads.mlp.shard` makes them). Returns [rows_r, H] in x's dtype.
    """
    knobs.check(*TILE_KNOBS)
    with refusal_reaches_peers(mesh, _KERNELS):
        mesh = check_operands("tensor_parallel_mlp", "etdist.workloads.mlp", x, w_gate_up, mesh)
        if not isinstance(w_down, torch.Tensor) or w_down.dim() != 2:
            raise InputError(f"tensor_parallel_mlp: w_down must be a 2-D tensor [I, {x.shape[1]}], "
                             f"got {getattr(w_down, 'shape', type(w_down).__name__)}")
        H, I = x.shape[1], w_down.shape[0]
        if w_gate_up.shape[1] != 2 * I or w_down.shape[1] != H:
            raise InputError(f"tensor_parallel_mlp: w_gate_up is {list(w_gate_up.shape)} and w_down "
                             f"{list(w_down.shape)}; with x [rows, {H}] expected [{H}, 2*I] and [I, {H}]")
        if w_down.dtype != x.dtype or w_down.device != x.device or not w_down.is_contiguous():
            raise InputError(f"tensor_parallel_mlp: w_down must be a contiguous {x.dtype} tensor on {x.device}, got "
                             f"{w_down.dtype} on {w_down.device}{'' if w_down.is_contiguous() else ', not contiguous'}")
        M = total_rows_of("tensor_parallel_mlp", total_rows, x, mesh.world_size)
    whole = M <= _ag_gemm.WHOLE_MAX_M       # small M: every weight read once (mlp_graph.tp_mlp_whole)
    cfg = _ag_gemm.whole_tile("tensor_parallel_mlp", M) if whole else TILES
    cfg = fp32_config(cfg) if x.dtype == torch.float32 else cfg
    align = 16 if H % 16 == 0 and I % 16 == 0 else 1
    graph = mlp_graph.tp_mlp_whole if whole else mlp_graph.tp_mlp
    down_n = {} if whole else {"down_n": DOWN_N}
    kernel = cached_kernel(_KERNELS, (x.dtype, cfg, align, whole, schedule), cfg, schedule,
                           lambda: graph(cfg.block_m, cfg.block_n, x.dtype, cfg.block_k, align, **down_n))
    return kernel(mesh, x=x, w_gate_up=w_gate_up, w_down=w_down, sizes={"M": M},
                  out=None if out is None else {"y": out})["y"]
