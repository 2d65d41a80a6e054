"""Tile arithmetic for tile bodies' torch references (plain ints, evaluated per task)."""
from __future__ import annotations


def block(i: int, size: int, extent: int) -> slice:
    """Rows (or columns) of tile i of `size`, clipped to `extent`; empty when the tile lies beyond it."""
    start = min(i * size, extent)
    return slice(start, min(start + size, extent))


def shift(s: slice, offset: int) -> slice:
    """The same range moved by `offset` (e.g. from a rank's rows to global rows)."""
    return slice(s.start + offset, s.stop + offset)
