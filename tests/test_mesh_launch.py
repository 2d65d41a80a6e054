"""Launcher detection and init_mesh's checks: no processes, no GPU."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from etdist.mesh import Launcher, MeshError, current_mesh, detect_launch, init_mesh
from etdist.mesh.launch import resolve_launch


@pytest.mark.parametrize("env, launcher, rank, world, local", [
    ({}, Launcher.SINGLE, 0, 1, 0),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, Launcher.TORCHRUN, 3, 4, 1),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     Launcher.OPENMPI, 1, 2, 1),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}, Launcher.MPICH, 2, 4, 0),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, Launcher.SLURM, 5, 8, 1),
    # torchrun inside an srun allocation: torchrun's variables win
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_PROCID": "7", "SLURM_NTASKS": "9"},
     Launcher.TORCHRUN, 0, 2, 0),
])
def test_detect(env, launcher, rank, world, local):
    got = detect_launch(env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank) == (launcher, rank, world, local)


def test_bad_integer_names_variable():
    with pytest.raises(MeshError, match="RANK='x'"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})


def test_explicit_arguments_override_and_are_checked():
    single = detect_launch({})
    assert resolve_launch(single, world_size=2, rank=1).rank == 1
    with pytest.raises(MeshError, match="rank 5 is outside"):
        resolve_launch(single, world_size=2, rank=5)
    with pytest.raises(MeshError, match="torchrun --nproc_per_node=2"):
        resolve_launch(single, world_size=2)
    tr = detect_launch({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(MeshError, match="started 2 processes"):
        resolve_launch(tr, world_size=4)


def test_two_ranks_without_launcher(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(MeshError, match=r"torchrun --nproc_per_node=2 your_script.py"):
        init_mesh(world_size=2)


def test_backend_errors(monkeypatch):
    with pytest.raises(MeshError, match="unknown backend"):
        init_mesh(backend="gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MeshError, match="backend='cpu'"):
        init_mesh(backend="nvshmem")


def test_nvshmem4py_missing_names_the_package(monkeypatch):
    import sys

    from etdist.mesh.nvshmem_backend import import_nvshmem
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(MeshError, match="pip install nvshmem4py-cu13"):
        import_nvshmem()


def test_nvshmem_settings_default_to_one_node_without_the_proxy_thread():
    from etdist.mesh.nvshmem_backend import env_defaults
    env = {}
    env_defaults(env, one_node=True)
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "none" and env["NVSHMEM_DISABLE_LOCAL_ONLY_PROXY"] == "1"
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    env = {"NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_SYMMETRIC_SIZE": "8G"}
    env_defaults(env, one_node=True)
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc" and env["NVSHMEM_SYMMETRIC_SIZE"] == "8G"   # the user's win
    env = {}
    env_defaults(env, one_node=False)          # across nodes the proxy carries remote traffic
    assert "NVSHMEM_REMOTE_TRANSPORT" not in env and "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY" not in env
    assert "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" not in env


def test_symmetric_copies_must_be_256_byte_congruent(monkeypatch):
    """The kernels address a peer's copy as a 256-byte multiple from their own (aligned_peer): a
    backend whose copies are not congruent must be refused at allocation, not read wrong later."""
    with init_mesh(backend="cpu") as mesh:
        alloc = mesh.impl.alloc
        freed = []
        monkeypatch.setattr(mesh, "world_size", 2)
        monkeypatch.setattr(mesh.impl, "alloc", lambda n: (lambda v: [v[0], v[0][16:]])(alloc(n + 256)))
        monkeypatch.setattr(mesh.impl, "free", lambda views: freed.append(views))
        monkeypatch.setattr(mesh.comm, "allgather", lambda obj: [obj, obj])
        held = len(mesh._allocs)
        with pytest.raises(MeshError, match="256-byte"):
            mesh.empty((8,), torch.float32)
        assert len(freed) == 1 and len(mesh._allocs) == held   # given back, not kept


def test_current_mesh_requires_init():
    with pytest.raises(MeshError, match="init_mesh"):
        current_mesh()


def test_single_process_mesh_api():
    with init_mesh(backend="cpu") as mesh:
        assert (mesh.rank, mesh.world_size, mesh.backend, mesh.device.type) == (0, 1, "cpu", "cpu")
        assert current_mesh() is mesh
        x = mesh.empty((3, 5), torch.bfloat16)
        assert x.shape == (3, 5) and x.dtype == torch.bfloat16 and bool((x == 0).all())
        assert mesh.peer(x, 0) is x
        ptrs = mesh.peer_ptrs(x[1])
        assert ptrs.dtype == torch.int64 and ptrs.tolist() == [x[1].data_ptr()]
        with pytest.raises(MeshError, match="mesh.empty"):
            mesh.peer(torch.zeros(3), 0)
        mesh.barrier()
        run_dir = mesh.impl.run_dir
        assert os.path.isdir(run_dir)
    assert not os.path.exists(run_dir), "symmetric files leaked"
    with pytest.raises(MeshError, match="init_mesh"):
        current_mesh()
    mesh.close()  # twice is fine


def test_watchdog_must_be_positive():
    with pytest.raises(MeshError, match="watchdog_s"):
        init_mesh(backend="cpu", watchdog_s=0)


def test_watchdog_must_be_a_finite_number(monkeypatch):
    """NaN compares false with every deadline: a wait on a peer that never comes spun forever."""
    for bad in (float("nan"), float("inf"), "10"):
        with pytest.raises(MeshError, match="watchdog_s must be a finite number of seconds > 0"):
            init_mesh(backend="cpu", watchdog_s=bad)
    for text, match in (("nan", "finite number"), ("ten", r"ETDIST_WATCHDOG_S='ten' is not a number")):
        monkeypatch.setenv("ETDIST_WATCHDOG_S", text)
        with pytest.raises(MeshError, match=match):
            init_mesh(backend="cpu")
    monkeypatch.setenv("ETDIST_WATCHDOG_S", "5")
    with init_mesh(backend="cpu") as mesh:   # nothing was left behind by the refused calls
        assert mesh.watchdog_s == 5 and current_mesh() is mesh


def test_arguments_of_the_wrong_type_are_named(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(MeshError, match=r"init_mesh\(world_size='2'\): world_size must be an int"):
        init_mesh(backend="cpu", world_size="2")
    with pytest.raises(MeshError, match=r"device cuda:0 with backend 'cpu'"):
        init_mesh(backend="cpu", device="cuda:0")


def test_host_group_is_destroyed_at_exit_when_nobody_closed_it(tmp_path):
    """A gloo group left alive at interpreter teardown aborts the process about one exit in three
    (SIGABRT, 'terminate called without an active exception': a flaky CI failure of the torchrun
    sweep, whose host communicator lives for the whole -m sweep). The exit handlers destroy it."""
    script = tmp_path / "leave_open.py"
    script.write_text(
        "import atexit, torch.distributed as dist\n"
        "from etdist.mesh.hostcomm import make_host_comm\n"
        "from etdist.mesh.launch import resolve_launch, detect_launch\n"
        "launch = resolve_launch(detect_launch({}), world_size=2, rank=0)\n"
        "comm = make_host_comm(launch, timeout_s=30)\n"
        "assert type(comm).__name__ == 'TorchComm' and dist.is_initialized()\n"
        "atexit._run_exitfuncs()\n"
        "print('destroyed' if not dist.is_initialized() else 'still alive')\n")
    # one rank makes no group (LocalComm): a second process joins as rank 1 and leaves
    peer = tmp_path / "peer.py"
    peer.write_text("from etdist.mesh.hostcomm import make_host_comm\n"
                    "from etdist.mesh.launch import resolve_launch, detect_launch\n"
                    "make_host_comm(resolve_launch(detect_launch({}), world_size=2, rank=1), timeout_s=30).close()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p1 = subprocess.Popen([sys.executable, str(peer)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    p0 = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    p1.wait(timeout=120)
    assert p0.returncode == 0, p0.stdout + p0.stderr
    assert "destroyed" in p0.stdout


def test_a_peer_that_skips_a_collective_is_named_not_gloos_raw_error(tmp_path):
    """Rank 1 exits where rank 0 calls a collective at a new shape (the ranks agree on the shape
    through the host group first): gloo's 'Connection closed by peer ... GLHF!' or its bare timeout
    became a PeerTimeoutError that says what a rank did wrong."""
    script = tmp_path / "skip.py"
    script.write_text(
        "import torch, etdist as et\n"
        "from etdist.mesh import liveness\n"
        f"liveness.SHM_DIR = {str(tmp_path)!r}\n"   # the mesh's files in the test's directory
        "mesh = et.init_mesh(backend='cpu', watchdog_s=5)\n"
        "if mesh.rank == 1:\n"
        "    raise SystemExit(0)\n"
        "try:\n"
        "    et.all_reduce(torch.ones(8), mesh=mesh)\n"
        "except et.PeerTimeoutError as e:\n"
        "    print('named:', e)\n")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                       capture_output=True, text=True, timeout=300)
    assert "named: rank 0: the ranks' host" in p.stdout and "every rank must make the same calls" in p.stdout, \
        (p.stdout + p.stderr)[-3000:]


def test_ranks_may_share_a_gpu_for_correctness_checks_only(monkeypatch):
    """init_mesh(share_gpu=True) / ETDIST_SHARE_GPU=1 deals the ranks over the GPUs by local rank
    (two ranks on one GPU: NVSHMEM's multi-process-per-GPU mode) where the plain mesh refuses more
    ranks than GPUs; a bad value is named; the cpu backend ignores it. The mesh shares a GPU only
    where two ranks did land on one (asked for: else refused), and only then etdist.bench.measure
    refuses to time (their kernels take turns on it)."""
    from etdist.mesh import mesh as mesh_module
    from etdist.bench.measure import timing
    launch = resolve_launch(detect_launch(), 2, 1, 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MeshError, match=r"only 1 GPU\(s\) here.*init_mesh\(share_gpu=True\) or ETDIST_SHARE_GPU=1"):
        mesh_module._pick_device(launch, "nvshmem", None)
    assert mesh_module._pick_device(launch, "nvshmem", None, share_gpu=True) == torch.device("cuda", 0)
    class Comm:   # every rank's (host, GPU) as the host group gathers them
        def __init__(self, gpus):
            self.gpus = gpus

        def allgather(self, mine):
            return [(mine[0], g) for g in self.gpus]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"uuid": "GPU-0"}))
    assert mesh_module._ranks_share_a_gpu(Comm(["GPU-0", "GPU-1"]), torch.device("cuda", 0), True) is False
    assert mesh_module._ranks_share_a_gpu(Comm(["GPU-0", "GPU-0"]), torch.device("cuda", 0), True) is True
    with pytest.raises(MeshError, match="ranks 0 and 1 are both on GPU GPU-0 .*init_mesh\\(share_gpu=True\\)"):
        mesh_module._ranks_share_a_gpu(Comm(["GPU-0", "GPU-0"]), torch.device("cuda", 0), False)
    with pytest.raises(MeshError, match="share_gpu must be True or False, got 'yes'"):
        init_mesh(backend="cpu", share_gpu="yes")
    monkeypatch.setenv("ETDIST_SHARE_GPU", "2")
    with pytest.raises(MeshError, match="ETDIST_SHARE_GPU='2': want 0 or 1"):
        init_mesh(backend="cpu")
    monkeypatch.setenv("ETDIST_SHARE_GPU", "1")
    with init_mesh(backend="cpu") as mesh:
        assert mesh.shares_gpu is False and timing.time_batched(lambda: None, device="cpu", batches=1) >= 0
        monkeypatch.setattr(mesh, "shares_gpu", True)   # as an nvshmem mesh made with share_gpu=True
        with pytest.raises(MeshError, match="not timing: the mesh's ranks share a GPU"):
            timing.time_batched(lambda: None, device="cpu")
        with pytest.raises(MeshError, match="not timing"):
            timing.time_alternated({"a": lambda: None}, device="cpu")
