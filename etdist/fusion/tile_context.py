"""What a tile body sees in the CPU runtime (its torch reference): `t.x`, `t.M`, `t.peer(r).buf`, `t(expr)`."""
from __future__ import annotations

from typing import Any

from .errors import RuntimeFault
from .expr import Size, evaluate


class TileContext:
    """This rank's tensors and sizes by name; peers' symmetric tensors through `peer(rank)`."""

    __slots__ = ("rank", "world", "_launch")

    def __init__(self, launch: Any, rank: int):
        self._launch, self.rank, self.world = launch, rank, launch.world

    def __getattr__(self, name: str):
        env = self._launch.envs[self.rank]
        if name in env:
            return env[name]
        raise AttributeError(f"graph {self._launch.b.table.ir.name!r} has no tensor or size {name!r}")

    def __call__(self, expr: Size) -> int:
        """Evaluate a symbolic size (e.g. `t(rows_per_rank)`) on this rank."""
        return evaluate(expr, self._launch.envs[self.rank])

    def peer(self, rank: int) -> "PeerView":
        if not 0 <= rank < self.world:
            raise RuntimeFault(f"peer({rank}) outside world of {self.world} ranks")
        return PeerView(self._launch, rank)


class PeerView:
    """Another rank's symmetric tensors (what a GPU reaches through NVSHMEM peer pointers)."""

    __slots__ = ("_launch", "rank")

    def __init__(self, launch: Any, rank: int):
        self._launch, self.rank = launch, rank

    def __getattr__(self, name: str):
        ir = self._launch.b.table.ir
        try:
            spec = ir.tensor(name)
        except KeyError:
            raise AttributeError(f"graph {ir.name!r} has no tensor {name!r}") from None
        if not spec.symmetric:
            raise RuntimeFault(f"tensor {name!r} is not symmetric: declare it with symmetric=True "
                               "to read or write it on another rank")
        return self._launch.envs[self.rank][name]
