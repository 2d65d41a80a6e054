"""Per-peer plans: which elements of x go to which rank, and where each rank's elements land.

A plan is plain Python (no torch, no device): the CPU exchange reads it directly and the GPU kernel
gets it packed as int64 [send_off | send_cnt | recv_off | recv_cnt | chunk, slot_elems, rest]. Offsets
and counts are in elements of x's dtype over the flattened tensors.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence, Tuple

from ..mesh.control import SIG_COUNT_BITS


class Op(enum.IntEnum):
    """The standalone collectives, as their plans and kernels name them."""

    REDUCE_SCATTER = 1
    ALL_GATHER = 2
    ALL_REDUCE = 3
    ALL_TO_ALL = 4

    @property
    def reduces(self) -> bool:
        return self in (Op.REDUCE_SCATTER, Op.ALL_REDUCE)


OP_NAMES = {int(op): op.name.lower() for op in Op}


@dataclass(frozen=True)
class Plan:
    op: Op
    send_off: Tuple[int, ...]
    send_cnt: Tuple[int, ...]
    recv_off: Tuple[int, ...]
    recv_cnt: Tuple[int, ...]
    # Elements of each segment that later rounds of the call move. In the signature, so that calls
    # that differ in their number of rounds disagree in the first (they agreed on every round that
    # both made, and the rank with fewer rounds returned without an error)
    rest: int = 0

    @property
    def max_count(self) -> int:
        return max(max(self.send_cnt), max(self.recv_cnt))

    def op_signature(self, dtype: int = 0) -> int:
        """The op and dtype fields of a signature (dtype: mesh.control.signature_dtype(x.dtype))."""
        return int(self.op) << 28 | dtype << SIG_COUNT_BITS

    def signature(self, count: int, dtype: int = 0) -> int:
        """What a sender writes into the receiver's meta lane: op << 28 | dtype << 24 | (count + rest)
        mod 2**24 (rest: what later rounds of the call move)."""
        return self.op_signature(dtype) | ((count + self.rest) & ((1 << SIG_COUNT_BITS) - 1))

    def aligned(self, elems: int) -> bool:
        return all(v % elems == 0 for v in self.send_off + self.send_cnt + self.recv_off + self.recv_cnt)


def reduce_scatter(world: int, n: int, k0: int = 0, k1: int = None) -> Plan:
    """x [world * n] -> out [n]; this call moves elements [k0, k1) of every segment."""
    k1 = n if k1 is None else k1
    return Plan(Op.REDUCE_SCATTER, tuple(d * n + k0 for d in range(world)), (k1 - k0,) * world,
                (k0,) * world, (k1 - k0,) * world, n - k1)


def all_gather(world: int, n: int, k0: int = 0, k1: int = None) -> Plan:
    """x [n] -> out [world * n]."""
    k1 = n if k1 is None else k1
    return Plan(Op.ALL_GATHER, (k0,) * world, (k1 - k0,) * world, tuple(s * n + k0 for s in range(world)),
                (k1 - k0,) * world, n - k1)


def all_reduce(world: int, n: int, k0: int = 0, k1: int = None) -> Plan:
    """x [n] -> out [n] (one shot: every rank sends all of x to every peer)."""
    k1 = n if k1 is None else k1
    return Plan(Op.ALL_REDUCE, (k0,) * world, (k1 - k0,) * world, (k0,) * world, (k1 - k0,) * world, n - k1)


def all_to_all(send_counts: Sequence[int], recv_counts: Sequence[int]) -> Plan:
    """x [sum(send_counts)] -> out [sum(recv_counts)], blocks in rank order on both sides."""
    prefix = lambda c: tuple(sum(c[:i]) for i in range(len(c)))  # noqa: E731
    return Plan(Op.ALL_TO_ALL, prefix(send_counts), tuple(send_counts), prefix(recv_counts), tuple(recv_counts))


def rounds(n: int, per_round: int):
    """Split [0, n) into pieces of at most per_round elements (at least one piece)."""
    if n == 0:
        yield 0, 0
        return
    for k0 in range(0, n, per_round):
        yield k0, min(n, k0 + per_round)
