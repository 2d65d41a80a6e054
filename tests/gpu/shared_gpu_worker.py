"""The fused ops at two or more ranks on one GPU (init_mesh(share_gpu=True): NVSHMEM's
multi-process-per-GPU mode), checked against float64 on the CPU: the cross-rank protocols on a
machine with fewer GPUs than ranks (correctness only: the ranks' kernels take turns on the GPU).

    ETDIST_SHARE_GPU=1 CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node=2 tests/gpu/shared_gpu_worker.py

Every rank builds every rank's inputs from the same seeds (no NCCL: it refuses two ranks on one
GPU). Prints 'OK shared-gpu rank r: n checks' once every check passed.
"""
import time

import torch

import etdist as et
from etdist.ops import gemm_rs as gemm_rs_op
from etdist.ops.config import DEFAULT_PLAN
from etdist.workloads import ag_gemm, gemm_rs, mlp

# the size classes at two and three ranks: skinny / whole-gather (16, 100), each rank's rows one
# row tile (129-256 at two ranks: the sources' tiles side by side), per-source tiles (1000)
MS = (16, 100, 129, 160, 256, 1000)
TOL = 2e-2   # bf16 inputs and outputs, fp32 accumulation


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-9)).item()


def main():
    mesh = et.init_mesh()
    assert mesh.shares_gpu, "run with ETDIST_SHARE_GPU=1"
    R, me, dev, bf = mesh.world_size, mesh.rank, mesh.device, torch.bfloat16
    checks = 0

    def check(what, y, ref):
        nonlocal checks
        err = rel_err(y, ref)
        assert y.shape == ref.shape and err < TOL, f"rank {me} {what}: shape {tuple(y.shape)}, rel err {err:.2e}"
        checks += 1

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert gemm_rs_op.kernel_plan(129, 1536, 1024, bf, sms, R, DEFAULT_PLAN)[3].keywords["interleave"] == (R > 1)
    for M in MS:
        t0 = time.time()
        schedules = ("static", "dynamic") if M == 129 else ("static",)
        inputs = gemm_rs.make_inputs(R, M, 1536, 1024, seed=M, dtype=bf)
        ref = gemm_rs.reference([i["x"] for i in inputs], [i["w"] for i in inputs])[me]
        for schedule in schedules:
            y = et.ops.gemm_reduce_scatter(inputs[me]["x"].to(dev), inputs[me]["w"].to(dev), schedule=schedule)
            check(f"gemm_rs M={M} {schedule}", y, ref)
        inputs = ag_gemm.make_inputs(R, M, 1024, 1536, seed=M + 1, dtype=bf)
        ref = ag_gemm.reference([i["x"] for i in inputs], [i["w"] for i in inputs])[me]
        for schedule in schedules:
            y = et.ops.all_gather_gemm(inputs[me]["x"].to(dev), inputs[me]["w"].to(dev), total_rows=M,
                                       schedule=schedule)
            check(f"ag_gemm M={M} {schedule}", y, ref)
        inputs = mlp.make_inputs(R, M, 1024, 1024 * R, seed=M + 2, dtype=bf)
        ref = mlp.reference(*([i[k] for i in inputs] for k in ("x", "w_gate_up", "w_down")))[me]
        mine = {k: v.to(dev) for k, v in inputs[me].items()}
        for schedule in schedules:
            y = et.ops.tensor_parallel_mlp(mine["x"], mine["w_gate_up"], mine["w_down"], total_rows=M,
                                           schedule=schedule)
            check(f"mlp M={M} {schedule}", y, ref)
        inputs = mlp.make_inputs(R, M, 1024, 1024 * R, seed=M + 3, dtype=bf, replicated=True)
        ref = mlp.reference_replicated(inputs[0]["x"], [i["w_gate_up"] for i in inputs],
                                       [i["w_down"] for i in inputs])
        y = et.ops.tensor_parallel_mlp(*(inputs[me][k].to(dev) for k in ("x", "w_gate_up", "w_down")),
                                       sequence_parallel=False)
        check(f"mlp replicated M={M}", y, ref)
        torch.cuda.synchronize()
        if me == 0:
            print(f"[M={M}] checked in {time.time() - t0:.1f} s", flush=True)
    mesh.close()
    print(f"OK shared-gpu rank {me}: {checks} checks", flush=True)


if __name__ == "__main__":
    main()
