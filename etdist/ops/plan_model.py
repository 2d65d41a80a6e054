"""What the ops' plan models share: the SM count, the cost model's rate and bounds, row pointers and interleaving."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Asked once per GPU, not on every call (the op's host time is on the decode path)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def row_pointers(rows: int, block_m: int, at_half: bool = False) -> bool:
    """Whether tiles of block_m rows over `rows` rows (a source's or an owner's) load them through
    pointers (gemm_tiles.use_tma), where a descriptor's box would run far past the rows (its zero
    fill is slow): where the last tile is ragged and is either the only one or less than half full
    (one row tile of 100 rows in 128; 129 rows in two tiles of 128, 1 row in the second); at_half,
    also where it is exactly half full (all_gather_gemm's). Records row_pointers_ab.jsonl and
    ag_gemm_ab.jsonl (variant ROW_POINTERS=1)."""
    last = rows % block_m
    return last > 0 and (rows < block_m or 2 * last < block_m or (at_half and 2 * last == block_m))


def interleave_sources(rows: int, block_m: int, world: int) -> bool:
    """Whether the per-source (per-owner) graphs put the sources' tiles side by side
    (workloads.gather.source_order), so that they read each weight tile once: where each source's
    `rows` are one row tile, at two or more ranks. Records rs_interleave_proxy_ab.jsonl."""
    return world > 1 and rows <= block_m


# The plan models' rate: a LARGE-sized tile's on one SM (records mlp_trace.jsonl)
SM_TFLOPS = 6.0
SPLIT_COST = 0.03   # per extra contraction slice: its partial's stores and sum, a pipeline fill
SCRATCH_BYTES = 1 << 30   # the most symmetric memory a plan's partials may take (x world x slices)


def tile_us(block_m: int, block_n: int, K: int) -> float:
    """us of one block_m x block_n output tile over a contraction of K on one SM at SM_TFLOPS."""
    return 2 * block_m * block_n * K / (SM_TFLOPS * 1e6)


def wave_splits(tiles: int, sms: int, most: int) -> int:
    """Contraction slices (at most `most`) of `tiles` equal tiles run together on `sms` SMs: the
    fewest that make their waves shortest, counting SPLIT_COST per extra slice (72 tiles on 132
    SMs: 3 slices make 216 tasks, two waves of thirds, 0.67 of a whole tile's time)."""
    costs = [-(-tiles * s // sms) / s * (1 + SPLIT_COST * (s - 1)) for s in range(1, most + 1)]
    return 1 + costs.index(min(costs))


def slices_that_fit(M: int, N: int, world: int, itemsize: int, splits: int) -> int:
    """`splits`, or fewer where the partials [world x splits, rows per owner, N] would outgrow
    SCRATCH_BYTES (NVSHMEM's heap is 4 GiB by default) or the bodies' int32 offsets into them."""
    one = world * -(-M // world) * N                     # elements of one slice's partials
    return max(1, min(splits, SCRATCH_BYTES // (one * itemsize), (2 ** 31 - 1) // one))
