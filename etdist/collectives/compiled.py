"""The standalone collectives registered as torch library ops (custom_op.py says why and how), so
torch.compile keeps each one as one node. all_to_all is not registered: its output rows are the
counts the peers send (data, not shapes), which a fake implementation cannot know.
"""
import torch

from ..mesh.mesh import mesh_by_key
from . import ops
from .custom_op import define_op


def _all_gather(x, check, mesh, token):
    return ops.all_gather(x, mesh=mesh_by_key(mesh), check=check)


def _all_gather_fake(x, check, mesh, token):
    x1 = x.reshape(1) if x.dim() == 0 else x
    return x.new_empty((mesh_by_key(mesh).world_size * x1.shape[0],) + tuple(x1.shape[1:]))


def _reduce_scatter(x, check, mesh, token):
    return ops.reduce_scatter(x, mesh=mesh_by_key(mesh), check=check)


def _reduce_scatter_fake(x, check, mesh, token):   # a dim 0 that the world does not divide: refused when run
    return x.new_empty((x.shape[0] // mesh_by_key(mesh).world_size,) + tuple(x.shape[1:]))


def _all_reduce(x, check, mesh, token):
    return ops.all_reduce(x, mesh=mesh_by_key(mesh), check=check)


def _all_reduce_fake(x, check, mesh, token):
    return torch.empty_like(x)


define_op("all_gather(Tensor x, bool check, str mesh, Tensor(a!) token) -> Tensor", _all_gather, _all_gather_fake)
define_op("reduce_scatter(Tensor x, bool check, str mesh, Tensor(a!) token) -> Tensor", _reduce_scatter,
          _reduce_scatter_fake)
define_op("all_reduce(Tensor x, bool check, str mesh, Tensor(a!) token) -> Tensor", _all_reduce, _all_reduce_fake)
