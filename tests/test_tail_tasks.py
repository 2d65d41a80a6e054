"""Tail tasks: under schedule="dynamic", a suffix of the graph dealt out by the static formula once
a program finds the ready queue drained (TaskSpec.tail), where its tasks spin on their waits instead
of each waiting for a queue hop."""
import pytest
import torch
import triton

import etdist as et
from etdist.fusion.bind import MapTable, bind
from etdist.fusion.codegen_triton import generate
from etdist.fusion.ir import early_pushed
from etdist.fusion.schedule_dynamic import release_plan


@triton.jit
def _noop():
    pass


def _chain(tail_c: bool = True, tail_d: bool = True, pin_a: bool = False):
    """a -> b -> c -> d over n elements; d[i] reads c's element n-1-i (another program's):
    z = 3 * y[::-1] - y with y = 2x + 1 (_want)."""
    g = et.Graph("tail_chain")
    n = g.size("n")
    g.input("x", (n,))
    g.scratch("y", (n,))
    g.scratch("u", (n,))
    g.output("z", (n,))
    ya, yb, yc = g.event("ya", (n,)), g.event("yb", (n,)), g.event("yc", (n,))

    @g.task(grid=(n,), notify=lambda i: ya[i], pinned=pin_a, triton=_noop)
    def a(t, i):
        t.y[i] = 2 * t.x[i]

    @g.task(grid=(n,), wait=lambda i: ya[i], notify=lambda i: yb[i], triton=_noop)
    def b(t, i):
        t.y[i] = t.y[i] + 1

    @g.task(grid=(n,), wait=lambda i: yb[i], notify=lambda i: yc[i], tail=tail_c, triton=_noop)
    def c(t, i):
        t.u[i] = 3 * t.y[i]

    @g.task(grid=(n,), wait=lambda i: yc[n - 1 - i], tail=tail_d, triton=_noop)
    def d(t, i):
        t.z[i] = t.u[t.n - 1 - i] - t.y[i]
    return g


def _want(x):
    y = 2 * x + 1
    return 3 * y.flip(0) - y


def test_tail_tasks_are_declared_last_and_nothing_else_waits_on_them():
    with pytest.raises(et.GraphError, match=r"tail tasks \['c'\] are declared before the task 'd', which is not"):
        _chain(tail_c=True, tail_d=False).to_ir()
    g = et.Graph("both")
    g.input("x", (1,))
    g.task(grid=(1,), pinned=True, tail=True, name="first")(lambda t, i: None)
    with pytest.raises(et.GraphError, match=r"tasks \['first'\] are both pinned and tail"):
        g.to_ir()
    g = et.Graph("waits_on_tail")
    g.input("x", (1,))
    e, f = g.event("e", (1,)), g.event("f", (1,))
    g.task(grid=(1,), notify=lambda i: e[0], name="first")(lambda t, i: None)
    g.task(grid=(1,), wait=lambda i: f[0], name="second")(lambda t, i: None)
    g.task(grid=(1,), wait=lambda i: e[0], notify=lambda i: f[0], tail=True, name="third")(lambda t, i: None)
    with pytest.raises(et.GraphError, match="task 'second' waits on 'f', which the tail task 'third' notifies"):
        g.to_ir()


def test_a_tail_task_waiting_on_a_later_one_is_refused():
    """The tail spins as the static schedule does: a wait on a later tail task is refused at
    compile time (it would deadlock on one program), as under "static"."""
    with pytest.raises(et.GraphError, match=r"tail task: d\(0,\)@rank0 waits on yc\[1\], notified by c\(1,\)@rank0, "
                                            r"which comes later.*take the waiter out of the tail"):
        et.compile(_backwards_tail(), schedule="dynamic")
    et.compile(_chain(), schedule="dynamic")   # producers first: fine


def _backwards_tail():
    """c and d of _chain with d declared first: d(0) waits on c(1), a later tail task."""
    g = et.Graph("tail_order")
    n = g.size("n")
    g.input("x", (n,))
    yc = g.event("yc", (n,))
    g.task(grid=(n,), wait=lambda i: yc[n - 1 - i], tail=True, name="d")(lambda t, i: None)
    g.task(grid=(n,), notify=lambda i: yc[i], tail=True, name="c")(lambda t, i: None)
    g.sample(n=2)
    return g


def test_release_plan_leaves_tail_tasks_out_of_the_queue():
    b = bind(MapTable.build(_chain().to_ir()), {"n": 5, "RANK": 0, "WORLD": 1})
    plan = release_plan(b, 0)
    assert (b.pinned, b.tail, b.total) == (0, 10, 20)                   # a, b queued; c, d the tail
    assert plan.initial == list(range(5))                                # a waits on nothing
    assert plan.consumers == {("ya", (i,)): [5 + i] for i in range(5)}  # yb and yc: waited in the tail only
    src = generate(_chain().to_ir(), dynamic=True)
    walk = src.index("for _et_gid in range(_et_end1 + _et_pid, _et_end3, NUM_PROGRAMS):")
    assert src.index("while _et_more != 0:") < walk
    assert src[walk:].count("_et_wait(") == 2 and src.count("_et_release(") == 1   # a's notify releases b
    # early push's chains (early_push=2): b waits only on a, which waits on nothing, so b is
    # seeded behind it and nothing is released
    early = early_pushed(_chain().to_ir(), chains=True)
    assert early == {"b"} and early_pushed(_chain().to_ir()) == frozenset()
    assert release_plan(b, 0, early).seeded == list(range(10))
    assert generate(_chain().to_ir(), dynamic=True, early=early).count("_et_release(") == 0


@pytest.mark.parametrize("interleave", ["round_robin", "random"])
@pytest.mark.parametrize("pin_a", [False, True])
def test_cpu_runtime_runs_the_tail_on_its_static_programs(interleave, pin_a):
    kernel = et.compile(_chain(pin_a=pin_a), schedule="dynamic", programs=3)
    x = torch.randn(7)
    for seed in (1, 2):   # counters re-armed: a second launch
        out = kernel.run([{"x": x}], interleave=interleave, seed=seed, trace=True)
        torch.testing.assert_close(out[0]["z"], _want(x))
        placed = {label: p for _, p, label, _, _ in kernel.last_stats.trace}
        for i in range(7):   # c: ids 14..20, d: ids 21..27, each tail task k on program k % 3
            assert placed[f"c({i},)@rank0"] == i % 3 and placed[f"d({i},)@rank0"] == (7 + i) % 3
        assert kernel.last_stats.tasks_run == 28


def test_static_schedule_ignores_the_tail_flag():
    """Under "static" the formula walks every task in id order anyway: the same kernel source."""
    sources = {generate(_chain(*tails).to_ir()) for tails in ((True, True), (False, True), (False, False))}
    assert len(sources) == 1
    x = torch.randn(6)
    out = et.compile(_chain(), schedule="static", programs=2).run([{"x": x}], interleave="random", seed=3)
    torch.testing.assert_close(out[0]["z"], _want(x))


def test_a_program_reaches_the_tail_once_every_queued_task_is_claimed_not_run():
    """As on the GPU, a program claims a queue index before its task is pushed; the program whose
    claim passes the last index goes on to the tail while earlier claims still wait. Here a -> b ->
    c are queued (one index each) and the tail task t waits on nothing: on 4 programs, program 0
    claims past the queue once it ran a, and starts t (its static share) before c starts (counting
    a program out of the queue only when every queued task had been popped, t started after c)."""
    g = et.Graph("tail_early")
    g.input("x", (1,))
    g.output("z", (1,))
    ea, eb = g.event("ea", (1,)), g.event("eb", (1,))
    g.task(grid=(1,), notify=lambda i: ea[0], name="a")(lambda t, i: None)
    g.task(grid=(1,), wait=lambda i: ea[0], notify=lambda i: eb[0], name="b")(lambda t, i: None)
    g.task(grid=(1,), wait=lambda i: eb[0], name="c")(lambda t, i: None)

    @g.task(grid=(1,), tail=True)
    def t(t, i):
        t.z[0] = t.x[0]
    kernel = et.compile(g, schedule="dynamic", programs=4)
    out = kernel.run([{"x": torch.ones(1)}], interleave="round_robin", trace=True)
    assert out[0]["z"].item() == 1.0
    start = {label: (p, s) for _, p, label, s, _ in kernel.last_stats.trace}
    assert start["t(0,)@rank0"][0] == 0 and start["t(0,)@rank0"][1] < start["c(0,)@rank0"][1]


def test_a_tail_task_may_not_first_wait_on_a_count_read_from_a_tensor():
    """It may start before the queued task that writes the count has run (found by review)."""
    def graph(guarded):
        g = et.Graph("tail_count")
        g.input("x", (4,))
        n = g.scratch("n", (1,), torch.int64)
        w = g.event("w", (1,))
        done = g.event("done", (1,), count=lambda _: n[0])
        g.task(grid=(1,), notify=lambda i: w[0], name="writer")(lambda t, i: None)
        g.task(grid=(4,), wait=lambda i: w[0], when=lambda i: i < n[0], notify=lambda i: done[0],
               name="work")(lambda t, i: None)
        g.task(grid=(1,), wait=lambda i: [w[0], done[0]] if guarded else done[0], tail=True,
               name="fin")(lambda t, i: None)
        return g
    with pytest.raises(et.GraphError, match="tail task 'fin' first waits on 'done', whose count reads a tensor"):
        graph(False).to_ir()
    graph(True).to_ir()
