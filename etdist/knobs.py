"""The library's environment variables: every ETDIST_* variable is named in VARIABLES and read here
(`now`, `text`), as are the few others it heeds (`triton_interpreted`, `torch_symm_mem_backend`);
no other module reads the environment (tests/test_knobs.py checks).

A value that must parse is read where it is used, not at import (a CPU-only user never reaches the
GPU code it sets), and a bad one raises KnobError naming the variable and what it wants.
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")


class KnobError(ValueError):
    """An ETDIST_* environment variable that an op reads has a value it cannot use."""


# Every variable, what it sets and the argument that sets it in code where there is one
VARIABLES = {
    "ETDIST_WATCHDOG_S": "seconds any wait may spin before every rank raises (init_mesh(watchdog_s=...); 30)",
    "ETDIST_DEBUG": "1: log each compiler pass and each generated GPU kernel (logger etdist)",
    "ETDIST_CACHE": "where generated kernels are written (~/.cache/etdist)",
    "ETDIST_SHARE_GPU": "1: more ranks than GPUs, correctness checks only (init_mesh(share_gpu=True))",
    "ETDIST_COMMIT": "the commit a benchmark record names where the tree's .git is stale (a GPU machine's copy)",
}


def triton_interpreted() -> bool:
    """Triton's own TRITON_INTERPRET=1: kernels run in its interpreter (Triton's rule: 1, true or on)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")


def torch_symm_mem_backend() -> str:
    """torch's own TORCH_SYMMMEM, upper-cased: the symmetric-memory backend torch will pick ("" if unset)."""
    return os.environ.get("TORCH_SYMMMEM", "").upper()


def text(name: str, default: str = "") -> str:
    """The raw value of `name` (a path, a commit), or `default` when it is unset or empty."""
    return os.environ.get(name, "") or default


def now(name: str, parse: Callable[[str], T], default):
    """The parsed value of environment variable `name`, or `default` when it is unset or empty; a
    value `parse` rejects (ValueError) raises KnobError naming it (for a knob read where it is used)."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    try:
        return parse(text)
    except ValueError as e:
        raise KnobError(f"{name}={text!r}: {e}") from None


def flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("want 0 or 1")
    return text == "1"


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def tile(text: str, blocks: str = "block_m,block_n,block_k") -> tuple[int, ...]:
    """"<blocks>,warps,stages" as ints: three blocks, powers of two >= 16 (tl.arange and tl.dot
    need them), warps a power of two <= 16, stages >= 1."""
    fields = [f.strip() for f in text.split(",")]
    values = [int(f) for f in fields] if all(f.isdigit() for f in fields) else []
    if len(values) != 5 or not (all(_pow2(b) and b >= 16 for b in values[:3]) and _pow2(values[3])
                                and values[3] <= 16 and values[4] >= 1):
        raise ValueError(f"want {blocks},warps,stages (blocks powers of two >= 16, warps a power of two "
                         "<= 16, stages >= 1)")
    return tuple(values)
