"""GPU checks of the mesh and collectives: real NVSHMEM, 2 ranks launched as subprocesses, one per
GPU, or both on one GPU where there is only one (init_mesh(share_gpu=True): correctness only).

Run on a GPU machine: `pytest -m gpu tests/gpu`. Skipped without a CUDA GPU.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ranks_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")]

ENV = dict(os.environ, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo", NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0",
           TORCH_SYMM_MEM_DISABLE_MULTICAST="1", PYTHONUNBUFFERED="1",
           ETDIST_SHARE_GPU="0")   # the refusal tests need the plain mesh; ranks_env(2) asks for sharing


def _run(cmd, timeout=240, **env):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(ENV, **env))
    return p.returncode, p.stdout + p.stderr


def torchrun(n, *args, **env):
    return _run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "-m",
                 "etdist.collectives.selfcheck", *args], **env)


@pytest.mark.parametrize("case", ["ok", "graph", "skip-notify", "shape", "empty-shape", "same-gpu"])
def test_selfcheck_torchrun(case):
    # same-gpu: both ranks ask for GPU 0 and the plain mesh must refuse (no sharing asked for)
    rc, out = torchrun(2, "--case", case, "--watchdog", "3", **({} if case == "same-gpu" else ranks_env(2)))
    assert rc == 0 and out.count("as expected") == 2, out[-4000:]


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs more than 2 GPUs")
@pytest.mark.parametrize("case", ["ok", "graph"])
def test_selfcheck_on_every_gpu(case):
    """The collectives at world = every GPU (4 on a four-GPU machine), one rank per GPU."""
    n = torch.cuda.device_count()
    rc, out = torchrun(n, "--case", case, "--watchdog", "3")
    assert rc == 0 and out.count("as expected") == n, out[-4000:]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun")
@pytest.mark.parametrize("case", ["ok", "skip-notify"])
def test_selfcheck_mpirun(case):
    env = ranks_env(2)
    rc, out = _run(["mpirun", "--allow-run-as-root", "-n", "2", "-x", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
                    "-x", "NVSHMEM_DISABLE_NVLS", "-x", "PYTHONPATH", *(a for k in env for a in ("-x", k)),
                    sys.executable, "-m", "etdist.collectives.selfcheck", "--case", case, "--watchdog", "3"], **env)
    assert rc == 0 and out.count("as expected") == 2, out[-4000:]


def test_more_ranks_than_gpus():
    n = torch.cuda.device_count() + 1
    rc, out = torchrun(n, "--case", "ok", timeout=120)
    assert rc != 0 and f"only {n - 1} GPU(s) here: run torchrun --nproc_per_node={n - 1}" in out, out[-3000:]


def test_two_ranks_one_visible_gpu():
    rc, out = torchrun(2, "--case", "ok", timeout=120, CUDA_VISIBLE_DEVICES="0")
    assert rc != 0 and "only 1 GPU(s) here" in out, out[-3000:]


def test_nvshmem_missing():
    code = ("import sys; sys.modules['nvshmem'] = None; import etdist.mesh as m\n"
            "try:\n    m.init_mesh(backend='nvshmem')\nexcept m.MeshError as e:\n    print('RAISED', e)\n")
    rc, out = _run([sys.executable, "-c", code], timeout=60)
    assert "RAISED" in out and "pip install nvshmem4py-cu13" in out, out[-3000:]


def test_bootstrap_failure_is_bounded():
    rc, out = torchrun(2, "--case", "ok", "--watchdog", "3", timeout=90,
                       NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="no_such_if0", **ranks_env(2))
    assert rc != 0 and "NVSHMEM bootstrap" in out, out[-3000:]
