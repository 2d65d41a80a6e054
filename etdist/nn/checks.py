"""Argument checks the layers share: a clear InputError before any weight is allocated or launch made."""
from __future__ import annotations

import operator

import torch

from .. import knobs
from ..fusion.errors import InputError


def positive_ints(owner: str, **values) -> None:
    """Each value an int >= 1 (not a bool, not a float)."""
    for name, v in values.items():
        try:
            ok = not isinstance(v, bool) and operator.index(v) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise InputError(f"{owner}: {name} must be a positive int, got {v!r}")


def float_dtype(owner: str, dtype, simulated: bool = False) -> None:
    """The GPU kernels take bf16, fp16 and fp32; simulated ranks (the CPU runtime) float64 too."""
    allowed = (torch.bfloat16, torch.float16, torch.float32) + ((torch.float64,) if simulated else ())
    if dtype not in allowed:
        raise InputError(f"{owner}: dtype must be a floating-point torch.dtype (torch.bfloat16, torch.float16 "
                         f"or torch.float32{', or torch.float64 when simulating' if simulated else ''}), got {dtype!r}")


def hidden_states(owner: str, x, hidden: int, dtype: torch.dtype) -> None:
    """x: a tensor [..., hidden] of the layer's floating-point dtype."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        got = "a 0-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"{owner}: x must be a tensor [..., {hidden}], got {got}")
    if x.shape[-1] != hidden:
        raise InputError(f"{owner}: x has {x.shape[-1]} features, the layer {hidden}")
    if not x.is_floating_point():
        raise InputError(f"{owner}: x is {x.dtype}; pass the hidden states as a floating-point tensor")
    if x.dtype != dtype:
        raise InputError(f"{owner}: x is {x.dtype}, the layer's weights {dtype}: pass x.to({dtype})")


def layer_mesh(owner: str, mesh):
    """The mesh a layer runs its ranks on (the current one if None): a GPU mesh, or a cpu mesh, where
    the layer runs on the CPU runtime across the processes (ops/cpu_path.py; under Triton's
    interpreter, TRITON_INTERPRET=1, the layer's generated GPU kernel instead, for tests)."""
    from ..mesh import current_mesh
    mesh = mesh or current_mesh()
    if getattr(mesh, "backend", None) not in ("nvshmem", "cpu"):
        raise InputError(f"{owner}: mesh must be the Mesh from et.init_mesh() (or None for the current one), got "
                         f"{type(mesh).__name__}; to simulate R ranks in this process, build the layer with "
                         f"simulate_world=R and no mesh")
    return mesh


def cpu_runtime(mesh) -> bool:
    """Whether a layer on `mesh` runs on the CPU runtime across processes (a cpu mesh, not under
    Triton's interpreter, which runs the GPU kernel on it)."""
    return getattr(mesh, "backend", None) == "cpu" and not knobs.triton_interpreted()
