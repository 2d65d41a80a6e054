"""Fused tensor-parallel ops on torch tensors: `et.ops.gemm_reduce_scatter(x, w)`, `et.ops.all_gather_gemm(x, w)`,
`et.ops.tensor_parallel_mlp(x, w_gate_up, w_down)`."""
import functools

from .ag_gemm import all_gather_gemm
from .gemm_rs import gemm_reduce_scatter
from .mlp import tensor_parallel_mlp
from . import compiled  # noqa: F401  (registers the ops as torch custom ops, for torch.compile)
from . import ag_gemm as _ag_gemm, gemm_rs as _gemm_rs, mlp as _mlp


def clear_plan_caches() -> None:
    """Forget the ops' cached plans (their kernel_plan and the plans under it, cached: the ops ask
    at every call). Needed after a plan knob's module attribute changes at run time (e.g.
    ops.gemm_rs.INTERLEAVE_SOURCES = False); the ETDIST_* variables are read once, at import."""
    for module in (_ag_gemm, _gemm_rs, _mlp):
        for fn in vars(module).values():
            if isinstance(fn, functools._lru_cache_wrapper):
                fn.cache_clear()
