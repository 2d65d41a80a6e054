"""Pinned tasks: under schedule="dynamic", a prefix of the graph dealt out by the static formula
(every program runs its share before it pops the ready queue), the rest queued as before."""
import pytest
import torch
import triton

import etdist as et
from etdist.fusion.bind import MapTable, bind
from etdist.fusion.codegen_triton import generate
from etdist.fusion.ir import early_pushed as ir_early
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


@pytest.mark.parametrize("chains", [True, False], ids=["chains", "pinned-only"])
def test_moe_router_chain_is_pinned_and_walked_before_the_queue(chains):
    """nn.MoE's logits -> route -> dispatch -> plan -> tile_table run at every routing: the static
    formula walks them (spinning waits), then programs pop the expert tasks, then walk the tail
    (send_back, combine). Events that only pinned, early-pushed or tail tasks wait on are plain
    notifies; those a queued task waits on release consumers. chains (early_push=2, nn.MoE's): the
    down tiles are early-pushed behind the gate/up tiles, so act_ready no longer releases anything."""
    ir = moe.moe_layer(top_k=8, block_m=64, dtype=torch.bfloat16, max_experts=128, block=64, block_n=128,
                       align=16).to_ir()
    assert [t.name for t in ir.tasks if t.pinned] == ["logits", "route", "dispatch", "plan", "tile_table"]
    assert [t.name for t in ir.tasks if t.tail] == ["send_back", "combine"]
    early = ir_early(ir, chains=chains)
    src = generate(ir, dynamic=True, early=early)
    if not chains:
        assert src == generate(ir, dynamic=True)   # generate's default (early_push=1)
    walk = src.index("for _et_gid in range(_et_pid, _et_end4, NUM_PROGRAMS):")
    pop = src.index("while _et_more != 0:")
    last = src.index("for _et_gid in range(_et_end6 + _et_pid, _et_end8, NUM_PROGRAMS):")
    assert walk < pop < last and "_et_push" not in src   # the seeded tasks are read, not pushed
    assert "_et_take(rq, _et_claimed, rq_q, _et_limit, rq_init, rq_ninit, rq_seed_base, rq_total," in src
    pinned, queued, after = src[walk:pop], src[pop:last], src[last:]
    sections = {"logits": pinned, "route": pinned, "dispatch": pinned, "plan": pinned, "tile_table": pinned,
                "gate_up": queued, "down": queued, "send_back": after, "combine": after}
    for name, where in sections.items():
        assert sum(f"_et_body_{name}(" in x for x in (pinned, queued, after)) == 1 and f"_et_body_{name}(" in where
    # gate_up is early-pushed (it waits on tiled alone) and spins on it; with chains, down too (it
    # waits on act_ready, which only gate_up notifies); send_back never (done's count reads ntiles)
    assert early == ({"gate_up", "down"} if chains else {"gate_up"})
    acts = 0 if chains else 1   # act_ready: released by gate_up's notify unless down is early
    # tiled, done and returned are waited in the tail: plain notifies
    assert pinned.count("_et_notify(") == 6 and pinned.count("_et_release(") == 0
    assert queued.count("_et_notify(") == 2 - acts and queued.count("_et_release(") == acts
    assert after.count("_et_notify(") == 1 and after.count("_et_release(") == 0 and "_et_wait(" in after
    assert "_et_wait(" in pinned


@triton.jit
def _noop():
    pass


def _sized(name: str, extra: int = 0):
    """The start the graphs below share: a (pinned) writes how many of x are positive into live[0]
    and notifies `sized`; `ran` completes after live[0] + extra notifies (a count read from a tensor).
    Returns the graph, n, live, sized and ran."""
    g = et.Graph(name)
    n = g.size("n")
    g.input("x", (n,))
    live = g.scratch("live", (1,), torch.int64)
    g.scratch("y", (n,))
    sized, ran = g.event("sized", (1,)), g.event("ran", (1,), count=lambda _: live[0] + extra)

    @g.task(grid=(1,), notify=lambda _: sized[0], pinned=True, triton=_noop)
    def a(t, _):
        t.live[0] = (t.x > 0).sum()
    return g, n, live, sized, ran


def _early_graph(extra: int = 0):
    """a (pinned) writes how many of b's tasks exist and notifies `sized`; b waits only on that (so it
    is early-pushed) and exists where i < live[0]: its `when` reads what a wrote; c waits on `ran`,
    which the live b tasks complete (released by the walk). extra: `ran` waits for that many more
    notifies than ever come (a deadlock)."""
    g, n, live, sized, ran = _sized("early_push", extra)
    g.output("z", (n,))

    @g.task(grid=(n,), wait=lambda i: sized[0], notify=lambda i: ran[0], when=lambda i: i < live[0], triton=_noop)
    def b(t, i):
        t.y[i] = 2 * t.x[i]

    @g.task(grid=(n,), wait=lambda i: ran[0], when=lambda i: i < live[0], triton=_noop)
    def c(t, i):
        t.z[i] = t.y[i] + 1
    return g


def _pinned_count_graph():
    """a (pinned) writes live[0]; p (pinned) notifies `ran` once per live task, a count read from
    live; u waits on `ran` alone, which only pinned tasks notify, yet is not early-pushed: queued at
    the start it would read ran's count before a wrote it (found by review)."""
    g, n, live, sized, ran = _sized("early_reads_count")
    g.output("z", (1,))

    @g.task(grid=(n,), wait=lambda i: sized[0], notify=lambda i: ran[0], when=lambda i: i < live[0], pinned=True,
            triton=_noop)
    def p(t, i):
        t.y[i] = 2 * t.x[i]

    @g.task(grid=(1,), wait=lambda _: ran[0], triton=_noop)
    def u(t, _):
        t.z[0] = t.y[:int(t.live[0])].sum()
    return g


def test_tasks_waiting_only_on_pinned_work_are_pushed_at_launch():
    """ir.early_pushed: b waits on `sized` alone, which only pinned a notifies, so it starts in the
    queue behind the tasks that wait on nothing and is left out of the release walk; c waits on
    `ran`, which b notifies: released as before."""
    g = _early_graph()
    ir = g.to_ir()
    assert ir_early(ir) == {"b"}
    assert ir_early(_chain(pin_b=False).to_ir()) == {"b"}    # b waits on pinned a's ya; c on b's yb
    assert ir_early(_chain().to_ir()) == {"c"}               # b pinned too: c waits on pinned work
    b = bind(MapTable.build(ir), {"n": 4, "RANK": 0, "WORLD": 1})
    plan = release_plan(b, 0, ir_early(ir))
    assert plan.initial == [] and plan.early == [1, 2, 3, 4] and plan.seeded == [1, 2, 3, 4]
    assert plan.consumers == {("ran", (0,)): [5, 6, 7, 8]}    # `sized` walks nothing now
    old = release_plan(b, 0)   # without early push: b released by a's notify
    assert old.early == [] and old.consumers[("sized", (0,))] == [1, 2, 3, 4]
    src = generate(ir, dynamic=True)
    assert src.count("_et_release(") == 1 and "_et_body_a(" in src       # b's notify of ran: released
    assert src.count("_et_release(") == generate(ir, dynamic=True, early=frozenset()).count("_et_release(") - 1


@pytest.mark.parametrize("early", ["1", "0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_early_pushed_tasks_wait_and_read_their_when_after_the_wait(early, seed):
    """Queued before `a` ran, b's tasks must spin on `sized`, then decide whether they exist from the
    count a wrote (scratch starts poisoned: read earlier, it would be garbage). Off by the knob, the
    walk releases them as before; the answers agree."""
    kernel = et.compile(_early_graph(), schedule="dynamic", programs=3, early_push=int(early))
    assert kernel.early == (frozenset({"b"}) if early == "1" else frozenset())
    x = torch.randn(9)
    x[:3] = x[:3].abs() + 0.1                    # at least three live tasks of b and c
    live = int((x > 0).sum())
    for launch in range(2):                      # counters re-armed: a second launch
        out = kernel.run([{"x": x}], interleave="random", seed=seed + 10 * launch)
        torch.testing.assert_close(out[0]["z"][:live], 2 * x[:live] + 1)
        assert torch.isnan(out[0]["z"][live:]).all()     # tasks that do not exist wrote nothing
        assert kernel.last_stats.tasks_run == 1 + 2 * live
        assert kernel.last_stats.tasks_skipped == 2 * (9 - live)


def _behind_released_graph():
    """a (pinned) writes live[0]; b and b2 wait on a (early-pushed); b notifies `ran`, whose count
    reads live, b2 `bd`; c waits on `ran` (so it is released, never early) and notifies `cd`; d
    waits on c's `cd`, e on b2's `bd`. With early push's chains e is seeded behind b2, d is not:
    seeded ahead of c (which is pushed later), d could hold every program spinning on it."""
    g, n, live, sized, ran = _sized("behind_released")
    g.scratch("u", (n,))
    g.scratch("v", (n,))
    g.output("z", (n,))
    g.output("w", (n,))
    bd, cd = g.event("bd", (n,)), g.event("cd", (n,))

    @g.task(grid=(n,), wait=lambda i: sized[0], notify=lambda i: ran[0], when=lambda i: i < live[0], triton=_noop)
    def b(t, i):
        t.y[i] = 2 * t.x[i]

    @g.task(grid=(n,), wait=lambda i: sized[0], notify=lambda i: bd[i], triton=_noop)
    def b2(t, i):
        t.v[i] = 3 * t.x[i]

    @g.task(grid=(n,), wait=lambda i: ran[0], notify=lambda i: cd[i], triton=_noop)
    def c(t, i):
        t.u[i] = t.y[:int(t.live[0])].sum() + i

    @g.task(grid=(n,), wait=lambda i: cd[n - 1 - i], triton=_noop)
    def d(t, i):
        t.z[i] = t.u[t.n - 1 - i]

    @g.task(grid=(n,), wait=lambda i: bd[i], triton=_noop)
    def e(t, i):
        t.w[i] = t.v[i] + 1
    return g


def test_early_push_chains_stop_at_released_tasks():
    ir = _behind_released_graph().to_ir()
    assert ir_early(ir) == {"b", "b2"} and ir_early(ir, chains=True) == {"b", "b2", "e"}
    x = torch.randn(7)
    x[:2] = x[:2].abs() + 0.1
    live = int((x > 0).sum())
    total = x[:live].mul(2).sum()
    for level in (0, 1, 2):
        kernel = et.compile(ir, schedule="dynamic", programs=2, early_push=level)
        assert kernel.early == [frozenset(), {"b", "b2"}, {"b", "b2", "e"}][level]
        for seed in range(4):
            out = kernel.run([{"x": x}], interleave="random", seed=seed)
            torch.testing.assert_close(out[0]["z"], total + torch.arange(7.0).flip(0))
            torch.testing.assert_close(out[0]["w"], 3 * x + 1)
    # d seeded (what a rule without the order would do): two programs claim d's tasks ahead of c's
    # and spin on them, and no program is left to run c
    kernel = et.compile(ir, schedule="dynamic", programs=2, early_push=2)
    kernel.early = frozenset({"b", "b2", "d", "e"})
    with pytest.raises(et.DeadlockError):
        kernel.run([{"x": x}], interleave="round_robin", seed=0)


def test_early_push_level_is_checked():
    with pytest.raises(et.GraphError, match=r"early_push must be one of \(0, 1, 2\), got 3"):
        et.compile(_early_graph(), schedule="dynamic", early_push=3)



def test_a_task_waiting_on_a_count_read_from_a_tensor_is_not_pushed_early():
    ir = _pinned_count_graph().to_ir()
    assert ir_early(ir) == frozenset()
    kernel = et.compile(ir, schedule="dynamic", programs=4)
    x = -torch.rand(9) - 0.1
    x[[0, 4]] = 1.0                              # two live tasks
    for seed in range(20):                       # early-pushed, 9 of 20 seeds read the count first
        out = kernel.run([{"x": x}], interleave="random", seed=seed)
        torch.testing.assert_close(out[0]["z"][0], 2 * x[:2].sum())


def test_a_deadlock_names_the_stuck_tasks_not_the_early_pushed_ones():
    """Early-pushed tasks are never released, so they have nothing pending: the report lists the
    task that is stuck (c, waiting on a count that never completes), not b's that ran."""
    kernel = et.compile(_early_graph(extra=1), schedule="dynamic", programs=3)
    x = torch.randn(9)
    x[:3] = x[:3].abs() + 0.1
    with pytest.raises(et.DeadlockError) as err:
        kernel.run([{"x": x}], interleave="random", seed=0)
    assert "c(0,) never released: waits on ran[0]" in str(err.value) and "b(" not in str(err.value)
