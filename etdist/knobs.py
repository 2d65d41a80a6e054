"""The library's environment variables: every ETDIST_* variable is named in VARIABLES and read here
(`now`, `read`, `text`), nowhere else (tests/test_knobs.py checks the package for other reads).

A bad value must not break `import etdist` (a CPU-only user never reaches the GPU ops it tunes),
nor be replaced silently: `read` records it and returns the default, and the op that reads the
knob calls `check` first, which raises KnobError naming the variable and what it wants.
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
_BAD: dict[str, str] = {}   # variable -> what is wrong with its value


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


def read(name: str, parse: Callable[[str], T], default):
    """`now` for a knob read at import: a bad value is recorded for `check` and the default returned."""
    try:
        return now(name, parse, default)
    except KnobError as e:
        _BAD[name] = str(e)
        return default


def check(*prefixes: str) -> None:
    """Raise KnobError if a variable starting with one of `prefixes` had a bad value."""
    if not _BAD:   # the usual case, on every call of an op: nothing to look through
        return
    bad = [why for name, why in _BAD.items() if name.startswith(prefixes)]
    if bad:
        raise KnobError("; ".join(bad) + " (fix or unset it; README.md lists the knobs)")


def flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("want 0 or 1")
    return text == "1"


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError("want a positive integer")
    return int(text)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def tile_width(text: str) -> int:
    """One block size: a power of two >= 16 (tl.arange and tl.dot need them)."""
    v = int(text) if text.strip().isdigit() else 0
    if not (_pow2(v) and v >= 16):
        raise ValueError("want a power of two >= 16")
    return v


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
