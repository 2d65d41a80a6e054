"""GPU checks of the ops and nn modules under torch.compile, one process per GPU:

    torchrun --nproc_per_node=N tests/gpu/compile_worker.py
        -> 'OK compile-ops', 'OK compile-nn', 'OK compile-cudagraphs'

fullgraph=True makes a graph break an error: each op must be one opaque node (collectives/compiled.py).
Compiled with dynamic sizes, run at several M, against the same function run eagerly.
"""
import torch
import torch.distributed as dist
from torch import nn

import etdist as et


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item() if b.numel() else 0.0


def chunk(x, M, mesh):
    C = -(-M // mesh.world_size)
    return x[mesh.rank * C:(mesh.rank + 1) * C].contiguous()


def check_ops(mesh):
    dev, bf16 = mesh.device, torch.bfloat16
    K, N, H, I = 1024, 512, 1024, 512
    w = torch.randn(K, N, device=dev, dtype=bf16) / K ** 0.5
    w_ag = torch.randn(H, N, device=dev, dtype=bf16) / H ** 0.5
    wgu = torch.randn(H, 2 * I, device=dev, dtype=bf16) / H ** 0.5
    wd = torch.randn(I, H, device=dev, dtype=bf16) / I ** 0.5

    def layer(h, x, M):   # torch ops around each of ours, as a model has them
        y = torch.relu(et.ops.gemm_reduce_scatter(h, w, mesh=mesh)) + 1
        z = et.ops.all_gather_gemm(x, w_ag, mesh=mesh, total_rows=M) * 0.5
        m = et.ops.tensor_parallel_mlp(x, wgu, wd, mesh=mesh, total_rows=M)
        s = et.reduce_scatter(torch.cat([m] * mesh.world_size), mesh=mesh)
        return y, z, m + x, et.all_reduce(m, mesh=mesh) * 2, s

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for M in (16, 100, 1000, 64):
        torch.manual_seed(M)
        h = torch.randn(M, K, device=dev, dtype=bf16)
        x = chunk(torch.randn(M, H, device=dev, dtype=bf16), M, mesh)
        for got, want in zip(compiled(h, x, M), layer(h, x, M)):
            assert got.shape == want.shape and rel(got, want) < 1e-2, (M, got.shape, want.shape, rel(got, want))
    print(f"OK compile-ops rank {mesh.rank}", flush=True)


def dense_mlp(dev, H, I):
    """A Llama-style MLP in bf16, the same weights on every rank."""
    dense = nn.Module()
    dense.gate_proj, dense.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
    dense.down_proj, dense.act_fn = nn.Linear(I, H, bias=False), nn.SiLU()
    torch.manual_seed(0)
    return dense.to(dev, torch.bfloat16)


def check_nn(mesh):
    dev, bf16 = mesh.device, torch.bfloat16
    H, I = 1024, 2048
    dense = dense_mlp(dev, H, I)
    for seq in (True, False):
        mlp = et.nn.TensorParallelMLP.from_dense(dense, mesh=mesh, sequence_parallel=seq)
        compiled = torch.compile(lambda t, M: mlp(t, total_rows=M) if seq else mlp(t), fullgraph=True, dynamic=True)
        for M in (16, 100, 1000):
            x = torch.randn(M, H, device=dev, dtype=bf16)
            x = chunk(x, M, mesh) if seq else x
            got, want = compiled(x, M), (mlp(x, total_rows=M) if seq else mlp(x))
            assert got.shape == want.shape and rel(got, want) < 1e-2, (seq, M, rel(got, want))
    for schedule in ("static", "dynamic"):
        moe = et.nn.MoE(512, 256, 8, 2, mesh=mesh, schedule=schedule, dtype=bf16)
        compiled = torch.compile(lambda t: moe(t) * 2, fullgraph=True, dynamic=True)
        for T in (1, 16, 100):
            x = torch.randn(T, 512, device=dev, dtype=bf16)
            got, want = compiled(x), moe(x) * 2
            assert rel(got, want) < 1e-2, (schedule, T, rel(got, want))
    print(f"OK compile-nn rank {mesh.rank}", flush=True)


def check_cudagraphs(mesh):
    """mode="reduce-overhead": inductor's CUDA graphs record our launch (after its warm-up runs,
    which prepare the shape) and replay it with new inputs."""
    dev, bf16 = mesh.device, torch.bfloat16
    K, N, M = 1024, 512, 32
    w = torch.randn(K, N, device=dev, dtype=bf16) / K ** 0.5
    # gemm_rs, and the replicated TensorParallelMLP (whole x in and y out; its all-reduce inside)
    mlp = et.nn.TensorParallelMLP.from_dense(dense_mlp(dev, 1024, 2048), mesh=mesh)
    cases = [(lambda h: torch.relu(et.ops.gemm_reduce_scatter(h, w, mesh=mesh)) * 2, K),
             (lambda x: mlp(torch.nn.functional.rms_norm(x, (1024,))) + x, 1024)]
    from torch._dynamo.utils import counters
    counters.clear()
    for fn, cols in cases:
        step = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        for i in range(6):
            h = torch.randn(M, cols, device=dev, dtype=bf16)
            got = step(h).clone()
            want = fn(h)
            assert rel(got, want) < 1e-2, (i, rel(got, want))
    # a skipped graph (a mutated input, say) runs without CUDA graphs and would pass the checks above
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    # et.all_gather's default check=True synchronises: inside a capture, a clear error before launch
    x = torch.randn(8, 4, device=dev)
    et.all_gather(x, mesh=mesh)
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            et.all_gather(x, mesh=mesh)
        raise AssertionError("all_gather(check=True) was captured")
    except et.MeshError as e:
        assert "check=True synchronises" in str(e), e
    print(f"OK compile-cudagraphs rank {mesh.rank}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    check_ops(mesh)
    check_nn(mesh)
    check_cudagraphs(mesh)
    mesh.close()
