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
