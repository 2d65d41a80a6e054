"""Traces of a launch as Chrome / Perfetto JSON: one process per rank, one track per program (CPU
runtime) or per SM (GPU).

    out = kernel.run(inputs, trace=True)                                   # CPU runtime
    et.fusion.trace.write_chrome(kernel.last_stats.trace, "launch.json")   # open in ui.perfetto.dev

    kernel = et.compile(graph, target="cuda", trace=True)                  # GPU: a compile-time switch
    kernel(mesh, **inputs); rows = kernel.trace(mesh)                      # every rank's tasks, on every rank
    et.fusion.trace.write_chrome(rows, "launch.json", track="SM")

The CPU runtime's clock is its scheduler step (deterministic for a seed), written as microseconds;
the GPU's is %globaltimer (ns). The timers of different GPUs have different origins (2x H200: ~0.24
s apart), so each rank measures its own against the host's monotonic clock, which every process of
a host shares (measure_offset: the tightest of several host brackets around a timer read), and every
rank's times are put on that clock, then shifted so the earliest program entry of any rank is 0:
ranks that started a launch apart show apart. (Ranks on several hosts: each host's clock, hosts
not aligned.)
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Iterable, Optional

from .expr import evaluate

TRACE_WORDS = 4   # per task in trace mode: start ns, waits done ns, end ns, SM << 32 | program
# then per program, the launch's own phases: entry, call agreed, tasks done, end (ns), SM << 32 | program
PHASE_WORDS = 5
# what a launch does outside its tasks, as rows named like tasks: entry to the call agreed (the
# launch's start and the cross-GPU agreement), tasks done to the program's end (the finish)
PHASES = (("agree", 0, 1), ("finish", 2, 3))


def clock_offset(samples) -> tuple[int, int]:
    """(device - host offset in ns, its uncertainty in ns) from (host ns before, device ns, host ns
    after) brackets of a device timer read: the device read its timer somewhere in [before, after],
    so the tightest bracket's midpoint is the estimate, give or take half its width."""
    samples = list(samples)
    if not samples:
        raise ValueError("clock_offset needs at least one (before, device, after) sample")
    before, device, after = min(samples, key=lambda s: s[2] - s[0])
    if after < before:
        raise ValueError(f"a bracket ends before it starts: {before} .. {after}")
    return device - (before + after) // 2, (after - before + 1) // 2


def first_start(buf, tasks: Optional[int] = None) -> Optional[int]:
    """The earliest start (device ns) among the first `tasks` tasks (default: all the words) that ran,
    in a GPU trace buffer."""
    words = [int(v) for v in buf]
    n = len(words) if tasks is None else tasks * TRACE_WORDS
    return min((words[k] for k in range(0, n, TRACE_WORDS) if words[k + 2]), default=None)


def _phase_records(words: list, tasks: int):
    """(entry, agreed, tasks done, end) clocks and SM << 32 | program of each program that recorded
    its phases, after `tasks` task records."""
    for at in range(tasks * TRACE_WORDS, len(words) - PHASE_WORDS + 1, PHASE_WORDS):
        if words[at + 3]:
            yield words[at:at + 4], words[at + 4]


def earliest(buf, tasks: int) -> Optional[int]:
    """The earliest time (device ns) in a GPU trace buffer of `tasks` task records: a program's entry
    where the phases were recorded, else the first task's start."""
    words = [int(v) for v in buf]
    first = first_start(words, tasks)
    return min([clocks[0] for clocks, _ in _phase_records(words, tasks)] + ([first] if first is not None else []),
               default=None)


def phase_rows(buf, tasks: int, rank: int, origin_ns: int) -> list[tuple]:
    """The per-program phase records after `tasks` task records -> rows as gpu_rows' ("agree@program
    p", "finish@program p"), times from `origin_ns`; programs that recorded nothing are left out."""
    return [(rank, where >> 32, f"{name}@program {where & 0xFFFFFFFF}",
             (clocks[a] - origin_ns) / 1e3, (clocks[b] - origin_ns) / 1e3)
            for clocks, where in _phase_records([int(v) for v in buf], tasks) for name, a, b in PHASES]


def gpu_rows(ir, sizes: dict, buf, rank: int, origin_ns: Optional[int] = None) -> list[tuple]:
    """A GPU trace buffer (TRACE_WORDS int64 per task, by global task id, as the generated kernel
    writes it) -> (rank, SM, "task@(i, j) program p, waited w us", start us, end us) for every task
    that ran, times from `origin_ns` (on this rank's timer: the common origin less its clock offset),
    by default from this rank's earliest start. `sizes`: the bound sizes with RANK and WORLD."""
    words = [int(v) for v in buf]
    tasks = task_count(ir, sizes)
    # the origin in integer ns first: %globaltimer values (~1e18) lose 256 ns as doubles
    t0 = (earliest(words, tasks) or 0) if origin_ns is None else origin_ns
    rows, gid = [], 0
    for t in ir.tasks:
        grid = [evaluate(g, sizes) for g in t.grid]
        n = math.prod(grid)
        for local in range(n):
            start, waited, end, where = words[(gid + local) * TRACE_WORDS:(gid + local + 1) * TRACE_WORDS]
            if end:
                idx, rest = [], local
                for g in reversed(grid):
                    idx.append(rest % g)
                    rest //= g
                label = (f"{t.name}@{tuple(reversed(idx))} program {where & 0xFFFFFFFF}, "
                         f"waited {(waited - start) / 1e3:.1f} us")
                rows.append((rank, where >> 32, label, (start - t0) / 1e3, (end - t0) / 1e3))
        gid += n
    return rows + phase_rows(words, tasks, rank, t0)


def task_count(ir, sizes: dict) -> int:
    """How many tasks a launch of `ir` at `sizes` has (the task records of its trace buffer)."""
    return sum(math.prod(evaluate(g, sizes) for g in t.grid) for t in ir.tasks)


def measure_offset(device, samples: int = 32) -> tuple[int, int]:
    """This GPU's %globaltimer less the host's monotonic clock, in ns, and the uncertainty
    (clock_offset over `samples` brackets: host time, a one-program kernel that stores the timer,
    a synchronize, host time)."""
    import time

    import torch

    from ..kernels.sync import store_clock

    out = torch.zeros(1, dtype=torch.int64, device=device)
    store_clock[(1,)](out)   # compiled and loaded before the first bracket
    torch.cuda.synchronize(device)
    brackets = []
    for _ in range(samples):
        before = time.monotonic_ns()
        store_clock[(1,)](out)
        torch.cuda.synchronize(device)
        after = time.monotonic_ns()
        brackets.append((before, int(out.item()), after))
    return clock_offset(brackets)


def chrome_events(trace: Iterable[tuple], track: str = "program") -> list[dict]:
    """(rank, program or SM, task label, start, end) rows -> Chrome trace events."""
    events = []
    ranks, programs = set(), set()
    for rank, program, label, start, end in trace:
        events.append({"name": label.split("@")[0], "ph": "X", "pid": rank, "tid": program, "ts": start,
                       "dur": max(end - start, 1), "args": {"task": label}})
        ranks.add(rank)
        programs.add((rank, program))
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in sorted(ranks)]
    meta += [{"name": "thread_name", "ph": "M", "pid": r, "tid": p, "args": {"name": f"{track} {p}"}}
             for r, p in sorted(programs)]
    return meta + events


def write_chrome(trace: Iterable[tuple], path, track: str = "program") -> pathlib.Path:
    path = pathlib.Path(path)
    path.write_text(json.dumps({"traceEvents": chrome_events(trace, track), "displayTimeUnit": "ms"}))
    return path


def summary(trace: Iterable[tuple], rank: int = 0) -> str:
    """One rank's trace rows as text: span, programs (SMs) and their busy share; per task kind the
    count, first start, last end, mean and p90 duration, mean wait, and the mean gap before it (from
    the end of the task before it on its program: where a schedule's hand-offs cost, by kind); the
    gaps between consecutive tasks on a program (the scheduling overhead). What
    experiments/trace_gemm_rs.py and trace_moe.py print."""
    mine = [r for r in trace if r[0] == rank]
    if not mine:
        return f"rank {rank}: no tasks"
    span = max(r[4] for r in mine)
    by_program: dict = {}
    kinds: dict = {}
    phases = {name for name, _, _ in PHASES}
    for _, program, label, start, end in mine:
        kind = label.split("@")[0]
        if kind not in phases:   # busy share and gaps: the tasks'
            by_program.setdefault(program, []).append((start, end, kind))
        kinds.setdefault(kind, []).append((start, end, _waited(label)))
    gaps, gaps_before = [], {}
    for v in by_program.values():
        v.sort()
        for a, b in zip(v, v[1:]):
            gaps.append(b[0] - a[1])
            gaps_before.setdefault(b[2], []).append(b[0] - a[1])
    gaps.sort()
    busy = sum(e - s for v in by_program.values() for s, e, _ in v)
    lines = [f"rank {rank}: span {span:.1f} us over {len(by_program)} programs, busy in tasks "
             f"{busy / (span * max(1, len(by_program))):.0%}",
             f"  {'task':12} {'n':>6} {'first':>8} {'last end':>9} {'mean us':>8} {'p90 us':>7} {'mean wait':>9} "
             f"{'gap before':>10}"]
    for name, v in kinds.items():
        d = sorted(e - s for s, e, _ in v)
        before = gaps_before.get(name)
        lines.append(f"  {name:12} {len(v):6d} {min(s for s, _, _ in v):8.1f} {max(e for _, e, _ in v):9.1f} "
                     f"{sum(d) / len(d):8.1f} {d[len(d) * 9 // 10]:7.1f} {sum(w for *_, w in v) / len(v):9.1f} "
                     f"{sum(before) / len(before) if before else float('nan'):10.2f}")
    if gaps:
        lines.append(f"  gaps between tasks on a program: median {gaps[len(gaps) // 2]:.2f} us, "
                     f"p90 {gaps[len(gaps) * 9 // 10]:.2f}, sum {sum(gaps) / 1e3:.2f} ms")
    return "\n".join(lines)


def _waited(label: str) -> float:
    """The microseconds a task's label says it waited (0 where it says nothing)."""
    return float(label.rsplit("waited ", 1)[1].split(" ")[0]) if "waited " in label else 0.0


def median_body_us(trace: Iterable[tuple], rank: int, kind: str) -> Optional[float]:
    """The median time of one rank's `kind` tasks less their waits: a tile body's own time (None
    where the rank ran none). experiments/trace_mlp.py and trace_ag_gemm.py rate GEMM tiles with it."""
    bodies = sorted(e - s - _waited(label) for r, _, label, s, e in trace
                    if r == rank and label.split("@")[0] == kind)
    return bodies[len(bodies) // 2] if bodies else None


def queued_trace(kernel, mesh, warm: int = 3, queued: int = 5, **args) -> list[tuple]:
    """Every rank's trace rows of a launch that starts as in steady use: `warm` launches, a barrier
    (which waits for them), then `queued` launches back to back, so the host runs ahead of the GPU and every rank
    starts the last one right after the one before (a lone launch after a sync shows the ranks'
    start skew instead)."""
    for _ in range(warm):
        kernel(mesh, **args)
    mesh.barrier()   # the warm launches done on every rank
    for _ in range(queued):
        kernel(mesh, **args)
    return kernel.trace(mesh)
