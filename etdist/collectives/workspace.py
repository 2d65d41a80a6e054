"""The symmetric buffers collectives exchange through: scratch slots and per-chunk signal lanes.

One workspace per mesh (mesh.cache), made collectively at the first collective. Scratch holds two
halves (epoch parity) of `world` slots each; a slot is where one source rank's data for us lands.
Size: init_mesh(workspace_mb=...) (default 1024 on GPUs, 64 on CPU, at most a quarter of a group
mesh's region); bigger messages go in rounds.
"""
from __future__ import annotations


import torch

from ..mesh import Mesh

MAX_CHUNKS = 4096


class Workspace:
    def __init__(self, mesh: Mesh, nbytes: int):
        self.mesh = mesh
        w = mesh.world_size
        self.slot_bytes = (nbytes // (2 * w)) // 256 * 256
        self.scratch = mesh.empty((2 * w * self.slot_bytes,), torch.uint8)
        self.signals = mesh.empty((MAX_CHUNKS, w), torch.int32)
        self.scratch_table = mesh.peer_ptrs(self.scratch)
        self.signals_table = mesh.peer_ptrs(self.signals)
        self.ctrl_table = mesh.peer_ptrs(mesh.ctrl)
        self._np = None

    def slot_elems(self, dtype: torch.dtype) -> int:
        return self.slot_bytes // torch.empty((), dtype=dtype).element_size()

    def slot(self, rank: int, parity: int, src: int, dtype: torch.dtype) -> torch.Tensor:
        """Flat view of `rank`'s slot for data from `src` (rank may be a peer)."""
        e = self.slot_elems(dtype)
        flat = self.mesh.peer(self.scratch, rank).view(dtype)
        return flat[(parity * self.mesh.world_size + src) * e:][:e]

    def signal_lanes_np(self, rank: int):
        """cpu backend: numpy view of rank's signal lanes, flattened [chunk * W + src]."""
        if self._np is None:
            self._np = [self.mesh.peer(self.signals, r).reshape(-1).numpy() for r in range(self.mesh.world_size)]
        return self._np[rank]


def get_workspace(mesh: Mesh) -> Workspace:
    ws = mesh.cache.get("collectives.workspace")
    if ws is None:
        default = 64.0 if mesh.backend == "cpu" else 1024.0
        capacity = mesh.symmetric_capacity()
        if capacity is not None:   # a group mesh: leave its region room for the ops' own buffers
            default = min(default, capacity / 4 / 2**20)
        mb = default if mesh.workspace_mb is None else mesh.workspace_mb
        ws = Workspace(mesh, int(mb * 2**20))
        mesh.cache["collectives.workspace"] = ws
    return ws
