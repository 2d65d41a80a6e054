"""Collective graph fragments on real GPUs (every task a Triton body), one process per GPU:

    torchrun --nproc_per_node=2 tests/gpu/fragments_worker.py      -> prints 'OK all_reduce', 'OK all_to_all'
"""
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import etdist as et
from etdist.workloads import collectives


@triton.jit
def copy_rows(s, i, j, ag_out, y, M, N, C, BLOCK: tl.constexpr):
    """y[rows of source s, tile (i, j)] = ag_out[same rows], cut at M."""
    offs_m = s * C + i * BLOCK + tl.arange(0, BLOCK)
    offs_n = j * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m[:, None] < tl.minimum(M, (s + 1) * C)) & (offs_n[None, :] < N)
    offs = offs_m[:, None] * N + offs_n[None, :]
    tl.store(y + offs, tl.load(ag_out + offs, mask=mask), mask=mask)


@triton.jit
def copy_recv(s, a2a_recv, a2a_recv_cnt, y, CAP, H, BLOCK: tl.constexpr):
    n = tl.load(a2a_recv_cnt + s).to(tl.int32)
    offs_m = tl.arange(0, BLOCK)
    offs_h = tl.arange(0, BLOCK)
    for h0 in range(0, H, BLOCK):
        mask = (offs_m[:, None] < CAP) & (h0 + offs_h[None, :] < H)
        offs = (s * CAP + offs_m[:, None]) * H + h0 + offs_h[None, :]
        v = tl.load(a2a_recv + offs, mask=mask & (offs_m[:, None] < n), other=0.0)
        tl.store(y + offs, v, mask=mask)


def all_reduce_graph(B=32):
    g = et.Graph("ar_gpu")
    M, N = g.size("M"), g.size("N", multiple_of=16)
    R, me = g.world, g.rank
    C = et.cdiv(M, R)
    x = g.input("x", (M, N), torch.float32)
    g.output("y", (M, N), torch.float32)
    summed, done = collectives.reduce_scatter(g, x, block_m=B, block_n=B)
    _, arrived = collectives.all_gather(g, summed, block_m=B, block_n=B, after=lambda i, j: done[i, j])

    @g.task(grid=(R, et.cdiv(C, B), et.cdiv(N, B)), wait=lambda s, i, j: arrived[me, s, i, j],
            triton=copy_rows, constexprs=dict(BLOCK=B), bind=dict(C=C))
    def unpad(t, s, i, j):
        pass
    return g


def all_to_all_graph(B=16):
    g = et.Graph("a2a_gpu")
    S, H, CAP = g.size("S"), g.size("H", multiple_of=16), g.size("CAP")
    x = g.input("x", (S, H), torch.float32)
    off, cnt = g.input("off", (g.world,), torch.int64), g.input("cnt", (g.world,), torch.int64)
    g.output("y", (g.world, CAP, H), torch.float32)
    _, _, arrived = collectives.all_to_all(g, x, off, cnt, capacity=CAP)

    @g.task(grid=(g.world,), wait=lambda s: arrived[g.rank, s], triton=copy_recv, constexprs=dict(BLOCK=B))
    def take(t, s):
        pass
    return g


def main():
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    R, dev = mesh.world_size, mesh.device
    ar = et.compile(all_reduce_graph(), target="cuda")
    for M in (1, 37, 256, 1000):
        x = torch.randint(-8, 8, (M, 96), device=dev).float()
        want = x.clone()
        dist.all_reduce(want)
        for _ in range(3):  # re-armed counters
            y = ar(mesh, x=x, sizes={})["y"]
        ar.check(mesh)
        assert torch.equal(y, want), (M, (y - want).abs().max().item())
    print(f"OK all_reduce rank {mesh.rank}", flush=True)
    a2a = et.compile(all_to_all_graph(), target="cuda")
    gen = torch.Generator().manual_seed(7)
    counts = torch.randint(0, 5, (R, R), generator=gen)            # counts[src, dst]
    xs = [torch.randn(16, 32, generator=gen) for _ in range(R)]
    me = mesh.rank
    offs = torch.cumsum(counts[me], 0) - counts[me]
    y = a2a(mesh, x=xs[me].to(dev), off=offs.to(dev), cnt=counts[me].to(dev), sizes={"CAP": 8})["y"]
    a2a.check(mesh)
    for s in range(R):
        o = (torch.cumsum(counts[s], 0) - counts[s])[me]
        n = counts[s, me]
        assert torch.equal(y[s, :n].cpu(), xs[s][o:o + n]), s
        assert torch.equal(y[s, n:].cpu(), torch.zeros(8 - n, 32)), s
    print(f"OK all_to_all rank {mesh.rank}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
