"""Symbolic expressions: tracing, evaluation, and the compiled form agreeing with evaluation."""
import pytest
import torch

import etdist as et
from etdist.fusion.expr import compile_fn, load, sym, var


def test_arithmetic_folds_constants_and_traces_symbols():
    M = sym("M")
    assert et.cdiv(10, 4) == 3
    e = et.cdiv(M, 4)
    assert e.symbols() == {"M"}
    assert [e.evaluate({"M": m}) for m in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert (sym("a") * 0 + 3).evaluate({"a": 7}) == 3


def test_compiled_maps_match_evaluation():
    i, j, M, R = var("i"), var("j"), sym("M"), sym("WORLD")
    exprs = ((i + 1) % R, et.minimum(M - i * 3, j), et.maximum(0, i - j), et.where(i < j, i, j), (j // 2) * 5)
    fn = compile_fn(exprs, ("i", "j"))
    for iv in range(4):
        for jv in range(5):
            env = {"M": 7, "WORLD": 3, "i": iv, "j": jv}
            assert fn(iv, jv, env) == tuple(e.evaluate(env) for e in exprs)


def test_loads_read_runtime_tensors():
    e = load("counts", (var("e"),)) * 2 + 1
    assert e.loads() == {"counts"} and e.is_data_dependent
    counts = torch.tensor([3, 0, 5])
    fn = compile_fn((e,), ("e",))
    assert [fn(k, {"counts": counts})[0] for k in range(3)] == [7, 1, 11]
    assert all(type(fn(k, {"counts": counts})[0]) is int for k in range(3))


def test_symbolic_values_refuse_python_control_flow():
    with pytest.raises(TypeError, match="no truth value"):
        bool(sym("M") > 1)
    with pytest.raises(TypeError, match="cannot be used as a Python int"):
        range(sym("M"))
    with pytest.raises(TypeError, match="index expressions are integers"):
        sym("M") + 1.5
    with pytest.raises(ValueError, match="must be a Python identifier"):
        sym("not a name")


def test_block_and_shift():
    assert et.block(0, 4, 10) == slice(0, 4)
    assert et.block(2, 4, 10) == slice(8, 10)
    assert et.block(3, 4, 10) == slice(10, 10)  # beyond the extent: empty
    assert et.shift(slice(1, 3), 10) == slice(11, 13)


def test_logical_ops_mean_the_same_on_host_and_gpu():
    e = et.logical_and(var("i"), var("j"))
    assert e.evaluate({"i": 2, "j": 1}) is True              # 2 and 1: true, though 2 & 1 == 0
    assert e.to_triton(lambda *_: "") == "((i != 0) & (j != 0))"


@pytest.mark.parametrize("rows,cols,group", [(5, 3, 2), (1, 7, 8), (9, 4, 8), (16, 16, 8), (3, 1, 4)])
def test_grouped_order_is_a_bijection_in_groups_of_rows(rows, cols, group):
    from etdist.fusion.expr import grouped
    order = [grouped(q, rows, cols, group) for q in range(rows * cols)]
    assert sorted(order) == [(i, j) for i in range(rows) for j in range(cols)]
    assert order[:min(group, rows)] == [(i, 0) for i in range(min(group, rows))]   # a column of weights, reused
    traced = grouped(var("q"), sym("R"), cols, group)     # the same order from the traced form
    from etdist.fusion.expr import evaluate
    assert [tuple(evaluate(e, {"q": q, "R": rows}) for e in traced) for q in range(rows * cols)] == order
    # ungrouped is its inverse, concrete and traced
    from etdist.fusion.expr import ungrouped
    assert [ungrouped(i, j, rows, cols, group) for i, j in order] == list(range(rows * cols))
    back = ungrouped(var("i"), var("j"), sym("R"), cols, group)
    assert [evaluate(back, {"i": i, "j": j, "R": rows}) for i, j in order] == list(range(rows * cols))


def test_adding_zero_or_multiplying_by_one_folds():
    k = var("k")
    assert k + 0 is k and 0 + k is k and k - 0 is k and k * 1 is k and 1 * k is k
    assert (0 - k).op == "sub"                      # not an identity
