"""Structured configs for the Hydra apps: a typo or a bad value fails when the config is composed.

The YAML files under conf/ fill these schemas: each starts from its group's schema, stored outside
the group (`- /schema_<group>@_here_`), so that no schema is offered or accepted as a choice
(`schedule=schema_schedule` fails at compose time like any unknown option).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class WorkloadName(enum.Enum):
    gemm_rs = "gemm_rs"
    ag_gemm = "ag_gemm"
    mlp = "mlp"
    mlp_replicated = "mlp_replicated"   # the MLP with whole x in and y out on every rank (not sequence-parallel)
    moe = "moe"
    collectives = "collectives"  # all-reduce built from the reduce_scatter + all_gather fragments


class ScheduleName(enum.Enum):
    static = "static"
    dynamic = "dynamic"


class Backend(enum.Enum):
    auto = "auto"      # nvshmem where there are GPUs, cpu otherwise
    cpu = "cpu"
    nvshmem = "nvshmem"


@dataclass
class ModelConfig:
    name: str = MISSING
    hidden: int = MISSING
    intermediate: int = MISSING       # dense MLP intermediate size (whole, before sharding)
    num_experts: int = 0              # MoE models only
    top_k: int = 0
    expert_intermediate: int = 0
    routing_skew: float = 0.0         # > 0: Zipf-like routing toward low-numbered experts


@dataclass
class WorkloadConfig:
    names: List[WorkloadName] = field(default_factory=lambda: list(WorkloadName))


@dataclass
class ScheduleConfig:
    names: List[ScheduleName] = field(default_factory=lambda: [ScheduleName.static])


@dataclass
class MeshConfig:
    backend: Backend = Backend.auto
    worlds: List[int] = field(default_factory=lambda: [1, 2, 4])  # simulated ranks on the CPU runtime


@dataclass
class BenchConfig:
    tokens: List[int] = field(default_factory=lambda: [37])  # M: tokens per layer call
    interleavings: int = 3    # seeded-random interleavings per cell on the CPU runtime
    programs: int = 4         # persistent programs per rank (simulated SMs on the CPU)
    block_m: int = 16
    block_n: int = 16
    seed: int = 0
    # GPU runs
    symm_mem: bool = True            # also time torch's fused symm_mem ops (PyTorch async-TP)
    startup: bool = False            # time cold compile / unseen M / 50 graph captures first
    rounds: int = 4                  # rounds per cell, each timing every contender once (timing.turns)
    warm_cell: bool = True           # time each job's first cell once more first, and drop that timing
    needs_gpu: bool = False          # a GPU sweep (bench=gpu, gpu_moe): refused at once where there are no GPUs
    results_dir: Optional[str] = None  # also append records here (e.g. bench/results), not only the run folder
    moe_config: str = ""             # nn.MoE's MoEConfig overrides, e.g. "tiles=128,64,64,4,4+large_rows=128"


@dataclass
class Config:
    model: ModelConfig = MISSING
    workload: WorkloadConfig = MISSING
    schedule: ScheduleConfig = MISSING
    mesh: MeshConfig = MISSING
    bench: BenchConfig = MISSING
    rank: int = 0  # this process's rank under a launcher (sets its output folder)


SCHEMAS = {"model": ModelConfig, "workload": WorkloadConfig, "schedule": ScheduleConfig, "mesh": MeshConfig,
           "bench": BenchConfig}


def register() -> None:
    """Store the schemas in Hydra's ConfigStore: `schema_config` for config.yaml, `schema_<group>` for
    each group's options, all at the top level (a schema stored in its group would be one of its choices)."""
    cs = ConfigStore.instance()
    cs.store(name="schema_config", node=Config)
    for group, node in SCHEMAS.items():
        cs.store(name=f"schema_{group}", node=node)
