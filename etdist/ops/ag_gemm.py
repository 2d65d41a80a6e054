"""All-gather + GEMM as one persistent kernel per GPU."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..workloads import ag_gemm
from .gemm_rs import LARGE, TileConfig, cached_kernel, check_operands, fp32_config, refusal_reaches_peers, total_rows_of

# Up to WHOLE_MAX_M rows the gather (tiny) completes first and GEMM tiles span every row, so the
# weights are read once; above, row tiles start per source as its rows arrive (overlap).
WHOLE_MAX_M = int(os.environ.get("ETDIST_WHOLE_MAX_M", "128"))
_text = os.environ.get("ETDIST_WHOLE_TILES")   # tuning knob: "block_m,block_n,block_k,warps,stages"
# 64x128x64, 4 warps, 4 stages won launch/tune_decode.py on 2x H200 (BENCHMARKS.md)
WHOLE = TileConfig.parse(_text) if _text else TileConfig(64, 128, 64, 4, 4)  # read at import
_KERNELS: dict = {}


def all_gather_gemm(x: torch.Tensor, w: torch.Tensor, mesh=None, total_rows: Optional[int] = None,
                    out: Optional[torch.Tensor] = None, schedule: str = "static") -> torch.Tensor:
    """x gathered over ranks by rows, times this rank's columns of w: [M, K] @ [K, N_local] -> [M, N_local].

    x: [rows_r, K] this rank's rows (chunks of cdiv(M, R), ragged at the end: pass `total_rows=M`
       when M is not R x rows). w: [K, N_local] row-major. Rows are multiplied as they arrive,
       this rank's own first.
    """
    with refusal_reaches_peers(mesh, _KERNELS):
        mesh = check_operands("all_gather_gemm", "etdist.workloads.ag_gemm", x, w, mesh)
        M = total_rows_of("all_gather_gemm", total_rows, x, mesh.world_size)
    whole = M <= WHOLE_MAX_M
    cfg: TileConfig = WHOLE if whole else LARGE
    cfg = fp32_config(cfg) if x.dtype == torch.float32 else cfg
    align = 16 if x.shape[1] % 16 == 0 and w.shape[1] % 16 == 0 else 1
    graph = ag_gemm.all_gather_gemm_whole if whole else ag_gemm.all_gather_gemm
    kernel = cached_kernel(_KERNELS, (x.dtype, cfg, align, whole, schedule), cfg, schedule,
                           lambda: graph(cfg.block_m, cfg.block_n, x.dtype, cfg.block_k, align))
    return kernel(mesh, x=x, w=w, sizes={"M": M}, out=None if out is None else {"y": out})["y"]
