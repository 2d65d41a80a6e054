"""Pinned tasks: under schedule="dynamic", a prefix of the graph dealt out by the static formula
(every program runs its share before it pops the ready queue), the rest queued as before."""
import pytest
import torch

import etdist as et
from etdist.fusion.bind import MapTable, bind
from etdist.fusion.codegen_triton import generate
from etdist.fusion.schedule_dynamic import release_plan
from etdist.workloads import moe


def _chain(pin_b: bool = True, pin_c: bool = False):
    """a (pinned) -> b -> c over n elements: c[i] = 2 * x[i] + 1, each step's event per element."""
    g = et.Graph("pinned_chain")
    n = g.size("n")
    g.input("x", (n,))
    g.scratch("y", (n,))
    g.output("z", (n,))
    ya, yb = g.event("ya", (n,)), g.event("yb", (n,))

    @g.task(grid=(n,), notify=lambda i: ya[i], pinned=True)
    def a(t, i):
        t.y[i] = 2 * t.x[i]

    @g.task(grid=(n,), wait=lambda i: ya[i], notify=lambda i: yb[i], pinned=pin_b)
    def b(t, i):
        t.y[i] = t.y[i] + 1

    @g.task(grid=(n,), wait=lambda i: yb[i], pinned=pin_c)
    def c(t, i):
        t.z[i] = t.y[i]
    return g


def _one_task_functions(name: str, *specs):
    """A graph of one-task functions first, second, ... over events e and f; each spec is (the event
    it waits on, the event it notifies, pinned), "" for none."""
    g = et.Graph(name)
    g.input("x", (4,))
    events = {"e": g.event("e", (1,)), "f": g.event("f", (1,))}
    for label, (waits, notifies, pinned) in zip(("first", "second", "third"), specs):
        g.task(grid=(1,), wait=(lambda i, n=waits: events[n][0]) if waits else None,
               notify=(lambda i, n=notifies: events[n][0]) if notifies else None,
               pinned=pinned, name=label)(lambda t, i: None)
    return g


def test_pinned_tasks_are_declared_first_and_wait_only_on_pinned_notifiers():
    with pytest.raises(et.GraphError, match=r"pinned tasks \['c'\] are declared after the unpinned task 'b'"):
        _chain(pin_b=False, pin_c=True).to_ir()
    g = _one_task_functions("pinned_waits_on_queued", ("f", "e", True), ("e", "f", False))
    with pytest.raises(et.GraphError,
                       match="pinned task 'first' waits on 'f', which the unpinned task 'second' notifies"):
        g.to_ir()


def test_a_pinned_task_waiting_on_a_later_one_is_refused():
    """The pinned prefix spins as the static schedule does: a wait on a later pinned task (found by
    review: it compiled, then deadlocked) is refused at compile time, as under "static"."""
    g = _one_task_functions("pinned_backwards", ("e", "f", True), ("", "e", True), ("f", "", False))
    with pytest.raises(et.GraphError, match=r"pinned task: first\(0,\)@rank0 waits on e\[0\], notified by "
                                            r"second\(0,\)@rank0, which comes later"):
        et.compile(g, schedule="dynamic")
    et.compile(_chain(), schedule="dynamic")   # producers first: fine


def test_release_plan_leaves_pinned_tasks_out_of_the_queue():
    b = bind(MapTable.build(_chain().to_ir()), {"n": 5, "RANK": 0, "WORLD": 1})
    plan = release_plan(b, 0)
    assert b.pinned == 10                                      # a and b: ids 0..9
    assert plan.initial == []                                  # c waits; a is pinned, not seeded
    assert plan.consumers == {("yb", (i,)): [10 + i] for i in range(5)}   # ya's consumers are pinned
    assert all(w == 0 for w in plan.waits[:10]) and plan.waits[10:] == [1] * 5


@pytest.mark.parametrize("interleave", ["round_robin", "random"])
def test_cpu_runtime_runs_the_pinned_prefix_on_its_static_programs(interleave):
    kernel = et.compile(_chain(), schedule="dynamic", programs=3)
    x = torch.randn(7)
    out = kernel.run([{"x": x}], interleave=interleave, seed=1, trace=True)
    torch.testing.assert_close(out[0]["z"], 2 * x + 1)
    placed = {label: p for _, p, label, _, _ in kernel.last_stats.trace}
    for i in range(7):   # a: ids 0..6, b: ids 7..13, each on program id % 3
        assert placed[f"a({i},)@rank0"] == i % 3 and placed[f"b({i},)@rank0"] == (7 + i) % 3
    assert kernel.last_stats.tasks_run == 21
    out = kernel.run([{"x": x}], interleave=interleave, seed=2)   # counters re-armed: a second launch
    torch.testing.assert_close(out[0]["z"], 2 * x + 1)


def test_moe_router_chain_is_pinned_and_walked_before_the_queue():
    """nn.MoE's logits -> route -> dispatch -> plan -> tile_table run at every routing: the static
    formula walks them (spinning waits), then programs pop the expert tasks. Events that only
    pinned tasks wait on are plain notifies; those a queued task waits on release consumers."""
    ir = moe.moe_layer(top_k=8, block_m=64, dtype=torch.bfloat16, max_experts=128, block=64, block_n=128,
                       align=16).to_ir()
    assert [t.name for t in ir.tasks if t.pinned] == ["logits", "route", "dispatch", "plan", "tile_table"]
    src = generate(ir, dynamic=True)
    walk = src.index("for _et_gid in range(_et_pid, _et_end4, NUM_PROGRAMS):")
    pop = src.index("while _et_more != 0:")
    assert src.index("_et_push(rq, tl.load(rq + rq_init") < walk < pop   # seeded, walked, popped
    pinned, queued = src[walk:pop], src[pop:]
    for name in ("logits", "route", "dispatch", "plan", "tile_table"):
        assert f"_et_body_{name}(" in pinned and f"_et_body_{name}(" not in queued
    for name in ("gate_up", "down", "send_back", "combine"):
        assert f"_et_body_{name}(" in queued and f"_et_body_{name}(" not in pinned
    # scored, routed, dispatched, planned: plain; tiled and done (gate_up, send_back wait): released
    assert pinned.count("_et_notify(") == 4 and pinned.count("_et_release(") == 2
    assert queued.count("_et_notify(") == 0 and queued.count("_et_release(") == 3
    assert "_et_wait(" in pinned
