"""Errors the mesh raises. Every message names the rank, the event and the fix where there is one."""
from __future__ import annotations


class MeshError(RuntimeError):
    """A mesh could not be set up or used (bad launch, missing package, bad arguments)."""


class PeerTimeoutError(MeshError):
    """A wait on a cross-rank event ran past the watchdog: a peer never notified (or died)."""


class ShapeMismatchError(MeshError):
    """Ranks called the same collective with different shapes or counts."""
