"""et.nn.MoE on GPUs (one process per GPU), both schedules, uniform and skewed routing, against
the float64 torch layer: torchrun --nproc_per_node=N tests/gpu/moe_worker.py  -> 'OK moe <schedule>'."""
import torch
import torch.distributed as dist

import etdist as et
from etdist.workloads import moe as moe_graph


def main():
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    R, r = mesh.world_size, mesh.rank
    H, I, E, K = 256, 128, 8 * R, 2
    for schedule in ("static", "dynamic"):
        for T, skew in ((16, 0.0), (100, 4.0), (1, 0.0)):
            ranks, (wg, w1, w2) = moe_graph.make_inputs(R, T, H, I, E, seed=T, skew=skew)
            want = moe_graph.reference([i["x"] for i in ranks], wg, w1, w2, top_k=K)[r]
            layer = et.nn.MoE(H, I, E, K, mesh=mesh, schedule=schedule, dtype=torch.float32)
            layer.load_experts(w1[..., :I], w1[..., I:], w2, wg)
            for _ in range(2):
                y = layer(ranks[r]["x"].to(mesh.device)).cpu()
                err = ((y.double() - want).abs().max() / want.abs().max()).item()
                assert err < 1e-3, (schedule, T, skew, err)
        print(f"OK moe {schedule} rank {r}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
