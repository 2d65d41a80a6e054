"""The same user code as on GPUs, on the cpu backend across processes (issue 46): sub-group meshes
(a torch sub-group, a DeviceMesh dimension) side by side in one 4-process job, each running the
fused ops and the nn layers on the CPU runtime against float64 references; nothing is left in
the shared-memory directory."""
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "cpu_mesh", "groups_worker.py")


@pytest.mark.parametrize("how", ["subgroups", "device_mesh"])
def test_two_tensor_parallel_groups_of_two(how, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ETDIST_SHM_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", WORKER, how],
                       capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and out.count(f"OK groups {how}") == 4, out[-4000:]
    assert os.listdir(tmp_path) == []
