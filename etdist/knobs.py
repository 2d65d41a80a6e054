"""Tuning knobs: environment variables read once at import, checked, and reported where they are used.

A bad value must not break `import etdist` (a CPU-only user never reaches the GPU ops it tunes),
nor be replaced silently: `read` records it and returns the default, and the op that reads the
knob calls `check` first, which raises KnobError naming the variable and what it wants.
"""
from __future__ import annotations

import math
import os
from typing import Callable, TypeVar

T = TypeVar("T")


class KnobError(ValueError):
    """An ETDIST_* environment variable that an op reads has a value it cannot use."""


_BAD: dict[str, str] = {}   # variable -> what is wrong with its value


def read(name: str, parse: Callable[[str], T], default):
    """The parsed value of environment variable `name`, or `default` when it is unset or empty; a
    value `parse` rejects (ValueError) is recorded for `check` and the default is returned."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    try:
        return parse(text)
    except ValueError as e:
        _BAD[name] = f"{name}={text!r}: {e}"
        return default


def now(name: str, parse: Callable[[str], T], default):
    """For a knob read where it is used (not at import): its parsed value, or KnobError naming it."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    try:
        return parse(text)
    except ValueError as e:
        raise KnobError(f"{name}={text!r}: {e}") from None


def check(*prefixes: str) -> None:
    """Raise KnobError if a variable starting with one of `prefixes` had a bad value."""
    bad = [why for name, why in _BAD.items() if name.startswith(prefixes)]
    if bad:
        raise KnobError("; ".join(bad) + " (fix or unset it; README.md lists the knobs)")


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError("want a positive integer")
    return int(text)


def power_of_two(text: str) -> int:
    v = positive_int(text) if text.strip().isdigit() else 0
    if v < 1 or v & (v - 1):
        raise ValueError("want a power of two")
    return v


def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError("want an integer >= 0")
    return int(text)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise ValueError("want a finite number > 0")
    return v


def flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("want 0 or 1")
    return text == "1"
