import pytest
import torch


# Modules outside the quick subset (`pytest -m quick`, ~1 minute on two cores; never a slow case):
# interpreted megakernels, launcher processes, the main command, PTX compiles, plans that compile kernels,
# the workloads' and the measurement protocol's sweeps over simulated ranks.
NOT_QUICK = {"test_megakernel_interpreted.py", "test_collectives_cpu.py", "test_mesh_cpu.py", "test_bench.py",
             "test_bench_launchers.py", "test_codegen.py", "test_cuda_runtime_host.py", "test_knobs.py",
             "test_property.py", "test_mesh_faults.py", "test_mesh_launch.py", "test_cpu_mesh_ops.py",
             "test_moe_baseline.py", "test_workloads.py", "test_sync_latency.py", "test_measure.py"}


@pytest.hookimpl(tryfirst=True)   # before -m selects on the marks added here
def pytest_collection_modifyitems(config, items):
    """Marks the quick subset. GPU tests need CUDA; skip them elsewhere (CI has no GPU). Run them
    with `pytest -m gpu`."""
    for item in items:
        if item.path.name not in NOT_QUICK and "gpu" not in item.keywords and "slow" not in item.keywords:
            item.add_marker(pytest.mark.quick)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def ranks_env(world: int) -> dict:
    """The environment of a `world`-rank GPU test run here: one rank per GPU where there are enough;
    else the ranks share the GPUs (init_mesh(share_gpu=True): NVSHMEM's multi-process-per-GPU mode,
    correctness only, no NCCL); no GPU: skip."""
    n = torch.cuda.device_count()
    if n >= world:
        return {}
    if n < 1:
        pytest.skip("needs a GPU")
    return {"ETDIST_SHARE_GPU": "1"}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float64; 0 for empty tensors."""
    if want.numel() == 0:
        assert got.numel() == 0
        return 0.0
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
