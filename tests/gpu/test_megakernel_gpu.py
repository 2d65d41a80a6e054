"""The fused GEMM+RS megakernel on real GPUs (1 and 2 ranks). Run: pytest -m gpu tests/gpu."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import ranks_env

WORKER = str(pathlib.Path(__file__).with_name("gemm_rs_worker.py"))
ENV = dict(os.environ, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo", NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0",
           TORCH_SYMM_MEM_DISABLE_MULTICAST="1", PYTHONUNBUFFERED="1", ETDIST_SHARE_GPU="0")   # ranks_env asks
pytestmark = pytest.mark.gpu
# one rank, two, and every GPU of a four-GPU machine (issue 47: the tests that take a world at 4 ranks)
WORLDS = [1, 2] + ([4] if torch.cuda.device_count() >= 4 else [])


def torchrun(n, *args, timeout=600, worker=WORKER, env=None):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", str(worker), *args],
                       capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})})
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("world", WORLDS)
def test_gemm_reduce_scatter_matches_reference(world):
    env = ranks_env(world)
    rc, out = torchrun(world, env=env)
    assert rc == 0, out[-5000:]
    for check in ("correctness", "config", "no-recompile", "bad-input", "idle-threads"):
        assert out.count(f"OK {check}") == world, out[-5000:]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["trace", "dynamic"])
def test_trace_mode_and_dynamic_schedule(case, world):
    """trace: every task recorded; dynamic: the ready-queue schedule matches the reference."""
    env = ranks_env(world)
    rc, out = torchrun(world, "--case", case, env=env)
    assert rc == 0 and out.count(f"OK {case}") == world, out[-5000:]


@pytest.mark.parametrize("world", WORLDS)
def test_ops_replay_from_cuda_graphs(world):
    """gemm_rs, ag_gemm and the MLP captured in CUDA graphs: replays with fresh inputs match the
    reference, eager calls in between too (both schedules); graphs captured at several M of one size
    class replay correctly, interleaved and after an eager call at a larger M."""
    env = ranks_env(world)
    rc, out = torchrun(world, "--case", "graph", env=env)
    assert rc == 0, out[-5000:]
    assert out.count("OK graph rank") == world and out.count("OK graphs-per-size") == world, out[-5000:]


@pytest.mark.parametrize("world", WORLDS)
def test_launches_on_two_streams_run_in_call_order(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    rc, out = torchrun(world, "--case", "streams")
    assert rc == 0 and out.count("OK streams") == world, out[-5000:]


@pytest.mark.parametrize("world", WORLDS)
def test_a_call_refused_while_capturing_stops_every_rank(world):
    env = ranks_env(world)
    rc, out = torchrun(world, "--case", "capture-refusal", timeout=120, env=env)
    assert out.count("OK capture-refusal") == world, out[-5000:]


def test_missing_peer_raises_within_watchdog():
    env = ranks_env(2)
    rc, out = torchrun(2, "--case", "peer-skips", timeout=120, env=env)
    assert out.count("OK watchdog") == 2 and "OK error-word" in out, out[-5000:]


def test_a_refusal_on_one_rank_stops_the_other_ranks_launch():
    env = ranks_env(2)
    rc, out = torchrun(2, "--case", "refusal", timeout=120, env=env)
    assert out.count("OK refusal") == 2, out[-5000:]


def test_dtypes_that_differ_at_a_prepared_shape_raise_on_every_rank():
    """bf16 against fp16 where both kernels were prepared: a silent wrong result on one rank and a
    timeout on the other before the call agreement (mesh/calls.py); now CallMismatchError on both."""
    env = ranks_env(2)
    rc, out = torchrun(2, "--case", "dtype-mismatch", timeout=120, env=env)
    assert rc == 0 and out.count("OK dtype-mismatch") == 2, out[-5000:]


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_gemm_and_tensor_parallel_mlp(world):
    env = ranks_env(world)
    _, out = torchrun(world, worker=pathlib.Path(__file__).with_name("mlp_worker.py"), env=env)
    for check in ("OK ag_gemm", "OK mlp-seq", "OK mlp-replicated", "OK mlp-tail", "OK mlp-fp32"):
        assert out.count(check) == world, out[-5000:]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sharing_one_gpu_match_float64(world):
    """More ranks than GPUs, on one GPU (init_mesh(share_gpu=True)): gemm_rs, ag_gemm and both MLPs
    at every size class, the per-source plans with their sources side by side and in order, both
    schedules at M=129, against float64. Runs on any GPU machine: the cross-rank protocols where
    only one GPU is lent (its times would mean nothing, and etdist.bench.measure refuses them)."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    rc, out = torchrun(world, worker=pathlib.Path(__file__).with_name("shared_gpu_worker.py"), timeout=900,
                       env={"ETDIST_SHARE_GPU": "1", "CUDA_VISIBLE_DEVICES": "0", "ETDIST_WATCHDOG_S": "60"})
    assert rc == 0 and out.count("OK shared-gpu rank") == world, out[-5000:]


def test_llama_with_tensor_parallel_mlps_matches_dense():
    env = ranks_env(2)
    pytest.importorskip("transformers")
    _, out = torchrun(2, worker=pathlib.Path(__file__).parents[1] / "cpu_mesh" / "llama_worker.py", env=env)
    assert out.count("OK llama") == 2, out[-5000:]


@pytest.mark.parametrize("world", WORLDS)
def test_ops_and_layers_under_torch_compile(world):
    """fullgraph=True (no graph breaks), dynamic sizes, and mode="reduce-overhead" (inductor's CUDA
    graphs): every result as when run eagerly."""
    env = ranks_env(world)
    rc, out = torchrun(world, worker=pathlib.Path(__file__).with_name("compile_worker.py"), env=env)
    for check in ("OK compile-ops", "OK compile-nn", "OK compile-cudagraphs"):
        assert out.count(check) == world, out[-5000:]


@pytest.mark.parametrize("world", WORLDS)
def test_moe_layer_both_schedules(world):
    """Both schedules eagerly and replayed from a CUDA graph with new tokens, bf16 in both tile
    classes; the torch baselines. One rank: the GPU bodies move no rows (x read in place)."""
    env = ranks_env(world)
    _, out = torchrun(world, worker=pathlib.Path(__file__).with_name("moe_worker.py"), env=env)
    baselines = () if env else ("OK moe-baselines",)   # NCCL's: not where ranks share a GPU
    for check in ("OK moe static", "OK moe dynamic", "OK moe-graph static", "OK moe-graph dynamic",
                  "OK moe-bf16 static", "OK moe-bf16 dynamic", *baselines):
        assert out.count(check) == world, out[-5000:]
