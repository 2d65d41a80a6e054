"""The fused ops and layers on a cpu-backend mesh: the same user code as on GPUs, across processes,
exact and slow.

Each call is agreed with the peers first (mesh/calls.py: op, dtypes, shapes, out=, schedule), then
every rank's operands are gathered to every rank over the mesh's host comm, and the CPU runtime runs
the workload's graph (etdist.workloads: the graph the GPU path compiles, with small tiles and the
tile bodies' torch references) over all ranks at once; each rank keeps its own rank's outputs.
Every rank computes everything (world x the work, and the weights of every rank travel): a way to
run a model script unchanged under `torchrun` on a laptop, not a way to run it fast.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..fusion import compile as et_compile
from ..fusion.errors import InputError
from ..mesh.calls import Signature, refusing, tensor_arg
from ..workloads import ag_gemm as ag_graph, gemm_rs as rs_graph, mlp as mlp_graph

TILE = 16          # rows and columns of the graphs' tiles on the CPU (the CPU runtime's task size)
_KERNELS: dict = {}


def _kernel(key: tuple, build, schedule: str):
    kernel = _KERNELS.get((key, schedule))
    if kernel is None:
        kernel = _KERNELS[key, schedule] = et_compile(build(), schedule=schedule, target="cpu")
    return kernel


def _check_out(mesh, op: str, out, shape: tuple, like: torch.Tensor) -> None:
    """out= must be the result's shape and dtype on the CPU (checked before the call is agreed; a
    refusal is published, mesh/calls.py)."""
    with refusing(mesh):
        _out_fits(op, out, shape, like)


def _out_fits(op: str, out, shape: tuple, like: torch.Tensor) -> None:
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape)
                            or out.dtype != like.dtype or out.device.type != "cpu"):
        raise InputError(f"{op}: out must be a {like.dtype} tensor {list(shape)} on the CPU, got "
                         f"{getattr(out, 'shape', type(out).__name__)}")


def _owned(M: int, world: int, rank: int) -> int:
    C = -(-M // world)
    return max(0, min(C, M - rank * C))


def run(mesh, op: str, kernel, mine: dict, sizes: Optional[dict], agreed: tuple, out, name: str = "y"):
    """Agree the call, gather every rank's `mine`, run `kernel` over all ranks; this rank's output."""
    mesh.calls.agree(Signature(op, agreed + (("out", out is not None),)))
    everyone = mesh.comm.allgather({k: v.contiguous() for k, v in mine.items()})
    y = kernel.run(everyone, sizes=sizes)[mesh.rank][name]
    return y if out is None else out.copy_(y)


def gemm_reduce_scatter(x: torch.Tensor, w: torch.Tensor, mesh, schedule: str, out):
    """et.ops.gemm_reduce_scatter on the cpu backend (its operands checked by the op)."""
    M, N = x.shape[0], w.shape[1]
    _check_out(mesh, "gemm_reduce_scatter", out, (_owned(M, mesh.world_size, mesh.rank), N), x)
    agreed = (("x", tensor_arg(x)), ("w", tensor_arg(w)), ("schedule", schedule))
    if M == 0:   # nothing to run, but agreed: a rank alone at M = 0 is named, not waited for
        mesh.calls.agree(Signature("gemm_reduce_scatter", agreed + (("out", out is not None),)))
        return out if out is not None else x.new_empty((0, N))
    kernel = _kernel(("gemm_rs", x.dtype), lambda: rs_graph.gemm_reduce_scatter(TILE, TILE, x.dtype), schedule)
    return run(mesh, "gemm_reduce_scatter", kernel, {"x": x, "w": w}, None, agreed, out)


def all_gather_gemm(x: torch.Tensor, w: torch.Tensor, mesh, M: int, schedule: str, out):
    """et.ops.all_gather_gemm on the cpu backend: M the gathered rows (the op's total_rows)."""
    N = w.shape[1]
    _check_out(mesh, "all_gather_gemm", out, (M, N), x)
    agreed = (("M", M), ("x", str(x.dtype).removeprefix("torch.")), ("w", tensor_arg(w)), ("schedule", schedule))
    if M == 0:
        mesh.calls.agree(Signature("all_gather_gemm", agreed + (("out", out is not None),)))
        return out if out is not None else x.new_empty((0, N))
    kernel = _kernel(("ag_gemm", x.dtype), lambda: ag_graph.all_gather_gemm(TILE, TILE, x.dtype), schedule)
    return run(mesh, "all_gather_gemm", kernel, {"x": x, "w": w}, {"M": M}, agreed, out)


def tensor_parallel_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, mesh, M: int,
                        schedule: str, sequence_parallel: bool, out):
    """et.ops.tensor_parallel_mlp on the cpu backend: M the rows of every rank together
    (sequence-parallel), or of x, which every rank passes whole (replicated)."""
    H = x.shape[1]
    rows = _owned(M, mesh.world_size, mesh.rank) if sequence_parallel else M
    _check_out(mesh, "tensor_parallel_mlp", out, (rows, H), x)
    agreed = (("M", M), ("x", str(x.dtype).removeprefix("torch.")), ("w_gate_up", tensor_arg(w_gate_up)),
              ("w_down", tensor_arg(w_down)), ("sequence_parallel", sequence_parallel), ("schedule", schedule))
    if M == 0:
        mesh.calls.agree(Signature("tensor_parallel_mlp", agreed + (("out", out is not None),)))
        return out if out is not None else x.new_empty((0, H))
    build = mlp_graph.tp_mlp if sequence_parallel else mlp_graph.tp_mlp_replicated
    kernel = _kernel(("mlp", sequence_parallel, x.dtype), lambda: build(TILE, TILE, x.dtype), schedule)
    return run(mesh, "tensor_parallel_mlp", kernel, {"x": x, "w_gate_up": w_gate_up, "w_down": w_down},
               {"M": M}, agreed, out)


def moe(layer, x: torch.Tensor) -> torch.Tensor:
    """nn.MoE's forward on the cpu backend: x [T, H] this rank's tokens (the same T on every rank),
    its experts the layer's shard; the layer's CPU graph over every rank's tokens and experts."""
    mesh = layer.mesh
    agreed = (("x", tensor_arg(x)), ("experts", layer.num_experts), ("top_k", layer.top_k),
              ("w_gate_up", tensor_arg(layer.w_gate_up[0])), ("w_down", tensor_arg(layer.w_down[0])),
              ("schedule", layer.schedule))
    mine = {"x": x, "wg": layer.router.data, "w_gate_up": layer.w_gate_up[0].data, "w_down": layer.w_down[0].data}
    return run(mesh, "MoE", layer._kernel("cpu"), mine, None, agreed, None)


def agree_no_rows(mesh, op: str, x: torch.Tensor, w: torch.Tensor, out) -> None:
    """An op called with no rows at all returns without a launch (its result is empty); it still
    agrees the call with the peers (on GPUs on the host, a slow path), so a rank alone at M = 0 is
    named instead of leaving the peers' launch waiting for it."""
    if getattr(mesh, "calls", None) is not None:
        mesh.calls.agree(Signature(op, (("M", 0), ("x", str(x.dtype).removeprefix("torch.")), ("w", tensor_arg(w)),
                                        ("out", out is not None))))
