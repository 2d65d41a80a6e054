"""Checks of the graph builders' integer parameters: the same message everywhere, before any graph."""
from __future__ import annotations

import etdist.fusion as et   # the graph builder (what `import etdist as et` offers), not the package root


def positive_int(where: str, name: str, value, optional: bool = False):
    """`value` if it is a positive int (or None, where `optional`), else a GraphError naming it."""
    if optional and value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise et.GraphError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


def prefetch_hint(where: str, rows) -> dict:
    """The constexprs of a matmul task's L2 prefetch hint (gemm_tiles.*_prefetch) for `rows` rows of
    its first weight tile: {} for 0 (no hint), else {"PREFETCH_ROWS": rows} (a power of two: a
    tile's row range is a tl.arange)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0 or rows & (rows - 1):
        raise et.GraphError(f"{where}: prefetch_rows must be 0 or a power of two, got {rows!r}")
    return {"PREFETCH_ROWS": rows} if rows else {}
