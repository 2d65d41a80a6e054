"""A rank's share of a tensor-parallel cell and the references around it: its rows of M, every
rank's rows gathered, the relative error against a float reference (the sweep, launch/regress.py
and launch/soak.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def chunk(M: int, world: int, rank: int) -> tuple[int, int]:
    """This rank's rows [start, stop) of M split in chunks of cdiv(M, world), ragged at the end."""
    C = -(-M // world)
    return min(M, rank * C), min(M, (rank + 1) * C)


def gather_rows(x_mine: torch.Tensor, M: int, world: int, group=None) -> torch.Tensor:
    """float32 [M, K] of every rank's row chunk (chunks padded to cdiv(M, world) in transit);
    collective over `group` (None: the world)."""
    C = -(-M // world)
    padded = torch.zeros(C, x_mine.shape[1], device=x_mine.device, dtype=torch.float32)
    padded[:x_mine.shape[0]] = x_mine.float()
    full = torch.empty(C * world, x_mine.shape[1], device=x_mine.device, dtype=torch.float32)
    dist.all_gather_into_tensor(full, padded, group=group)
    return full[:M]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 for an empty result)."""
    if not want.numel():
        return 0.0
    return ((got.float() - want).abs().max() / want.abs().max()).item()
