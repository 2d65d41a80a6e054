"""all_gather as a torch custom op, so that torch.compile keeps it whole in its graph (the
replicated TensorParallelMLP ends in one). ops/compiled.py says why and how; the other collectives
are not registered yet."""
import torch

from ..mesh.mesh import mesh_by_key
from . import ops

_LIB = torch.library.Library("etdist", "FRAGMENT")   # kept alive: the registrations live with it


def _all_gather(x, mesh, check, token):
    return ops.all_gather(x, mesh=mesh_by_key(mesh), check=check)


def _all_gather_fake(x, mesh, check, token):
    x1 = x.reshape(1) if x.dim() == 0 else x
    return x.new_empty((mesh_by_key(mesh).world_size * x1.shape[0],) + tuple(x1.shape[1:]))


_LIB.define("all_gather(Tensor x, str mesh, bool check, Tensor(a!) token) -> Tensor")
_LIB.impl("all_gather", _all_gather, "CUDA")
torch.library.register_fake("etdist::all_gather", _all_gather_fake, lib=_LIB)
