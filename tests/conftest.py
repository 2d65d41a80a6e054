import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """GPU tests need CUDA; skip them elsewhere (CI has no GPU). Run them with `pytest -m gpu`."""
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
