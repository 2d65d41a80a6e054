"""All-gather + GEMM as one persistent kernel per GPU."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import knobs
from ..collectives.compiled import call_op
from ..workloads import ag_gemm
from . import cpu_path
from .gemm_rs import (LARGE, TILE_KNOBS, TileConfig, _sm_count, cached_kernel, check_operands, fp32_config,
                      interleave_sources, no_rows, refusal_reaches_peers, row_pointers, total_rows_of)

# Up to WHOLE_MAX_M rows the gather (tiny) completes first and GEMM tiles span every row, so the
# weights are read once; above, row tiles start per source as its rows arrive (overlap).
WHOLE_MAX_M = knobs.read("ETDIST_WHOLE_MAX_M", knobs.non_negative_int, 128)
# Their tiles, a size class each (M <= 32, <= 64, above), from launch/tune_decode.py on 2x H200
# (records gemm_rs_skinny_ab, commit fa617fe: us per call for qwen3_8b / llama31_70b; M=16: 32x128x64
# with 6 stages, ag_gemm 60 / 154 and mlp 107 / 233, against the former single tile 64x128x64's
# 60 / 179 and 116 / 261; M=128: ag_gemm 64x128x128 66 / 179 against 76 / 216; the MLP keeps
# 64x128x64, as its gate and up weight tiles at 128 deep and 4 stages need more shared memory than an
# SM has), then from launch/ops_ab.py on one H200 as a rank of two (twenty-second session, records
# whole_swap_ab / whole_tiles_ab2, every variant checked against float32): the 32-row tile computed
# transposed (swap: the weights on the wgmma's M side), the MLP -1.7% geomean over 16 cells at M=16
# and 32 in two calls (gemma2_27b -8 / -9%), ag_gemm -0.7%; above 64 rows one 128-row tile
# (128x128x64, 8 warps, 4 stages) instead of two of 64: at M=100 and 128, -9% geomean for the MLP
# (-12 to -23% on the 27B-405B shapes, within +3% on the 8-9B ones) and -6% for ag_gemm; at M=64 it
# lost 20-45%, so the 64-row tiles keep M <= 64.
WHOLE_32 = TileConfig(32, 128, 64, 4, 6, swap_ab=True)   # M <= 32, both ops
WHOLE_AG = TileConfig(64, 128, 128, 4, 4)    # all_gather_gemm, 32 < M <= 64
WHOLE_MLP = TileConfig(64, 128, 64, 4, 4)    # tensor_parallel_mlp, the same M
WHOLE_128 = TileConfig(128, 128, 64, 8, 4)   # M > 64, both ops


_EVERY = knobs.read("ETDIST_WHOLE_TILES", TileConfig.parse, None)


def _override(name: str, default: TileConfig) -> TileConfig:
    """Tuning knobs: ETDIST_WHOLE_<NAME>="block_m,block_n,block_k,warps,stages[,swap]" for one class,
    and ETDIST_WHOLE_TILES for every class of both ops at once (launch/tune_decode.py's A/B)."""
    return knobs.read(f"ETDIST_WHOLE_{name}", TileConfig.parse, _EVERY or default)


WHOLE_32, WHOLE_AG, WHOLE_MLP = _override("32", WHOLE_32), _override("AG", WHOLE_AG), _override("MLP", WHOLE_MLP)
WHOLE_128 = _override("128", WHOLE_128)
# op -> its size classes: (the most rows a class serves, the module attribute holding its tile),
# the last serving every M above; read when a plan is made (an A/B may replace the attributes, then
# call ops.clear_plan_caches())
WHOLE_TILES = {"all_gather_gemm": ((32, "WHOLE_32"), (64, "WHOLE_AG"), (None, "WHOLE_128")),
               "tensor_parallel_mlp": ((32, "WHOLE_32"), (64, "WHOLE_MLP"), (None, "WHOLE_128"))}
# The whole-gather GEMM tiles span every row, so at decode sizes they can be fewer than the SMs (48
# gate/up tiles on qwen3_8b's shard at M=16, traced on one H200: 38 us each, ~55 GB/s per SM, on 48
# of 132 SMs). whole_width halves them while twice as many still fit in one wave, down to
# WHOLE_MIN_N (128: never). Measured on one H200 as a rank of two (launch/ops_ab.py, records
# whole_width_ab, twenty-second session): the MLP at M=16 on qwen3_8b / llama31_8b / gemma2_9b
# -13 / -20 / -8% at 64 wide; 32 wide lost up to 2x, and halving tiles that already fill a wave (the
# rule of fewest columns on the busiest program) lost 15-40% wherever it applied.
WHOLE_MIN_N = 64
# Above WHOLE_MAX_M, the LARGE tiles (128x256), or half as wide ones where those fill the last wave
# of SMs so much better that it pays their lower rate (large_tile). On one H200 as a rank of two
# (launch/ops_ab.py, records ag_gemm_large_ab, twenty-second session), 128x128 tiles against LARGE:
# at M=2048 / 8192 4-9% slower on every shape (full waves), at M=1000 -6 / -8 / -7% on llama31_8b /
# gemma2_9b / qwen3_32b, whose 448 / 448 / 800 LARGE tiles leave a ragged last wave (3.4 / 3.4 / 6.1
# waves on 132 SMs).
LARGE_NARROW = knobs.read("ETDIST_AG_GEMM_LARGE_NARROW", TileConfig.parse, TileConfig(128, 128, 64, 8, 4))
NARROW_RATE = 0.94   # LARGE_NARROW's work per SM-second against LARGE's, in full waves
# Above WHOLE_MAX_M rows, this rank's own row tiles (here and the MLP's gate/up) read x itself, no
# wait, and the gather copies rows to the peers only; one GEMM body serves both sources (a second
# copy of the MLP's, own rows in a task of their own, made large cells 1-3% slower: records
# own_from_x_ab / _ab2). Records own_from_x_ab5 (one H200 running a world-2 rank's shapes at world 1,
# where the whole gather goes, so an upper bound): ag_gemm -2.0% geomean, all 8 cells faster; MLP
# -1.1%, 7 of 8.
OWN_FROM_X = knobs.read("ETDIST_AG_GEMM_OWN_FROM_X", knobs.flag, True)
_KERNELS: dict = {}


def whole_tile(op: str, M: int) -> TileConfig:
    """The whole-gather tile of `op` ("all_gather_gemm" or "tensor_parallel_mlp") for M <= WHOLE_MAX_M rows."""
    return globals()[next(name for most, name in WHOLE_TILES[op] if most is None or M <= most)]


def whole_width(M: int, N: int, cfg: TileConfig, sms: int) -> int:
    """The whole-gather GEMM tiles' width over N columns: cfg.block_n, halved while twice as many
    tiles still fit in one wave of `sms` programs, to no less than WHOLE_MIN_N."""
    m, n = -(-M // cfg.block_m), cfg.block_n
    while n // 2 >= max(16, WHOLE_MIN_N) and m * -(-N // (n // 2)) <= sms:
        n //= 2
    return n


def large_tile(M: int, N: int, world: int, sms: int) -> TileConfig:
    """LARGE, or LARGE_NARROW where its share of busy SMs over the waves (world sources x row tiles
    of each source's rows x column tiles, dealt over `sms` programs), times NARROW_RATE, is higher."""
    rows = -(-M // world)

    def busy(cfg: TileConfig) -> float:
        tiles = world * -(-rows // cfg.block_m) * -(-N // cfg.block_n)
        return tiles / (-(-tiles // sms) * sms)
    return LARGE_NARROW if NARROW_RATE * busy(LARGE_NARROW) > busy(LARGE) else LARGE


@functools.lru_cache(maxsize=4096)
def kernel_plan(M: int, K: int, N: int, dtype: torch.dtype, sms: int, world: int):
    """What the op compiles for x [M, K] gathered @ w [K, N] on a GPU of `sms` SMs among `world`
    ranks: (tile config, a builder of the graph). At most WHOLE_MAX_M rows the whole-gather graph
    (its size class's tile, GEMM tiles narrowed by whole_width), above the per-source graph with
    large_tile's tiles. launch/trace_ag_gemm.py traces the same plan. Cached (~1.5 us a call
    uncached): after changing a knob's module attribute, ops.clear_plan_caches()."""
    whole = M <= WHOLE_MAX_M
    cfg = whole_tile("all_gather_gemm", M) if whole else large_tile(M, N, world, sms)
    cfg = fp32_config(cfg) if dtype == torch.float32 else cfg
    align = 16 if K % 16 == 0 and N % 16 == 0 else 1
    args = (cfg.block_m, cfg.block_n, dtype, cfg.block_k, align)
    if whole:   # the GEMM tiles span every row
        return cfg, functools.partial(ag_gemm.all_gather_gemm_whole, *args, swap_ab=cfg.swap_ab,
                                      gemm_n=whole_width(M, N, cfg, sms), row_pointers=row_pointers(M, cfg.block_m))
    rows = -(-M // world)                                # rows per source
    return cfg, functools.partial(ag_gemm.all_gather_gemm, *args, own_from_x=bool(OWN_FROM_X),
                                  row_pointers=row_pointers(rows, cfg.block_m),
                                  interleave=interleave_sources(rows, cfg.block_m, world))


def all_gather_gemm(x: torch.Tensor, w: torch.Tensor, mesh=None, total_rows: Optional[int] = None,
                    out: Optional[torch.Tensor] = None, schedule: str = "static") -> torch.Tensor:
    """x gathered over ranks by rows, times this rank's columns of w: [M, K] @ [K, N_local] -> [M, N_local].

    x: [rows_r, K] this rank's rows (chunks of cdiv(M, R), ragged at the end: pass `total_rows=M`
       when M is not R x rows). w: [K, N_local] row-major. Rows are multiplied as they arrive,
       this rank's own first.
    Under torch.compile: one opaque node of its graph (ops/compiled.py; `out=` is then a copy).
    """
    if torch.compiler.is_compiling():
        return call_op("all_gather_gemm", x, w, total_rows, schedule, mesh=mesh, out=out)
    knobs.check(*TILE_KNOBS)
    with refusal_reaches_peers(mesh, _KERNELS):
        mesh = check_operands("all_gather_gemm", "etdist.workloads.ag_gemm", x, w, mesh)
        M = total_rows_of("all_gather_gemm", total_rows, x, mesh.world_size)
        # without total_rows a rank with no rows cannot tell M = 0 from a ragged M < world: the
        # kernel's agreement with the peers decides
        empty = (None if M or (total_rows is None and mesh.world_size > 1)
                 else no_rows("all_gather_gemm", x, w.shape[1], out))
    if mesh.backend == "cpu":   # the CPU runtime across processes (ops/cpu_path.py)
        return cpu_path.all_gather_gemm(x, w, mesh, M, schedule, out)
    if empty is not None:
        cpu_path.agree_no_rows(mesh, "all_gather_gemm", x, w, out)
        return empty
    cfg, build = kernel_plan(M, x.shape[1], w.shape[1], x.dtype, _sm_count(mesh.device.index), mesh.world_size)
    kernel = cached_kernel(_KERNELS, cfg, schedule, build)
    return kernel(mesh, x=x, w=w, sizes={"M": M}, out=None if out is None else {"y": out})["y"]
