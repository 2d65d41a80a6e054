"""Broken graphs are refused at compile time with errors naming the culprit."""
import pytest
import torch

import etdist as et


def chain(produce_count=1, wait_map=None, notify_map=None, count=1):
    """a(i) notifies done[i]; b(i) waits on done[i]. Knobs break it in one place each."""
    g = et.Graph("chain")
    n = g.size("n")
    g.input("x", (n,))
    done = g.event("done", (n,), count=count)

    @g.task(grid=(n,), notify=notify_map or (lambda i: [done[i]] * produce_count))
    def a(t, i):
        pass

    @g.task(grid=(n,), wait=wait_map or (lambda i: done[i]))
    def b(t, i):
        pass

    return g


def test_valid_chain_compiles():
    et.compile(chain(), schedule="static")
    et.compile(chain(), schedule="dynamic")


def test_missing_notify_is_named():
    g = et.Graph("g")
    n = g.size("n")
    ready = g.event("ready", (n,))
    other = g.event("other", (n,))

    @g.task(grid=(n,), notify=lambda i: other[i])
    def a(t, i):
        pass

    @g.task(grid=(n,), wait=lambda i: [ready[i], other[i]])
    def b(t, i):
        pass

    with pytest.raises(et.GraphError, match=r"event 'ready' is waited on \(by \['b'\]\) but no task notifies it"):
        et.compile(g)




def test_out_of_range_wait():
    g = et.Graph("oob")
    n = g.size("n")
    done = g.event("done", (n,))

    @g.task(grid=(n,), notify=lambda i: done[i])
    def a(t, i):
        pass

    @g.task(grid=(n,), wait=lambda i: done[i + 1])
    def b(t, i):
        pass

    with pytest.raises(et.GraphError, match=r"task b\(0,\) on rank 0 of 1 waits on done\[1\], outside the event's shape \[1\]"):
        et.compile(g)


def test_count_mismatch_names_element_and_notifiers():
    with pytest.raises(et.GraphError, match=r"event done\[0\] on rank 0 expects 1 notifies but receives 2 \(from a\(0,\)@rank0, a\(0,\)@rank0\)"):
        et.compile(chain(produce_count=2))
    with pytest.raises(et.GraphError, match=r"event done\[0\] on rank 0 expects 3 notifies but receives 1 \(from a\(0,\)@rank0\); b\(0,\)@rank0 waits on it"):
        et.compile(chain(count=3))


def test_cycle_is_reported_by_task_names():
    g = et.Graph("cyc")
    n = g.size("n")
    ea = g.event("ea", (n,))
    eb = g.event("eb", (n,))

    @g.task(grid=(n,), wait=lambda i: eb[i], notify=lambda i: ea[i])
    def a(t, i):
        pass

    @g.task(grid=(n,), wait=lambda i: ea[i], notify=lambda i: eb[i])
    def b(t, i):
        pass

    for schedule in ("static", "dynamic"):
        with pytest.raises(et.GraphError, match=r"dependency cycle: .*a\(0,\)@rank0 -> b\(0,\)@rank0|dependency cycle: .*b\(0,\)@rank0 -> a\(0,\)@rank0"):
            et.compile(g, schedule=schedule)


def test_static_order_violation_suggests_fix():
    g = et.Graph("backwards")
    n = g.size("n")
    done = g.event("done", (n,))

    @g.task(grid=(n,), wait=lambda i: done[i])
    def consumer(t, i):
        pass

    @g.task(grid=(n,), notify=lambda i: done[i])
    def producer(t, i):
        pass

    with pytest.raises(et.GraphError, match="static schedule: consumer.*notified by producer.*declare producers before consumers"):
        et.compile(g, schedule="static")
    et.compile(g, schedule="dynamic")  # the ready queue does not care about declaration order


def test_wait_on_another_ranks_event_is_refused():
    g = et.Graph("remote_wait")
    R = g.world
    done = g.event("done", (R,), distributed=True)

    @g.task(grid=(R,), notify=lambda d: done[d])
    def a(t, d):
        pass

    @g.task(grid=(1,), wait=lambda _: done[(g.rank + 1) % R], notify=None)
    def b(t, _):
        pass

    with pytest.raises(et.GraphError, match=r"waits on done\[1\], which lives on rank 1: a task may only wait on its own rank's events"):
        et.compile(g)


def test_grid_arity_and_rank_dependent_grid():
    g = et.Graph("arity")
    n = g.size("n")
    with pytest.raises(et.GraphError, match="grid has 2 dims but the body takes 1 index"):
        @g.task(grid=(n, n))
        def a(t, i):
            pass
        g.to_ir()
    g = et.Graph("rankgrid")
    done = g.event("done", (4,))

    @g.task(grid=(g.rank + 1,), notify=lambda i: done[i])
    def a(t, i):
        pass

    @g.task(grid=(1,), wait=lambda i: done[i])
    def b(t, i):
        pass

    with pytest.raises(et.GraphError, match="its grid may depend on sizes only"):
        et.compile(g)


def test_unused_and_unwaited_events():
    g = et.Graph("unused")
    g.event("lonely", (2,))

    @g.task(grid=(1,))
    def a(t, i):
        pass

    with pytest.raises(et.GraphError, match=r"events \['lonely'\] are declared but no task uses them"):
        et.compile(g)


def test_symbolic_truth_value_is_a_clear_error():
    g = et.Graph("branchy")
    n = g.size("n")
    done = g.event("done", (n,))
    with pytest.raises(TypeError, match="use et.where"):
        @g.task(grid=(n,), notify=lambda i: done[i if i > 0 else 0])
        def a(t, i):
            pass
        g.to_ir()


def test_dynamic_wait_may_not_read_runtime_tensors():
    g = et.Graph("dd")
    n = g.size("n")
    idx = g.input("idx", (n,), torch.int64)
    done = g.event("done", (n,))

    @g.task(grid=(n,), notify=lambda i: done[i])
    def a(t, i):
        pass

    @g.task(grid=(n,), wait=lambda i: done[idx[i]])
    def b(t, i):
        pass

    with pytest.raises(et.GraphError, match="reads a runtime tensor"):
        et.compile(g, schedule="dynamic")


def test_bad_compile_arguments():
    with pytest.raises(et.GraphError, match="schedule must be one of"):
        et.compile(chain(), schedule="greedy")
    with pytest.raises(et.GraphError, match="target must be one of"):
        et.compile(chain(), target="tpu")
    with pytest.raises(et.GraphError, match="task 'a' has no GPU tile body: pass triton="):
        et.compile(chain(), target="cuda")


def test_every_workload_validates_at_its_samples():
    from etdist.workloads import ag_gemm, gemm_rs, moe
    for g in (gemm_rs.gemm_reduce_scatter(), ag_gemm.all_gather_gemm(), moe.moe_layer()):
        ir = g.to_ir()
        assert len(ir.key()) == 16 and ir.key() == g.to_ir().key()  # deterministic content hash
        et.compile(g, schedule="dynamic")
