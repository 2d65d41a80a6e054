"""All-gather + GEMM as one persistent kernel per GPU, and its plan model."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..collectives.custom_op import call_op
from ..workloads import ag_gemm
from . import cpu_path
from .common import (RepeatedCall, cached_kernel, check_operands, no_rows, plan_config, refusal_reaches_peers,
                     total_rows_of)
from .config import PlanConfig, TileConfig, fp32_config
from .plan_model import interleave_sources, row_pointers, sm_count

# The plan (kernel_plan): up to PlanConfig.whole_max_m rows the gather (tiny) completes first and
# GEMM tiles span every row, so the weights are read once (the whole-gather graph, a tile class per
# bound: whole_tile; to whole_tail_m more rows with a tail accumulator: tail_tile); above, row tiles
# start per source as its rows arrive (overlap), this rank's own row tiles reading x itself (the
# gather copies to the peers only: records own_from_x_ab5.jsonl); from 257 rows to whole_large_m
# the whole-gather graph again where its large tiles fill their waves (whole_large).

# The whole-gather GEMM tiles span every row, so at decode sizes they can be fewer than the SMs:
# whole_width halves them while twice as many still fit in one wave, down to WHOLE_MIN_N (records
# whole_width_ab.jsonl: 32 wide lost, as did halving tiles that already fill a wave).
WHOLE_MIN_N = 64
# whole_large_m's whole-gather plan where PlanConfig.large's tiles over every row fill at least this
# share of their waves. Two GPUs, 8 shapes (records ag_gemm_ab at 0d891ba, variant
# whole_max_m=640+whole_256=128,256,64,8,4, and at f12f1e6, variant whole_large_m=0): at M 300/384/640
# 13-46% faster on the shapes at 76-98% (gemma2_27b and up; qwen3_8b at 640: 20%), 10-15% slower at
# 55-71% (the 8-9B shapes' 2-3 waves), which it leaves; at 512 gemma2_27b and up within -2..+7%, but
# llama31_8b and gemma2_9b (85%) 5-9% slower, which it takes too; at 256 mixed.
WHOLE_LARGE_BUSY = 0.75
NARROW_RATE = 0.94   # PlanConfig.large_narrow's work per SM-second against large's, in full waves
_KERNELS: dict = {}
_REPEAT = RepeatedCall()


def whole_classes(op: str, config: PlanConfig) -> tuple:
    """`op`'s ("all_gather_gemm" or "tensor_parallel_mlp") whole-gather size classes: (the most
    rows a class serves, its tile), the last serving every M above."""
    if op == "all_gather_gemm":
        return (32, config.whole_32), (64, config.whole_ag), (128, config.whole_128), (None, config.whole_256)
    return (32, config.whole_32), (64, config.whole_mlp), (128, config.whole_128), (None, config.whole_256_mlp)


def whole_tile(op: str, M: int, config: PlanConfig) -> TileConfig:
    """The whole-gather tile of `op` for M <= config.whole_max_m rows."""
    return next(cfg for most, cfg in whole_classes(op, config) if most is None or M <= most)


def whole_width(M: int, N: int, cfg: TileConfig, sms: int) -> int:
    """The whole-gather GEMM tiles' width over N columns: cfg.block_n, halved while twice as many
    tiles still fit in one wave of `sms` programs, to no less than WHOLE_MIN_N."""
    m, n = -(-M // cfg.block_m), cfg.block_n
    while n // 2 >= max(16, WHOLE_MIN_N) and m * -(-N // (n // 2)) <= sms:
        n //= 2
    return n


def large_tile(M: int, N: int, world: int, sms: int, config: PlanConfig) -> TileConfig:
    """config.large, or config.large_narrow where its share of busy SMs over the waves (world sources
    x row tiles of each source's rows x column tiles, dealt over `sms` programs), times NARROW_RATE,
    is higher (records ag_gemm_large_ab.jsonl)."""
    rows = -(-M // world)

    def busy(cfg: TileConfig) -> float:
        tiles = world * -(-rows // cfg.block_m) * -(-N // cfg.block_n)
        return tiles / (-(-tiles // sms) * sms)
    return config.large_narrow if NARROW_RATE * busy(config.large_narrow) > busy(config.large) else config.large


def whole_large(M: int, N: int, align: int, world: int, sms: int, config: PlanConfig) -> bool:
    """Whether M rows past 256 and whole_max_m (up to config.whole_large_m) take the whole-gather
    graph with config.large's tiles: where those fill at least WHOLE_LARGE_BUSY of their waves;
    aligned sizes (their loads through descriptors), worlds 2 .. config.plan_worlds."""
    if not max(256, config.whole_max_m) < M <= config.whole_large_m or not config.whole_max_m or align != 16 \
            or not config.measured_world(world):
        return False
    large = config.large
    tiles = -(-M // large.block_m) * -(-N // whole_width(M, N, large, sms))
    return tiles >= WHOLE_LARGE_BUSY * -(-tiles // sms) * sms


def ragged_wave(tiles: int, sms: int, config: PlanConfig) -> dict:
    """A whole class's ragged last wave (one row tile, so the same for every M of the class): where
    `tiles` GEMM tiles leave one on `sms` SMs, its tiles in as many contraction slices as fill the
    SMs, at most config.whole_ragged_splits ({} where that is under 2: gemma2_27b's 288 tiles of 128
    at TP=2 leave 24 on 132 SMs: 5 slices each)."""
    ragged = tiles % sms if tiles > sms else 0
    splits = min(config.whole_ragged_splits, sms // ragged) if ragged else 0
    return {"ragged_tiles": ragged, "ragged_splits": splits} if splits >= 2 else {}


def tail_tile(M: int, align: int, world: int, dtype: torch.dtype, config: PlanConfig,
              op: str = "all_gather_gemm") -> Optional[TileConfig]:
    """`op`'s whole class's tile where M rows take it with a tail (all_gather_gemm's
    config.whole_tail_m rows, tensor_parallel_mlp's config.mlp_tail_m): just past a class of at
    most 128 rows that whole_max_m fills; aligned, two ranks or more; else None."""
    tail_m = config.mlp_tail_m if op == "tensor_parallel_mlp" else config.whole_tail_m
    if M <= config.whole_max_m or not tail_m or align != 16 or not config.measured_world(world):
        return None
    cfg = whole_tile(op, config.whole_max_m, config)
    cfg = fp32_config(cfg) if dtype == torch.float32 else cfg
    # 0: no whole-gather graph at all; past 128 rows the accumulators spill
    return cfg if 0 < config.whole_max_m <= cfg.block_m <= 128 and M <= cfg.block_m + tail_m else None


@functools.lru_cache(maxsize=4096)
def kernel_plan(M: int, K: int, N: int, dtype: torch.dtype, sms: int, world: int, config: PlanConfig):
    """What the op compiles for x [M, K] gathered @ w [K, N] on a GPU of `sms` SMs among `world`
    ranks with `config`: (tile config, a builder of the graph). At most config.whole_max_m rows the
    whole-gather graph (its size class's tile, GEMM tiles narrowed by whole_width; a tail up to
    whole_tail_m more), above the per-source graph with large_tile's tiles, but where whole_large
    holds the whole-gather graph with config.large's. Cached (~1.5 us a call uncached); config is
    part of the key."""
    align = 16 if K % 16 == 0 and N % 16 == 0 else 1
    big = whole_large(M, N, align, world, sms, config)
    whole = M <= config.whole_max_m or big
    tail = tail_tile(M, align, world, dtype, config)
    if tail is not None:   # a row tile and a tail in one task
        return tail, functools.partial(ag_gemm.all_gather_gemm_whole, tail.block_m, tail.block_n, dtype, tail.block_k,
                                       align, gemm_n=whole_width(tail.block_m, N, tail, sms),
                                       tail_m=config.whole_tail_m,
                                       **({"tail_row_tma": True} if config.tail_row_tma else {}))
    cfg = config.large if big else whole_tile("all_gather_gemm", M, config) if whole else \
        large_tile(M, N, world, sms, config)
    cfg = fp32_config(cfg) if dtype == torch.float32 else cfg
    args = (cfg.block_m, cfg.block_n, dtype, cfg.block_k, align)
    if whole:   # the GEMM tiles span every row
        width = whole_width(M, N, cfg, sms)
        return cfg, functools.partial(ag_gemm.all_gather_gemm_whole, *args, swap_ab=cfg.swap_ab, gemm_n=width,
                                      row_pointers=row_pointers(M, cfg.block_m),
                                      **(ragged_wave(-(-N // width), sms, config) if M <= cfg.block_m else {}))
    rows = -(-M // world)                                # rows per source
    return cfg, functools.partial(ag_gemm.all_gather_gemm, *args, own_from_x=True,
                                  row_pointers=row_pointers(rows, cfg.block_m, at_half=True),
                                  interleave=interleave_sources(rows, cfg.block_m, world))


def all_gather_gemm(x: torch.Tensor, w: torch.Tensor, *, mesh=None, total_rows: Optional[int] = None,
                    out: Optional[torch.Tensor] = None, schedule: str = "static",
                    config: Optional[PlanConfig] = None) -> torch.Tensor:
    """x gathered over ranks by rows, times this rank's columns of w: [M, K] @ [K, N_local] -> [M, N_local].

    x: [rows_r, K] this rank's rows (chunks of cdiv(M, R), ragged at the end: pass `total_rows=M`
       when M is not R x rows). w: [K, N_local] row-major. Rows are multiplied as they arrive,
       this rank's own first.
    config: the plan's tiles and bounds (et.ops.PlanConfig; None: DEFAULT_PLAN), alike on every rank.
    Under torch.compile: one opaque node of its graph (ops/compiled.py; `out=` is then a copy; the
    default config only).
    """
    if torch.compiler.is_compiling():
        plan_config("all_gather_gemm", config, compiling=True)
        return call_op("all_gather_gemm", x, w, total_rows, schedule, mesh=mesh, out=out)
    key = (schedule, config)
    if out is None and (total_rows is None or type(total_rows) is int):   # a decode step's repeat (RepeatedCall)
        y = _REPEAT.launch(key, mesh, total_rows, {"x": x, "w": w})
        if y is not None:
            return y
    with refusal_reaches_peers(mesh, _KERNELS):
        config = plan_config("all_gather_gemm", config)
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
    cfg, build = kernel_plan(M, x.shape[1], w.shape[1], x.dtype, sm_count(mesh.device.index), mesh.world_size, config)
    kernel = cached_kernel(_KERNELS, config, cfg, schedule, build)
    sizes = {"M": M}
    y = kernel(mesh, x=x, w=w, sizes=sizes, out=None if out is None else {"y": out})["y"]
    _REPEAT.remember(key, mesh, total_rows, kernel, sizes)   # x's rows and total_rows give M
    return y
