"""Stream-K dealing of a tail of tiles (Osama et al., "Stream-K", PPoPP 2023).

A tail of `tiles` GEMM tiles, fewer than there are programs, runs badly in whole tiles (some
programs idle) and not much better in equal contraction slices (72 tiles on 132 SMs in 3 slices:
216 tasks, so some programs run two thirds of a tile's steps and others one third). Stream-K lays
the tail's contraction steps end to end, tile after tile, and cuts them in `programs` equal shares:
every program runs tiles x steps / programs steps (a tail of fewer steps than programs: one step
each on the first ones). A share is shorter than a tile, so it covers at
most two tiles: pieces c = 0 and 1 of program p, each a partial of its tile. A tile is cut among the
programs first(t) .. last(t), and its owner sums their pieces.

All sizes may be symbolic (et expressions); `programs` is the number of co-resident programs
the shares are made for (an int).
"""
from __future__ import annotations

from dataclasses import dataclass

import etdist as et


@dataclass(frozen=True)
class StreamK:
    tiles: object          # tiles in the tail (< programs)
    steps: object          # contraction steps of a tile
    programs: int

    @property
    def total(self):
        """The tail's steps, end to end."""
        return self.tiles * self.steps

    @property
    def shares(self):
        """The programs that get a share: all of them, or one a step where the tail has fewer steps
        (so that no share is empty, and the programs first(t) .. last(t) all cut tile t)."""
        return et.minimum(self.programs, self.total)

    def start(self, p):
        """Program p's share: steps [start(p), start(p + 1)) of the tail's (empty from p = shares)."""
        return et.minimum(p, self.shares) * self.total // et.maximum(self.shares, 1)

    def program_at(self, x):
        """The program whose share holds step x: the last p with start(p) <= x."""
        return ((x + 1) * self.shares - 1) // et.maximum(self.total, 1)

    def tile(self, c, p):
        """The tail tile of piece c of program p."""
        return self.start(p) // self.steps + c

    def piece_steps(self, c, p):
        """(lo, hi): piece c of program p is steps [lo, hi) of its tile; empty where hi <= lo (the
        share ends in its first tile, or is empty: fewer steps than programs)."""
        first = self.tile(c, p) * self.steps
        lo = et.maximum(self.start(p), first) - first
        hi = et.minimum(self.start(p + 1), first + self.steps) - first
        return lo, hi

    def first(self, t):
        """The first program whose share cuts tail tile t."""
        return self.program_at(t * self.steps)

    def last(self, t):
        """The last program whose share cuts tail tile t."""
        return self.program_at(t * self.steps + self.steps - 1)

    def pieces(self, t):
        """How many pieces tail tile t is cut in."""
        return self.last(t) - self.first(t) + 1
