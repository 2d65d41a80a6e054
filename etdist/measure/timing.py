"""Timing per DESIGN.md: warm up, barrier, then batches of back-to-back calls between two events.

A batch of `calls` calls between two CUDA events hides host launch latency as a real forward pass
does; per-call time = batch time / calls; the result is the median over `batches` batches. Across
ranks report `slowest_rank(t)`. Without CUDA the same structure runs on `time.perf_counter`, so the
protocol is testable on CPU (the numbers then include host overhead).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


def _use_cuda(device) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def _elapsed_us(fn: Callable[[], object], calls: int, cuda: bool) -> float:
    """Total microseconds of `calls` back-to-back calls of fn."""
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3      # elapsed_time is in ms
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e6


def _median_per_call(fn, *, calls, batches, warmup, barrier, device) -> float:
    if calls < 1 or batches < 1 or warmup < 0:
        raise ValueError(f"need calls >= 1, batches >= 1, warmup >= 0; "
                         f"got {calls}, {batches}, {warmup}")
    cuda = _use_cuda(device)
    pinned = cuda and device is not None
    with torch.cuda.device(device) if pinned else contextlib.nullcontext():
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
        if barrier is not None:
            barrier()
        per_call = [_elapsed_us(fn, calls, cuda) / calls for _ in range(batches)]
    return statistics.median(per_call)


def time_batched(fn: Callable[[], object], *, calls: int = 20, batches: int = 7, warmup: int = 5,
                 barrier: Optional[Callable[[], object]] = None, device=None) -> float:
    """Microseconds per call of fn: median over `batches` batches of `calls` back-to-back calls.

    fn is called warmup + calls * batches times. `barrier` (e.g. `dist.barrier`) runs once, after
    the warm-up has finished on the device and before the first batch. `device`: a CUDA device to
    time on with events (default: the current one if CUDA is available), or "cpu" for perf_counter.
    """
    return _median_per_call(fn, calls=calls, batches=batches, warmup=warmup, barrier=barrier,
                            device=device)


def time_single(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 5,
                barrier: Optional[Callable[[], object]] = None, device=None) -> float:
    """Microseconds of one call between two events (launch latency included), median of `repeats`."""
    return _median_per_call(fn, calls=1, batches=repeats, warmup=warmup, barrier=barrier,
                            device=device)


def slowest_rank(value: float, group=None) -> float:
    """The maximum of `value` over the ranks of `group` (all-reduce MAX); `value` itself when
    torch.distributed is not initialised. Collective: every rank of the group must call it."""
    if not (dist.is_available() and dist.is_initialized()):
        return float(value)
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def time_ranks(fn: Callable[[], object], *, group=None, single: bool = False, **kwargs) -> float:
    """The protocol end to end on every rank of `group`: a barrier over the group (when
    torch.distributed is initialised), `time_batched` (or `time_single` if single=True) with
    **kwargs, then the slowest rank's figure. Collective."""
    if dist.is_available() and dist.is_initialized():
        kwargs.setdefault("barrier", lambda: dist.barrier(group=group))
    t = (time_single if single else time_batched)(fn, **kwargs)
    return slowest_rank(t, group)
