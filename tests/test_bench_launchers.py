"""The main command under real launchers on the CPU: 2 processes share the sweep, rank 0 alone
writes the records, the report table and the PNGs; the ranks' output folders differ."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# 2 workloads x 2 schedules x 2 worlds x 1 M = 8 cells
ARGS = ["workload.names=[gemm_rs,moe]", "mesh.worlds=[1,2]", "bench.interleavings=1", "bench.tokens=[9]"]


def _run(cmd, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    return p.returncode, p.stdout + p.stderr


def _check(rc: int, out: str, cwd: pathlib.Path):
    assert rc == 0, out[-3000:]
    assert "8 cells over 2 processes" in out, out[-3000:]
    # one folder per rank (each rank resolves the time in the path itself: the parents may differ)
    folders = {p.name: p for p in (cwd / "outputs").glob("*/*/rank*")}
    assert sorted(folders) == ["rank0", "rank1"]
    assert not (folders["rank1"] / "results").exists()                   # rank 0 alone writes
    results = folders["rank0"] / "results"
    records = [line for f in ("gemm_rs.jsonl", "moe.jsonl") for line in (results / f).read_text().splitlines()]
    assert len(records) == 8
    report = (folders["rank0"] / "report.md").read_text()
    assert "### gemm_rs" in report and "### moe" in report
    assert len(list((folders["rank0"] / "plots").glob("*.png"))) == 8    # workload x schedule x world


def test_torchrun_sweep(tmp_path):
    _check(*_run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "etdist.bench",
                  *ARGS], tmp_path), tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (pip install mpi4py mpich)")
def test_mpiexec_sweep(tmp_path):
    _check(*_run(["mpiexec", "-n", "2", sys.executable, "-m", "etdist.bench", *ARGS], tmp_path), tmp_path)


@pytest.mark.slow
def test_launch_scripts_pass_overrides(tmp_path):
    """launch/torchrun.sh runs the main command with the overrides given to it."""
    env = dict(os.environ, NPROC="2", PYTHONPATH=str(ROOT), PYTHON=sys.executable)
    p = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), *ARGS], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "8 cells over 2 processes" in p.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without GPUs")
@pytest.mark.parametrize("script", ["bench-gpu.sh", "gpu-check.sh"])
def test_gpu_scripts_without_gpus_fail_in_one_line(script, tmp_path):
    """bench-gpu.sh without GPUs printed a traceback and exited 0 ("BENCHMARKS.md regenerated")."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable,
               PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    before = (ROOT / "BENCHMARKS.md").stat().st_mtime if (ROOT / "BENCHMARKS.md").exists() else None
    p = subprocess.run(["bash", str(ROOT / "launch" / script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0
    assert p.stdout == "" and p.stderr.count("\n") == 1, p.stdout + p.stderr
    assert p.stderr.startswith(f"{script}: no CUDA GPU here")
    assert before is None or (ROOT / "BENCHMARKS.md").stat().st_mtime == before


@pytest.mark.slow
def test_the_relaunch_soak_runs_on_the_cpu_mesh(tmp_path):
    """launch/soak.py under torchrun on the cpu mesh: every op at random M with fresh inputs, the
    checked launches against float32, a table last; no mismatch, exit 0."""
    rc, out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(ROOT / "launch" / "soak.py"),
                    "--launches", "30", "--check-every", "10", "--hidden", "32", "--intermediate", "64",
                    "--max-m", "37"], tmp_path)
    assert rc == 0, out[-3000:]
    table = out[out.index("op | launches"):].splitlines()[1:5]
    assert [row.split(" | ")[:4] for row in table] == [[op, "30", "3", "0"] for op in
                                                       ("gemm_rs", "ag_gemm", "mlp", "mlp_replicated")], out[-3000:]
