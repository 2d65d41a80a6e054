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


@pytest.fixture(autouse=True)
def _fresh_op_plans():
    """Tests patch the ops' plan knobs (module attributes): no cached plan outlives a test."""
    yield
    import sys
    if "etdist.ops" in sys.modules:
        sys.modules["etdist.ops"].clear_plan_caches()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float64; 0 for empty tensors."""
    if want.numel() == 0:
        assert got.numel() == 0
        return 0.0
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
