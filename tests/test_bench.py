"""The Hydra configs compose, bad overrides fail at compose time, and the main command runs."""
import pathlib
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from etdist import bench
from etdist.config import ScheduleName, WorkloadName

CONF = str(pathlib.Path(__file__).resolve().parents[1] / "conf")
MODELS = sorted(p.stem for p in (pathlib.Path(CONF) / "model").glob("*.yaml"))


def cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("model", MODELS)
def test_every_model_composes(model):
    c = cfg(f"model={model}")
    assert c.model.name == model and c.model.hidden > 0 and c.model.intermediate > 0


@pytest.mark.parametrize("group,option", [("workload", w) for w in ("gemm_rs", "ag_gemm", "mlp", "mlp_replicated", "moe", "collectives", "all")]
                         + [("schedule", s) for s in ("static", "dynamic", "both")]
                         + [("mesh", m) for m in ("auto", "cpu", "nvshmem")] + [("bench", b) for b in ("cpu", "gpu", "gpu_moe")])
def test_every_group_option_composes(group, option):
    c = cfg(f"{group}={option}")
    OmegaConf.to_container(c, resolve=True, throw_on_missing=True)


def test_enums_parse():
    c = cfg("workload=moe", "schedule=dynamic")
    assert list(c.workload.names) == [WorkloadName.moe]
    assert list(c.schedule.names) == [ScheduleName.dynamic]


@pytest.mark.parametrize("bad", ["model=no_such_model", "bench.programs=many", "schedule.names=[greedy]",
                                 "workload.names=[conv]", "bench.typo=1"])
def test_bad_overrides_fail_at_compose(bad):
    with pytest.raises(Exception) as err:
        cfg(bad)
    text = f"{err.value} {err.value.__cause__}"
    value = bad.split("=")[1].strip("[]")
    assert value in text or "no_such_model" in text or "typo" in text, text


@pytest.mark.parametrize("bad, message", [
    ("bench.tokens=[-3]", r"bench.tokens=\[-3\]: token counts must be >= 1"),   # was torch's negative-dimension error
    ("bench.tokens=[0,1]", r"bench.tokens=\[0, 1\]: token counts must be >= 1"),  # was ZeroDivisionError in the plots
    ("mesh.worlds=[0]", r"mesh.worlds=\[0\]: world sizes must be >= 1"),          # was ZeroDivisionError
    ("mesh.worlds=[-2]", r"mesh.worlds=\[-2\]: world sizes must be >= 1"),        # was AttributeError
    ("bench.interleavings=0", "bench.interleavings=0: must be >= 1"),            # was AttributeError on None
    ("bench.programs=0", "bench.programs=0: must be >= 1"),
    ("bench.block_m=0", "bench.block_m=0: must be >= 1"),                        # was a ValueError from an index map
    ("model.hidden=-5", "model.hidden=-5: must be >= 1"),
    ("model.top_k=0", "model.top_k=0: must be between 1 and model.num_experts=8"),  # was a tile body's reshape error
    ("model.expert_intermediate=0", "model.expert_intermediate=0: must be >= 1"),   # was a DeadlockError
])
def test_bad_values_fail_before_any_cell_runs(bad, message, monkeypatch):
    monkeypatch.setattr(bench, "cells", lambda cfg: pytest.fail("a cell was planned"))
    with pytest.raises(SystemExit, match=message):
        bench.run(cfg(bad, "mesh.worlds=[1]" if "mesh.worlds" not in bad else "bench.seed=0"))


def test_run_returns_accurate_rows():
    rows = bench.run(cfg("mesh.worlds=[1,2]", "bench.tokens=[9]", "bench.interleavings=2"))
    assert {r.workload for r in rows} == {"gemm_rs", "ag_gemm", "mlp", "mlp_replicated", "moe", "collectives"}
    assert {r.schedule for r in rows} == {"static", "dynamic"}
    assert len(rows) == 6 * 2 * 2
    assert all(r.max_rel_err < 1e-5 and r.tasks > 0 for r in rows)


def test_dense_models_skip_moe_cells():
    rows = list(bench.cells(cfg("model=qwen3_8b", "mesh.worlds=[2]")))
    assert rows and all(name != "moe" for name, *_ in rows)


def test_cells_left_out_are_named_with_the_reason():
    """mesh.worlds=[3] ran its 8 rows and the MoE ones vanished without a word."""
    assert bench.skipped_cells(cfg("mesh.worlds=[2,3]")) == [
        "moe at 3 ranks: 8 experts do not split over 3 ranks (the expert count must be a multiple of the world size)"]
    assert bench.skipped_cells(cfg("model=qwen3_8b")) == ["moe: model 'qwen3_8b' is dense (no experts)"]
    assert bench.skipped_cells(cfg("mesh.worlds=[1,2]")) == []
    with pytest.raises(SystemExit, match="skipped moe at 3 ranks: 8 experts do not split"):
        bench.run(cfg("workload=moe", "mesh.worlds=[3]"))


def test_main_command_prints_the_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "etdist.bench", "mesh.worlds=[1,2]", "bench.interleavings=1",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for word in ("gemm_rs", "ag_gemm", "mlp", "mlp_replicated", "moe", "collectives", "static", "dynamic", "max rel err", "wall ms"):
        assert word in out.stdout
    lines = [line for f in (tmp_path / "results").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(lines) == 24  # 6 workloads x 2 schedules x 2 worlds, docs/design.md's records
    report = (tmp_path / "report.md").read_text()
    assert "### moe" in report and "from results/<workload>.jsonl" in report
    assert "A correctness run: simulated ranks" in report and "(vs the float64 reference, eager)" in report


def test_results_dir_takes_the_cpu_records_too(tmp_path):
    """bench.results_dir was honoured on GPUs only; the CPU run ignored it silently. CPU records go
    to its cpu/ folder: in the folder itself they would replace GPU records' cells in a report."""
    out = subprocess.run([sys.executable, "-m", "etdist.bench", "mesh.worlds=[1]", "bench.interleavings=1",
                          "workload=gemm_rs", f"bench.results_dir={tmp_path / 'also'}", f"hydra.run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "also" / "cpu" / "gemm_rs.jsonl").read_text() == \
        (tmp_path / "run" / "results" / "gemm_rs.jsonl").read_text()
    assert not list((tmp_path / "also").glob("*.jsonl"))


def test_gpu_plan_runs_what_gpus_have_and_names_the_rest():
    from etdist import bench_gpu
    cells, left_out = bench_gpu.plan(cfg("model=llama31_8b", "workload=all", "schedule=both", "bench=gpu"))
    assert cells == [(w, s, M) for w in ("gemm_rs", "ag_gemm", "mlp", "mlp_replicated") for s in ("static", "dynamic")
                     for M in (16, 128, 1024, 8192, 1000)]
    assert any("moe" in l and "dense" in l for l in left_out)
    assert any("collectives" in l for l in left_out)
    cells, left_out = bench_gpu.plan(cfg("model=qwen3_30b_a3b", "workload=moe", "schedule=both", "bench=gpu_moe"))
    assert cells == [("moe", s, M) for s in ("static", "dynamic") for M in (1, 16, 128, 1024, 4096)]
    cells, left_out = bench_gpu.plan(cfg("workload=gemm_rs", "schedule=dynamic"))
    assert cells == [("gemm_rs", "dynamic", 37)] and left_out == ["gemm_rs/ag_gemm/mlp: model tiny is an MoE; its dense MLP shape is used"]
    with pytest.raises(ValueError, match="at least one round"):
        bench_gpu.plan(cfg("workload=gemm_rs", "bench=gpu", "bench.rounds=0"))


def test_mesh_nvshmem_without_gpus_is_a_clear_error(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs CUDA GPUs"):
        bench.on_gpus(cfg("mesh=nvshmem"))
    assert not bench.on_gpus(cfg("mesh=auto"))


def test_moe_floor_counts_the_experts_and_slots_the_routing_reaches():
    """The floor of a MoE cell (etdist.bench_gpu): weights of the experts that received a slot, or the
    FLOPs of the slots, on the busiest rank. Routing all 4 tokens to experts 0 and 1 (of 8) must count
    2 experts' weights, not min(experts, slots) = 8 of them; a 2-expert rank's share is checked by hand."""
    import torch
    from etdist import bench_gpu
    from etdist.measure.baselines import Ceilings
    H, I, E, k = 16, 8, 8, 2
    router = torch.full((H, E), -10.0)
    router[:, :2] = torch.tensor([2.0, 1.0])   # every token scores experts 0 and 1 highest
    x = torch.rand(4, H) + 0.5                  # positive: the scores keep their order
    ceil = Ceilings(copy_TBps=1e-6, mm_TFps=1e6)   # weights-bound: the floor is the weights read
    weights_us = lambda n: n * 3 * H * I * 2 / 1e6 * 1e6   # noqa: E731  n experts' bf16 weights at 1 MB/s
    assert bench_gpu._moe_floor_us(x, router, k, E, H, I, ceil, "cpu") == pytest.approx(weights_us(2))
    # 4 ranks' worth of experts (2 each): the busiest rank (rank 0: experts 0 and 1) sets the floor
    assert bench_gpu._moe_floor_us(x, router, k, 2, H, I, ceil, "cpu") == pytest.approx(weights_us(2))
    # FLOPs-bound: 8 slots, all on rank 0 of 4
    ceil = Ceilings(copy_TBps=1e6, mm_TFps=1e-6)
    flops_us = 8 * 2 * 3 * H * I / 1e6 * 1e6
    assert bench_gpu._moe_floor_us(x, router, k, 2, H, I, ceil, "cpu") == pytest.approx(flops_us)
    # uniform-ish routing over many experts: far fewer distinct experts than slots
    gen = torch.Generator().manual_seed(0)
    xr, rr = torch.randn(16, 64, generator=gen), torch.randn(64, 128, generator=gen)
    got = bench_gpu._moe_floor_us(xr, rr, 8, 128, 64, 8, Ceilings(copy_TBps=1e-6, mm_TFps=1e6), "cpu")
    distinct = torch.softmax(xr @ rr, -1).topk(8, -1).indices.unique().numel()
    assert distinct < 128 and got == pytest.approx(distinct * 3 * 64 * 8 * 2)
