"""The torch MoE baseline (issue 7) matches the float64 reference, on one rank and expert-parallel
over two gloo ranks (all_to_all_single dispatch and combine)."""
import torch
import torch.distributed as dist

from etdist.measure.moe_baseline import torch_moe
from etdist.workloads import moe


def _run(rank, world, store, skew):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ranks, (wg, w1, w2) = moe.make_inputs(world, 11, 16, 12, 4 * world, seed=5, skew=skew)
        want = moe.reference([i["x"] for i in ranks], wg, w1, w2, top_k=2)[rank]
        got = torch_moe(ranks[rank]["x"], wg, ranks[rank]["w_gate_up"], ranks[rank]["w_down"], top_k=2)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    finally:
        dist.destroy_process_group()


def test_torch_moe_one_and_two_ranks(tmp_path):
    for world, skew in ((1, 0.0), (2, 0.0), (2, 4.0)):
        store = tmp_path / f"s{world}{skew}"
        torch.multiprocessing.spawn(_run, args=(world, str(store), skew), nprocs=world)
