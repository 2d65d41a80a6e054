"""The torch MoE baseline (issue 7) matches the float64 reference, on one rank and expert-parallel
over two gloo ranks, every way it runs: experts grouped (torch._grouped_mm) or one mm pair each,
dispatch with exchanged sizes or fixed padded blocks (the CUDA-graph-capturable form)."""
import pytest
import torch
import torch.distributed as dist

from etdist.measure.moe_baseline import torch_moe
from etdist.workloads import moe

WAYS = [("grouped", "exact"), ("grouped", "padded"), ("loop", "exact"), ("loop", "padded")]


def _run(rank, world, store, skew):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ranks, (wg, w1, w2) = moe.make_inputs(world, 11, 16, 12, 4 * world, seed=5, skew=skew)
        want = moe.reference([i["x"] for i in ranks], wg, w1, w2, top_k=2)[rank]
        for experts, dispatch in WAYS:
            got = torch_moe(ranks[rank]["x"], wg, ranks[rank]["w_gate_up"], ranks[rank]["w_down"], top_k=2,
                            experts=experts, dispatch=dispatch)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, (world, skew, experts, dispatch, err)
    finally:
        dist.destroy_process_group()


def test_torch_moe_one_and_two_ranks(tmp_path):
    for world, skew in ((1, 0.0), (2, 0.0), (2, 4.0)):
        store = tmp_path / f"s{world}{skew}"
        torch.multiprocessing.spawn(_run, args=(world, str(store), skew), nprocs=world)


def test_experts_no_token_routes_to_are_skipped():
    """Grouped experts with empty groups (skewed routing leaves most experts idle) and padding rows
    (expert -1) that belong to no group."""
    from etdist.measure.moe_baseline import _grouped_experts, _looped_experts
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 16, generator=gen)
    local = torch.tensor([3, -1, 0, 3, 3, -1, 0, 3, 3])
    wgu, wd = torch.randn(5, 16, 24, generator=gen), torch.randn(5, 12, 16, generator=gen)
    got, want = _grouped_experts(rows, local, wgu, wd), _looped_experts(rows, local, wgu, wd)
    used = local >= 0
    assert torch.allclose(got[used], want[used], rtol=1e-5, atol=1e-5)


def test_bad_way_is_refused():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="experts must be"):
        torch_moe(x, torch.randn(16, 4), torch.randn(4, 16, 24), torch.randn(4, 12, 16), 2, experts="fast")
