"""The cpu backend across real processes (multiprocessing spawn, torchrun-style environment)."""
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, case, q):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from etdist.mesh import PeerTimeoutError, init_mesh
    try:
        mesh = init_mesh(backend="cpu", watchdog_s=1.5)
        run_dir = mesh.impl.run_dir
        if case == "peer-writes":
            x = mesh.empty((world, 4), torch.int32)
            for d in range(world):  # write our rank into row `rank` of every peer's copy
                mesh.peer(x, d)[rank] = rank + 1
            mesh.barrier()
            ptrs = mesh.peer_ptrs(x)
            q.put((rank, "ok", x[:, 0].tolist(), len(ptrs), run_dir))
        elif case == "barrier-timeout":
            t0 = time.monotonic()
            try:
                if rank != world - 1:  # the last rank never arrives
                    mesh.barrier()
                    q.put((rank, "no error", None, None, run_dir))
                else:
                    time.sleep(3.0)
                    q.put((rank, "skipped", None, None, run_dir))
            except PeerTimeoutError as e:
                q.put((rank, "raised", round(time.monotonic() - t0, 1), str(e), run_dir))
        mesh.close()
    except Exception as e:  # report, never hang the parent
        q.put((rank, "crash", repr(e), None, None))


def _spawn(world, case, timeout=60):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, case, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = sorted(q.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=timeout)
        assert p.exitcode == 0
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_peer_writes_are_seen(world):
    out = _spawn(world, "peer-writes")
    for rank, status, rows, nptrs, run_dir in out:
        assert status == "ok", out
        assert rows == [r + 1 for r in range(world)] and nptrs == world
    assert not os.path.exists(out[0][4]), "run dir leaked"


def test_barrier_timeout_names_the_missing_rank():
    out = _spawn(2, "barrier-timeout")
    rank0 = out[0]
    assert rank0[1] == "raised", out
    assert rank0[2] < 5.0
    assert "from rank 1" in rank0[3] and "barrier" in rank0[3]


@pytest.mark.parametrize("name, value", [("workspace_mb", 0), ("workspace_mb", -1.5), ("workspace_mb", "64"),
                                         ("group_heap_mb", float("nan")), ("group_heap_mb", True)])
def test_a_bad_size_is_refused_before_anything_is_made(name, value, monkeypatch, tmp_path):
    """init_mesh(workspace_mb=, group_heap_mb=) refuse anything but a positive number, naming the
    argument, before a host group or a file exists."""
    from etdist.mesh import init_mesh, liveness
    from etdist.mesh import mesh as mesh_module
    monkeypatch.setattr(liveness, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(mesh_module, "make_host_comm", lambda *a, **k: pytest.fail("a host group was made"))
    with pytest.raises(ValueError, match=rf"init_mesh\({name}=\.\.\.\) wants a positive number of MiB.*got {value!r}"):
        init_mesh(backend="cpu", **{name: value})
    assert os.listdir(tmp_path) == []
