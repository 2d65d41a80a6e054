"""GPU checks of et.ops.all_gather_gemm and et.nn.TensorParallelMLP, one process per GPU:

    torchrun --nproc_per_node=N tests/gpu/mlp_worker.py
        -> 'OK ag_gemm', 'OK mlp-seq', 'OK mlp-replicated', 'OK mlp-tail', 'OK mlp-fp32'
"""
import torch
import torch.distributed as dist
from torch import nn

import etdist as et


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item() if b.numel() else 0.0


def main():
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    R, r, dev = mesh.world_size, mesh.rank, mesh.device
    torch.manual_seed(0)  # the same full tensors on every rank
    K, N = 1024, 512
    # every whole-gather class at its edges, the 128-row class's tail (129-160), ragged, large; fp32
    # (transposed 32-row tiles) in each class
    cases = [(M, torch.bfloat16) for M in (16, 32, 33, 64, 65, 100, 128, 129, 160, 161, 1000, 4096)]
    for M, dtype in cases + [(M, torch.float32) for M in (16, 64, 100, 150)]:
        x = torch.randn(M, K, device=dev, dtype=dtype)
        w = torch.randn(K, N * R, device=dev, dtype=dtype) / K ** 0.5
        C = -(-M // R)
        y = et.ops.all_gather_gemm(x[r * C:(r + 1) * C].contiguous(), w[:, r * N:(r + 1) * N].contiguous(),
                                   mesh=mesh, total_rows=M)
        assert rel(y, x.float() @ w[:, r * N:(r + 1) * N].float()) < 1e-2, (M, dtype)
    # past 256 rows, columns enough for the whole-gather graph's large tiles to fill their waves
    # (ops.ag_gemm.whole_large), ragged M
    for M, n in ((300, 20480), (640, 20480)):
        x = torch.randn(M, 512, device=dev, dtype=torch.bfloat16)
        w = torch.randn(512, n, device=dev, dtype=torch.bfloat16) / 512 ** 0.5
        C = -(-M // R)
        y = et.ops.all_gather_gemm(x[r * C:(r + 1) * C].contiguous(), w, mesh=mesh, total_rows=M)
        assert rel(y, x.float() @ w.float()) < 1e-2, M
    print(f"OK ag_gemm rank {r}", flush=True)
    H, I = 1024, 4096
    dense = nn.Module()
    dense.gate_proj, dense.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
    dense.down_proj, dense.act_fn = nn.Linear(I, H, bias=False), nn.SiLU()
    dense = dense.to(dev, torch.bfloat16)
    ref = lambda t: dense.down_proj(dense.act_fn(dense.gate_proj(t)) * dense.up_proj(t))
    for seq in (True, False):
        mlp = et.nn.TensorParallelMLP.from_dense(dense, mesh=mesh, sequence_parallel=seq)
        # H = 1024 on 132 SMs: every down tile in slices from 129 rows to 2048 (at most 64 tiles of 256
        # columns); at 4096 and 8192 every tile whole (the tail plans slice none of this small shape's:
        # check_tail_slices runs that graph at each TAIL)
        for M in (16, 33, 64, 100, 256, 300, 1000, 2048, 4096, 8192):
            x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
            C = -(-M // R)
            want = ref(x.float().to(torch.bfloat16))
            if seq:
                got, want = mlp(x[r * C:(r + 1) * C].contiguous(), total_rows=M), want[r * C:(r + 1) * C]
            else:
                got = mlp(x)
            assert rel(got, want) < 2e-2, (seq, M, rel(got, want))
        if not seq:
            # one launch, no host sync (its all-reduce is in the kernel): a call at a shape run
            # before returns while the GPU is still busy with the work queued before it
            torch.cuda._sleep(1 << 30)
            mlp(x)
            assert not torch.cuda.current_stream().query(), "the replicated TensorParallelMLP waited for the GPU"
            torch.cuda.synchronize()
            # an x longer than one launch's partials allow runs in launches of replicated_rows rows
            # (here 128: 300 rows in 128 + 128 + 44), each into its rows of one y
            from etdist.ops import mlp as mlp_op
            saved, mlp_op.SCRATCH_BYTES = mlp_op.SCRATCH_BYTES, R * 128 * H * 2
            try:
                x = torch.randn(300, H, device=dev, dtype=torch.bfloat16)
                assert mlp_op.replicated_rows(H, R, 2) == 128
                assert rel(mlp(x), ref(x)) < 2e-2, ("chunked", rel(mlp(x), ref(x)))
            finally:
                mlp_op.SCRATCH_BYTES = saved
            # a replicated module takes the whole x: total_rows of other rows is refused (last: a
            # refusal stops the module's kernel on the mesh, peers included)
            try:
                mlp(x, total_rows=x.shape[0] + 1)
            except et.InputError as e:
                assert "not sequence-parallel" in str(e), e
            else:
                raise AssertionError("a replicated TensorParallelMLP took total_rows")
        print(f"OK mlp-{'seq' if seq else 'replicated'} rank {r}", flush=True)
    check_tail_slices(mesh, et.nn.TensorParallelMLP.from_dense(dense, mesh=mesh), ref)
    dense = dense.float()   # fp32: the whole-gather classes' tiles with halved contraction steps
    mlp = et.nn.TensorParallelMLP.from_dense(dense, mesh=mesh, sequence_parallel=True)
    for M in (16, 64, 100):
        x = torch.randn(M, H, device=dev)
        C = -(-M // R)
        got, want = mlp(x[r * C:(r + 1) * C].contiguous(), total_rows=M), ref(x)[r * C:(r + 1) * C]
        assert rel(got, want) < 1e-2, ("fp32", M, rel(got, want))
    print(f"OK mlp-fp32 rank {r}", flush=True)
    mesh.close()


def check_tail_slices(mesh, mlp, ref):
    """The MLP graph whose last TAIL down tiles run in 3 contraction slices (PlanConfig.mlp_tail_splits),
    with the op's tiles and own rows read from x as the op builds it, at TAIL = 0, 1, one owner's
    every down tile (mn) and every owner's (R x mn), ragged M too."""
    from etdist.ops.config import DEFAULT_PLAN
    from etdist.workloads import mlp as mlp_graph
    R, r, dev, cfg = mesh.world_size, mesh.rank, mesh.device, DEFAULT_PLAN.mlp_tiles
    down_n = DEFAULT_PLAN.mlp_down_n
    kernel = et.compile(mlp_graph.tp_mlp(cfg.block_m, cfg.block_n, torch.bfloat16, cfg.block_k, 16,
                                         down_n=down_n, tail_splits=3, own_from_x=True),
                        target="cuda")
    kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
    H = mlp.w_down[0].shape[1]
    for M in (1000, 2048):
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        C = -(-M // R)
        want = ref(x)[r * C:(r + 1) * C]
        mn = -(-C // cfg.block_m) * -(-H // down_n)
        for tail in sorted({0, 1, mn, R * mn}):
            got = kernel(mesh, x=x[r * C:(r + 1) * C].contiguous(), w_gate_up=mlp.w_gate_up[0].data,
                         w_down=mlp.w_down[0].data, sizes={"M": M, "TAIL": tail})["y"]
            kernel.check(mesh)
            assert rel(got, want) < 2e-2, (M, tail, rel(got, want))
    print(f"OK mlp-tail rank {r}", flush=True)


if __name__ == "__main__":
    main()
