"""Workloads written as Event Tensor graphs with the public API, each with a float64 reference.

`WORKLOADS[name]` describes how the benchmark and the tests build, feed and check one of them
at a model's shapes, so the two never drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import etdist.fusion as et   # the graph builder, not the package root

from . import ag_gemm, collectives, gemm_rs, mlp, moe


@dataclass(frozen=True)
class Case:
    """One run of a workload: per-rank inputs, explicit sizes, the reference per rank, and the
    reference computation itself (eager torch, float64, one process: the CPU baseline)."""

    inputs: list
    sizes: dict
    reference: list
    compute_reference: Callable[[], list]


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[..., "object"]          # (block_m, block_n, model) -> Graph
    case: Callable[..., Case]               # (model, world, M, seed) -> Case
    needs_experts: bool = False


def _gemm_rs_case(model, world, M, seed) -> Case:
    K = max(1, model.intermediate // world)     # this rank's shard of the intermediate dim
    ins = gemm_rs.make_inputs(world, M, K, model.hidden, seed=seed)
    ref = lambda: gemm_rs.reference([i["x"] for i in ins], [i["w"] for i in ins])
    return Case(ins, {}, ref(), ref)


def _ag_gemm_case(model, world, M, seed) -> Case:
    N = max(1, 2 * model.intermediate // world)  # this rank's gate/up columns
    ins = ag_gemm.make_inputs(world, M, model.hidden, N, seed=seed)
    ref = lambda: ag_gemm.reference([i["x"] for i in ins], [i["w"] for i in ins])
    return Case(ins, {"M": M}, ref(), ref)


def _moe_case(model, world, M, seed) -> Case:
    if model.num_experts % world:
        raise ValueError(f"model {model.name!r}: {model.num_experts} experts do not split over {world} ranks")
    ins, (wg, w1, w2) = moe.make_inputs(world, M, model.hidden, model.expert_intermediate,
                                        model.num_experts, seed=seed, skew=model.routing_skew)
    ref = lambda: moe.reference([i["x"] for i in ins], wg, w1, w2, model.top_k)
    return Case(ins, {}, ref(), ref)


def _mlp_case(model, world, M, seed) -> Case:
    ins = mlp.make_inputs(world, M, model.hidden, model.intermediate, seed=seed)
    ref = lambda: mlp.reference([i["x"] for i in ins], [i["w_gate_up"] for i in ins], [i["w_down"] for i in ins])
    return Case(ins, {"M": M}, ref(), ref)


def _mlp_replicated_case(model, world, M, seed) -> Case:
    ins = mlp.make_inputs(world, M, model.hidden, model.intermediate, seed=seed, replicated=True)
    ref = lambda: [mlp.reference_replicated(ins[0]["x"], [i["w_gate_up"] for i in ins],
                                            [i["w_down"] for i in ins])] * world
    return Case(ins, {"M": M}, ref(), ref)


def all_reduce_graph(block_m: int, block_n: int):
    """x [M, H] on every rank -> the sum over ranks on every rank, from the reduce_scatter and
    all_gather fragments (the gathered rows are cut back to M by a last task)."""
    g = et.Graph("all_reduce")
    M, N = g.size("M"), g.size("N")
    R, me = g.world, g.rank
    C, owned = et.row_chunks(M, R)
    x = g.input("x", (M, N))
    g.output("y", (M, N))
    summed, done = collectives.reduce_scatter(g, x, block_m=block_m, block_n=block_n)
    _, arrived = collectives.all_gather(g, summed, block_m=block_m, block_n=block_n, after=lambda i, j: done[i, j])

    @g.task(grid=(R, et.cdiv(C, block_m), et.cdiv(N, block_n)), wait=lambda s, i, j: arrived[me, s, i, j])
    def unpad(t, s, i, j):
        rows = et.shift(et.block(i, block_m, t(owned(s))), s * t(C))
        cols = et.block(j, block_n, t.N)
        t.y[rows, cols] = t.ag_out[rows, cols]

    return g


def _all_reduce_case(model, world, M, seed) -> Case:
    gen = torch.Generator().manual_seed(seed)
    ins = [{"x": torch.randn(M, model.hidden, generator=gen)} for _ in range(world)]
    ref = lambda: [sum(i["x"].double() for i in ins)] * world
    return Case(ins, {}, ref(), ref)


WORKLOADS = {
    "gemm_rs": Workload("gemm_rs", lambda bm, bn, model: gemm_rs.gemm_reduce_scatter(bm, bn), _gemm_rs_case),
    "ag_gemm": Workload("ag_gemm", lambda bm, bn, model: ag_gemm.all_gather_gemm(bm, bn), _ag_gemm_case),
    "moe": Workload("moe", lambda bm, bn, model: moe.moe_layer(model.top_k, bm), _moe_case, needs_experts=True),
    "mlp": Workload("mlp", lambda bm, bn, model: mlp.tp_mlp(bm, bn), _mlp_case),
    "mlp_replicated": Workload("mlp_replicated", lambda bm, bn, model: mlp.tp_mlp_replicated(bm, bn),
                               _mlp_replicated_case),
    "collectives": Workload("collectives", lambda bm, bn, model: all_reduce_graph(bm, bn), _all_reduce_case),
}


def max_rel_err(outputs: list, reference: list, key: str = "y") -> float:
    """Largest relative error over ranks, against the float64 reference."""
    worst = 0.0
    for out, ref in zip(outputs, reference):
        got = out[key].double()
        if got.shape != ref.shape:
            raise AssertionError(f"output shape {list(got.shape)} != reference {list(ref.shape)}")
        if ref.numel():
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
    return worst
