"""A count read from a tensor the kernel writes, on the GPU codegen (under Triton's interpreter):
`plan` decides at run time how many `work` tiles exist (like MoE routing), `done`'s count is that
number + 1, and it changes from launch to launch (the kernel zeroes such counters at its end).

    TRITON_INTERPRET=1 torchrun --nproc_per_node=2 tests/interp/data_dependent_worker.py [--dynamic]
"""
import sys

import torch
import triton
import triton.language as tl

import etdist as et

B = 16


@triton.jit
def plan_body(n_in, cnt, N):
    tl.store(cnt, tl.minimum(tl.load(n_in), N))


@triton.jit
def work_body(i, x, y, B: tl.constexpr):
    offs = i * B + tl.arange(0, B)
    tl.store(y + offs, 2 * tl.load(x + offs))


@triton.jit
def fin_body(y, cnt, total, B: tl.constexpr):
    acc = tl.zeros((B,), tl.float32)
    for k in range(0, tl.load(cnt)):
        acc += tl.load(y + k * B + tl.arange(0, B))
    tl.store(total, tl.sum(acc))


def graph():
    g = et.Graph("data_dependent")
    N = g.size("N")
    g.input("x", (N * B,), torch.float32)
    g.input("n_in", (1,), torch.int64)
    cnt = g.scratch("cnt", (1,), torch.int64)
    g.output("y", (N * B,), torch.float32)
    g.output("total", (1,), torch.float32)
    planned = g.event("planned", (1,))
    done = g.event("done", (1,), count=lambda e: cnt[0] + 1)     # one per existing tile + plan's

    @g.task(grid=(1,), notify=lambda _: [planned[0], done[0]], triton=plan_body)
    def plan(t, _):
        t.cnt[0] = min(int(t.n_in[0]), t.N)

    @g.task(grid=(N,), wait=lambda i: planned[0], when=lambda i: i < cnt[0], notify=lambda i: done[0],
            triton=work_body, constexprs=dict(B=B))
    def work(t, i):
        t.y[i * B:(i + 1) * B] = 2 * t.x[i * B:(i + 1) * B]

    @g.task(grid=(1,), wait=lambda _: [planned[0], done[0]], triton=fin_body, constexprs=dict(B=B))
    def fin(t, _):
        t.total[0] = t.y[:int(t.cnt[0]) * B].sum()

    return g


def main(args):
    schedule = "dynamic" if "--dynamic" in args else "static"
    mesh = et.init_mesh(backend="cpu")
    kernel = et.compile(graph(), schedule=schedule, target="cuda")
    N = 6
    x = torch.randn(N * B, generator=torch.Generator().manual_seed(mesh.rank))
    for n in (3, 1, 6, 9, 0, 4):          # the count changes every launch (9: capped at N; 0: no tile)
        out = kernel(mesh, x=x, n_in=torch.tensor([n]), sizes={"N": N})
        k = min(n, N)
        assert torch.equal(out["y"][:k * B], 2 * x[:k * B]), (schedule, n)
        assert torch.allclose(out["total"], (2 * x[:k * B]).sum().reshape(1), atol=1e-4), (schedule, n)
    print(f"OK data-dependent {schedule} rank {mesh.rank}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main(sys.argv[1:])
