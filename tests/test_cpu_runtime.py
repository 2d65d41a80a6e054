"""The CPU runtime: faults it must catch, re-arming, bad input, and the programs it simulates."""
import pytest
import torch

import etdist as et
from etdist.fusion.bind import MapTable
from etdist.fusion.cpu_runtime import CpuKernel
from etdist.workloads import gemm_rs

from conftest import rel_err


def counted(notify_times=1):
    """a(i) writes x[i] + 1 into v and notifies ready[i] `notify_times`; b(i) waits, doubles it.

    ready's count is read at run time from `need` (a data-dependent count, so validation
    leaves it to the runtime): a wrong `need` is a deadlock or a double notify.
    """
    g = et.Graph("counted")
    n = g.size("n")
    need = g.input("need", (n,), torch.int64)
    g.input("x", (n,))
    g.scratch("v", (n,))
    g.output("y", (n,))
    ready = g.event("ready", (n,), count=lambda c: need[c])

    @g.task(grid=(n,), notify=lambda i: [ready[i]] * notify_times)
    def a(t, i):
        t.v[i] = t.x[i] + 1

    @g.task(grid=(n,), wait=lambda i: ready[i])
    def b(t, i):
        t.y[i] = 2 * t.v[i]

    return g


def inputs(n, need):
    return [{"need": torch.full((n,), need, dtype=torch.int64), "x": torch.arange(n, dtype=torch.float32)}]


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_counted_graph_runs(schedule):
    out = et.compile(counted(), schedule=schedule).run(inputs(5, 1))
    assert torch.equal(out[0]["y"], 2 * (torch.arange(5.0) + 1))


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_deadlock_names_stuck_task_event_and_counter(schedule):
    kernel = et.compile(counted(), schedule=schedule, programs=2)
    with pytest.raises(et.DeadlockError) as err:
        kernel.run(inputs(3, 2))  # each element waits for 2 notifies; only 1 ever comes
    msg = str(err.value)
    assert "no program can move" in msg
    assert "b(0,)" in msg and "ready[0]" in msg and "1 of 2 notifies" in msg


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_double_notify(schedule):
    kernel = et.compile(counted(notify_times=2), schedule=schedule)
    with pytest.raises(et.DoubleNotifyError, match=r"task a\(0,\)@rank0 notified ready\[0\] on rank 0: 2 notifies arrived, the element expects 1"):
        kernel.run(inputs(3, 1))


def test_counter_not_ending_where_expected():
    g = et.Graph("leftover")
    n = g.size("n")
    need = g.input("need", (n,), torch.int64)
    ev = g.event("ev", (n,), count=lambda c: need[c])

    @g.task(grid=(n,), notify=lambda i: ev[i])
    def a(t, i):
        pass

    @g.task(grid=(1,), wait=lambda _: ev[0])  # only element 0 is waited on
    def b(t, _):
        pass

    with pytest.raises(et.CounterError, match=r"ev\[1\] on rank 0: 1 notifies, expected 3"):
        et.compile(g).run([{"need": torch.tensor([1, 3, 1])}])


def test_runtime_catches_what_validation_was_told_to_skip():
    """A graph with a missing notify, run without validation: the runtime itself reports the deadlock."""
    g = et.Graph("never")
    n = g.size("n")
    g.input("x", (n,))
    done = g.event("done", (n,))

    @g.task(grid=(1,), notify=lambda i: done[0])  # bug: only element 0 is ever notified
    def a(t, i):
        pass

    @g.task(grid=(n,), wait=lambda i: done[i])
    def b(t, i):
        pass

    with pytest.raises(et.GraphError, match=r"b\(1,\)@rank0 waits on done\[1\] on rank 0, which expects 1 "
                                            r"notifies, but no task notifies it"):
        et.compile(g)
    for schedule in ("static", "dynamic"):
        # validation skipped on purpose (at compile time and at the sizes of the call)
        kernel = CpuKernel(MapTable.build(g.to_ir()), schedule, programs=2, check_sizes=False)
        with pytest.raises(et.DeadlockError, match=r"b\(1,\).* waits on done\[1\]: 0 of 1 notifies"):
            kernel.run([{"x": torch.zeros(3)}])


def test_counters_rearm_without_reset():
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=8, block_n=8))
    for M in (20, 20, 7, 20):  # same shapes twice in a row, then another, then back
        ins = gemm_rs.make_inputs(2, M, 4, 6, seed=M)
        want = gemm_rs.reference([i["x"] for i in ins], [i["w"] for i in ins])
        got = kernel.run(ins, interleave="random", seed=M)
        assert all(rel_err(g["y"], w) < 1e-5 for g, w in zip(got, want))
    counters, bases = kernel._counters_for(
        __import__("etdist.fusion.bind", fromlist=["bind"]).bind(kernel.table, {"M": 20, "K": 4, "N": 6, "WORLD": 2}))
    arrived = counters[0]["arrived"]
    assert int(arrived[0].max()) == 3 * 2  # three launches at M=20, each adding world notifies
    assert (counters[0]["arrived"] == bases[0]["arrived"]).all()


def test_bad_inputs_raise_before_running_and_leave_inputs_untouched():
    kernel = et.compile(gemm_rs.gemm_reduce_scatter())
    ins = gemm_rs.make_inputs(2, 9, 4, 6)
    before = [{k: v.clone() for k, v in d.items()} for d in ins]
    bad_dtype = [dict(ins[0], x=ins[0]["x"].double()), ins[1]]
    with pytest.raises(et.InputError, match=r"input 'x' on rank 0: dtype torch.float64, expected torch.float32"):
        kernel.run(bad_dtype)
    bad_shape = [ins[0], dict(ins[1], w=torch.randn(5, 6))]
    with pytest.raises(et.InputError, match=r"input 'w' on rank 1 has shape \[5, 6\], expected \[4, 6\]"):
        kernel.run(bad_shape)
    with pytest.raises(et.InputError, match=r"missing inputs \['w'\]"):
        kernel.run([{"x": ins[0]["x"]}])
    with pytest.raises(et.InputError, match="on meta; the CPU runtime takes CPU tensors"):
        kernel.run([dict(ins[0], x=ins[0]["x"].to("meta")), ins[1]])
    with pytest.raises(et.InputError, match="one dict of input tensors per rank"):
        kernel.run(ins[0])
    with pytest.raises(et.InputError, match="has no size 'Q'"):
        kernel.run(ins, sizes={"Q": 1})
    with pytest.raises(et.InputError, match="interleave must be one of"):
        kernel.run(ins, interleave="chaos")
    for b, a in zip(before, ins):
        assert all(torch.equal(b[k], a[k]) for k in b)


def test_inputs_by_rank_and_sizes_of_the_wrong_kind():
    """{rank: dict} inputs must name every rank from 0 (KeyError from deep in run() before), sizes=
    must be a dict (AttributeError before); the next good call is right."""
    kernel = et.compile(gemm_rs.gemm_reduce_scatter())
    ins = gemm_rs.make_inputs(2, 9, 4, 6)
    want = gemm_rs.reference([i["x"] for i in ins], [i["w"] for i in ins])
    for bad in ({1: ins[1]}, {0: ins[0], 2: ins[1]}):
        with pytest.raises(et.InputError, match=r"needs inputs for ranks 0\.\.\d; got ranks"):
            kernel.run(bad)
    for bad in ("M", [("M", 9)]):
        with pytest.raises(et.InputError, match="sizes= takes a dict of size name -> int"):
            kernel.run(ins, sizes=bad)
    for got in (kernel.run(ins), kernel.run({0: ins[0], 1: ins[1]})):
        assert all(rel_err(g["y"], w) < 1e-5 for g, w in zip(got, want))


def test_compile_arguments_of_the_wrong_kind():
    with pytest.raises(et.GraphError, match="compile takes an et.Graph"):
        et.compile("gemm_rs")
    with pytest.raises(et.GraphError, match="programs must be a positive int, got True"):
        et.compile(gemm_rs.gemm_reduce_scatter(), programs=True)
    g = gemm_rs.gemm_reduce_scatter()
    with pytest.raises(et.GraphError, match="samples= takes a list of dicts of sizes"):
        et.compile(g, samples={"M": 3, "K": 2, "N": 2})
    for sample, bad in (({"M": -3, "K": 2, "N": 2}, "M=-3"), ({"M": 3, "K": 2, "N": 2, "WORLD": 0}, "WORLD=0")):
        with pytest.raises(et.GraphError, match=f"sizes must be non-negative ints \\(WORLD >= 1\\), got {bad}"):
            et.compile(g, samples=[sample])


def test_missing_size_and_failed_check():
    from etdist.workloads import ag_gemm, moe
    kernel = et.compile(ag_gemm.all_gather_gemm())
    ins = ag_gemm.make_inputs(2, 9, 4, 6)
    with pytest.raises(et.InputError, match=r"sizes \['M'\] are not named by any input's shape; pass sizes="):
        kernel.run(ins)
    kernel = et.compile(moe.moe_layer(), schedule="dynamic")
    ins, _ = moe.make_inputs(2, 4, 8, 4, E=4)
    ins[0]["wg"] = ins[0]["wg"][:, :3]
    ins[1]["wg"] = ins[1]["wg"][:, :3]
    with pytest.raises(et.InputError, match="the number of experts must be world size x experts per rank"):
        kernel.run(ins)


def test_tile_body_error_names_task():
    g = et.Graph("oops")
    n = g.size("n")
    g.input("x", (n,))
    done = g.event("done", (n,))

    @g.task(grid=(n,), notify=lambda i: done[i])
    def a(t, i):
        if i == 2:
            raise ValueError("bad tile")

    @g.task(grid=(n,), wait=lambda i: done[i])
    def b(t, i):
        t.x  # noqa: B018

    with pytest.raises(et.RuntimeFault, match=r"tile body of task a\(2,\)@rank0 raised ValueError: bad tile"):
        et.compile(g).run([{"x": torch.zeros(4)}])


def test_non_symmetric_tensor_is_not_reachable_from_peers():
    g = et.Graph("private")
    g.input("x", (2,))
    done = g.event("done", (g.world,), count=g.world, distributed=True)

    @g.task(grid=(g.world,), notify=lambda d: done[d])
    def a(t, d):
        t.peer(d).x[0] = 1.0

    @g.task(grid=(1,), wait=lambda _: done[g.rank])
    def b(t, _):
        pass

    with pytest.raises(et.RuntimeFault, match="tensor 'x' is not symmetric"):
        et.compile(g).run([{"x": torch.zeros(2)}, {"x": torch.zeros(2)}])


def test_outputs_start_poisoned():
    """An output element no task writes stays NaN, so a missing tile shows up as an error."""
    g = et.Graph("partial_write")
    n = g.size("n")
    g.input("x", (n,))
    g.output("y", (n,))
    done = g.event("done", (1,))

    @g.task(grid=(1,), notify=lambda _: done[0])
    def a(t, _):
        t.y[0] = 1.0

    @g.task(grid=(1,), wait=lambda _: done[0])
    def b(t, _):
        pass

    y = et.compile(g).run([{"x": torch.zeros(3)}])[0]["y"]
    assert y[0] == 1 and torch.isnan(y[1:]).all()


@pytest.mark.parametrize("rezero", [True, False])
def test_zeroed_scratch_starts_zero_and_must_be_left_zero(rezero):
    """A scratch declared zeroed (a counter one task takes and re-zeroes: the one-rank MoE's `fill`)
    starts at zero, not poisoned; a launch whose tasks leave it non-zero raises, naming it."""
    g = et.Graph("take_a_count")
    n = g.size("n")
    g.input("x", (n,))
    g.scratch("count", (1,), torch.int64, zeroed=True)
    g.output("y", (1,))
    counted = g.event("counted", (1,), count=n)

    @g.task(grid=(n,), notify=lambda i: counted[0])
    def add(t, i):
        t.count[0] += int(t.x[i] > 0)

    @g.task(grid=(1,), wait=lambda _: counted[0])
    def take(t, _):
        t.y[0] = float(t.count[0])
        if rezero:
            t.count[0] = 0

    kernel = et.compile(g)
    x = torch.tensor([1.0, -1.0, 2.0, 3.0])
    if rezero:
        assert kernel.run([{"x": x}])[0]["y"].item() == 3
    else:
        with pytest.raises(et.GraphError, match="scratch 'count' is declared zeroed but is not zero after the launch"):
            kernel.run([{"x": x}])


def test_static_programs_run_the_formula():
    from etdist.fusion.schedule_static import StaticSchedule
    s = StaticSchedule(programs=3)
    total = 10
    ran = sorted(t for p in range(3) for t in s.tasks_of(p, total))
    assert ran == list(range(total))
    for t in range(total):
        assert s.task_at(s.program_of(t), s.position_of(t)) == t
    with pytest.raises(ValueError):
        StaticSchedule(0)


def test_trace_records_every_task():
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=8, block_n=8), programs=2)
    kernel.run(gemm_rs.make_inputs(2, 17, 4, 9), trace=True)
    stats = kernel.last_stats
    assert len(stats.trace) == stats.tasks_run
    assert {p for _, p, _, _, _ in stats.trace} == {0, 1}
    assert all(s <= e for *_, s, e in stats.trace)


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_notify_coordinates_read_runtime_tensors(schedule):
    """Task i notifies bucket[dest[i]] (a data-dependent map); bucket b expects hist[b] notifies."""
    g = et.Graph("scatter")
    n, B = g.size("n"), g.size("B")
    dest = g.input("dest", (n,), torch.int64)
    hist = g.input("hist", (B,), torch.int64)
    g.input("x", (n,))
    g.scratch("acc", (n,))
    g.output("y", (B,))
    bucket = g.event("bucket", (B,), count=lambda b: hist[b] + 1)
    started = g.event("started", (B,))

    @g.task(grid=(B,), notify=lambda b: [started[b], bucket[b]])  # the +1: a bucket nobody picks completes
    def open_bucket(t, b):
        pass

    @g.task(grid=(n,), notify=lambda i: bucket[dest[i]])
    def put(t, i):
        t.acc[i] = t.x[i] * 10

    @g.task(grid=(B,), wait=lambda b: [started[b], bucket[b]])
    def total(t, b):
        t.y[b] = t.acc[t.dest == b].sum()

    dest = torch.tensor([2, 0, 2, 2, 1, 0])
    x = torch.arange(6, dtype=torch.float32)
    hist = torch.bincount(dest, minlength=4)
    kernel = et.compile(g, schedule=schedule)
    for seed in range(10):
        y = kernel.run([{"dest": dest, "hist": hist, "x": x}], interleave="random", seed=seed)[0]["y"]
        assert torch.equal(y, torch.tensor([60.0, 40.0, 50.0, 0.0]))
    with pytest.raises(et.DeadlockError, match=r"bucket\[3\]: 1 of 2 notifies"):
        kernel.run([{"dest": dest, "hist": hist + torch.tensor([0, 0, 0, 1]), "x": x}])


@pytest.mark.parametrize("world, programs, seed", [(1, 5, 24), (1, 5, 58), (2, 8, 27)])
def test_moe_waits_for_the_data_its_counts_read(world, programs, seed):
    """Interleavings that once let send_back pass done[e] before plan(e) wrote counts[e]."""
    from etdist.workloads import moe
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=4), schedule="static", programs=programs)
    inputs, (wg, w1, w2) = moe.make_inputs(world, 11, 8, 6, E=2 * world, seed=world, skew=4.0)
    want = moe.reference([i["x"] for i in inputs], wg, w1, w2, top_k=2)
    got = kernel.run(inputs, interleave="random", seed=seed)
    assert all(rel_err(g["y"], w) < 1e-5 for g, w in zip(got, want))


def test_count_read_before_its_data_is_an_error():
    """A static-schedule waiter that polls an element whose count reads a tensor not yet written
    gets an error naming the element, never a silent pass (poisoned memory reads negative)."""
    g = et.Graph("early_count")
    n = g.size("n")
    g.input("x", (n,))
    need = g.scratch("need", (n,), torch.int64)
    ready = g.event("ready", (n,), count=lambda c: need[c])

    @g.task(grid=(n,), notify=lambda i: ready[i])
    def produce(t, i):
        t.need[i] = 1

    @g.task(grid=(n,), wait=lambda i: ready[i])  # nothing orders its first poll after produce's body
    def consume(t, i):
        pass

    kernel = et.compile(g, schedule="static", programs=4)
    outcomes = set()
    for seed in range(30):
        try:
            kernel.run([{"x": torch.zeros(2)}], interleave="random", seed=seed)
            outcomes.add("ok")
        except et.RuntimeFault as e:
            assert "ready[" in str(e) and "read before its data was written" in str(e)
            outcomes.add("error")
    assert outcomes == {"ok", "error"}  # both orders happen, and the early one is caught


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_failed_launch_leaves_no_counts_behind(schedule):
    g = et.Graph("flaky")
    n = g.size("n")
    g.input("x", (n,))
    g.output("y", (n,))
    done = g.event("done", (n,))

    @g.task(grid=(n,), notify=lambda i: done[i])
    def a(t, i):
        if t.x[0] < 0:
            raise ValueError("bad value")

    @g.task(grid=(n,), wait=lambda i: done[i])
    def b(t, i):
        t.y[i] = 2.0

    kernel = et.compile(g, schedule=schedule)
    with pytest.raises(et.RuntimeFault, match="bad value"):
        kernel.run([{"x": -torch.ones(4)}])
    assert torch.equal(kernel.run([{"x": torch.ones(4)}])[0]["y"], torch.full((4,), 2.0))


def test_sizes_must_be_non_negative_ints():
    from etdist.workloads import ag_gemm
    kernel = et.compile(ag_gemm.all_gather_gemm())
    ins = ag_gemm.make_inputs(2, 9, 4, 6)
    for bad in (-5, 6.7, True):
        with pytest.raises(et.InputError, match="size M must be a non-negative int"):
            kernel.run(ins, sizes={"M": bad})


def test_trace_exports_chrome_json(tmp_path):
    import json
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=8, block_n=8), programs=2)
    kernel.run(gemm_rs.make_inputs(2, 17, 4, 9), trace=True)
    path = et.fusion.trace.write_chrome(kernel.last_stats.trace, tmp_path / "t.json")
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == kernel.last_stats.tasks_run
    assert {(e["pid"], e["tid"]) for e in spans} == {(r, p) for r in range(2) for p in range(2)}
    assert {e["name"].split("(")[0] for e in spans} == {"matmul", "reduce"}
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"rank 0", "rank 1", "program 0", "program 1"} <= names
