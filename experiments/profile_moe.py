"""nn.MoE's megakernel and the fused MoE baseline, one launch each after warm-up, for Nsight Compute:

    ncu --profile-from-start off --kernel-name regex:"megakernel|_expert_gemm" --section SpeedOfLight \
        --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum,lts__t_bytes.sum \
        python3 -m torch.distributed.run --nproc_per_node=1 experiments/profile_moe.py mixtral_8x7b 1024 0 static,dynamic

Arguments: model (etdist.bench.measure.shapes.MOE_SHAPES), tokens, routing skew (0: uniform; 1.5: the benchmark's
Zipf), schedules. Only the calls between cudaProfilerStart and Stop are profiled: the layer once per
schedule, then the fused baseline (etdist.bench.measure.fused_moe, its tuned config). ncu serialises the
kernels and fixes the clocks: its durations compare with each other, not with timed records.
"""
import sys

import torch
import torch.distributed as dist

import etdist as et
from etdist.bench.gpu import moe_operands
from etdist.bench.measure import fused_moe
from etdist.bench.measure.shapes import MOE_SHAPES


def main(model: str, tokens: int, skew: float, schedules: list[str]):
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    m = MOE_SHAPES[model]
    H, I, E, k = m.hidden, m.expert_intermediate, m.num_experts, m.top_k
    x, router, (wgu,), (wd,) = moe_operands(mesh, H, I, E, tokens, skew, copies=1)
    layers = []
    for sched in schedules:
        layer = et.nn.MoE(H, I, E, k, mesh=mesh, schedule=sched)
        layer.router.data, layer.w_gate_up[0].data, layer.w_down[0].data = router, layer.pack_gate_up(wgu), wd
        layers.append(layer)
    w, ids = torch.softmax(x.float() @ router.float(), -1).topk(k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    for _ in range(3):                       # compile, tune, warm up: none of it profiled
        for layer in layers:
            layer(x)
        fused_moe.fused_moe(x, ids, w, wgu, wd)
    torch.cuda.synchronize()
    print("fused config", fused_moe.pick_config(x, ids, w, wgu, wd).label, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    for layer in layers:
        layer(x)
    fused_moe.fused_moe(x, ids, w, wgu, wd)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    mesh.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split(",") if len(sys.argv) > 4 else ["static"])
