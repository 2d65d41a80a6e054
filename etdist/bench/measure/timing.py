"""Timing per docs/benchmarks.md ("How we measure"): warm up, barrier, then batches of back-to-back calls between two events.

A batch of `calls` calls between two CUDA events hides host launch latency as a real forward pass
does; per-call time = batch time / calls; the result is the median over `batches` batches. Across
ranks report `slowest_rank(t)`. `time_alternated` times several contenders in rounds of turning
order (`turns`), so that none keeps the same slot. Without CUDA the same structure runs on `time.perf_counter`, so the
protocol is testable on CPU (the numbers then include host overhead).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...mesh import MeshError, timing_refused


def refuse_shared_gpu() -> None:
    """Raise MeshError where times would mean nothing: the current mesh's ranks share a GPU."""
    why = timing_refused()
    if why:
        raise MeshError(f"not timing: {why}")


def _use_cuda(device) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


BATCH_US = 10_000   # a batch's length: in short batches eager decode calls read slow (records batch_length_ab)
MOST_CALLS = 200    # the longest batches those records compare


def batch_calls(est_us: float) -> int:
    """Calls per batch for a call of about `est_us`: BATCH_US worth, 3 to MOST_CALLS."""
    return max(3, min(MOST_CALLS, round(BATCH_US / max(est_us, 1.0))))


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


def _per_call(fn, *, calls, batches, warmup, barrier, device) -> list[float]:
    """Microseconds per call of each of `batches` batches (after the warm-up and the barrier)."""
    if calls < 1 or batches < 1 or warmup < 0:
        raise ValueError(f"need calls >= 1, batches >= 1, warmup >= 0; "
                         f"got {calls}, {batches}, {warmup}")
    refuse_shared_gpu()
    cuda = _use_cuda(device)
    pinned = cuda and device is not None
    with torch.cuda.device(device) if pinned else contextlib.nullcontext():
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
        if barrier is not None:
            barrier()
        return [_elapsed_us(fn, calls, cuda) / calls for _ in range(batches)]


def time_batched(fn: Callable[[], object], *, calls: int = 20, batches: int = 7, warmup: int = 5,
                 barrier: Optional[Callable[[], object]] = None, device=None) -> float:
    """Microseconds per call of fn: median over `batches` batches of `calls` back-to-back calls.

    fn is called warmup + calls * batches times. `barrier` (e.g. `dist.barrier`) runs once, after
    the warm-up has finished on the device and before the first batch. `device`: a CUDA device to
    time on with events (default: the current one if CUDA is available), or "cpu" for perf_counter.
    """
    return statistics.median(_per_call(fn, calls=calls, batches=batches, warmup=warmup,
                                       barrier=barrier, device=device))


def time_graph(fn: Callable[[], object], calls: int = 20, batches: int = 5) -> float:
    """Median microseconds per call of fn over replays of a CUDA graph of `calls` back-to-back calls
    (warmed up off the capture, so compiles and allocations stay out of it): one GPU's kernel time
    with no host launch cost in it, what the experiments' tile and ceiling studies time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_single(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 5,
                barrier: Optional[Callable[[], object]] = None, device=None) -> float:
    """Microseconds of one call between two events (launch latency included), median of `repeats`."""
    return statistics.median(_per_call(fn, calls=1, batches=repeats, warmup=warmup,
                                       barrier=barrier, device=device))


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
    refuse_shared_gpu()   # on every rank alike, before any collective
    if dist.is_available() and dist.is_initialized():
        kwargs.setdefault("barrier", lambda: dist.barrier(group=group))
    t = (time_single if single else time_batched)(fn, **kwargs)
    return slowest_rank(t, group)


def turns(names: list, rounds: int) -> list[list]:
    """The order of each round: rotated by one every two rounds, and every second round reversed,
    so that over an even number of rounds each name runs before each other name as often as after
    it and every name's mean slot is the middle one."""
    n = len(names)
    out = []
    for r in range(rounds):
        k = (r // 2) % n if n else 0
        order = names[k:] + names[:k]
        out.append(order[::-1] if r % 2 else order)
    return out


def time_alternated(fns: dict[str, Callable[[], object]], *, rounds: int = 4, group=None,
                    single: bool = False, calls: Optional[int] = 20, batches: int = 2, repeats: int = 2,
                    warmup: int = 5, device=None) -> dict[str, float]:
    """Microseconds per call of each of `fns` (name -> fn), timed alternately: every round times each
    fn once (warm-up, a barrier over `group` when torch.distributed is initialised, then `batches`
    batches of `calls` calls (None: each fn's own batch_calls, ~10 ms of it), or `repeats` single
    calls if single=True), in the orders of `turns`. Per name: the median over all its rounds'
    batches, then the slowest rank. Collective: the ranks of `group` must pass the same names in the
    same order (checked).

    Why alternate: timed in a fixed order, the later of two identical kernels measured 2-3% faster,
    and the bench's first contender ~6% faster at large M (records ops_ab_control, bench_order_ab).
    An even number of rounds balances every pair's order.
    """
    if rounds < 1:
        raise ValueError(f"need rounds >= 1, got {rounds}")
    refuse_shared_gpu()   # on every rank alike, before any collective
    distributed = dist.is_available() and dist.is_initialized()
    names = list(fns)
    if distributed and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, names, group=group)
        if any(theirs != names for theirs in everyone):
            raise RuntimeError(f"time_alternated: the ranks time different contenders: {everyone}")
    if not names:
        return {}
    barrier = (lambda: dist.barrier(group=group)) if distributed else None
    if single:
        per = {n: 1 for n in names}
    elif calls is None:   # each contender's own batch_calls, from its time on the slowest rank
        # (sized by the slowest contender, a fast call's batches were so short that their start dominated:
        # records moe_batch_length_ab)
        per = {n: batch_calls(slowest_rank(_per_call(fns[n], calls=1, batches=1, warmup=1, barrier=barrier,
                                                     device=device)[0], group)) for n in names}
    else:
        per = {n: calls for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    for order in turns(names, rounds):
        for n in order:
            samples[n] += _per_call(fns[n], calls=per[n], batches=repeats if single else batches, warmup=warmup,
                                    barrier=barrier, device=device)
    return {n: slowest_rank(statistics.median(samples[n]), group) for n in names}
