"""The whole tensor-parallel SwiGLU MLP as one persistent kernel per GPU: sequence-parallel
(all-gather, gate/up GEMM, SwiGLU, down GEMM, reduce-scatter) or with replicated input and output
(gate/up GEMM, SwiGLU, down GEMM, all-reduce)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np
import torch

from ..fusion.errors import InputError
from ..collectives.custom_op import call_op
from ..workloads import mlp as mlp_graph
from . import cpu_path
from .ag_gemm import tail_tile, whole_tile, whole_width
from .common import (RepeatedCall, cached_kernel, check_operands, no_rows, plan_config, refusal_reaches_peers,
                     total_rows_of)
from .config import PlanConfig, TileConfig, fp32_config
from .plan_model import (SCRATCH_BYTES, SPLIT_COST, interleave_sources, row_pointers, slices_that_fit, sm_count,
                         tile_us, wave_splits)

# The plan above PlanConfig.whole_max_m rows (kernel_plan): gate/up tiles of PlanConfig.mlp_tiles
# (two accumulators each), down tiles PlanConfig.mlp_down_n wide (one accumulator: records
# mlp_down_ab.jsonl). A down tile is the MLP's longest task (K = I per rank), so where they leave a
# ragged last wave the last few of each rank's order run in PlanConfig.mlp_tail_splits contraction
# slices (tail_plan; records mlp_w1_ab.jsonl), and where they all fit one wave, all of them in as
# many slices as make it shortest (few_down_splits; records mlp_mid_slices_ab.jsonl). The gathered
# rows lie in a buffer padded to whole row tiles, which the gate/up tiles read through descriptors
# over whole tiles (gemm_tiles.box_rows): no slow zero fill past the rows, no pointer loads; where
# row_pointers holds for a rank's rows its own rows are gathered too, as x is the caller's
# (records padded_rows_ab.jsonl).
# At or below whole_max_m rows (the whole-gather graph) the down tiles are few (H / block_n per row
# tile) and each streams a whole column of w_down: they run in up to WHOLE_DOWN_SPLITS slices
# (whole_down_splits), as many as keep one task per SM.
WHOLE_DOWN_SPLITS = 4
TAIL_UP_N = 64   # the tail class's gate/up tiles at most this wide: four accumulators (gate, up; rows, tail)
SEND_US, REDUCE_US = 1.0, 3.0   # least_busy_tail's guesses for a gathered row tile's copy and an owner's sum
MIN_GAIN = 0.03   # least_busy_tail slices nothing for less: its model ignores the waits, and slices cost traffic
_KERNELS: dict = {}
_REPEAT = RepeatedCall()


@functools.lru_cache(maxsize=4096)
def tail_plan(M: int, H: int, I: int, world: int, sms: int, splits: int, config: PlanConfig, *,
              own_from_x: bool) -> int:
    """How many of the last down tiles (config.mlp_tiles' rows, config.mlp_down_n wide) of each
    rank's order to cut in `splits` slices (at most one owner's): the number that makes the static
    schedule's busiest program least busy, its tasks (dealt round-robin: task t to program t % sms)
    weighed by their work at plan_model.SM_TFLOPS, a slice SPLIT_COST more per extra slice; the fewest
    among equals, and none unless that program's load falls by MIN_GAIN, nor where every down tile
    fits in one wave (the model then trades the gate/up tiles' dealing against partials it does not
    price: records mlp_w1_ab.jsonl).
    own_from_x: as the graph is built (then the gather deals (world - 1) x row tiles x column tiles
    copies ahead of the gate/up tiles, not world x)."""
    cfg, down_n = config.mlp_tiles, config.mlp_down_n
    rows = -(-M // world)                                # rows per owner
    m = -(-rows // cfg.block_m)                          # row tiles per owner
    i_tiles, h_tiles, k_tiles = -(-I // cfg.block_n), -(-H // down_n), -(-H // cfg.block_n)
    mn = m * h_tiles
    if world * mn <= sms:
        return 0
    sends = (world - 1 if own_from_x else world) * m * k_tiles   # the gather's copies, then the gate/up tiles
    before = [(sends, SEND_US), (world * m * i_tiles, _gate_up_us(cfg, cfg.block_n, H))]
    return least_busy_tail(sms, before, world * mn, _down_us(cfg, down_n, I), splits, [(m * h_tiles, REDUCE_US)],
                           most=min(mn, sms))


def _gate_up_us(cfg: TileConfig, up_n: int, H: int) -> float:   # a gate/up tile (gate and up) at SM_TFLOPS
    return tile_us(cfg.block_m, 2 * up_n, H)


def _down_us(cfg: TileConfig, down_n: int, I: int) -> float:     # a whole down tile at SM_TFLOPS
    return tile_us(cfg.block_m, down_n, I)


def least_busy_tail(sms: int, before: list, n_down: int, down_us: float, splits: int, after: list,
                    most: int) -> int:
    """tail_plan's model: tasks dealt round-robin (task t to program t % sms) in the order `before`
    ((count, us) pairs), the n_down down tiles (the last `tail` of them in `splits` slices, each
    SPLIT_COST more per extra slice), `after`. The tail in [0, most] that makes the busiest program
    least busy; the fewest among equals, and 0 unless that program's load falls by MIN_GAIN."""
    slice_us = down_us / splits * (1 + SPLIT_COST * (splits - 1))
    tails = np.arange(0, most + 1)[:, None]              # candidates x programs
    programs = np.arange(sms)[None, :]

    def dealt(start, count, us):                         # each program's share of tasks [start, start + count)
        return us * (count // sms + ((programs - start) % sms < count % sms))

    load, start = 0.0, 0
    for count, us in before:
        load, start = load + dealt(start, count, us), start + count
    whole = n_down - tails
    load = load + dealt(start, whole, down_us) + dealt(start + whole, tails * splits, slice_us)
    start = start + whole + tails * splits
    for count, us in after:
        load, start = load + dealt(start, count, us), start + count
    busiest = load.max(axis=1)
    best = int(np.argmin(busiest))
    return best if busiest[best] <= (1 - MIN_GAIN) * busiest[0] else 0


def whole_down_splits(M: int, H: int, cfg: TileConfig, sms: int) -> int:
    """Contraction slices of the whole-gather graph's down tiles: as many as fit one task per SM
    (rounded down: a few tasks over make a second wave), at most WHOLE_DOWN_SPLITS."""
    tiles = -(-M // cfg.block_m) * -(-H // cfg.block_n)
    return max(1, min(WHOLE_DOWN_SPLITS, sms // tiles))


def few_down_splits(tiles: int, sms: int, most: int, config: PlanConfig) -> int:
    """Contraction slices of all `tiles` down tiles above whole_max_m rows: where they are no more
    than the SMs, as many as make their wave shortest (plan_model.wave_splits; 36 tiles on 132 SMs: 3;
    72: 3, two waves of thirds; 112 or 128: none), at most `most`; none with more tiles (the tail
    plans' case) or where config.mlp_tail_splits is 1 (every tile whole)."""
    if tiles > sms or config.mlp_tail_splits == 1:
        return 1
    return wave_splits(tiles, sms, min(most, WHOLE_DOWN_SPLITS))


def size_class(M: int, H: int, I: int, dtype: torch.dtype, config: PlanConfig) -> tuple[bool, TileConfig, int]:
    """Both graphs' tiles for M rows: (whole: M <= config.whole_max_m, the tile config, the sizes'
    promised alignment)."""
    whole = M <= config.whole_max_m
    cfg = whole_tile("tensor_parallel_mlp", M, config) if whole else config.mlp_tiles
    cfg = fp32_config(cfg) if dtype == torch.float32 else cfg
    return whole, cfg, 16 if H % 16 == 0 and I % 16 == 0 else 1


@functools.lru_cache(maxsize=4096)
def kernel_plan(M: int, H: int, I: int, dtype: torch.dtype, sms: int, world: int, config: PlanConfig):
    """What the op compiles for M rows of x [M, H] and a rank's I on a GPU of `sms` SMs among `world`
    ranks with `config`: (tile config, a builder of the graph, the graph's run-time sizes). At most
    config.whole_max_m rows, the whole-gather graph (every weight read once) with its down tiles in
    slices and its gate/up tiles narrowed (ag_gemm.whole_width); above, the sequence-parallel graph:
    every down tile in few_down_splits' slices where they fit in one wave, else the last ones where
    tail_plan finds a ragged wave; just past whole_max_m, with the option config.mlp_tail_m, the
    whole-gather graph with a tail accumulator in every task. Cached: the op asks at every call
    (2-6 us uncached on our CPU host); config is part of the key."""
    whole, cfg, align = size_class(M, H, I, dtype, config)
    tile = tail_tile(M, align, world, dtype, config, "tensor_parallel_mlp")
    if tile is not None:   # a row tile and a tail in each task (an option)
        up_n = min(TAIL_UP_N, tile.block_k, whole_width(tile.block_m, I, tile, sms))
        return tile, functools.partial(mlp_graph.tp_mlp_whole, tile.block_m, tile.block_n, dtype, tile.block_k, align,
                                       down_splits=whole_down_splits(tile.block_m, H, tile, sms), up_n=up_n,
                                       tail_m=config.mlp_tail_m,
                                       **({"tail_row_tma": True} if config.tail_row_tma else {})), {"M": M}
    args = (cfg.block_m, cfg.block_n, dtype, cfg.block_k, align)
    if whole:
        return cfg, functools.partial(mlp_graph.tp_mlp_whole, *args, down_splits=whole_down_splits(M, H, cfg, sms),
                                      up_n=whole_width(M, I, cfg, sms), swap_ab=cfg.swap_ab,
                                      row_pointers=row_pointers(M, cfg.block_m)), {"M": M}
    # the sliced graph only where its plan slices (its partials take `splits` x the memory)
    rows = -(-M // world)                                # rows per owner
    pointers = row_pointers(rows, cfg.block_m)
    own_from_x = not pointers   # the padded buffer's rows, where x's own would leave a short ragged tile
    down_n, most_tail = config.mlp_down_n, config.mlp_tail_splits
    tiles = world * -(-rows // cfg.block_m) * -(-H // down_n)   # down tiles per rank
    splits = few_down_splits(tiles, sms, slices_that_fit(M, H, world, dtype.itemsize, WHOLE_DOWN_SPLITS), config)
    if splits > 1:   # every down tile in slices
        tail = tiles
    else:            # or the last few, where they leave a ragged last wave
        splits = 1 if most_tail == 1 else slices_that_fit(M, H, world, dtype.itemsize, most_tail)
        tail = tail_plan(M, H, I, world, sms, splits, config, own_from_x=own_from_x) if splits > 1 else 0
    # interleaved owners need the down tiles all whole or all in slices (a tail is one owner's)
    interleave = interleave_sources(rows, cfg.block_m, world) and tail in (0, tiles)
    build = functools.partial(mlp_graph.tp_mlp, *args, down_n=down_n, tail_splits=splits if tail else 1,
                              own_from_x=own_from_x, row_pointers=pointers, padded=True,
                              interleave=interleave)
    return cfg, build, ({"M": M, "TAIL": tail} if tail else {"M": M})


def replicated_rows(H: int, world: int, itemsize: int) -> int:
    """The most rows one launch of the replicated graph takes (a multiple of 128): its partials
    [world, rows, H] within SCRATCH_BYTES and the bodies' int32 offsets. A longer x runs in
    launches of that many rows (a long prefill at world 8 on the largest shapes)."""
    per_row = world * H
    rows = min(SCRATCH_BYTES // (per_row * itemsize), (2 ** 31 - 1) // per_row)
    return max(128, rows // 128 * 128)


@functools.lru_cache(maxsize=4096)
def replicated_plan(M: int, H: int, I: int, dtype: torch.dtype, sms: int, world: int, config: PlanConfig):
    """The plan (as kernel_plan's) of the replicated-in-and-out graph for M <= replicated_rows rows:
    up to config.whole_max_m rows the whole-gather graph's tiles and narrowing, every down tile in
    slices where they leave SMs idle (whole_down_splits); above, the sequence-parallel graph's
    gate/up (config.mlp_tiles) and down (config.mlp_down_n wide) tiles: where the down tiles fit in
    one wave, all of them in few_down_splits' slices; with more, the last ones in
    config.mlp_tail_splits slices where least_busy_tail finds a ragged last wave. In the whole
    classes from config.replicated_owners_min_m rows (worlds 2 .. plan_worlds) each output tile is
    summed on one owner rank, who sends the sum to all (tp_mlp_replicated(owners=True))."""
    whole, cfg, align = size_class(M, H, I, dtype, config)
    down_n = cfg.block_n if whole else config.mlp_down_n
    up_n = whole_width(M, I, cfg, sms) if whole else cfg.block_n
    m = -(-M // cfg.block_m)
    mh = m * -(-H // down_n)                            # down tiles
    if whole:
        splits, tail = whole_down_splits(M, H, dataclasses.replace(cfg, block_n=down_n), sms), mh
    elif mh <= sms:   # one slice's partials on a rank: world x M x H
        splits, tail = few_down_splits(mh, sms, slices_that_fit(M * world, H, world, dtype.itemsize,
                                                                WHOLE_DOWN_SPLITS), config), mh
    else:   # a ragged last wave
        splits = slices_that_fit(M * world, H, world, dtype.itemsize, config.mlp_tail_splits)
        tail = 0 if splits == 1 else least_busy_tail(
            sms, [(m * -(-I // up_n), _gate_up_us(cfg, up_n, H))], mh, _down_us(cfg, down_n, I), splits,
            [(mh, REDUCE_US)], most=min(mh, sms))
    splits = splits if tail else 1
    build = functools.partial(mlp_graph.tp_mlp_replicated, cfg.block_m, down_n, dtype, cfg.block_k, align,
                              down_splits=splits, up_n=up_n, swap_ab=cfg.swap_ab,
                              row_pointers=row_pointers(M, cfg.block_m),
                              **({"owners": True} if whole and 0 < config.replicated_owners_min_m <= M
                                 and config.measured_world(world) else {}))
    return cfg, build, ({"M": M, "TAIL": tail} if splits > 1 else {"M": M})


def tensor_parallel_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *, mesh=None,
                        total_rows: Optional[int] = None, out: Optional[torch.Tensor] = None,
                        schedule: str = "static", sequence_parallel: bool = True,
                        config: Optional[PlanConfig] = None) -> torch.Tensor:
    """This rank's rows of sum_r (silu(x @ gate_r) * (x @ up_r)) @ w_down_r, sequence-parallel
    (or, with sequence_parallel=False, all its rows on every rank).

    x: [rows_r, H] this rank's rows of x [M, H] (chunks of cdiv(M, R), ragged at the end: pass
       `total_rows=M` when M is not R x rows). w_gate_up: [H, 2 I_r], this rank's gate columns then
       its up columns; w_down: [I_r, H] its rows of the down projection (row-major, as
       `etdist.workloads.mlp.shard` makes them). Returns [rows_r, H] in x's dtype.
    sequence_parallel=False: every rank passes the whole x [M, H] (the same on every rank) and gets
       the whole y [M, H]: no gather, the down tiles' partials pushed to every rank and summed
       there (Megatron's MLP and its all-reduce, in one kernel; workloads.mlp.tp_mlp_replicated).
    config: the plan's tiles and bounds (et.ops.PlanConfig; None: DEFAULT_PLAN), alike on every rank.
    Under torch.compile: one opaque node of its graph (ops/compiled.py; `out=` is then a copy; the
    default config only).
    """
    if torch.compiler.is_compiling():
        plan_config("tensor_parallel_mlp", config, compiling=True)
        return call_op("tensor_parallel_mlp", x, w_gate_up, w_down, total_rows, schedule, sequence_parallel,
                       mesh=mesh, out=out)
    key = (schedule, config, sequence_parallel)
    if out is None and type(sequence_parallel) is bool and (total_rows is None or type(total_rows) is int):
        # a decode step's repeat (RepeatedCall); sequence_parallel=1 is refused by the op's checks
        y = _REPEAT.launch(key, mesh, total_rows, {"x": x, "w_gate_up": w_gate_up, "w_down": w_down})
        if y is not None:
            return y
    with refusal_reaches_peers(mesh, _KERNELS):
        config = plan_config("tensor_parallel_mlp", config)
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
        if not isinstance(sequence_parallel, bool):
            raise InputError(f"tensor_parallel_mlp: sequence_parallel must be True or False, got {sequence_parallel!r}")
        if not sequence_parallel and total_rows not in (None, x.shape[0]):
            raise InputError(f"tensor_parallel_mlp: total_rows={total_rows!r} but sequence_parallel=False: every "
                             f"rank passes the whole x ({x.shape[0]} rows here)")
        M = total_rows_of("tensor_parallel_mlp", total_rows, x, mesh.world_size if sequence_parallel else 1)
        # without total_rows a rank with no rows cannot tell M = 0 from a ragged M < world: the
        # kernel's agreement with the peers decides
        empty = (None if M or (total_rows is None and mesh.world_size > 1 and sequence_parallel)
                 else no_rows("tensor_parallel_mlp", x, H, out))
        rows = M if sequence_parallel else replicated_rows(H, mesh.world_size, x.dtype.itemsize)
        if M > rows and out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (M, H)
                                             or out.dtype != x.dtype or out.device != x.device
                                             or not out.is_contiguous()):
            raise InputError(f"tensor_parallel_mlp: out must be a contiguous {x.dtype} tensor [{M}, {H}] on "
                             f"{x.device}, got {getattr(out, 'shape', type(out).__name__)}")
    if mesh.backend == "cpu":   # the CPU runtime across processes (ops/cpu_path.py)
        return cpu_path.tensor_parallel_mlp(x, w_gate_up, w_down, mesh, M, schedule, sequence_parallel, out)
    if empty is not None:
        cpu_path.agree_no_rows(mesh, "tensor_parallel_mlp", x, w_gate_up, out)
        return empty
    sms = sm_count(mesh.device.index)
    if sequence_parallel or M <= rows:   # one launch
        plan = (kernel_plan if sequence_parallel else replicated_plan)(M, H, I, x.dtype, sms, mesh.world_size, config)
        kernel = cached_kernel(_KERNELS, config, plan[0], schedule, plan[1])
        y = kernel(mesh, x=x, w_gate_up=w_gate_up, w_down=w_down, sizes=plan[2],
                   out=None if out is None else {"y": out})["y"]
        _REPEAT.remember(key, mesh, total_rows, kernel, plan[2])   # x's rows and total_rows give M
        return y
    y = out if out is not None else x.new_empty(M, H)
    for lo in range(0, M, rows):   # every rank the same launches: x is the same everywhere
        hi = min(M, lo + rows)
        _launch(config, replicated_plan(hi - lo, H, I, x.dtype, sms, mesh.world_size, config), schedule, mesh,
                x[lo:hi], w_gate_up, w_down, y[lo:hi])
    return y


def _launch(config: PlanConfig, plan, schedule: str, mesh, x, w_gate_up, w_down, out):
    """One launch of the megakernel `plan` (a kernel_plan or replicated_plan of `config`) builds."""
    cfg, build, sizes = plan
    kernel = cached_kernel(_KERNELS, config, cfg, schedule, build)
    return kernel(mesh, x=x, w_gate_up=w_gate_up, w_down=w_down, sizes=sizes,
                  out=None if out is None else {"y": out})["y"]
