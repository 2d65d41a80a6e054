"""Collectives as standalone ops on torch tensors (split along dim 0, any world size).

    out = reduce_scatter(x)            # x [W*m, ...] -> [m, ...], summed over ranks
    out = all_gather(x)                # x [m, ...] -> [W*m, ...], rank order
    out = all_reduce(x)                # x [...] -> [...], summed over ranks
    out = all_to_all(x, send_counts)   # rows x[prefix(send)[d]:][:send[d]] go to rank d

Every rank must make the same calls in the same order with the same shapes (all_to_all: matching
counts); a rank that does not makes every rank raise within the mesh's watchdog. check=True
(default) ends with an exit rendezvous, waits for the op and raises here. check=False is the fast
path (benchmarks, CUDA graphs, a forward pass): no rendezvous, no host sync; a fault is recorded
on the device and raises at the next mesh.check() or mesh.barrier() (or check=True op).
Sums accumulate in fp32.
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import torch

from ..mesh import Mesh, MeshError, current_mesh
from ..mesh.calls import Signature, refusing, tensor_arg
from ..mesh.stream_order import capturing as stream_capturing
from . import plan as plans
from .custom_op import call_op
from .cpu_exchange import exchange_cpu
from .gpu_exchange import exchange_interpreted, prepare_gpu
from .plan import OP_NAMES, Op
from .workspace import get_workspace

REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# "triton": the cpu backend runs the GPU exchange kernel under Triton's interpreter (tests set it)
CPU_EXCHANGE = "torch"
# The exit rendezvous (every rank leaves a call only after all did) runs when check=True, so a
# fault makes every rank raise; check=False skips it (double-buffered scratch keeps that safe).
# all_gather into an `out` from mesh.empty writes peers' out directly (no scratch, no receiver copy).


def _mesh(mesh: Optional[Mesh]) -> Mesh:
    if mesh is not None and not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be the Mesh from etdist.init_mesh() (or None for the current one), "
                        f"got {type(mesh).__name__}")
    mesh = current_mesh() if mesh is None else mesh
    # The workspace is a collective allocation (host allgather, no watchdog): make it before the
    # checks that may refuse this rank's arguments, or a refused first call left the peers in it
    get_workspace(mesh)
    return mesh


def _check_input(mesh: Mesh, x: torch.Tensor, op: Op) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{OP_NAMES[op]}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.device != mesh.device and not (x.device.type == mesh.device.type == "cuda"
                                        and x.device.index == mesh.device.index):
        raise MeshError(f"{OP_NAMES[op]}: x is on {x.device} but this rank's mesh device is {mesh.device}")
    if op.reduces and x.dtype not in REDUCE_DTYPES:
        raise MeshError(f"{OP_NAMES[op]}: dtype {x.dtype} is not supported for sums; use one of "
                        f"{', '.join(str(d) for d in REDUCE_DTYPES)}")
    return x.contiguous()


def _check_out(out: Optional[torch.Tensor], shape, x: torch.Tensor, op: Op) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if not isinstance(out, torch.Tensor):
        raise MeshError(f"{OP_NAMES[op]}: out must be a {tuple(shape)} {x.dtype} tensor on {x.device} (or None), "
                        f"got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != x.dtype or out.device != x.device:
        raise MeshError(f"{OP_NAMES[op]}: out must be {tuple(shape)} {x.dtype} on {x.device}, got "
                        f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise MeshError(f"{OP_NAMES[op]}: out must be contiguous")
    return out


def _run(mesh: Mesh, x: torch.Tensor, out: torch.Tensor, key: tuple, pieces, check: bool, sig_x,
         out_given: bool) -> torch.Tensor:
    """Run the plans `pieces(slot_elems)` yields (one per round), once every rank agreed on the call
    (mesh/calls.py: op, sig_x (x's dtype and shape, or what must match of it), out= given, the
    rendezvous). On GPUs each distinct call (same tensors, shapes, flags) is prepared once and then
    launched straight from a cache; the kernel itself checks the agreement at entry."""
    if mesh._failed is not None or mesh._closed:
        mesh._check_usable()
    direct = key[0] is Op.ALL_GATHER and mesh.is_symmetric(out)
    if mesh.backend == "nvshmem":
        capturing = stream_capturing(mesh.device)
        if not capturing:   # an earlier launch (of any op) the ranks disagreed on: raised here, at once
            mesh.calls.raise_pending()
        full_key = key + (x.data_ptr(), out.data_ptr(), x.dtype, tuple(x.shape), out_given, check,
                          mesh.fault_skip_notify_rank)
        cache = mesh.cache.setdefault("collectives.launches", {})
        launches = cache.get(full_key)
        if launches is None or (capturing and check):
            with refusing(mesh):
                if capturing and check:   # check= synchronises, which a capture forbids (a CUDA error from within)
                    raise MeshError(f"{OP_NAMES[key[0]]}: check=True synchronises after the launch, which a CUDA "
                                    f"graph capture forbids: pass check=False inside CUDA graphs (errors then show "
                                    f"at mesh.check())")
                ws = get_workspace(mesh)
                plans_ = list(pieces(ws.slot_elems(x.dtype)))
            word = _signature(key[0], sig_x, out_given, check).word
            launches = [prepare_gpu(mesh, ws, x, out, p, check, direct, call_sig=word) for p in plans_]
            if len(cache) > 1024:   # launches in flight may still read their plans: let them finish
                mesh.impl.synchronize()
                cache.clear()
            cache[full_key] = launches
        # in call order with the mesh's other launches, whatever the stream (mesh/stream_order.py)
        order = None if capturing else mesh.stream_order
        if order is not None:
            order.before(torch._C._cuda_getCurrentRawStream(mesh.device.index))
        for launch in launches:
            launch()
        if order is not None:
            order.after()
        if check:
            mesh.impl.synchronize()
            mesh.check(OP_NAMES)
        return out
    ws = get_workspace(mesh)
    with refusing(mesh):
        plans_ = list(pieces(ws.slot_elems(x.dtype)))
    sig = _signature(key[0], sig_x, out_given, check)
    interpreted = CPU_EXCHANGE == "triton"
    if not interpreted:   # the interpreted kernel agrees at entry, as on GPUs
        mesh.calls.agree(sig)
    for plan in plans_:
        if interpreted:
            exchange_interpreted(mesh, ws, x, out, plan, check, direct, call_sig=sig.word)
        else:
            exchange_cpu(mesh, ws, x, out, plan, mesh.next_epoch("coll"))
    mesh.check(OP_NAMES)
    return out


def _signature(op: Op, sig_x, out_given: bool, rendezvous: bool) -> Signature:
    return Signature(OP_NAMES[op], (("x", sig_x), ("out", out_given), ("rendezvous", rendezvous)))


def reduce_scatter(x: torch.Tensor, out: Optional[torch.Tensor] = None, *, mesh: Optional[Mesh] = None,
                   check: bool = True) -> torch.Tensor:
    """Sum x over ranks and keep this rank's block of dim 0: [W*m, ...] -> [m, ...]. Under
    torch.compile: one opaque node of its graph (collectives/compiled.py; `out=` is then a copy)."""
    if torch.compiler.is_compiling():   # before _mesh: it may allocate (collectively)
        return call_op("reduce_scatter", x, check, mesh=mesh, out=out)
    mesh = _mesh(mesh)
    given = out is not None
    with refusing(mesh):   # refused here alone, the peers raise too, naming it
        x = _check_input(mesh, x, Op.REDUCE_SCATTER)
        w = mesh.world_size
        if x.dim() == 0 or x.shape[0] % w:
            raise MeshError(f"reduce_scatter: x.shape[0] must be divisible by the world size {w}, got shape "
                            f"{tuple(x.shape)}")
        out = _check_out(out, (x.shape[0] // w,) + tuple(x.shape[1:]), x, Op.REDUCE_SCATTER)
    n = x.numel() // w
    return _run(mesh, x, out, (Op.REDUCE_SCATTER, n), lambda per: (
        plans.reduce_scatter(w, n, a, b) for a, b in plans.rounds(n, per)), check, tensor_arg(x), given)


def all_gather(x: torch.Tensor, out: Optional[torch.Tensor] = None, *, mesh: Optional[Mesh] = None,
               check: bool = True) -> torch.Tensor:
    """Concatenate every rank's x along dim 0 in rank order: [m, ...] -> [W*m, ...]. Under
    torch.compile: one opaque node of its graph (collectives/compiled.py; `out=` is then a copy)."""
    if torch.compiler.is_compiling():   # before _mesh: it may allocate (collectively)
        return call_op("all_gather", x, check, mesh=mesh, out=out)
    mesh = _mesh(mesh)
    given = out is not None
    with refusing(mesh):
        x = _check_input(mesh, x, Op.ALL_GATHER)
        w = mesh.world_size
        x1 = x.reshape(1) if x.dim() == 0 else x
        out = _check_out(out, (w * x1.shape[0],) + tuple(x1.shape[1:]), x, Op.ALL_GATHER)
    n = x.numel()
    return _run(mesh, x, out, (Op.ALL_GATHER, n), lambda per: (
        plans.all_gather(w, n, a, b) for a, b in plans.rounds(n, per)), check, tensor_arg(x), given)


def all_reduce(x: torch.Tensor, out: Optional[torch.Tensor] = None, *, mesh: Optional[Mesh] = None,
               check: bool = True, two_shot: bool = False) -> torch.Tensor:
    """Sum x over ranks (out of place unless out=x is passed). Under torch.compile: one opaque node
    of its graph (collectives/compiled.py; `out=` is then a copy; one shot only).
    One shot sends all of x to every peer ((R-1) x's bytes on each rank's links); two_shot=True runs
    reduce_scatter then all_gather (2 (R-1)/R of them, in two calls; x.numel() a multiple of R):
    at four ranks on H200 those two took 178 us at 16 MiB and 830 us at 128 MiB against the one
    shot's 257 and 1373 (records reduce_scatter, all_gather, all_reduce at 9e7952a). An option until
    the two-shot call itself is measured there (etdist.bench.collectives times both)."""
    if torch.compiler.is_compiling():   # before _mesh: it may allocate (collectively)
        if two_shot:
            raise MeshError("all_reduce: two_shot=True is not supported under torch.compile (one shot only)")
        return call_op("all_reduce", x, check, mesh=mesh, out=out)
    mesh = _mesh(mesh)
    given = out is not None
    with refusing(mesh):
        x = _check_input(mesh, x, Op.ALL_REDUCE)
        out = _check_out(out, tuple(x.shape), x, Op.ALL_REDUCE)
        if not isinstance(two_shot, bool):
            raise MeshError(f"all_reduce: two_shot must be True or False, got {two_shot!r}")
        if two_shot and x.numel() % mesh.world_size:
            raise MeshError(f"all_reduce: two_shot=True needs x.numel() ({x.numel()}) to be a multiple of the world "
                            f"size ({mesh.world_size})")
    if two_shot and mesh.world_size > 1:   # every rank's own sum of a 1/R slice, then everyone's slices
        part = reduce_scatter(x.reshape(-1), mesh=mesh, check=check)
        all_gather(part, out.view(-1), mesh=mesh, check=check)
        return out
    w, n = mesh.world_size, x.numel()
    return _run(mesh, x, out, (Op.ALL_REDUCE, n), lambda per: (
        plans.all_reduce(w, n, a, b) for a, b in plans.rounds(n, per)), check, tensor_arg(x), given)


def _counts(name: str, counts, w: int) -> list[int]:
    """Row counts per rank as ints: a sequence (or 1-D tensor) of whole numbers."""
    try:
        if isinstance(counts, (str, bytes)) or any(isinstance(c, bool) for c in counts):
            raise TypeError
        return [operator.index(c.item() if isinstance(c, torch.Tensor) else c) for c in counts]
    except (TypeError, RuntimeError):  # not iterable, not whole numbers, a tensor of several values
        raise MeshError(f"all_to_all: {name} must be {w} int row counts (one per rank), got {counts!r}") from None


def all_to_all(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Optional[Sequence[int]] = None,
               out: Optional[torch.Tensor] = None, *, mesh: Optional[Mesh] = None, check: bool = True) -> torch.Tensor:
    """Rows x[sum(send_counts[:d]):][:send_counts[d]] go to rank d; out holds the rows every rank sent
    us, in rank order. recv_counts (what each rank sends us) is exchanged when not given (MoE passes it)."""
    mesh = _mesh(mesh)
    w, r = mesh.world_size, mesh.rank
    given = out is not None
    with refusing(mesh):
        x = _check_input(mesh, x, Op.ALL_TO_ALL)
        send = _counts("send_counts", send_counts, w)
        if len(send) != w or any(c < 0 for c in send) or x.dim() == 0 or sum(send) != x.shape[0]:
            raise MeshError(f"all_to_all: send_counts must be {w} non-negative row counts summing to x.shape[0]="
                            f"{x.shape[0] if x.dim() else 'scalar'}, got {send}")
        if recv_counts is not None:
            recv = _counts("recv_counts", recv_counts, w)
            if len(recv) != w or any(c < 0 for c in recv):
                raise MeshError(f"all_to_all: recv_counts must be {w} non-negative row counts, got {recv}")
    if recv_counts is None:   # a call of its own (agreed as one)
        table = all_gather(torch.tensor(send, dtype=torch.int64, device=x.device), mesh=mesh).tolist()
        recv = [int(table[s * w + r]) for s in range(w)]
    with refusing(mesh):
        if recv[r] != send[r]:
            raise MeshError(f"all_to_all: recv_counts[{r}]={recv[r]} but this rank sends itself {send[r]} rows")
        row = math.prod(x.shape[1:])
        out = _check_out(out, (sum(recv),) + tuple(x.shape[1:]), x, Op.ALL_TO_ALL)
    plan = plans.all_to_all([c * row for c in send], [c * row for c in recv])

    def pieces(per):
        if plan.max_count > per:
            raise MeshError(f"all_to_all: {plan.max_count} elements for one peer exceed the workspace slot of "
                            f"{per}: pass a larger init_mesh(workspace_mb=...)")
        return [plan]

    # the counts differ from rank to rank: the rows' dtype and shape must agree (and the counts, each
    # sender's against its receiver's, are checked in the exchange)
    return _run(mesh, x, out, (Op.ALL_TO_ALL, plan.send_cnt, plan.recv_cnt), pieces, check,
                (str(x.dtype).removeprefix("torch."), tuple(x.shape[1:])), given)
