"""Workloads written as Event Tensor graphs with the public API, each with a float64 reference.

`WORKLOADS[name]` describes how the benchmark and the tests build, feed and check one of them
at a model's shapes, so the two never drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import ag_gemm, gemm_rs, moe


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


WORKLOADS = {
    "gemm_rs": Workload("gemm_rs", lambda bm, bn, model: gemm_rs.gemm_reduce_scatter(bm, bn), _gemm_rs_case),
    "ag_gemm": Workload("ag_gemm", lambda bm, bn, model: ag_gemm.all_gather_gemm(bm, bn), _ag_gemm_case),
    "moe": Workload("moe", lambda bm, bn, model: moe.moe_layer(model.top_k, bm), _moe_case, needs_experts=True),
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
