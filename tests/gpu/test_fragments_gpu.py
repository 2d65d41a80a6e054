"""Collective graph fragments run as megakernels on 2 GPUs. Run: pytest -m gpu tests/gpu."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

WORKER = str(pathlib.Path(__file__).with_name("fragments_worker.py"))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def test_fragments_on_two_gpus():
    env = dict(os.environ, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo", NVSHMEM_DISABLE_NVLS="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", WORKER],
                       capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and out.count("OK all_reduce") == 2 and out.count("OK all_to_all") == 2, out[-4000:]
