"""Dynamic schedule: a ready queue fed by an inverse map from event elements to consumer tasks.

Pinned tasks (TaskSpec.pinned) come first in id order and never enter the queue: every program
runs its static share of them before it pops. Tail tasks (TaskSpec.tail) come last and never enter
it either: every program runs its static share of them once the queue is drained. Of the rest,
tasks without waits start in the queue, and behind them the early-pushed ones (ir.early_pushed:
they wait only on what pinned tasks notify, or with its chains also on tasks seeded ahead of them,
and spin on it when popped). Whoever brings an event element to completion walks the
element's other consumers and decrements each one's pending-wait count; a consumer reaching zero
is evaluated (`when`, which may read data its waits guarded) and pushed, or dropped if it does not
exist. The plan is plain Python built from a bound graph; runtimes own the queue itself.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .bind import Bound
from .expr import RANK_NAME


@dataclass(frozen=True)
class ReleasePlan:
    """One rank's inverse map at concrete sizes."""

    consumers: dict  # (event, coord) -> [task ids waiting on it, early-pushed ones left out], on this rank
    waits: list      # task id -> number of wait elements
    initial: list    # task ids with no waits, in id order (pinned and tail ones never queue)
    early: list = field(default_factory=list)   # early-pushed task ids, in id order: queued after `initial`

    @property
    def seeded(self) -> list:
        """What the queue holds when the launch starts, in the order programs claim it."""
        return self.initial + self.early


def release_plan(b: Bound, rank: int, early: frozenset = frozenset()) -> ReleasePlan:
    """early: the task functions to push at launch (ir.early_pushed), not released by a walk."""
    env = {**b.sizes, RANK_NAME: rank}
    consumers = defaultdict(list)
    waits = [0] * b.total
    initial, pushed = [], []
    for f in b.functions:
        if f.maps.spec.pinned or f.maps.spec.tail:   # the static formula runs them: never queued
            continue
        is_early = f.maps.spec.name in early
        for local in range(f.size):
            gid = f.offset + local
            elements = f.maps.wait_elements(f.unravel(local), env)
            waits[gid] = len(elements)
            if not elements:
                initial.append(gid)
            elif is_early:
                pushed.append(gid)
            else:
                for el in elements:
                    consumers[el].append(gid)
    return ReleasePlan(dict(consumers), waits, initial, pushed)
