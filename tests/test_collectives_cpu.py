"""Collectives on the cpu backend: R real processes under torchrun and mpiexec, faults included.

Each case runs `python -m etdist.collectives.selfcheck` under a launcher as a subprocess with a
timeout; every rank prints one line and the exit code says whether the case behaved. The
`triton` cases run the GPU exchange kernel itself under TRITON_INTERPRET=1 across processes.
"""
import multiprocessing as mp
import os
import queue
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from etdist.collectives import all_gather, all_reduce, all_to_all, ops, reduce_scatter
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


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_torchrun(n):
    _ok(*torchrun(n), n)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpi4py mpich)")
@pytest.mark.parametrize("n, workspace_mb", [(2, "0.05"), pytest.param(4, "64", marks=pytest.mark.slow)])
def test_mpiexec(n, workspace_mb):
    # 0.05 MB of workspace forces the larger messages through several rounds
    _ok(*mpiexec(n, "--workspace-mb", workspace_mb), n)


@pytest.mark.parametrize("n, case, error", [pytest.param(4, "skip-notify", "PeerTimeoutError", marks=pytest.mark.slow),
                                            (2, "shape", "CallMismatchError"),
                                            (2, "dtype", "CallMismatchError"),
                                            (2, "big-count", "CallMismatchError"),
                                            (2, "skip-call", "CallMismatchError"),
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


@pytest.mark.parametrize("case", ["ok", "skip-notify", "shape", "dtype"])
def test_triton_kernel_interpreted(case):
    rc, out = torchrun(2, "--case", case, "--small", "--watchdog", "2", "--exchange", "triton",
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


def test_two_shot_all_reduce_on_one_rank_and_its_bad_arguments(mesh):
    """two_shot on one rank is the identity; a two_shot that is not a bool is named."""
    x = torch.arange(6, dtype=torch.float32)
    assert torch.equal(all_reduce(x, two_shot=True), x)
    with pytest.raises(MeshError, match="two_shot must be True or False, got 'yes'"):
        all_reduce(x, two_shot="yes")


def test_bad_arguments_say_what_to_fix(mesh):
    with pytest.raises(MeshError, match="not supported for sums"):
        all_reduce(torch.ones(4, dtype=torch.int64))
    with pytest.raises(MeshError, match="out must be"):
        all_gather(torch.ones(4), out=torch.empty(3))
    with pytest.raises(MeshError, match="send_counts"):
        all_to_all(torch.ones(4, 2), [3])
    with pytest.raises(TypeError):
        all_reduce([1.0, 2.0])


def test_triton_all_to_all_with_ranks_of_different_largest_segments():
    """Both ends of a segment must cut it into the same chunks; sized by each rank's own largest
    segment they did not, and the kernel waited on chunks never sent (PeerTimeoutError)."""
    worker = os.path.join(os.path.dirname(__file__), "interp", "a2a_uneven_worker.py")
    rc, out = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", worker],
                      TRITON_INTERPRET="1", ETDIST_WATCHDOG_S="5")
    assert rc == 0 and out.count("OK a2a uneven") == 2, out[-4000:]



def _refused_call(rank, world, port, case, q, exchange="torch"):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ops.CPU_EXCHANGE = exchange
    try:
        with init_mesh(backend="cpu", watchdog_s=1.5, workspace_mb=0.05 if case == "rounds" else None) as mesh:
            if case == "rounds":   # rank 0: two rounds of the 0.05 MB workspace's 3264 floats, rank 1: one
                t0 = time.monotonic()
                try:
                    all_reduce(torch.ones(6528 if rank == 0 else 3264), mesh=mesh)
                    q.put((rank, "returned", time.monotonic() - t0))
                except MeshError as e:
                    q.put((rank, type(e).__name__, time.monotonic() - t0))
                return
            if case == "then-empty":
                all_reduce(torch.ones(4), mesh=mesh)   # the workspace exists
            t0 = time.monotonic()
            try:   # the last rank passes a wrong `out`: refused before anything starts ("then-empty": it
                   # skips the call, and its peer's watchdog fails the mesh)
                if case != "then-empty" or rank != world - 1:
                    all_reduce(torch.ones(4), torch.empty(5 if rank == world - 1 else 4), mesh=mesh)
                outcome = "returned"
            except MeshError as e:
                outcome = type(e).__name__
            if case == "then-empty":   # the other rank's error is recorded here, not yet raised
                t0 = time.monotonic()
                try:
                    mesh.empty((16,), torch.float32)
                    outcome = "returned"
                except MeshError as e:
                    outcome = type(e).__name__
            q.put((rank, outcome, time.monotonic() - t0))
    except Exception as e:  # report, never hang the parent
        q.put((rank, "crash", repr(e)))


def _spawn_refused(case, world=2, exchange="torch"):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_refused_call, args=(r, world, port, case, q, exchange)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted(q.get(timeout=30) for _ in procs)
    except queue.Empty:
        return "no answer from every rank within 30 s"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()


def test_a_refused_first_collective_raises_at_once_on_every_rank():
    """Arguments refused on one rank at the mesh's first collective: the peers, inside the workspace's
    collective allocation (a host allgather, not the watchdog), waited for the gloo timeout (60 s);
    then for the watchdog. The refusal is now published as that rank's call (mesh/calls.py)."""
    out = _spawn_refused("first")
    assert out[0][:2] == (0, "CallMismatchError") and out[0][2] < 1 and out[1][:2] == (1, "MeshError"), out


def test_mesh_empty_after_a_fault_raises_on_every_rank():
    """After a fault that rank 0 raised (PeerTimeoutError: rank 1 skipped the call) and rank 1 had
    not seen, mesh.empty refused at once on rank 0, alone, and rank 1 waited in its allgather for
    the gloo timeout (60 s). Now rank 0 takes part, and both refuse."""
    out = _spawn_refused("then-empty")
    assert [o[:2] for o in out] == [(0, "MeshError"), (1, "MeshError")] and out[1][2] < 10, out


@pytest.mark.parametrize("exchange", ["torch", "triton"])
def test_calls_that_differ_in_rounds_raise_on_every_rank(exchange, monkeypatch):
    """Shapes that differ only in their number of rounds (6528 vs 3264 floats through 3264-float
    slots): every round both made agreed (same op, same count), so rank 1 returned its one-round
    result without an error, and rank 0 timed out waiting for a second round."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = _spawn_refused("rounds", exchange=exchange)
    assert [o[:2] for o in out] == [(0, "CallMismatchError"), (1, "CallMismatchError")], out


def test_arguments_of_the_wrong_kind_are_named(mesh):
    """out, send_counts and mesh of the wrong kind: AttributeError / TypeError from inside the ops
    before; the next good call still works."""
    x = torch.randn(6, 4)
    with pytest.raises(MeshError, match=r"out must be a \(6, 4\) torch.float32 tensor on cpu \(or None\), got list"):
        all_reduce(x, out=[0])
    for bad in (None, "6", [5.5], [True]):
        with pytest.raises(MeshError, match="send_counts must be 1 int row counts"):
            all_to_all(x, bad)
    with pytest.raises(MeshError, match="recv_counts must be 1 int row counts"):
        all_to_all(x, [6], "6")
    with pytest.raises(MeshError, match="mesh must be the Mesh from etdist.init_mesh"):
        all_reduce(x, mesh="cpu")
    assert torch.equal(all_to_all(x, torch.tensor([6])), x) and torch.equal(all_reduce(x), x)


def test_the_workspace_fits_a_group_meshs_region(monkeypatch):
    """A group mesh holds its symmetric tensors in a region of its own (init_mesh(group_heap_mb=...)):
    the collectives' workspace takes at most a quarter of it by default, so the ops keep room there."""
    import etdist as et
    from etdist.collectives.workspace import get_workspace
    with et.init_mesh(backend="cpu") as mesh:
        monkeypatch.setattr(mesh, "symmetric_capacity", lambda: 16 << 20)
        ws = get_workspace(mesh)
        assert ws.scratch.numel() <= 4 << 20 and ws.scratch.numel() > 3 << 20, ws.scratch.numel()


def test_workspace_mb_sizes_the_collectives_workspace():
    """init_mesh(workspace_mb=...) reaches the workspace the collectives make at the mesh's first
    call; group_heap_mb is taken and has no effect on the cpu backend."""
    from etdist.collectives.workspace import get_workspace
    with init_mesh(backend="cpu", workspace_mb=0.05, group_heap_mb=256) as mesh:
        ws = get_workspace(mesh)
        assert ws.slot_bytes == int(0.05 * 2**20) // 2 // 256 * 256 and ws.scratch.numel() == 2 * ws.slot_bytes
        x = torch.randn(3 * ws.slot_elems(torch.float32) + 5)   # several rounds through the small slot
        assert torch.equal(all_reduce(x, mesh=mesh), x)
    with init_mesh(backend="cpu") as mesh:   # the default: 64 MiB on the CPU
        assert get_workspace(mesh).scratch.numel() == 64 << 20
