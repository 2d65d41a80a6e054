"""all_gather as a torch custom op, so that torch.compile keeps it whole in its graph (the
replicated TensorParallelMLP ends in one). ops/compiled.py says why and how; the other collectives
are not registered yet."""
import torch

from ..mesh.mesh import mesh_by_key
from . import ops


@torch.library.custom_op("etdist::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, mesh: str, check: bool) -> torch.Tensor:
    return ops.all_gather(x, mesh=mesh_by_key(mesh), check=check)


@all_gather.register_fake
def _(x, mesh, check):
    x1 = x.reshape(1) if x.dim() == 0 else x
    return x.new_empty((mesh_by_key(mesh).world_size * x1.shape[0],) + tuple(x1.shape[1:]))
