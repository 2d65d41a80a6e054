"""Tensor-parallel GEMM + reduce-scatter as one persistent kernel per GPU."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .. import knobs
from ..fusion import compile as et_compile
from ..fusion.cuda_runtime import post_refusal
from ..collectives.compiled import call_op
from ..fusion.errors import InputError
from ..mesh import MeshError, current_mesh
from ..workloads import gemm_rs
from . import cpu_path


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False   # skinny gemm_rs only: the tile multiplies transposed (gemm_tiles)

    @classmethod
    def parse(cls, text: str) -> "TileConfig":
        """"block_m,block_n,block_k,warps,stages[,swap]" (the knobs' format; knobs.tile's rules)."""
        swap = text.replace(" ", "").endswith(",swap")
        try:
            values = knobs.tile(text.rsplit(",", 1)[0] if swap else text)
        except ValueError as e:
            raise ValueError(f"tile config {text!r}: {str(e).replace('stages', 'stages[,swap]', 1)}") from None
        return cls(*values, swap_ab=swap)


# Size classes, one compiled kernel for every M in each. Up to 128 rows, the skinny graph (all
# rows in one tile, split-K, weights read once); above, LARGE tiles per destination rank, one
# kernel per number of contraction slices (large_plan).
# launch/tune_decode.py on 2x H200, each config checked against float32 first (BENCHMARKS.md,
# seventh session), us at M=16, qwen3_8b / llama31_70b: 32x128x128 swap-AB (weights on the wgmma
# M side, 5 stages of 32 KiB in flight), one task per SM, 41 / 87; 64x128x128 one task per SM
# 49 / 88; the old 64x64x128, two per SM, 55 / 132. The 128-row class, tenth session (us at M=128,
# qwen3_8b / llama31_70b): 128x128x128 swap-AB, 8 warps, 3 stages, one task per SM, 49 / 92; the
# fourth session's 128x64x128 unswapped, two per SM, 54 / 103 (the LARGE tiles: ~2x that).
SKINNY_32 = TileConfig(32, 128, 128, 4, 5, swap_ab=True)
SKINNY = TileConfig(64, 128, 128, 4, 4)
SKINNY_128 = TileConfig(128, 128, 128, 8, 3, swap_ab=True)
LARGE = TileConfig(128, 256, 64, 8, 4)  # won the A/B against 128x128x64x8x3 (BENCHMARKS.md)
# Above 128 rows, LARGE tiles whole or in up to MAX_SPLITS contraction slices (split-K: more,
# shorter tasks, each slice a partial in x's dtype on the owner, who sums them all), planned by
# plan_cost. Eleventh session, same call, alternated twice: 4 slices at M=1000/1024 on gemma2_27b's
# shape took 334-351 us against whole tiles' 400-444 (144 tiles on 132 SMs: two waves); at M=256
# (one row tile per owner) slices cut 15-40% on six shapes, and they beat 128x128 tiles there too.
# Knob: ETDIST_GEMM_RS_MAX_SPLITS (1: whole tiles, as before).
MAX_SPLITS = 4
SPLIT_COST = 0.03   # the MLP's tail model: per extra slice, its partial's stores and sum, a pipeline fill
# plan_cost's fixed costs (thirty-third session, one H100 as a rank of two, launch/trace_gemm_rs.py
# and launch/ops_ab.py, records rs_splits_curve_proxy_ab): a task runs ~6 us longer than its steps
# at SM_TFLOPS (pipeline fill, its tile's stores, the notify), so short slices pay it several times
# over (qwen3_8b at M=768: 384 quarter tasks of 22.7 us for 16.8 us of steps); and a plan with a
# reduce task (slices, or owners' tiles side by side) ends one reduce after its last matmul (the
# reduce tasks ended ~8 us after it there). SPLIT_COST's 3% a slice had rated 4 slices of 96 tiles
# at 0.82 of the whole wave: they took 1.24x its time (qwen3_8b and llama31_8b at M=768, gemma2_9b
# at M=896). Fitted over 8 shapes x M = 256-1536 (72 cells), the plans at these costs run within 3%
# of the fastest plan measured in 70 cells (the former within 3% in 67; 1.19-1.24x off in 3).
TASK_US = 6.0
REDUCE_WAVE_US = 8.0   # not ops.mlp's REDUCE_US: that is one sum task's guess
# plan_cost's rates, measured on H200 (eleventh session): LARGE-sized tiles at ~6 TF/s on one SM
# (the MLP's down tiles, traced); gemm_rs at M=256 on gpt3_175b's shape streamed its 1.2 GB of
# weights at 4.3 TB/s, where 4 slices (planned by waves alone) took 350 us against 282 whole.
SM_TFLOPS = 6.0
HBM_TBS = 4.3


# The tail plan (ETDIST_GEMM_RS_SPLIT_TAIL; 0: large_plan's slices for every tile, as before):
# where the tiles fill at least a wave of SMs, the tiles that fill whole waves run whole and only
# those past the last whole wave run in slices, as many as make their waves shortest (tail_plan),
# where plan_cost rates that faster than large_plan's plan (chosen_plan; before the thirty-third
# session, wherever large_plan cut every tile). gemma2_27b at M=1024: 144 tiles on 132 SMs make one
# wave of whole tiles and 12 tiles in 4 slices, where large_plan cuts all 144 in 4 (5 waves of
# quarter tiles, each tile's 4 partials stored, sent and summed). Measured on one H200 as a rank of
# two (launch/ops_ab.py, records gemm_rs_w1_ab, twenty-first session): gemma2_27b / qwen3_32b at
# M=1000 and 1024 -4.6 / -4.0 / -8.0 / -9.8%; the plans of the other shapes and of M=8192 do not
# change (splitting the last wave's tiles at M=8192, where large_plan keeps them whole, lost 0-3%).
SPLIT_TAIL = True
# Each rank's own rows' tiles last (ETDIST_GEMM_RS_OWN_LAST=1; off until measured): by default every
# rank runs owner 0's tiles first, so on 2 GPUs rank 0's last wave stores all its partials over
# NVLink and rank 1's reduce waits for them. Own tiles last, both ranks' last waves store locally
# (peers' partials leave during the earlier waves), and with the tail plan each owner sums the
# slices of its own tail tiles only.
OWN_LAST = False
# Whole-tile plans (large_plan / tail_plan cut nothing: M=8192 on every shape) with each rank's own
# tiles last and their reduce in their epilogue (ETDIST_GEMM_RS_FUSE_OWN; gemm_rs.gemm_reduce_scatter's
# fuse_own): no own partial is stored and read back, and no reduce task runs after the matmuls. On
# one H200 as a rank of two (launch/ops_ab.py, records gemm_rs_fuse_ab, twenty-second session),
# against owner 0's tiles first and a reduce task: -2% geomean over M = 1000-8192 x 8 shapes in two
# calls, -3 to -7% on the 8-9B shapes (M=8192: 1.14-1.16x torch.mm -> 1.06-1.09x), none slower by
# more than 3% (the sliced plans do not change: their cells read within noise). One GPU only so far:
# `bash launch/decode-ab.sh rsfuse` measures it on two.
FUSE_OWN = True


def _override(name: str, default: TileConfig) -> TileConfig:
    """Tuning knob: ETDIST_GEMM_RS_<NAME>="block_m,block_n,block_k,warps,stages[,swap]"."""
    return knobs.read(f"ETDIST_GEMM_RS_{name}", TileConfig.parse, default)


MAX_SPLITS = knobs.read("ETDIST_GEMM_RS_MAX_SPLITS", knobs.positive_int, MAX_SPLITS)
SPLIT_TAIL = knobs.read("ETDIST_GEMM_RS_SPLIT_TAIL", knobs.flag, SPLIT_TAIL)
OWN_LAST = knobs.read("ETDIST_GEMM_RS_OWN_LAST", knobs.flag, OWN_LAST)
FUSE_OWN = knobs.read("ETDIST_GEMM_RS_FUSE_OWN", knobs.flag, FUSE_OWN)
# The skinny classes' owner sums column tiles down to SKINNY_REDUCE_N wide (skinny_reduce_n), about
# one reduce task per SM: traced on one H200 at M=128 (twenty-first session), one reduce task per
# 128-wide column tile (32 on qwen3_8b's shape) read 4-8 fp32 partials of 128 rows each and ended
# ~6 us after the last matmul task.
SKINNY_REDUCE_N = 32
SKINNY_32, SKINNY, SKINNY_128, LARGE = (_override("SKINNY_32", SKINNY_32), _override("SKINNY", SKINNY),
                                        _override("SKINNY_128", SKINNY_128), _override("LARGE", LARGE))
# Tasks per SM that each skinny class's split-K aims at (more slices: more tasks, each shorter).
# Every task drains and refills its load pipeline, so the 128-wide tiles run best as one long task
# per SM (A/B above). Tuning knob for every class at once: ETDIST_GEMM_RS_SKINNY_TASKS_PER_SM.
# Knobs may reorder the classes' sizes: each M takes the smallest class that holds it (sorted,
# stable), and where two classes end up with the same tile the one that serves first keeps its
# tasks per SM.
_CLASSES = sorted(((SKINNY_32, 1.0), (SKINNY, 1.0), (SKINNY_128, 1.0)), key=lambda c: c[0].block_m)
SKINNY_CLASSES = tuple(cfg for cfg, _ in _CLASSES)   # each serves M <= its block_m, in this order
_tasks = knobs.read("ETDIST_GEMM_RS_SKINNY_TASKS_PER_SM", knobs.positive_float, None)


def class_aims(classes) -> dict:
    """{tile: tasks per SM} of (tile, aim) classes in serving order; where two classes share a tile,
    the first one's aim (dict() keeps the last write)."""
    return dict(reversed(tuple(classes)))


SKINNY_TASKS_PER_SM = {cfg: _tasks for cfg in SKINNY_CLASSES} if _tasks else class_aims(_CLASSES)
TILE_KNOBS = ("ETDIST_GEMM_RS_", "ETDIST_WHOLE_", "ETDIST_TMA", "ETDIST_MLP_", "ETDIST_AG_GEMM_",
              "ETDIST_ROW_POINTERS", "ETDIST_INTERLEAVE_SOURCES")   # what the fused ops' plans read


def skinny_tasks_per_sm(cfg: TileConfig) -> float:
    """The split-K aim of a skinny class (2 for a tile outside the classes, e.g. an A/B's)."""
    return SKINNY_TASKS_PER_SM.get(cfg, 2.0)


def fp32_config(cfg: TileConfig) -> TileConfig:
    """fp32 tiles take twice the shared memory per stage: halve the contraction step, <= 3 stages."""
    return dataclasses.replace(cfg, block_k=max(16, cfg.block_k // 2), num_stages=min(3, cfg.num_stages))

_KERNELS: dict = {}

# Rows through pointers (gemm_tiles.use_tma's row_pointers) in the plans whose row tiles leave a
# descriptor's box running far past the rows (row_pointers): one H200 as a rank of two
# (launch/ops_ab.py, records row_loads_ab, twenty-eighth session), pointers against descriptors for
# every GEMM's rows: at M=129 (a second row tile of 1 row) ag_gemm -17 to -20%, gemm_rs -6 to -23%,
# the MLPs -3 to -17%; at M=16 / 100 (one tile of 32 / 128 rows) ag_gemm and the MLPs 0 to -11%;
# at M=192 (a half tile) -9 to +6%; at M=1000 / 1024 (full tiles) ag_gemm and gemm_rs within
# +-2%, the MLPs up to +11% (llama31_70b). gemm_rs's skinny classes keep descriptors: -1 to +14%
# at M=16 / 100. The rule against descriptors everywhere (records row_pointers_ab, 4 shapes x 7 M):
# geomean over 28 cells ag_gemm -8.6%, gemm_rs -4.7%, the MLPs -2.0 / -2.7%; at M=129 -27 / -16 /
# -11 / -13%; its miss, the MLPs at M=160 on llama31_70b, +10 / +13% (the SwiGLU tiles' pointer
# loads: above 128 rows the MLP's plan pads its gathered rows instead, ops.mlp.PAD_ROWS).
# Unmeasured at world 2, where a rank's 65-127 rows (M = 129-255) make every row tile ragged.
# Knob: ETDIST_ROW_POINTERS=0 / 1 (never / always; unset, -1: the plans' rule).
ROW_POINTERS = knobs.read("ETDIST_ROW_POINTERS", knobs.flag, -1)


def row_pointers(rows: int, block_m: int) -> bool:
    """Whether tiles of block_m rows over `rows` rows (a source's or an owner's) load them through
    pointers: where the last tile is ragged and is either the only one or less than half full (one
    row tile of 100 rows in 128; 129 rows in two tiles of 128, 1 row in the second)."""
    if ROW_POINTERS != -1:
        return bool(ROW_POINTERS)
    last = rows % block_m
    return last > 0 and (rows < block_m or 2 * last < block_m)


# Above the decode sizes, where each source's (ag_gemm, the MLP) or owner's (gemm_rs) rows are one
# row tile (M <= 256 at world 2), the per-source tiles in source-major order read every weight tile
# once per source: at world 2 the MLP at M = 129 / 160 took 1.6x its M = 128 time (records
# mlp_mid_world2). INTERLEAVE_SOURCES puts the sources' tiles q side by side
# (workloads.gather.source_order; the MLP's down tiles and gemm_rs's tiles with their owners side
# by side too), so they read each weight tile once. One GPU has one source, but the same two orders of two row tiles (tile
# order group_m=1: row tile 0 across every column, then row tile 1, against the default grouped
# order) on one H100 as a rank of two (thirtieth session, M = 129-256 on 4 shapes): the row-major
# order +30% geomean for the MLP (llama31_70b +38-48%), +38% for ag_gemm (+13-67% a cell; records
# source_order_proxy_ab) and +20% for gemm_rs (+35-38% on llama31_70b / gemma2_27b at 129 / 160;
# records rs_source_order_proxy_ab). gemm_rs interleaved from the thirty-first session: as its tiles
# then read the weights once, plan_cost counts them once, and its plans at M = 129-256 become the
# one-GPU plans of the same rows (more slices on the 8-9B shapes and gpt3_175b; whole tiles on
# llama31_405b, with a reduce task, as fuse_own needs own tiles last). On one H100 as a rank of two
# (records rs_interleave_proxy_ab, 8 shapes x M = 129 / 160 / 256), the former world-2 plan in the
# world-2 order (its slices, owner-major order as group_m=1, fused whole tiles) took 1.19x the new
# plan's time geomean (1.04-1.66x a cell; llama31_405b 1.16-1.66x); the former slices in the new
# order 1.03x. Checked against float64 at two and three ranks sharing one H100
# (tests/gpu/shared_gpu_worker.py); unmeasured on two GPUs yet (`bash launch/decode-ab.sh mid`).
# Knob: ETDIST_INTERLEAVE_SOURCES=0 (source order, as before).
INTERLEAVE_SOURCES = knobs.read("ETDIST_INTERLEAVE_SOURCES", knobs.flag, True)


def interleave_sources(rows: int, block_m: int, world: int) -> bool:
    """Whether the per-source (per-owner) graphs put the sources' tiles side by side
    (INTERLEAVE_SOURCES): where each source's `rows` are one row tile, at two or more ranks."""
    return bool(INTERLEAVE_SOURCES) and world > 1 and rows <= block_m


def skinny_class(M: int) -> Optional[TileConfig]:
    """The smallest skinny class that holds M rows (None above 128: the large graph's tiles)."""
    return next((cfg for cfg in SKINNY_CLASSES if M <= cfg.block_m), None)


def large_tiles(M: int, N: int, world: int, cfg: TileConfig) -> int:
    """Tiles of the large graph: world destinations x row tiles of an owner's rows x column tiles."""
    rows = -(-M // world)                     # rows per owner
    return world * -(-rows // cfg.block_m) * -(-N // cfg.block_n)


def tile_us(block_m: int, block_n: int, K: int) -> float:
    """us of one block_m x block_n output tile over a contraction of K on one SM at SM_TFLOPS."""
    return 2 * block_m * block_n * K / (SM_TFLOPS * 1e6)


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


def large_plan(M: int, K: int, N: int, world: int, sms: int, itemsize: int = 2, interleave: bool = False) -> int:
    """Contraction slices of the large graph's LARGE tiles: the fewest that plan_cost rates best."""
    costs = [plan_cost(M, K, N, world, sms, LARGE, s, itemsize, interleave) for s in range(1, MAX_SPLITS + 1)]
    return 1 + costs.index(min(costs))


SCRATCH_BYTES = 1 << 30   # the most symmetric memory a plan's partials may take (x world x slices)


def slices_that_fit(M: int, N: int, world: int, itemsize: int, splits: int) -> int:
    """`splits`, or fewer where the partials [world x splits, rows per owner, N] would outgrow
    SCRATCH_BYTES (NVSHMEM's heap is 4 GiB by default) or the bodies' int32 offsets into them."""
    one = world * -(-M // world) * N                     # elements of one slice's partials
    return max(1, min(splits, SCRATCH_BYTES // (one * itemsize), (2 ** 31 - 1) // one))


def tail_plan(M: int, K: int, N: int, world: int, sms: int, itemsize: int = 2, interleave: bool = False) -> int:
    """Contraction slices of the LARGE tiles past the last whole wave on `sms` SMs: the fewest that
    make their waves shortest, a task its steps and TASK_US (72 tiles left of gemma2_27b's: 3 slices
    make 216 tasks, two waves of thirds), at most MAX_SPLITS. Fewer tiles than SMs are all tail:
    large_plan's roofline, which knows when the weights' traffic bounds the kernel."""
    tiles = large_tiles(M, N, world, LARGE)
    if tiles < sms:
        return slices_that_fit(M, N, world, itemsize, large_plan(M, K, N, world, sms, itemsize, interleave))
    tail = tiles % sms
    if not tail:
        return 1
    whole = tile_us(LARGE.block_m, LARGE.block_n, K)
    most = slices_that_fit(M, N, world, itemsize, MAX_SPLITS)
    costs = [-(-tail * s // sms) * (whole / s + TASK_US) for s in range(1, most + 1)]
    return 1 + costs.index(min(costs))


def wave_splits(tiles: int, sms: int, most: int) -> int:
    """Contraction slices (at most `most`) of `tiles` equal tiles run together on `sms` SMs: the
    fewest that make their waves shortest, counting SPLIT_COST per extra slice (72 tiles on 132
    SMs: 3 slices make 216 tasks, two waves of thirds, 0.67 of a whole tile's time). The MLP's."""
    costs = [-(-tiles * s // sms) / s * (1 + SPLIT_COST * (s - 1)) for s in range(1, most + 1)]
    return 1 + costs.index(min(costs))


def chosen_plan(M: int, K: int, N: int, world: int, sms: int, itemsize: int = 2,
                interleave: bool = False) -> tuple[int, int]:
    """(splits, wave) of the large graph: large_plan's slices of every tile (wave 0) or, where the
    tiles fill a wave of SMs (SPLIT_TAIL), whole waves of whole tiles and tail_plan's slices past
    them (wave = sms), whichever plan_cost rates faster. Measured on one H100 as a rank of two
    (records rs_task_cost_proxy_ab): qwen3_8b at M=2560, 320 tiles, a tail of 56 tiles in 2 slices
    took 0.92x the whole tiles' time, where gemma2_9b at M=2048 (224 tiles, 92 left in 4 slices)
    took 1.09x."""
    splits = large_plan(M, K, N, world, sms, itemsize, interleave)
    if not SPLIT_TAIL or large_tiles(M, N, world, LARGE) < sms:
        return splits, 0
    tail = tail_plan(M, K, N, world, sms, itemsize, interleave)
    if tail > 1 and plan_cost(M, K, N, world, sms, LARGE, tail, itemsize, interleave, wave=sms) < \
            plan_cost(M, K, N, world, sms, LARGE, splits, itemsize, interleave):
        return tail, sms
    return splits, 0


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    """Asked once per GPU, not on every call (the op's host time is on the decode path)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def skinny_reduce_n(block_n: int, n_tiles: int, sms: int) -> int:
    """Width of the skinny graph's reduce tiles: block_n cut in a power of two of parts, no narrower
    than SKINNY_REDUCE_N, and no more reduce tasks than SMs (qwen3_8b's 32 column tiles on 132 SMs:
    4 parts of 32; gpt3_175b's 96: whole). One H200 as a rank of two (records gemm_rs_w1_ab), 32 wide
    against 128 at M = 16 / 100 / 128: -1 to -20% on the 8-9B shapes, within +-3% on the others."""
    sub = 1
    while block_n % (2 * sub) == 0 and block_n // (2 * sub) >= SKINNY_REDUCE_N and 2 * sub * n_tiles <= sms:
        sub *= 2
    return block_n // sub


def skinny_splits(N: int, sms: int, block_n: int, tasks_per_sm: float) -> int:
    """Contraction slices so that slices x column tiles gives every SM at most `tasks_per_sm` tasks:
    rounded down, as a few tasks over the aim make a whole extra wave (gemma2_27b at M=128, 36 column
    tiles: 4 slices put 144 tasks on 132 SMs, 12 of them in a second wave after the first)."""
    return max(1, min(8, int(tasks_per_sm * sms / -(-N // block_n))))


@functools.lru_cache(maxsize=4096)
def kernel_plan(M: int, K: int, N: int, dtype: torch.dtype, sms: int, world: int = 2):
    """What the op compiles for x [M, K] @ w [K, N] on a GPU of `sms` SMs among `world` ranks: (tile
    config, split-K slices, alignment, a builder of the graph). launch/trace_gemm_rs.py traces the
    same plan. Cached (~1.7 us a call uncached, on the eager decode path): after changing a knob's
    module attribute, ops.clear_plan_caches()."""
    cfg = skinny_class(M)
    skinny = cfg is not None
    cfg = cfg or LARGE
    tasks_per_sm = skinny_tasks_per_sm(cfg)
    if dtype == torch.float32:
        cfg = fp32_config(cfg)
    align = 16 if K % 16 == 0 and N % 16 == 0 else 1  # aligned rows vectorise
    # builders as partials: `build.func` names the graph, which the op's kernel cache keys on
    if not skinny:
        rows = -(-M // world)                            # rows per owner
        # the owners' tiles side by side (each reads the weights once): not owner by owner, so
        # neither own_last nor fuse_own
        interleave = interleave_sources(rows, cfg.block_m, world) and not OWN_LAST
        splits, wave = chosen_plan(M, K, N, world, sms, dtype.itemsize, interleave)
        fuse = FUSE_OWN and splits == 1 and not interleave
        return cfg, splits, align, functools.partial(gemm_rs.gemm_reduce_scatter, cfg.block_m, cfg.block_n, dtype,
                                                     cfg.block_k, align, splits=splits, wave=wave,
                                                     own_last=OWN_LAST or fuse, fuse_own=fuse,
                                                     row_pointers=row_pointers(rows, cfg.block_m),
                                                     interleave=interleave)
    splits = skinny_splits(N, sms, cfg.block_n, tasks_per_sm)
    reduce_n = skinny_reduce_n(cfg.block_n, -(-N // cfg.block_n), sms)
    return cfg, splits, align, functools.partial(gemm_rs.gemm_reduce_scatter_skinny, cfg.block_m, cfg.block_n, dtype,
                                                 cfg.block_k, splits, align, cfg.swap_ab, reduce_n=reduce_n)


def gemm_reduce_scatter(x: torch.Tensor, w: torch.Tensor, mesh=None, schedule: str = "static",
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum over ranks of x @ w, scattered by rows: this rank's rows [r*C, min((r+1)*C, M)), C = cdiv(M, R).

    x: [M, K_local] this rank's shard of the contraction (row-major, contiguous); the same M on
       every rank, any M (not necessarily a multiple of the world size or the tile).
    w: [K_local, N] (row-major: pass `weight.t().contiguous()` for an nn.Linear weight [N, K]).
    Returns [rows owned, N] in x's dtype (bf16/fp16/fp32), accumulated in fp32 per rank and summed
    in fp32 across ranks (partials travel in x's dtype; fp32 inputs multiply as TF32 on tensor cores).
    Under torch.compile: one opaque node of its graph (ops/compiled.py; `out=` is then a copy).
    """
    if torch.compiler.is_compiling():
        return call_op("gemm_reduce_scatter", x, w, schedule, mesh=mesh, out=out)
    knobs.check(*TILE_KNOBS)
    with refusal_reaches_peers(mesh, _KERNELS):
        mesh = check_operands("gemm_reduce_scatter", "etdist.workloads.gemm_rs", x, w, mesh)
        empty = None if x.shape[0] else no_rows("gemm_reduce_scatter", x, w.shape[1], out)
    if mesh.backend == "cpu":   # the CPU runtime across processes (ops/cpu_path.py)
        return cpu_path.gemm_reduce_scatter(x, w, mesh, schedule, out)
    if empty is not None:
        cpu_path.agree_no_rows(mesh, "gemm_reduce_scatter", x, w, out)
        return empty
    cfg, splits, align, build = kernel_plan(x.shape[0], x.shape[1], w.shape[1], x.dtype, _sm_count(mesh.device.index),
                                            mesh.world_size)
    kernel = cached_kernel(_KERNELS, cfg, schedule, build)
    return kernel(mesh, x=x, w=w, out=None if out is None else {"y": out})["y"]


def kernel_key(cfg: TileConfig, schedule: str, build) -> tuple:
    """What the ops' kernel caches key on: the graph and every argument it is built with (a knob may
    give a skinny class the large graph's tile), and the tile's warps and stages."""
    return cfg, schedule, build.func, build.args, tuple(sorted(build.keywords.items()))


def cached_kernel(cache: dict, cfg: TileConfig, schedule: str, build):
    """The op's megakernel for its plan (kernel_key): compiled from build() (a graph) on first use,
    with cfg's warps and stages; one binary per size class, reused for every M."""
    key = kernel_key(cfg, schedule, build)
    kernel = cache.get(key)
    if kernel is None:
        kernel = cache[key] = et_compile(build(), schedule=schedule, target="cuda")
        kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
    return kernel


class refusal_reaches_peers:
    """Around an op's own argument checks: a refusal on this rank alone is published as this rank's
    call (fusion.cuda_runtime.post_refusal, mesh/calls.py), so the peers' launch of it runs nothing and
    every rank raises, naming it. A class, not a contextlib generator: it wraps every call of the ops
    (a generator cost ~1 us more per call)."""

    __slots__ = ("mesh", "kernels")

    def __init__(self, mesh, kernels: dict):
        self.mesh, self.kernels = mesh, kernels

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, InputError):
            try:
                m = self.mesh or current_mesh()
            except MeshError:
                m = None
            if m is not None:
                post_refusal(m, list(self.kernels.values()), str(exc))
        return False   # the error goes on


def check_operands(op: str, graph: str, x, w, mesh):
    """x [rows, K] and w [K, N]: 2-D, contiguous, on this rank's device (its GPU; the CPU on a cpu
    mesh, where the CPU runtime runs `graph`: ops/cpu_path.py), one dtype among bf16/fp16/fp32; a
    clear error before anything launches. Returns the mesh (the current one if None)."""
    mesh = mesh or current_mesh()
    if getattr(mesh, "backend", None) is None:
        raise InputError(f"et.ops.{op}: mesh must be the Mesh from et.init_mesh() (or None for the current "
                         f"one), got {type(mesh).__name__}")
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise InputError(f"{op}: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != mesh.device:
            raise InputError(f"{op}: {name} is on {t.device}, this rank's device is {mesh.device}")
        if not t.is_contiguous():
            raise InputError(f"{op}: {name} is not contiguous (row-major): pass {name}.contiguous()")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"{op}: x and w must share a dtype among bf16/fp16/fp32, got {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[0]:
        raise InputError(f"{op}: x is [rows, {x.shape[1]}] but w is [{w.shape[0]}, N]: the contraction dims differ")
    if x.shape[1] == 0 or w.shape[1] == 0:   # before any plan code (tile counts, splits divide by them)
        raise InputError(f"{op}: x is {list(x.shape)} and w {list(w.shape)}: a zero-sized "
                         f"{'contraction (K = 0)' if x.shape[1] == 0 else 'output width (N = 0)'} is not supported; "
                         f"skip the call (its result is {'all zeros' if x.shape[1] == 0 else 'empty'})")
    return mesh


def no_rows(op: str, x: torch.Tensor, cols: int, out) -> torch.Tensor:
    """The result at M = 0 (every rank's batch empty: every rank must be told so alike, as the op
    returns without a word to the peers): nothing to launch, so the empty [0, cols] (`out` itself,
    checked, if given)."""
    if x.shape[0]:
        raise InputError(f"{op}: total_rows is 0 but x has {x.shape[0]} rows")
    if out is None:
        return x.new_empty((0, cols))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (0, cols) or out.dtype != x.dtype \
            or out.device != x.device:
        raise InputError(f"{op}: out must be an empty {x.dtype} tensor [0, {cols}] on {x.device} (no rows), got "
                         f"{getattr(out, 'shape', type(out).__name__)}")
    return out


def total_rows_of(op: str, total_rows, x: torch.Tensor, world: int) -> int:
    """M for an op whose x holds this rank's rows: total_rows, or rows x world when not given."""
    if total_rows is None:
        return x.shape[0] * world
    if isinstance(total_rows, bool) or not isinstance(total_rows, int) or total_rows < 0:
        raise InputError(f"{op}: total_rows must be a non-negative int (M, the rows of every rank together), "
                         f"got {total_rows!r}")
    return total_rows


def compiled_variants() -> int:
    """How many megakernel binaries the op has compiled so far (over all size classes)."""
    n = 0
    for k in _KERNELS.values():
        for caches in k.module.megakernel.device_caches.values():
            n += len(caches[0])
    return n
