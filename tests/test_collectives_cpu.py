"""Collectives on the cpu backend: R real processes under torchrun and mpiexec, faults included.

Each case runs `python -m etdist.collectives.selfcheck` under a launcher as a subprocess with a
timeout; every rank prints one line and the exit code says whether the case behaved. The
`triton` cases run the GPU exchange kernel itself under TRITON_INTERPRET=1 across processes.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from etdist.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from etdist.mesh import MeshError, init_mesh

SELFCHECK = ["-m", "etdist.collectives.selfcheck"]
BASE_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
MPIEXEC = shutil.which("mpiexec")


def _launch(cmd, timeout=120, **env):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(BASE_ENV, **env))
    return p.returncode, p.stdout + p.stderr


def torchrun(n, *args, **env):
    return _launch([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", *SELFCHECK, *args], **env)


def mpiexec(n, *args, **env):
    return _launch([MPIEXEC, "-n", str(n), sys.executable, *SELFCHECK, *args], **env)


def _ok(rc, out, n):
    assert rc == 0 and out.count("as expected") == n, out[-4000:]


@pytest.mark.parametrize("n", [2, 4])
def test_torchrun(n):
    _ok(*torchrun(n), n)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpi4py mpich)")
@pytest.mark.parametrize("n, workspace_mb", [(2, "0.05"), (4, "64")])
def test_mpiexec(n, workspace_mb):
    # 0.05 MB of workspace forces the larger messages through several rounds
    _ok(*mpiexec(n, ETDIST_WORKSPACE_MB=workspace_mb), n)


@pytest.mark.parametrize("n, case, error", [(4, "skip-notify", "PeerTimeoutError"),
                                            (2, "shape", "ShapeMismatchError"),
                                            (2, "empty-shape", "ShapeMismatchError")])
def test_faults_raise_on_every_rank(n, case, error):
    rc, out = torchrun(n, "--case", case, "--watchdog", "1")
    _ok(rc, out, n)
    assert out.count(f"RAISED {error}") == n


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpi4py mpich)")
def test_mpiexec_missing_notify():
    rc, out = mpiexec(2, "--case", "skip-notify", "--watchdog", "1")
    _ok(rc, out, 2)
    assert "Rank 1 never notified" in out


@pytest.mark.parametrize("case", ["ok", "skip-notify", "shape"])
def test_triton_kernel_interpreted(case):
    rc, out = torchrun(2, "--case", case, "--small", "--watchdog", "2", ETDIST_CPU_EXCHANGE="triton",
                       TRITON_INTERPRET="1")
    _ok(rc, out, 2)


@pytest.fixture
def mesh():
    with init_mesh(backend="cpu") as m:
        yield m


def test_single_rank_ops_are_identities(mesh):
    x = torch.randn(6, 4)
    assert torch.equal(all_reduce(x), x) and torch.equal(reduce_scatter(x), x) and torch.equal(all_gather(x), x)
    assert torch.equal(all_to_all(x, [6]), x)
    out = torch.empty_like(x)
    assert all_reduce(x, out) is out


def test_bad_arguments_say_what_to_fix(mesh):
    with pytest.raises(MeshError, match="not supported for sums"):
        all_reduce(torch.ones(4, dtype=torch.int64))
    with pytest.raises(MeshError, match="out must be"):
        all_gather(torch.ones(4), out=torch.empty(3))
    with pytest.raises(MeshError, match="send_counts"):
        all_to_all(torch.ones(4, 2), [3])
    with pytest.raises(TypeError):
        all_reduce([1.0, 2.0])
