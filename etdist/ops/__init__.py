"""Fused tensor-parallel ops on torch tensors: `et.ops.gemm_reduce_scatter(x, w)`, `et.ops.all_gather_gemm(x, w)`,
`et.ops.tensor_parallel_mlp(x, w_gate_up, w_down)`."""
from .ag_gemm import all_gather_gemm
from .gemm_rs import gemm_reduce_scatter
from .mlp import tensor_parallel_mlp
from . import compiled  # noqa: F401  (registers the ops as torch custom ops, for torch.compile)
