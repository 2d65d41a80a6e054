"""Fused tensor-parallel ops on torch tensors: `et.ops.gemm_reduce_scatter(x, w)`."""
from .gemm_rs import gemm_reduce_scatter
