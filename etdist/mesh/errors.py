"""Errors the mesh raises. Every message names the rank, the event and the fix where there is one."""
from __future__ import annotations


class MeshError(RuntimeError):
    """A mesh could not be set up or used (bad launch, missing package, bad arguments)."""


class PeerTimeoutError(MeshError):
    """A wait on a cross-rank event ran past the watchdog: a peer never notified (or died)."""


class ShapeMismatchError(MeshError):
    """Ranks called the same collective with different shapes or counts."""


class CallMismatchError(ShapeMismatchError):
    """Ranks made different calls at the same point of their programs (another op, shape, dtype or
    out=), or one refused its own arguments: raised on every rank before anything ran for that call.
    The mesh stays usable: the next call is checked afresh."""
