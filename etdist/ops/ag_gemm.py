"""All-gather + GEMM as one persistent kernel per GPU."""
from __future__ import annotations

from typing import Optional

import torch

from ..fusion import compile as et_compile
from ..workloads import ag_gemm
from .gemm_rs import LARGE, TileConfig, check_operands, fp32_config

_KERNELS: dict = {}


def all_gather_gemm(x: torch.Tensor, w: torch.Tensor, mesh=None, total_rows: Optional[int] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x gathered over ranks by rows, times this rank's columns of w: [M, K] @ [K, N_local] -> [M, N_local].

    x: [rows_r, K] this rank's rows (chunks of cdiv(M, R), ragged at the end: pass `total_rows=M`
       when M is not R x rows). w: [K, N_local] row-major. Rows are multiplied as they arrive,
       this rank's own first.
    """
    mesh = check_operands("all_gather_gemm", "etdist.workloads.ag_gemm", x, w, mesh)
    M = total_rows if total_rows is not None else x.shape[0] * mesh.world_size
    cfg: TileConfig = fp32_config(LARGE) if x.dtype == torch.float32 else LARGE
    align = 16 if x.shape[1] % 16 == 0 and w.shape[1] % 16 == 0 else 1
    key = (x.dtype, cfg, align)
    kernel = _KERNELS.get(key)
    if kernel is None:
        graph = ag_gemm.all_gather_gemm(cfg.block_m, cfg.block_n, x.dtype, cfg.block_k, align)
        kernel = _KERNELS[key] = et_compile(graph, schedule="static", target="cuda")
        kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
    return kernel(mesh, x=x, w=w, sizes={"M": M}, out=None if out is None else {"y": out})["y"]
