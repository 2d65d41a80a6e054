"""The generated megakernel's source written to the cache directory (Triton reads a kernel's source
from its file) and imported as a module: one module per source and tile bodies."""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import pathlib
import sys

from .. import knobs

CACHE = pathlib.Path(knobs.text("ETDIST_CACHE") or pathlib.Path.home() / ".cache" / "etdist")


def _body_key(fn) -> str:
    """A tile body's source key (interpreted functions have no cache_key: hash their source)."""
    key = getattr(fn, "cache_key", None)
    return key if key is not None else hashlib.sha256(inspect.getsource(fn.fn).encode()).hexdigest()


def load_module(ir, source: str):
    """Write the generated source to the cache (Triton reads source from files) and import it.
    Keyed by the source and the tile bodies' own sources, so a redefined body gets a new module."""
    bodies = "".join(_body_key(t.triton_body) for t in ir.tasks)
    key = hashlib.sha256((source + bodies).encode()).hexdigest()[:16]
    path = CACHE / f"megakernel_{ir.name}_{key}.py"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    name = f"etdist_megakernel_{ir.name}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    for t in ir.tasks:  # the tile bodies the generated code calls by name
        setattr(mod, f"_et_body_{t.name}", t.triton_body)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod
