"""Traces of a launch as Chrome / Perfetto JSON: one process per rank, one track per program.

    out = kernel.run(inputs, trace=True)
    et.fusion.trace.write_chrome(kernel.last_stats.trace, "launch.json")   # open in ui.perfetto.dev

The CPU runtime's clock is its scheduler step (deterministic for a seed), written as microseconds.
"""
from __future__ import annotations

import json
import pathlib
from typing import Iterable


def chrome_events(trace: Iterable[tuple]) -> list[dict]:
    """(rank, program, task label, start, end) rows -> Chrome trace events."""
    events = []
    ranks, programs = set(), set()
    for rank, program, label, start, end in trace:
        events.append({"name": label.split("@")[0], "ph": "X", "pid": rank, "tid": program, "ts": start,
                       "dur": max(end - start, 1), "args": {"task": label}})
        ranks.add(rank)
        programs.add((rank, program))
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in sorted(ranks)]
    meta += [{"name": "thread_name", "ph": "M", "pid": r, "tid": p, "args": {"name": f"program {p}"}}
             for r, p in sorted(programs)]
    return meta + events


def write_chrome(trace: Iterable[tuple], path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.write_text(json.dumps({"traceEvents": chrome_events(trace), "displayTimeUnit": "ms"}))
    return path
