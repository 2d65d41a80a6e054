"""torch.compile support shared by every etdist op: define_op registers one, call_op calls it.

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
host against ~2 us. The collectives' registrations are in compiled.py.
"""
import torch

from ..mesh import current_mesh

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
