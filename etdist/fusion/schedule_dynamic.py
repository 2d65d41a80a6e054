"""Dynamic schedule: a ready queue fed by an inverse map from event elements to consumer tasks.

Pinned tasks (TaskSpec.pinned) come first in id order and never enter the queue: every program
runs its static share of them before it pops. Of the rest, tasks without waits start in the
queue. Whoever brings an event element to completion walks the element's consumers and decrements
each one's pending-wait count; a consumer reaching zero is evaluated (`when`, which may read data
its waits guarded) and pushed, or dropped if it does not exist. The plan is plain Python built
from a bound graph; runtimes own the queue itself.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .bind import Bound
from .expr import RANK_NAME


@dataclass(frozen=True)
class ReleasePlan:
    """One rank's inverse map at concrete sizes."""

    consumers: dict  # (event, coord) -> [task ids waiting on it], on this rank
    waits: list      # task id -> number of wait elements
    initial: list    # task ids with no waits, in id order (pinned ones, below Bound.pinned, never queue)


def release_plan(b: Bound, rank: int) -> ReleasePlan:
    env = {**b.sizes, RANK_NAME: rank}
    consumers = defaultdict(list)
    waits = [0] * b.total
    initial = []
    for f in b.functions:
        if f.maps.spec.pinned:
            continue
        for local in range(f.size):
            gid = f.offset + local
            elements = f.maps.wait_elements(f.unravel(local), env)
            waits[gid] = len(elements)
            for el in elements:
                consumers[el].append(gid)
            if not elements:
                initial.append(gid)
    return ReleasePlan(dict(consumers), waits, initial)
