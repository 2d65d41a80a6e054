"""Collectives over a Mesh: point-to-point stores into peers' symmetric buffers plus signals.

Standalone ops on torch tensors today; the same exchange (collectives/plan.py + kernels/exchange.py)
is meant to become tile tasks in fusion graphs once the graph IR exists.
"""
from .ops import all_gather, all_reduce, all_to_all, reduce_scatter
from . import compiled  # noqa: F401  (registers the collectives as torch library ops, for torch.compile)
from .plan import Op, Plan

__all__ = ["reduce_scatter", "all_gather", "all_reduce", "all_to_all", "Op", "Plan"]
