"""The same user code as on GPUs, on the cpu backend across processes (issue 46): sub-group meshes
(a torch sub-group, a DeviceMesh dimension) side by side in one 4-process job, each running the
fused ops and the nn layers on the CPU runtime against float64 references; nothing is left in
the shared-memory directory."""
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "cpu_mesh", "groups_worker.py")


@pytest.mark.parametrize("how", ["subgroups", pytest.param("device_mesh", marks=pytest.mark.slow)])
def test_two_tensor_parallel_groups_of_two(how, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TEST_SHM_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", WORKER, how],
                       capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and out.count(f"OK groups {how}") == 4, out[-4000:]
    assert os.listdir(tmp_path) == []


def test_the_readme_example_runs_under_torchrun_on_the_cpu_mesh(tmp_path):
    """README.md's `Use it` example, as written, under torchrun with two processes and no GPU."""
    import re
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    script = tmp_path / "tp_demo.py"
    script.write_text(re.search(r"```python\n(.*?)```", readme, re.S).group(1))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")   # the script as written: /dev/shm
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    errs = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if " gemm_rs (128, 1024) rel err " in line]
    assert len(errs) == 2 and max(errs) < 1e-4, out[-4000:]
    assert out.count("mlp (16, 1024)") == 2, out[-4000:]


def test_a_llama_with_its_mlps_swapped_runs_under_torchrun_on_the_cpu_mesh(tmp_path):
    """The GPU test's client (tests/cpu_mesh/llama_worker.py), unchanged, on two CPU processes: a
    transformers Llama whose MLPs are et.nn.TensorParallelMLP.from_dense(..., mesh=mesh)."""
    pytest.importorskip("transformers")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TEST_SHM_DIR=str(tmp_path))
    worker = os.path.join(os.path.dirname(__file__), "cpu_mesh", "llama_worker.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", worker],
                       capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and out.count("OK llama") == 2, out[-4000:]
    assert os.listdir(tmp_path) == []
