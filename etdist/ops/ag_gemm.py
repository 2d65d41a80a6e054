"""All-gather + GEMM as one persistent kernel per GPU."""
from __future__ import annotations

from typing import Optional

import torch

from .. import knobs
from ..workloads import ag_gemm
from .gemm_rs import LARGE, TILE_KNOBS, TileConfig, cached_kernel, check_operands, fp32_config, refusal_reaches_peers, total_rows_of

# Up to WHOLE_MAX_M rows the gather (tiny) completes first and GEMM tiles span every row, so the
# weights are read once; above, row tiles start per source as its rows arrive (overlap).
WHOLE_MAX_M = knobs.read("ETDIST_WHOLE_MAX_M", knobs.non_negative_int, 128)
WHOLE_SMALL_M = 32   # the whole-gather variants' two size classes: M <= 32, and up to WHOLE_MAX_M

# Their tiles, from launch/tune_decode.py on 2x H200 (records gemm_rs_skinny_ab, commit fa617fe,
# every config checked against float32 first), us per call for qwen3_8b / llama31_70b. M=16:
# 32x128x64 with 6 stages, ag_gemm 60 / 154 and mlp 107 / 233, against the former single tile
# 64x128x64's 60 / 179 and 116 / 261. M=128: ag_gemm 64x128x128 66 / 179 against 76 / 216; the
# MLP keeps 64x128x64 (106 / 254), as its gate and up weight tiles at 128 deep and 4 stages need
# more shared memory than an SM has.
WHOLE_32 = TileConfig(32, 128, 64, 4, 6)    # M <= WHOLE_SMALL_M, both ops
WHOLE_AG = TileConfig(64, 128, 128, 4, 4)   # all_gather_gemm, WHOLE_SMALL_M < M <= WHOLE_MAX_M
WHOLE_MLP = TileConfig(64, 128, 64, 4, 4)   # tensor_parallel_mlp, the same M


_EVERY = knobs.read("ETDIST_WHOLE_TILES", TileConfig.parse, None)


def _override(name: str, default: TileConfig) -> TileConfig:
    """Tuning knobs: ETDIST_WHOLE_<NAME>="block_m,block_n,block_k,warps,stages" for one class, and
    ETDIST_WHOLE_TILES for every class of both ops at once (launch/tune_decode.py's A/B)."""
    return knobs.read(f"ETDIST_WHOLE_{name}", TileConfig.parse, _EVERY or default)


WHOLE_32, WHOLE_AG, WHOLE_MLP = _override("32", WHOLE_32), _override("AG", WHOLE_AG), _override("MLP", WHOLE_MLP)
# op -> (its tile at M <= WHOLE_SMALL_M, its tile above); read at every call (an A/B may replace it)
WHOLE_TILES = {"all_gather_gemm": (WHOLE_32, WHOLE_AG), "tensor_parallel_mlp": (WHOLE_32, WHOLE_MLP)}
_KERNELS: dict = {}


def whole_tile(op: str, M: int) -> TileConfig:
    """The whole-gather tile of `op` ("all_gather_gemm" or "tensor_parallel_mlp") for M <= WHOLE_MAX_M rows."""
    small, rest = WHOLE_TILES[op]
    return small if M <= WHOLE_SMALL_M else rest


def all_gather_gemm(x: torch.Tensor, w: torch.Tensor, mesh=None, total_rows: Optional[int] = None,
                    out: Optional[torch.Tensor] = None, schedule: str = "static") -> torch.Tensor:
    """x gathered over ranks by rows, times this rank's columns of w: [M, K] @ [K, N_local] -> [M, N_local].

    x: [rows_r, K] this rank's rows (chunks of cdiv(M, R), ragged at the end: pass `total_rows=M`
       when M is not R x rows). w: [K, N_local] row-major. Rows are multiplied as they arrive,
       this rank's own first.
    """
    knobs.check(*TILE_KNOBS)
    with refusal_reaches_peers(mesh, _KERNELS):
        mesh = check_operands("all_gather_gemm", "etdist.workloads.ag_gemm", x, w, mesh)
        M = total_rows_of("all_gather_gemm", total_rows, x, mesh.world_size)
    whole = M <= WHOLE_MAX_M
    cfg: TileConfig = whole_tile("all_gather_gemm", M) if whole else LARGE
    cfg = fp32_config(cfg) if x.dtype == torch.float32 else cfg
    align = 16 if x.shape[1] % 16 == 0 and w.shape[1] % 16 == 0 else 1
    graph = ag_gemm.all_gather_gemm_whole if whole else ag_gemm.all_gather_gemm
    kernel = cached_kernel(_KERNELS, (x.dtype, cfg, align, whole, schedule), cfg, schedule,
                           lambda: graph(cfg.block_m, cfg.block_n, x.dtype, cfg.block_k, align))
    return kernel(mesh, x=x, w=w, sizes={"M": M}, out=None if out is None else {"y": out})["y"]
