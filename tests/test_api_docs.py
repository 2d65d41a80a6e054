"""The public API says what it is: every class and function that etdist, etdist.ops, etdist.nn and
etdist.collectives export has a docstring, and `mesh` is keyword-only wherever it is taken."""
import inspect

import pytest

import etdist
import etdist.collectives
import etdist.nn
import etdist.ops

PUBLIC = (etdist, etdist.ops, etdist.nn, etdist.collectives)


def exported(module):
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield f"{module.__name__}.{name}", obj


def test_every_exported_class_and_function_has_a_docstring():
    missing = [name for module in PUBLIC for name, obj in exported(module)
               if not (obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__ or "").strip()]
    assert not missing, f"no docstring: {missing}"


def callables_taking_mesh():
    """(name, function) of every exported function, and of every exported class's constructor and
    class methods, that takes a `mesh`."""
    for module in PUBLIC:
        for name, obj in exported(module):
            if inspect.isfunction(obj):
                candidates = [(name, obj)]
            else:
                candidates = [(f"{name}.{k}", getattr(obj, k)) for k, v in vars(obj).items()
                              if k == "__init__" or (not k.startswith("_") and isinstance(v, classmethod))]
            for fn_name, fn in candidates:
                if "mesh" in inspect.signature(fn).parameters:
                    yield fn_name, fn


def test_mesh_is_keyword_only_everywhere():
    found = dict(callables_taking_mesh())
    for name in ("etdist.ops.gemm_reduce_scatter", "etdist.ops.all_gather_gemm", "etdist.ops.tensor_parallel_mlp",
                 "etdist.nn.TensorParallelMLP.__init__", "etdist.nn.TensorParallelMLP.from_dense",
                 "etdist.nn.MoE.__init__", "etdist.collectives.all_reduce", "etdist.collectives.all_to_all"):
        assert name in found, sorted(found)
    positional = [name for name, fn in found.items()
                  if inspect.signature(fn).parameters["mesh"].kind is not inspect.Parameter.KEYWORD_ONLY]
    assert not positional, f"mesh taken by position: {positional}"


def test_a_mesh_by_position_is_refused():
    import torch
    with pytest.raises(TypeError):
        etdist.ops.gemm_reduce_scatter(torch.ones(2, 2), torch.ones(2, 2), None)
