"""Two tensor-parallel groups of 2 on 4 GPUs (issue 46): NVSHMEM over the four processes once, each
group's mesh in its own region; gemm_rs, ag_gemm, the MLP and MoE layers in both groups against
float64 (tests/cpu_mesh/groups_worker.py, which CI runs on the cpu backend). Run: pytest -m gpu."""
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ranks_env

WORKER = pathlib.Path(__file__).parents[1] / "cpu_mesh" / "groups_worker.py"
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("how", ["subgroups", "device_mesh"])
def test_two_tensor_parallel_groups_of_two_on_gpus(how):
    env = dict(os.environ, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo", NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1",
               **ranks_env(4))   # the worker gives each group's region 256 MiB (init_mesh(group_heap_mb=))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", str(WORKER), how,
                        "nvshmem"], capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and out.count(f"OK groups {how}") == 4, out[-5000:]
