"""Tensor-parallel groups inside a 4-process job: two TP groups of 2 (torch sub-groups, or the "tp"
dimension of a 2x2 DeviceMesh), each running the fused ops and the nn layers on its own data,
against float64 references. On the cpu backend (the CPU runtime) or on GPUs (nvshmem: NVSHMEM over
the four processes, each group's mesh in its own region; fp32 multiplies as TF32 there).

    torchrun --nproc_per_node=4 tests/cpu_mesh/groups_worker.py subgroups|device_mesh [cpu|nvshmem]
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import etdist as et
from etdist.mesh import liveness
from etdist.workloads import ag_gemm, gemm_rs

liveness.SHM_DIR = os.environ.get("TEST_SHM_DIR")   # the test's own directory, checked empty after
HEAP_MB = 256   # each group's NVSHMEM region: ample for these sizes (no effect on the cpu backend)


def rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def dense_moe(x, gate, up, down, router, k):
    probs = torch.softmax(x @ router, dim=-1)
    w, idx = probs.topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            e = idx[t, j]
            y[t] += w[t, j] * ((F.silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    return y


def main():
    backend = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if sys.argv[1] == "subgroups":
        tp, _ = dist.new_subgroups(group_size=2)
        mesh = et.init_mesh(backend=backend, group=tp, watchdog_s=30, group_heap_mb=HEAP_MB)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh = et.init_mesh(backend=backend, device_mesh=dm, dim="tp", watchdog_s=30, group_heap_mb=HEAP_MB)
    dev = mesh.device
    tol = 1e-5 if backend == "cpu" else 2e-2
    group = rank // 2                      # each TP group runs its own data
    W, r = mesh.world_size, mesh.rank
    assert (W, r) == (2, rank % 2), (W, r)

    M, K, N = 37, 24, 40                   # ragged rows: 19 + 18
    ins = gemm_rs.make_inputs(W, M, K, N, seed=100 + group)
    y = et.ops.gemm_reduce_scatter(ins[r]["x"].to(dev), ins[r]["w"].to(dev), mesh=mesh).cpu()
    want = gemm_rs.reference([i["x"] for i in ins], [i["w"] for i in ins])[r]
    assert y.shape == want.shape and rel(y, want) < tol, ("gemm_rs", rel(y, want))

    ins = ag_gemm.make_inputs(W, M, K, N, seed=200 + group)
    y = et.ops.all_gather_gemm(ins[r]["x"].to(dev), ins[r]["w"].to(dev), mesh=mesh, total_rows=M).cpu()
    want = ag_gemm.reference([i["x"] for i in ins], [i["w"] for i in ins])[r]
    assert y.shape == want.shape and rel(y, want) < tol, ("ag_gemm", rel(y, want))

    H, I = 32, 64
    gen = torch.Generator().manual_seed(300 + group)
    dense = torch.nn.Module()
    dense.gate_proj, dense.up_proj = torch.nn.Linear(H, I, bias=False), torch.nn.Linear(H, I, bias=False)
    dense.down_proj = torch.nn.Linear(I, H, bias=False)
    for lin in (dense.gate_proj, dense.up_proj, dense.down_proj):
        lin.weight.data = torch.randn(lin.weight.shape, generator=gen) / lin.weight.shape[1] ** 0.5
    x = torch.randn(9, H, generator=gen)   # the same on both ranks of the group (replicated layer)
    with torch.no_grad():
        want = dense.down_proj(F.silu(dense.gate_proj(x)) * dense.up_proj(x)).double()
    mlp = et.nn.TensorParallelMLP.from_dense(dense.to(dev), mesh=mesh)
    assert rel(mlp(x.to(dev)).cpu(), want) < tol, ("mlp", rel(mlp(x.to(dev)).cpu(), want))
    seq = et.nn.TensorParallelMLP.from_dense(dense.to(dev), mesh=mesh, sequence_parallel=True)
    C = -(-9 // W)
    got = seq(x[r * C:(r + 1) * C].to(dev), total_rows=9).cpu()
    assert rel(got, want[r * C:(r + 1) * C]) < tol, "mlp sequence-parallel"

    E, Ie, top_k = 8, 20, 2
    gen = torch.Generator().manual_seed(400 + group)
    gate, up = torch.randn(E, H, Ie, generator=gen) / H ** 0.5, torch.randn(E, H, Ie, generator=gen) / H ** 0.5
    down, router = torch.randn(E, Ie, H, generator=gen) / Ie ** 0.5, torch.randn(H, E, generator=gen)
    moe = et.nn.MoE(H, Ie, E, top_k, mesh=mesh, dtype=torch.float32)
    moe.load_experts(*(t.to(dev) for t in (gate, up, down, router)))
    tokens = torch.randn(W, 6, H, generator=gen)   # each rank its own 6 tokens
    want = dense_moe(tokens[r].double(), gate.double(), up.double(), down.double(), router.double(), top_k)
    got = moe(tokens[r].to(dev)).cpu()
    assert rel(got, want) < tol, ("moe", rel(got, want))

    got = et.all_reduce(torch.full((3,), float(rank), device=dev), mesh=mesh).cpu()   # the group's ranks only
    assert got.tolist() == [float(2 * (rank - r) + 1)] * 3, got
    print(f"OK groups {sys.argv[1]} rank {rank} (group {group}, rank {r} of {W}): gemm_rs, ag_gemm, mlp, moe, "
          f"all_reduce", flush=True)
    mesh.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
