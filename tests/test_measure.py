"""etdist.bench.measure on CPU: timing, records, shapes, floors, eager baselines (gloo, world 1)."""
import json
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
import yaml

from etdist.bench.measure import baselines as B
from etdist.bench.measure import records as R
from etdist.bench.measure.shapes import ALL_M, MLP_SHAPES, MOE_SHAPES, ag_gemm_dims, gemm_rs_dims
from etdist.bench.measure.timing import slowest_rank, time_alternated, time_batched, time_ranks, time_single

CONF = pathlib.Path(__file__).resolve().parents[1] / "etdist" / "bench" / "conf" / "model"


# ----------------------------------------------------------------------------------------- timing

def test_time_batched_structure_on_cpu():
    calls, events = [], []
    fn = lambda: calls.append(1)  # noqa: E731
    us = time_batched(fn, calls=4, batches=3, warmup=2, barrier=lambda: events.append(len(calls)))
    assert us > 0
    assert len(calls) == 2 + 4 * 3
    assert events == [2]                   # one barrier, after the warm-up, before any batch


def test_batches_are_about_ten_ms_of_calls():
    from etdist.bench.measure.timing import batch_calls
    assert (batch_calls(30), batch_calls(100), batch_calls(1000), batch_calls(9000)) == (200, 100, 10, 3)
    took = {"a": [], "b": []}
    def call(name, s):
        t0 = time.perf_counter()
        time.sleep(s)
        took[name].append((time.perf_counter() - t0) * 1e6)
    fns = {"a": lambda: call("a", 0.001), "b": lambda: call("b", 0.004)}   # each sizes its own batches
    time_alternated(fns, rounds=2, calls=None, batches=2, warmup=0, device="cpu")
    # a warm-up and an estimate call each, then 2 rounds x 2 batches of batch_calls(the estimate):
    # ~10 ms of calls (a loaded machine's sleeps overshoot: the estimate says by how much), each
    # batch within one call of it (the timer adds a little to the estimate the test sees)
    for name in took:
        want = batch_calls(took[name][1])
        assert abs(len(took[name]) - 2 - 2 * 2 * want) <= 2 * 2, (name, len(took[name]), want)
    assert batch_calls(took["a"][1]) > batch_calls(took["b"][1]) or took["a"][1] > took["b"][1] / 2


def test_time_single_and_bad_arguments():
    x = torch.randn(64, 64)
    assert time_single(lambda: x @ x, repeats=3, warmup=1) > 0
    with pytest.raises(ValueError, match="calls >= 1"):
        time_batched(lambda: None, calls=0)


def test_median_not_mean():
    import itertools
    import time
    slow = itertools.chain([0.05], itertools.repeat(0.0))   # first batch is slow, the rest are not
    us = time_batched(lambda: time.sleep(next(slow)), calls=1, batches=5, warmup=0)
    assert us < 20_000


def test_time_alternated_turns_the_order_every_round():
    called = []
    fns = {n: (lambda n=n: called.append(n)) for n in "abc"}
    us = time_alternated(fns, rounds=4, calls=1, batches=1, warmup=0, device="cpu")
    assert list(us) == ["a", "b", "c"] and all(v > 0 for v in us.values())
    assert "".join(called) == "abc" "cba" "bca" "acb"     # turned every two rounds, every second reversed
    called.clear()
    time_alternated(fns, rounds=2, calls=3, batches=2, warmup=1, device="cpu")
    assert called.count("a") == 2 * (1 + 3 * 2)           # per round: warm-up + batches x calls
    called.clear()
    time_alternated(fns, rounds=2, single=True, repeats=3, warmup=0, device="cpu")
    assert called.count("b") == 2 * 3


def test_turns_balance_every_pair_over_an_even_number_of_rounds():
    from etdist.bench.measure.timing import turns
    for n in range(1, 8):
        names = list(range(n))
        for rounds in (2, 4, 6):
            orders = turns(names, rounds)
            assert all(sorted(o) == names for o in orders)
            for a in names:
                slots = [o.index(a) for o in orders]
                assert sum(slots) * 2 == (n - 1) * rounds            # mean slot: the middle one
                for b in names[a + 1:]:
                    first = sum(o.index(a) < o.index(b) for o in orders)
                    assert first * 2 == rounds                       # before b as often as after


def test_time_alternated_takes_the_median_of_every_batch(monkeypatch):
    from etdist.bench.measure import timing
    given = {"a": iter([[1.0], [2.0], [100.0]]), "b": iter([[5.0, 7.0], [6.0, 900.0], [8.0, 9.0]])}
    monkeypatch.setattr(timing, "_per_call", lambda fn, **kw: next(given[fn()]))
    us = time_alternated({"a": lambda: "a", "b": lambda: "b"}, rounds=3, device="cpu")
    assert us == {"a": 2.0, "b": 7.5}     # not a mean (34.3, 155.8), nor one round's


def test_time_alternated_medians_over_every_round():
    import time
    slow = iter([0.05])                        # the first call of "a" only is slow
    us = time_alternated({"a": lambda: time.sleep(next(slow, 0.0)), "b": lambda: None},
                         rounds=5, calls=1, batches=1, warmup=0, device="cpu")
    assert us["a"] < 20_000
    assert time_alternated({}, device="cpu") == {}
    with pytest.raises(ValueError, match="rounds >= 1"):
        time_alternated({"a": lambda: None}, rounds=0)


def test_slowest_rank_without_distributed():
    assert not dist.is_initialized()
    assert slowest_rank(3.5) == 3.5


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_slowest_rank_and_time_ranks_with_gloo(gloo):
    assert slowest_rank(2.25) == 2.25
    assert time_ranks(lambda: None, calls=2, batches=2, warmup=1) > 0
    seen = []
    us = time_alternated({"a": lambda: seen.append(dist.get_world_size()), "b": lambda: None},
                         rounds=2, calls=1, batches=2, warmup=0, device="cpu")
    assert set(us) == {"a", "b"} and seen == [1] * 4


# ---------------------------------------------------------------------------------------- records

def _rec(**kw):
    base = dict(workload="gemm_rs", model="qwen3_8b", M=16, world=2, schedule="static",
                ours_us=30.0, baselines={"graph": 40.6, "eager": 47.2, "mm": 18.5}, floor_us=12.2,
                rel_err=3e-3, device="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0",
                commit="abc1234", date="2026-11-22T10:00:00+00:00")
    base.update(kw)
    return R.Record(**base)


def test_record_schema_is_the_documented_one():
    want = ["workload", "model", "M", "world", "schedule", "ours_us", "baselines", "floor_us",
            "rel_err", "device", "torch", "triton", "commit", "date"]
    assert list(json.loads(_rec().to_json())) == want            # notes left out when None
    assert list(json.loads(_rec(notes="x").to_json())) == want + ["notes"]


def test_records_round_trip(tmp_path):
    path = tmp_path / "results" / "gemm_rs.jsonl"
    recs = [_rec(), _rec(M=128, notes="symm_mem skipped: no CUDA"), _rec(floor_us=None)]
    for r in recs:
        R.append(path, r)
    assert len(path.read_text().splitlines()) == 3
    assert R.load(path) == recs


def test_load_names_line_of_a_bad_record(tmp_path):
    path = tmp_path / "x.jsonl"
    obj = json.loads(_rec().to_json())
    del obj["floor_us"]
    obj["speed"] = 1
    path.write_text(_rec().to_json() + "\n\n" + json.dumps(obj) + "\n")
    with pytest.raises(ValueError, match=r"x.jsonl:3.*missing \['floor_us'\].*unknown \['speed'\]"):
        R.load(path)


def test_newest_per_cell():
    old = _rec(ours_us=1.0, date="2026-11-20T10:00:00+00:00")
    new = _rec(ours_us=2.0, date="2026-11-22T10:00:00+00:00")
    tie = _rec(ours_us=3.0, date="2026-11-22T10:00:00+00:00")     # same date, later in file
    other = _rec(M=128, ours_us=4.0, date="2026-11-01T00:00:00+00:00")
    dynamic = _rec(schedule="dynamic", ours_us=5.0)
    got = R.newest_per_cell([new, old, other, tie, dynamic])
    assert [r.ours_us for r in got] == [3.0, 4.0, 5.0]
    assert [r.ours_us for r in R.newest_per_cell([new, old])] == [2.0]


def test_env_info_and_make_record():
    env = R.env_info()
    assert set(env) == {"device", "torch", "triton", "commit"}
    assert env["torch"] == torch.__version__
    assert env["commit"] == "uncommitted" or len(env["commit"].split("+")[0]) >= 4
    rec = R.make_record(workload="ag_gemm", model="tiny", M=16, world=1, schedule="static",
                        ours_us=1, baselines={"eager": 2}, floor_us=None, rel_err=0.0, env=env)
    assert rec.device == env["device"] and rec.date.endswith("+00:00")
    assert isinstance(rec.ours_us, float) and rec.baselines == {"eager": 2.0}


# ----------------------------------------------------------------------------------------- shapes

def test_moe_shapes_match_conf_model():
    for name, shape in MOE_SHAPES.items():
        conf = yaml.safe_load((CONF / f"{name}.yaml").read_text())
        assert (conf["hidden"], conf["expert_intermediate"], conf["num_experts"], conf["top_k"]) == \
            (shape.hidden, shape.expert_intermediate, shape.num_experts, shape.top_k), name


def test_shapes_match_conf_model():
    for name, shape in MLP_SHAPES.items():
        conf = yaml.safe_load((CONF / f"{name}.yaml").read_text())
        assert conf["name"] == name
        assert (conf["hidden"], conf["intermediate"]) == (shape.hidden, shape.intermediate)
    assert len(MLP_SHAPES) == 8
    assert ALL_M == (16, 128, 1000, 1024, 8192)
    assert gemm_rs_dims("qwen3_8b", 2) == (6144, 4096)
    assert ag_gemm_dims("qwen3_8b", 2) == (4096, 12288)
    with pytest.raises(ValueError, match="world=7"):
        gemm_rs_dims("qwen3_8b", 7)


# ---------------------------------------------------------------------------------------- floors

@pytest.mark.parametrize("model,M,floor", [("qwen3_8b", 16, 12.2), ("qwen3_8b", 8192, 595.4),
                                           ("llama31_70b", 16, 56.6), ("gpt3_175b", 1024, 893.1)])
def test_gemm_rs_floor_matches_baselines_md(model, M, floor):
    s = MLP_SHAPES[model]        # BASELINES.md: copy 4.16 TB/s, mm 692 TF/s, TP=2
    got = B.floor_us(M, s.intermediate, s.hidden, 2, 4.16, 692)
    assert got == pytest.approx(floor, rel=0.01)


def test_floor_sharding_by_workload():
    kw = dict(copy_TBps=4.0, mm_TFps=700.0)
    assert B.floor_us(16, 4096, 8192, 2, **kw, workload="ag_gemm") == \
        B.mm_floor_us(16, 4096, 4096, **kw)
    assert B.floor_us(16, 4096, 8192, 2, **kw, workload="mlp") == \
        B.mm_floor_us(16, 4096, 8192, **kw) + B.mm_floor_us(16, 4096, 4096, **kw)
    with pytest.raises(ValueError):
        B.floor_us(16, 4096, 8192, 2, **kw, workload="moe")


def test_measure_ceilings_small_on_cpu():
    c = B.measure_ceilings("cpu", copy_bytes=1 << 16, mm_size=32, calls=2, batches=2, warmup=1)
    assert c.copy_TBps > 0 and c.mm_TFps > 0


# ------------------------------------------------------------------------------- baselines (CPU)

def test_mm_only_rotates_weights():
    ops = B.random_operands(8, 16, 12, copies=3, device="cpu")
    fn = B.gemm_rs_mm_only(5, 16, 12, operands=ops)
    for i in range(4):
        torch.testing.assert_close(fn().float(), ops.x[:5].float() @ ops.weights[i % 3].float(),
                                   rtol=2e-2, atol=2e-2)
    assert fn().shape == (5, 12)
    assert B.ag_gemm_mm_only(7, 16, 12, copies=2, device="cpu")().shape == (7, 12)
    chunk = B.random_operands(4, 16, 12, copies=3, device="cpu")   # ag_gemm's: one rank's rows of M = 8
    fn = B.ag_gemm_mm_only(8, 16, 12, operands=chunk)
    assert fn().shape == (8, 12)                                   # over M rows (random ones)
    for w in chunk.weights:
        w.zero_()
    assert all(not fn().any() for _ in range(3))                   # with the given weights
    with pytest.raises(ValueError, match="do not hold"):
        B.ag_gemm_mm_only(8, 20, 12, operands=chunk)


def test_padded_rows():
    assert [B.padded_rows(m, 2) for m in (16, 1000, 1001)] == [16, 1000, 1002]
    assert B.padded_rows(1000, 16) == 1008


def test_random_operands_are_random_and_seeded():
    a = B.random_operands(4, 8, 8, copies=2, device="cpu", seed=1)
    b = B.random_operands(4, 8, 8, copies=2, device="cpu", seed=1)
    assert torch.equal(a.x, b.x) and not torch.equal(a.weights[0], a.weights[1])
    assert a.x.dtype == torch.bfloat16 and a.x.abs().sum() > 0


def test_baselines_need_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        B.gemm_rs_eager(16, 8, 8, device="cpu")


def test_eager_baselines_world_one(gloo):
    ops = B.gemm_rs_operands(10, 32, 24, copies=2, device="cpu")
    fn = B.gemm_rs_eager(10, 32, 24, operands=ops, device="cpu")
    for i in range(3):
        torch.testing.assert_close(fn().float(), ops.x.float() @ ops.weights[i % 2].float(),
                                   rtol=2e-2, atol=2e-2)
    ag = B.ag_gemm_operands(10, 32, 24, copies=2, device="cpu")
    fn = B.ag_gemm_eager(10, 32, 24, operands=ag, device="cpu")
    torch.testing.assert_close(fn().float(), ag.x.float() @ ag.weights[0].float(),
                               rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="expected"):
        B.gemm_rs_eager(10, 16, 24, operands=ops, device="cpu")


def test_mlp_baselines_world_one(gloo):
    M, H, I = 10, 32, 24
    ops = B.mlp_operands(M, H, I, copies=2, device="cpu", dtype=torch.float32)
    fn = B.mlp_eager(M, H, I, operands=ops, device="cpu", dtype=torch.float32)
    for i in range(3):
        gu = ops.x @ ops.gate_up[i % 2]
        want = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ ops.down[i % 2]
        torch.testing.assert_close(fn(), want)
    assert B.mlp_mm_only(M, H, I, copies=2, device="cpu")().shape == (M, H)
    res = B.measure_baselines("mlp", M, H, I, device="cpu", graph=False, operands=ops, calls=2,
                              batches=2, warmup=1)
    assert set(res.baselines) == {"mm", "eager"} and "CUDA" in res.skipped["symm_mem"]
    with pytest.raises(ValueError, match="expected"):
        B.mlp_eager(M, H, 2 * I, operands=ops, device="cpu")


def test_symm_mem_skips_with_reason_on_cpu(gloo):
    fn, why = B.gemm_rs_symm_mem(16, 8, 8, device="cpu")
    assert fn is None and "CUDA" in why
    fn, why = B.ag_gemm_symm_mem(16, 8, 8, device="cpu")
    assert fn is None and "CUDA" in why


def test_measure_baselines_on_cpu(gloo):
    res = B.measure_baselines("gemm_rs", 16, 32, 24, device="cpu", graph=False, calls=2,
                              batches=2, warmup=1)
    assert set(res.baselines) == {"mm", "eager"} and all(v > 0 for v in res.baselines.values())
    assert list(res.fns) == ["mm", "eager"] and res.fns["mm"]().shape == (16, 24)
    fns = B.baseline_fns("gemm_rs", 16, 32, 24, device="cpu", graph=False, symm_mem=False)
    assert list(fns.fns) == ["mm", "eager"] and not fns.baselines       # built, not timed
    assert fns.skipped == {"graph": "graph=False", "symm_mem": "symm_mem=False"}
    assert set(res.skipped) == {"graph", "symm_mem"} and "symm_mem skipped" in res.notes()
    res = B.measure_baselines("ag_gemm", 16, 32, 24, device="cpu", graph=False, symm_mem=False,
                              single=True, repeats=2, warmup=1)
    assert res.skipped["symm_mem"] == "symm_mem=False"
    with pytest.raises(ValueError, match="unknown workload"):
        B.measure_baselines("moe", 16, 32, 24)


# ------------------------------------------------------------------------------- baselines (GPU)

@pytest.mark.gpu
def test_graph_baseline_keeps_its_operands_alive(tmp_path):
    """gemm_rs_graph makes operands of its own. It let them go once built: the next capture's
    empty_cache() unmapped them, and the bench's replays faulted (illegal address) once it timed
    its contenders alternately."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        M, K, N = 256, 512, 384
        graph = B.gemm_rs_graph(M, K, N, copies=2)            # its own operands (seed 0)
        a = torch.randn(64, 64, device="cuda")
        with torch.cuda.graph(torch.cuda.CUDAGraph()):        # empty_cache() on entry
            a.mul_(2)
        junk = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(16)]
        ops = B.gemm_rs_operands(M, K, N, copies=2)           # the same seed: the same values
        for i in range(4):
            torch.testing.assert_close(graph(), ops.x @ ops.weights[i % 2])
        torch.cuda.synchronize()
        del junk                                              # held until the replays are done
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_graph_baselines_match_eager_on_gpu(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        ops = B.gemm_rs_operands(1000, 256, 128, copies=2)
        eager, graph = (f(1000, 256, 128, operands=ops) for f in (B.gemm_rs_eager, B.gemm_rs_graph))
        for _ in range(3):
            torch.testing.assert_close(graph(), eager())
        ag = B.ag_gemm_operands(1000, 256, 128, copies=2)
        eager, graph = (f(1000, 256, 128, operands=ag) for f in (B.ag_gemm_eager, B.ag_gemm_graph))
        for _ in range(3):
            torch.testing.assert_close(graph(), eager())
        assert time_batched(graph) > 0
        c = B.measure_ceilings(copy_bytes=1 << 26, mm_size=2048)
        assert c.copy_TBps > 0.1 and c.mm_TFps > 1
        res = B.measure_baselines("gemm_rs", 128, 256, 128)
        assert {"mm", "eager", "graph"} <= set(res.baselines)
        assert "symm_mem" in res.baselines or "symm_mem" in res.skipped
    finally:
        dist.destroy_process_group()


def _two_ranks(rank, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        assert slowest_rank(float(rank + 1)) == 2.0
        M, K, N = 5, 8, 4                                  # ragged: rows padded to 6
        fn = B.gemm_rs_eager(M, K, N, copies=2, device="cpu", dtype=torch.float32)
        mine = [B.random_operands(6, K, N, copies=2, device="cpu", dtype=torch.float32, seed=r)
                for r in range(2)]                         # what gemm_rs_operands gives rank r
        for i in range(3):
            full = sum(o.x @ o.weights[i % 2] for o in mine)
            torch.testing.assert_close(fn(), full[3 * rank: 3 * rank + 3])
        fn = B.ag_gemm_eager(M, K, N, copies=2, device="cpu", dtype=torch.float32)
        shards = [B.random_operands(3, K, N, copies=2, device="cpu", dtype=torch.float32, seed=r)
                  for r in range(2)]
        x = torch.cat([s.x for s in shards])
        torch.testing.assert_close(fn(), x @ shards[rank].weights[0])
        us = time_alternated({"a": lambda: None, "b": lambda: None}, rounds=2, calls=1, batches=1,
                             warmup=0, device="cpu")
        assert list(us) == ["a", "b"]
        with pytest.raises(RuntimeError, match="time different contenders"):   # on both ranks
            time_alternated({f"only on rank {rank}": lambda: None}, device="cpu")
    finally:
        dist.destroy_process_group()


def test_eager_baselines_two_ranks_ragged(tmp_path):
    torch.multiprocessing.spawn(_two_ranks, args=(str(tmp_path / "store"),), nprocs=2)


# ---------------------------------------------------------------------------------------- threads

def test_busy_threads_names_a_spinning_thread():
    import threading

    from etdist.bench.measure.threads import busy_threads
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    def idle():
        stop.wait()

    spinner, sleeper = threading.Thread(target=spin), threading.Thread(target=idle)
    spinner.start()
    sleeper.start()
    try:
        busy = busy_threads(0.5)
    finally:
        stop.set()
        spinner.join()
        sleeper.join()
    assert busy[spinner.native_id][1] > 0.3 and busy[sleeper.native_id][1] < 0.1
