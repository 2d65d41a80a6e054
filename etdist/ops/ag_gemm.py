"""All-gather + GEMM as one persistent kernel per GPU."""
from __future__ import annotations

from typing import Optional

import torch

from ..fusion import compile as et_compile
from ..fusion.errors import InputError
from ..mesh import current_mesh
from ..workloads import ag_gemm
from .gemm_rs import LARGE, TileConfig, _check_operand, fp32_config

_KERNELS: dict = {}


def all_gather_gemm(x: torch.Tensor, w: torch.Tensor, mesh=None, total_rows: Optional[int] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x gathered over ranks by rows, times this rank's columns of w: [M, K] @ [K, N_local] -> [M, N_local].

    x: [rows_r, K] this rank's rows (chunks of cdiv(M, R), ragged at the end: pass `total_rows=M`
       when M is not R x rows). w: [K, N_local] row-major. Rows are multiplied as they arrive,
       this rank's own first.
    """
    mesh = mesh or current_mesh()
    if mesh.backend != "nvshmem":
        raise InputError("et.ops.all_gather_gemm runs on GPUs (mesh backend 'nvshmem'); on the CPU, "
                         "run the graph etdist.workloads.ag_gemm on the CPU runtime")
    _check_operand("all_gather_gemm", "x", x, mesh)
    _check_operand("all_gather_gemm", "w", w, mesh)
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"all_gather_gemm: x and w must share a dtype among bf16/fp16/fp32, got {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[0]:
        raise InputError(f"all_gather_gemm: x is [rows, {x.shape[1]}] but w is [{w.shape[0]}, N]")
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
