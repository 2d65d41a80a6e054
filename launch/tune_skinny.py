"""A/B the gemm_rs skinny class (M <= 64) configs, tasks per SM included, on this node's GPUs:

    torchrun --nproc_per_node=2 launch/tune_skinny.py block_m,block_n,block_k,warps,stages,tasks_per_sm ...

us per call (batched, slowest rank) at M=16 (and M=128 where block_m allows) on three shapes.
Times only: check a winner's correctness with tests/gpu/gemm_rs_worker.py under the same knobs.
"""
import itertools
import sys

import torch
import torch.distributed as dist
import etdist as et
from etdist.measure.timing import time_ranks
from etdist.ops import gemm_rs as op

dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
R, dev = mesh.world_size, mesh.device
shapes = {"qwen3_8b": (4096, 12288), "llama31_70b": (8192, 28672), "qwen3_32b": (5120, 25600)}
res = {}
for spec in sys.argv[1:]:
    bm, bn, bk, w, s, tps = (float(v) if i == 5 else int(v) for i, v in enumerate(spec.split(",")))
    cfg = op.TileConfig(bm, bn, bk, w, s)
    op.SKINNY_CLASSES = (cfg,)
    op.SKINNY_TASKS_PER_SM = {cfg: tps}
    op._KERNELS.clear()
    row = []
    for name, (N, KF) in shapes.items():
        for M in (16, 128):
            if M > bm:
                row.append(float("nan")); continue
            K = KF // R
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ws = itertools.cycle([torch.randn(K, N, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(4)])
            try:
                t = time_ranks(lambda: op.gemm_reduce_scatter(x, next(ws), mesh=mesh), device=dev)
            except Exception as e:
                if mesh.rank == 0: print(spec, "failed:", str(e)[:200], flush=True)
                t = float("nan")
            row.append(t)
    res[spec] = row
    if mesh.rank == 0:
        print(f"{spec:22} " + " ".join(f"{v:7.1f}" for v in row), flush=True)
if mesh.rank == 0:
    print("columns: " + " ".join(f"{n}/M={M}" for n in shapes for M in (16, 128)))
mesh.close()
