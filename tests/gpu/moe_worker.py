"""et.nn.MoE on GPUs (one process per GPU), both schedules, uniform and skewed routing, against
the float64 torch layer; then the layer captured in a CUDA graph and replayed with new tokens (the
routing, so which tiles exist, changes between replays), bf16 in both tile classes, and the torch
baselines of the sweep (grouped experts, exact and padded dispatch, the padded one captured in a CUDA graph):

    torchrun --nproc_per_node=N tests/gpu/moe_worker.py  -> 'OK moe <schedule>', 'OK moe-graph <schedule>',
                                                            'OK moe-bf16 <schedule>', 'OK moe-baselines'
"""
import torch
import torch.distributed as dist

import etdist as et
from etdist.bench.measure.baselines import graphed
from etdist.bench.measure.moe_baseline import torch_moe
from etdist.workloads import moe as moe_graph


def rel_err(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


def main():
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    R, r, dev = mesh.world_size, mesh.rank, mesh.device
    H, I, E, K = 256, 128, 8 * R, 2
    for schedule in ("static", "dynamic"):
        for T, skew in ((16, 0.0), (100, 4.0), (1, 0.0)):
            ranks, (wg, w1, w2) = moe_graph.make_inputs(R, T, H, I, E, seed=T, skew=skew)
            want = moe_graph.reference([i["x"] for i in ranks], wg, w1, w2, top_k=K)[r]
            layer = et.nn.MoE(H, I, E, K, mesh=mesh, schedule=schedule, dtype=torch.float32)
            layer.load_experts(w1[..., :I], w1[..., I:], w2, wg)
            for _ in range(2):
                y = layer(ranks[r]["x"].to(dev)).cpu()
                err = rel_err(y, want)
                assert err < 1e-3, (schedule, T, skew, err)
        print(f"OK moe {schedule} rank {r}", flush=True)

        # captured once, replayed with new tokens: routing runs in the kernel, so each replay
        # routes its own tokens (uniform, then skewed toward a few experts)
        T = 24
        _, (wg, w1, w2) = moe_graph.make_inputs(R, T, H, I, E, seed=7)
        layer = et.nn.MoE(H, I, E, K, mesh=mesh, schedule=schedule, dtype=torch.float32)
        layer.load_experts(w1[..., :I], w1[..., I:], w2, wg)
        x = torch.randn(T, H, device=dev)
        layer(x)                                       # the first call at a shape prepares it
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = layer(x)
        for seed, skew in ((1, 0.0), (2, 6.0)):
            gen = torch.Generator().manual_seed(seed)
            xs = [torch.randn(T, H, generator=gen) + skew * wg[:, 0] / wg[:, 0].norm() for _ in range(R)]
            x.copy_(xs[r])
            g.replay()
            err = rel_err(y, moe_graph.reference(xs, wg, w1, w2, top_k=K)[r])
            assert err < 1e-3, ("graph", schedule, seed, err)
            assert rel_err(layer(x), moe_graph.reference(xs, wg, w1, w2, top_k=K)[r]) < 1e-3  # eager in between
        print(f"OK moe-graph {schedule} rank {r}", flush=True)

    # bf16, both tile classes (float32 above only takes the small one): 300 tokens a rank give the
    # average expert 75 rows, past nn.moe.LARGE_ROWS_PER_EXPERT; an intermediate size of two blocks
    # of 128, which w_gate_up interleaves (one dot over gate and up)
    rounded = lambda t: t.bfloat16().double()   # noqa: E731  (the reference routes what the kernel sees)
    Ib = 2 * I
    for schedule in ("static", "dynamic"):
        for T, skew in ((16, 0.0), (300, 2.0)):
            ranks, (wg, w1, w2) = moe_graph.make_inputs(R, T, H, Ib, E, seed=T + 1, skew=skew)
            want = moe_graph.reference([rounded(i["x"]) for i in ranks], rounded(wg), rounded(w1), rounded(w2),
                                       top_k=K)[r]
            layer = et.nn.MoE(H, Ib, E, K, mesh=mesh, schedule=schedule, dtype=torch.bfloat16)
            layer.load_experts(w1[..., :Ib], w1[..., Ib:], w2, wg)
            assert layer.large_tiles(T) == (T == 300) and layer.gate_up_block == 128
            err = rel_err(layer(ranks[r]["x"].to(dev, torch.bfloat16)), want)
            assert err < 3e-2, ("bf16", schedule, T, err)
        print(f"OK moe-bf16 {schedule} (both tile classes) rank {r}", flush=True)

    if mesh.shares_gpu:   # the baselines' all-to-all is NCCL's, which refuses ranks that share a GPU
        mesh.close()
        return
    # the sweep's baselines in bf16 (torch._grouped_mm takes bf16 on GPUs) against float64
    T = 40
    ranks, (wg, w1, w2) = moe_graph.make_inputs(R, T, H, I, E, seed=3, skew=2.0)
    # the reference routes the bf16-rounded inputs: on the originals one token of rank 0 picks
    # another expert (a near tie), an error of 0.27 that is the rounding's, not the baseline's
    want = moe_graph.reference([rounded(i["x"]) for i in ranks], rounded(wg), rounded(w1), rounded(w2), top_k=K)[r]
    bf = {k: v.to(dev, torch.bfloat16) for k, v in ranks[r].items()}
    for experts in ("grouped", "fused"):          # fused: the serving engine's kernels (measure.fused_moe)
        for dispatch in ("exact", "padded"):
            got = torch_moe(bf["x"], bf["wg"], bf["w_gate_up"], bf["w_down"], K, experts=experts, dispatch=dispatch)
            assert rel_err(got, want) < 3e-2, (experts, dispatch, rel_err(got, want))
        replay = graphed(lambda i: torch_moe(bf["x"], bf["wg"], bf["w_gate_up"], bf["w_down"], K, experts=experts,
                                             dispatch="padded"), 1, dev)
        assert rel_err(replay(), want) < 3e-2, (experts, "graph")
    print(f"OK moe-baselines rank {r}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
