"""The fused ops as torch library ops, so that torch.compile keeps each one whole in its graph
(collectives/compiled.py says why and how). A node carries no PlanConfig: compiled calls plan with
DEFAULT_PLAN, and an op traced with another config refuses it (common.plan_config)."""
from __future__ import annotations

import torch

from ..collectives.custom_op import define_op
from ..fusion.errors import InputError
from ..mesh.mesh import mesh_by_key
from . import ag_gemm, gemm_rs, mlp


def rows_of_rank(M, world: int, rank: int):
    """This rank's rows of M split in chunks of cdiv(M, world), ragged at the end (M may be symbolic)."""
    C = (M + world - 1) // world
    return torch.sym_min(M, (rank + 1) * C) - torch.sym_min(M, rank * C)


def _gemm_rs(x, w, schedule, mesh, token):
    return gemm_rs.gemm_reduce_scatter(x, w, mesh=mesh_by_key(mesh), schedule=schedule)


def _gemm_rs_fake(x, w, schedule, mesh, token):
    m = mesh_by_key(mesh)
    return x.new_empty(rows_of_rank(x.shape[0], m.world_size, m.rank), w.shape[1])


def _gathered_rows(op: str, x: torch.Tensor, total_rows, world: int, y: torch.Tensor):
    """The ops that gather rows return M of them: under torch.compile M is total_rows, or rows x
    world when not given (the graph was traced so); a rank with no rows of a ragged M would learn
    another M from its peers at run time."""
    M = total_rows if total_rows is not None else x.shape[0] * world
    if y.shape[0] != M:
        raise InputError(f"{op} under torch.compile: {y.shape[0]} rows gathered, the graph expected {M}; pass "
                         f"total_rows=M where M is not world x rows")
    return y


def _ag_gemm(x, w, total_rows, schedule, mesh, token):
    m = mesh_by_key(mesh)
    y = ag_gemm.all_gather_gemm(x, w, mesh=m, total_rows=total_rows, schedule=schedule)
    return _gathered_rows("all_gather_gemm", x, total_rows, m.world_size, y)


def _ag_gemm_fake(x, w, total_rows, schedule, mesh, token):
    M = total_rows if total_rows is not None else x.shape[0] * mesh_by_key(mesh).world_size
    return x.new_empty(M, w.shape[1])


def _mlp(x, w_gate_up, w_down, total_rows, schedule, sequence_parallel, mesh, token):
    return mlp.tensor_parallel_mlp(x, w_gate_up, w_down, mesh=mesh_by_key(mesh), total_rows=total_rows,
                                   schedule=schedule, sequence_parallel=sequence_parallel)


def _mlp_fake(x, w_gate_up, w_down, total_rows, schedule, sequence_parallel, mesh, token):
    return x.new_empty(x.shape[0], w_down.shape[1])   # this rank's rows in and out, or all of them


define_op("gemm_reduce_scatter(Tensor x, Tensor w, str schedule, str mesh, Tensor(a!) token) -> Tensor",
          _gemm_rs, _gemm_rs_fake)
define_op("all_gather_gemm(Tensor x, Tensor w, SymInt? total_rows, str schedule, str mesh, Tensor(a!) token) "
          "-> Tensor", _ag_gemm, _ag_gemm_fake)
define_op("tensor_parallel_mlp(Tensor x, Tensor w_gate_up, Tensor w_down, SymInt? total_rows, str schedule, "
          "bool sequence_parallel, str mesh, Tensor(a!) token) -> Tensor", _mlp, _mlp_fake)
