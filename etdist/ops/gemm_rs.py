"""Tensor-parallel GEMM + reduce-scatter as one persistent kernel per GPU, and its plan model."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..collectives.custom_op import call_op
from ..workloads import gemm_rs
from . import cpu_path
from .common import RepeatedCall, cached_kernel, check_operands, no_rows, plan_config, refusal_reaches_peers
from .config import PlanConfig, TileConfig, fp32_config
from .plan_model import interleave_sources, row_pointers, slices_that_fit, sm_count, tile_us

# The plan (kernel_plan): up to 128 rows the skinny graph (all rows in one tile, split-K, the
# weights read once) with the smallest of PlanConfig's skinny classes that holds M; above, the
# large graph's tiles per destination rank (PlanConfig.large), whole or in up to
# PlanConfig.max_splits contraction slices (split-K: more, shorter tasks, each slice a partial in
# x's dtype on the owner, who sums them all), as plan_cost rates them.

# plan_cost's fixed costs: a task runs ~TASK_US longer than its steps at SM_TFLOPS (pipeline fill,
# its tile's stores, the notify), and a plan with a reduce task ends a wave of them after its last
# matmul. Fitted over 8 shapes x M = 256-1536: records rs_splits_curve_proxy_ab.jsonl.
TASK_US = 6.0
REDUCE_WAVE_US = 8.0   # not ops.mlp's REDUCE_US: that is one sum task's guess
HBM_TBS = 4.3   # the weights' streaming rate (H200): records gemm_rs_split_ab.jsonl
# The skinny classes' owner sums column tiles down to SKINNY_REDUCE_N wide, about one reduce task
# per SM (skinny_reduce_n): records gemm_rs_w1_ab.jsonl.
SKINNY_REDUCE_N = 32
SKINNY_WAVES = 3   # skinny_splits' most waves where one leaves SMs idle
_KERNELS: dict = {}
_REPEAT = RepeatedCall()


def skinny_classes(config: PlanConfig) -> tuple:
    """The skinny tiles, each serving M <= its block_m, smallest first."""
    return tuple(sorted((config.skinny_32, config.skinny_64, config.skinny_128), key=lambda cfg: cfg.block_m))


def skinny_class(M: int, config: PlanConfig) -> Optional[TileConfig]:
    """The smallest skinny class that holds M rows (None above 128: the large graph's tiles)."""
    return next((cfg for cfg in skinny_classes(config) if M <= cfg.block_m), None)


def large_tiles(M: int, N: int, world: int, cfg: TileConfig) -> int:
    """Tiles of the large graph: world destinations x row tiles of an owner's rows x column tiles."""
    rows = -(-M // world)                     # rows per owner
    return world * -(-rows // cfg.block_m) * -(-N // cfg.block_n)


def plan_cost(M: int, K: int, N: int, world: int, sms: int, cfg: TileConfig, splits: int = 1,
              itemsize: int = 2, interleave: bool = False, wave: int = 0) -> float:
    """Estimated us of the large graph with `cfg`'s tiles in `splits` contraction slices (with `wave`,
    the tail plan: the tiles of whole waves of `wave` whole, the rest in slices): the slower of its
    compute, in whole waves (every SM pays for a whole last wave however few tasks it holds; tasks:
    world destinations x row tiles x column tiles x slices), each task its steps at SM_TFLOPS and
    TASK_US, plus REDUCE_WAVE_US a wave of reduce tasks (one a tile) where they follow (slices, or the
    owners' tiles side by side; whole tiles reduce in their epilogue), and its HBM traffic (weights
    read once per destination, or once with the owners' tiles interleaved; x; partials written and
    summed)."""
    rows = -(-M // world)                     # rows per owner
    tiles = large_tiles(M, N, world, cfg)
    head = tiles // wave * wave if wave and splits > 1 else 0   # the tail plan's whole tiles
    whole = tile_us(cfg.block_m, cfg.block_n, K)
    compute = -(-head // sms) * (whole + TASK_US) + -(-(tiles - head) * splits // sms) * (whole / splits + TASK_US)
    if splits > 1 or interleave:
        compute += -(-tiles // sms) * REDUCE_WAVE_US
    reads = 1 if interleave else world        # of the weights
    traffic = itemsize * (reads * K * N + M * K + 2 * world * splits * rows * N)
    return max(compute, traffic / (HBM_TBS * 1e6))


def large_plan(M: int, K: int, N: int, world: int, sms: int, config: PlanConfig, itemsize: int = 2,
               interleave: bool = False) -> int:
    """Contraction slices of the large graph's tiles: the fewest that plan_cost rates best."""
    costs = [plan_cost(M, K, N, world, sms, config.large, s, itemsize, interleave)
             for s in range(1, config.max_splits + 1)]
    return 1 + costs.index(min(costs))


def tail_plan(M: int, K: int, N: int, world: int, sms: int, config: PlanConfig, itemsize: int = 2,
              interleave: bool = False) -> int:
    """Contraction slices of the large tiles past the last whole wave on `sms` SMs: the fewest that
    make their waves shortest, a task its steps and TASK_US (72 tiles left of gemma2_27b's: 3 slices
    make 216 tasks, two waves of thirds), at most max_splits. Fewer tiles than SMs are all tail:
    large_plan's roofline, which knows when the weights' traffic bounds the kernel."""
    large = config.large
    tiles = large_tiles(M, N, world, large)
    if tiles < sms:
        return slices_that_fit(M, N, world, itemsize, large_plan(M, K, N, world, sms, config, itemsize, interleave))
    tail = tiles % sms
    if not tail:
        return 1
    whole = tile_us(large.block_m, large.block_n, K)
    most = slices_that_fit(M, N, world, itemsize, config.max_splits)
    costs = [-(-tail * s // sms) * (whole / s + TASK_US) for s in range(1, most + 1)]
    return 1 + costs.index(min(costs))


def chosen_plan(M: int, K: int, N: int, world: int, sms: int, config: PlanConfig, itemsize: int = 2,
                interleave: bool = False) -> tuple[int, int]:
    """(splits, wave) of the large graph: large_plan's slices of every tile (wave 0) or, where the
    tiles fill a wave of SMs, whole waves of whole tiles and tail_plan's slices past them (wave =
    sms), whichever plan_cost rates faster. Records gemm_rs_w1_ab.jsonl (the tail plan) and
    rs_task_cost_proxy_ab.jsonl (the choice)."""
    splits = large_plan(M, K, N, world, sms, config, itemsize, interleave)
    if large_tiles(M, N, world, config.large) < sms:
        return splits, 0
    tail = tail_plan(M, K, N, world, sms, config, itemsize, interleave)
    if tail > 1 and plan_cost(M, K, N, world, sms, config.large, tail, itemsize, interleave, wave=sms) < \
            plan_cost(M, K, N, world, sms, config.large, splits, itemsize, interleave):
        return tail, sms
    return splits, 0


def skinny_tail(M: int, align: int, world: int, config: PlanConfig) -> Optional[TileConfig]:
    """config.skinny_tail where M rows just past the skinny classes take it (up to its block_m +
    config.skinny_tail_m; aligned, two ranks or more, so that an owner's rows fit one tile), else None."""
    cfg = config.skinny_tail
    if not config.skinny_tail_m or align != 16 or world < 2 or skinny_class(M, config) is not None:
        return None
    return cfg if M <= cfg.block_m + config.skinny_tail_m and -(-M // world) <= cfg.block_m else None


def skinny_reduce_n(block_n: int, n_tiles: int, sms: int) -> int:
    """Width of the skinny graph's reduce tiles: block_n cut in a power of two of parts, no narrower
    than SKINNY_REDUCE_N, and no more reduce tasks than SMs (qwen3_8b's 32 column tiles on 132 SMs:
    4 parts of 32; gpt3_175b's 96: whole)."""
    sub = 1
    while block_n % (2 * sub) == 0 and block_n // (2 * sub) >= SKINNY_REDUCE_N and 2 * sub * n_tiles <= sms:
        sub *= 2
    return block_n // sub


def skinny_splits(N: int, sms: int, block_n: int) -> int:
    """Contraction slices of the skinny classes (at most 8): slices x column tiles gives every SM at
    most one task (each task drains and refills its load pipeline, so one long task each runs
    best: records gemm_rs_ab at e16cc6e), rounded down, as a few tasks over make a whole extra wave.
    Where that leaves over a quarter of the SMs idle, the slices whose waves (at most SKINNY_WAVES)
    per slice are fewest: gpt3_175b's 96 column tiles on 132 SMs in 4 slices, 3 waves (4-10%
    faster at M 16-100; gemma2_27b's 108 busy SMs in 7 slices, 2 waves: 12-22% slower; records
    gemm_rs_ab at 19c5c8e, variant skinny_waves=3)."""
    n_tiles = -(-N // block_n)
    best = max(1, min(8, sms // n_tiles))
    if 4 * n_tiles * best >= 3 * sms:
        return best
    for s in range(best + 1, 9):
        w = -(-n_tiles * s // sms)
        if w <= SKINNY_WAVES and w * best < s * -(-n_tiles * best // sms):   # w / s < the best's waves / slices
            best = s
    return best


@functools.lru_cache(maxsize=4096)
def kernel_plan(M: int, K: int, N: int, dtype: torch.dtype, sms: int, world: int, config: PlanConfig):
    """What the op compiles for x [M, K] @ w [K, N] on a GPU of `sms` SMs among `world` ranks with
    `config`: (tile config, split-K slices, alignment, a builder of the graph). Cached (~1.7 us a
    call uncached, on the eager decode path); config is part of the key."""
    align = 16 if K % 16 == 0 and N % 16 == 0 else 1  # aligned rows vectorise
    tail = skinny_tail(M, align, world, config)
    cfg = skinny_class(M, config) or tail
    skinny = cfg is not None
    cfg = cfg or config.large
    if dtype == torch.float32:
        cfg = fp32_config(cfg)
    # builders as partials: `build.func` names the graph, which the op's kernel cache keys on
    if not skinny:
        rows = -(-M // world)                            # rows per owner
        interleave = interleave_sources(rows, cfg.block_m, world)   # the owners' tiles side by side
        splits, wave = chosen_plan(M, K, N, world, sms, config, dtype.itemsize, interleave)
        return cfg, splits, align, functools.partial(gemm_rs.gemm_reduce_scatter, cfg.block_m, cfg.block_n, dtype,
                                                     cfg.block_k, align, splits=splits, wave=wave,
                                                     row_pointers=row_pointers(rows, cfg.block_m),
                                                     interleave=interleave)
    splits = skinny_splits(N, sms, cfg.block_n)
    # the class's M all alike: one binary; the tail class sums its slices locally (its body's form)
    local = tail is not None or (0 < config.local_sums_min_m <= M and splits > 1 and world > 1)
    n_tiles = -(-N // cfg.block_n)
    # the reduce's width; with local sums the combine tasks' too, one per owner: sized to one wave of SMs
    # (two waves: 3-12% slower on the 8-9B and 32B shapes at M 96/128, records gemm_rs_ab at 9e7952a)
    reduce_n = skinny_reduce_n(cfg.block_n, n_tiles * (world if local else 1), sms)
    return cfg, splits, align, functools.partial(gemm_rs.gemm_reduce_scatter_skinny, cfg.block_m, cfg.block_n, dtype,
                                                 cfg.block_k, splits, align, cfg.swap_ab, reduce_n=reduce_n,
                                                 **({"local_sums": True} if local else {}),
                                                 **({"tail_m": config.skinny_tail_m} if tail is not None else {}),
                                                 **({"tail_row_tma": True} if tail is not None and config.tail_row_tma
                                                    else {}),
                                                 **({"x_partials": True} if config.skinny_x_partials and world > 1
                                                    and dtype != torch.float32 else {}))


def gemm_reduce_scatter(x: torch.Tensor, w: torch.Tensor, *, mesh=None, schedule: str = "static",
                        out: Optional[torch.Tensor] = None, config: Optional[PlanConfig] = None) -> torch.Tensor:
    """sum over ranks of x @ w, scattered by rows: this rank's rows [r*C, min((r+1)*C, M)), C = cdiv(M, R).

    x: [M, K_local] this rank's shard of the contraction (row-major, contiguous); the same M on
       every rank, any M (not necessarily a multiple of the world size or the tile).
    w: [K_local, N] (row-major: pass `weight.t().contiguous()` for an nn.Linear weight [N, K]).
    Returns [rows owned, N] in x's dtype (bf16/fp16/fp32), accumulated in fp32 per rank and summed
    in fp32 across ranks (partials travel in x's dtype; fp32 inputs multiply as TF32 on tensor cores).
    config: the plan's tiles and bounds (et.ops.PlanConfig; None: DEFAULT_PLAN), alike on every rank.
    Under torch.compile: one opaque node of its graph (ops/compiled.py; `out=` is then a copy; the
    default config only).
    """
    if torch.compiler.is_compiling():
        plan_config("gemm_reduce_scatter", config, compiling=True)
        return call_op("gemm_reduce_scatter", x, w, schedule, mesh=mesh, out=out)
    key = (schedule, config)
    if out is None:   # a decode step's repeat (RepeatedCall)
        y = _REPEAT.launch(key, mesh, None, {"x": x, "w": w})
        if y is not None:
            return y
    with refusal_reaches_peers(mesh, _KERNELS):
        config = plan_config("gemm_reduce_scatter", config)
        mesh = check_operands("gemm_reduce_scatter", "etdist.workloads.gemm_rs", x, w, mesh)
        empty = None if x.shape[0] else no_rows("gemm_reduce_scatter", x, w.shape[1], out)
    if mesh.backend == "cpu":   # the CPU runtime across processes (ops/cpu_path.py)
        return cpu_path.gemm_reduce_scatter(x, w, mesh, schedule, out)
    if empty is not None:
        cpu_path.agree_no_rows(mesh, "gemm_reduce_scatter", x, w, out)
        return empty
    cfg, splits, align, build = kernel_plan(x.shape[0], x.shape[1], w.shape[1], x.dtype, sm_count(mesh.device.index),
                                            mesh.world_size, config)
    kernel = cached_kernel(_KERNELS, config, cfg, schedule, build)
    y = kernel(mesh, x=x, w=w, out=None if out is None else {"y": out})["y"]
    _REPEAT.remember(key, mesh, None, kernel, None)
    return y


def compiled_variants() -> int:
    """How many megakernel binaries the op has compiled so far (over all size classes)."""
    n = 0
    for k in _KERNELS.values():
        for caches in k.module.megakernel.device_caches.values():
            n += len(caches[0])
    return n
