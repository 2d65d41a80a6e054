"""Fused tensor-parallel ops on torch tensors: `et.ops.gemm_reduce_scatter(x, w)`, `et.ops.all_gather_gemm(x, w)`,
`et.ops.tensor_parallel_mlp(x, w_gate_up, w_down)`. Each plans its kernel with a PlanConfig
(`config=`; DEFAULT_PLAN when not given)."""
from .ag_gemm import all_gather_gemm
from .config import DEFAULT_PLAN, PlanConfig, TileConfig
from .gemm_rs import gemm_reduce_scatter
from .mlp import tensor_parallel_mlp
from . import compiled  # noqa: F401  (registers the ops as torch custom ops, for torch.compile)

__all__ = ["DEFAULT_PLAN", "PlanConfig", "TileConfig", "all_gather_gemm", "gemm_reduce_scatter", "tensor_parallel_mlp"]
