"""torch.compile support shared by every etdist op, and the collectives registered with it.

Traced by Dynamo, an op's Python (per-mesh kernel states, raw pointers, host exchanges) would break
the graph or be baked into it. So each op is a torch library op (`define_op`): an opaque node
whose output shape comes from a fake implementation, symbolic M included (one compiled graph serves
every batch size, as our kernels do). Eager calls do not pass through the dispatcher (it adds
microseconds to a host-bound decode call): the public ops call `call_op` only while torch.compile
traces them (`torch.compiler.is_compiling()`). A library op takes tensors and plain values: the mesh
travels as its key (`mesh.key`, a string: torch.compile(dynamic=True) would make an int symbolic),
and every op declares it writes the mesh's token (`mesh.token`), so that no call is dropped as
unused (a rank that drops one leaves its peers waiting) and the calls keep their order. Defined
through torch.library.Library, not @custom_op: its Python wrappers cost ~45 us a call on our CPU
host against ~2 us. all_to_all is not registered: its output rows are the
counts the peers send (data, not shapes), which a fake implementation cannot know.
"""
import torch

from ..mesh import current_mesh
from ..mesh.mesh import mesh_by_key
from . import ops

_LIB = torch.library.Library("etdist", "FRAGMENT")   # kept alive: the registrations live with it


def define_op(schema: str, impl, fake) -> None:
    """Register etdist::<name> from `schema`, which ends in `str mesh, Tensor(a!) token` (what
    call_op passes): `impl` runs on CUDA tensors, `fake` gives the output while tracing."""
    name = schema[:schema.index("(")]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CUDA")
    torch.library.register_fake(f"etdist::{name}", fake, lib=_LIB)


def call_op(name: str, *args, mesh=None, out=None) -> torch.Tensor:
    """etdist::<name>(*args, the mesh's key, its token): one node of torch.compile's graph (`out=`
    then gets a copy)."""
    m = mesh if mesh is not None else current_mesh()
    y = getattr(torch.ops.etdist, name)(*args, m.key, m.token)
    return y if out is None else out.copy_(y)


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
