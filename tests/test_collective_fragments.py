"""Collectives as graph fragments: alone, chained into an all-reduce, after a producer task, and
compiled for the GPU (PTX on the host)."""
import re

import pytest
import torch
import triton

import etdist as et
from etdist.fusion.codegen_triton import compile_ptx
from etdist.workloads import collectives

from conftest import rel_err

WORLDS = (1, 2, 3, 4, 8)


def all_reduce_graph(block=4, dtype=torch.float32):
    """x [M, N] -> producer task (x * 2) -> reduce_scatter -> all_gather -> y [M, N] on every rank."""
    g = et.Graph("all_reduce")
    M, N = g.size("M"), g.size("N")
    R, me = g.world, g.rank
    C = et.cdiv(M, R)
    g.input("x", (M, N), dtype)
    x2 = g.scratch("x2", (M, N), dtype)
    g.output("y", (M, N), dtype)
    nt = et.cdiv(N, block)
    doubled = g.event("doubled", (R, et.cdiv(C, block), nt))  # per (chunk, row tile, col tile)

    @g.task(grid=(R, et.cdiv(C, block), nt), notify=lambda c, i, j: doubled[c, i, j])
    def double(t, c, i, j):                                   # a producer the collective overlaps with
        rows = et.shift(et.block(i, block, t(et.maximum(0, et.minimum(C, M - c * C)))), c * t(C))
        cols = et.block(j, block, t.N)
        t.x2[rows, cols] = 2 * t.x[rows, cols]

    summed, done = collectives.reduce_scatter(g, x2, block_m=block, block_n=block,
                                              after=lambda c, i, j: doubled[c, i, j])
    gathered, arrived = collectives.all_gather(g, summed, block_m=block, block_n=block,
                                               after=lambda i, j: done[i, j])

    @g.task(grid=(R, et.cdiv(C, block), nt), wait=lambda s, i, j: arrived[me, s, i, j])
    def unpad(t, s, i, j):                                    # gathered rows [s*C, ...) -> y, cut at M
        rows = et.shift(et.block(i, block, t(et.maximum(0, et.minimum(C, M - s * C)))), s * t(C))
        cols = et.block(j, block, t.N)
        t.y[rows, cols] = t.ag_out[rows, cols]

    return g


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [13, 1])
def test_all_reduce_from_fragments(schedule, world, M):
    kernel = et.compile(all_reduce_graph(), schedule=schedule, programs=3)
    gen = torch.Generator().manual_seed(world * 100 + M)
    xs = [torch.randn(M, 6, generator=gen) for _ in range(world)]
    want = 2 * sum(x.double() for x in xs)
    for seed in range(10):
        out = kernel.run([{"x": x} for x in xs], interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(out[r]["y"], want) < 1e-6, (r, seed)


def test_reduce_scatter_fragment_alone():
    g = et.Graph("rs_alone")
    M, N = g.size("M"), g.size("N")
    x = g.input("x", (M, N))
    C = et.cdiv(M, g.world)
    g.output("y", (C, N))
    out, done = collectives.reduce_scatter(g, x, block_m=4, block_n=4)

    @g.task(grid=(et.cdiv(C, 4), et.cdiv(N, 4)), wait=lambda i, j: done[i, j])
    def copy_out(t, i, j):
        rows, cols = et.block(i, 4, t(C)), et.block(j, 4, t.N)
        t.y[rows, cols] = t.rs_out[rows, cols]

    kernel = et.compile(g, schedule="static")
    xs = [torch.randn(10, 5) for _ in range(3)]
    got = kernel.run([{"x": x} for x in xs], interleave="random", seed=1)
    total = sum(x.double() for x in xs)
    for r in range(3):  # C = 4: rank 2 owns rows 8..9 only
        rows = total[r * 4:(r + 1) * 4]
        assert rel_err(got[r]["y"][:rows.shape[0]], rows) < 1e-6


def test_fragments_compile_for_the_gpu():
    """reduce_scatter -> all_gather, with a GPU sink task, compiles for sm_90 with sys-scope signals."""
    g = et.Graph("rs_ag")
    M, N = g.size("M", multiple_of=16), g.size("N", multiple_of=16)
    x = g.input("x", (M, N), torch.bfloat16)
    summed, done = collectives.reduce_scatter(g, x, block_m=64, block_n=64)
    gathered, arrived = collectives.all_gather(g, summed, block_m=64, block_n=64, after=lambda i, j: done[i, j])

    @triton.jit
    def nop(s, i, j):
        pass

    @g.task(grid=(g.world, 1, 1), wait=lambda s, i, j: arrived[g.rank, s, i, j], triton=nop)
    def sink(t, s, i, j):
        pass

    ptx = compile_ptx(g.to_ir())
    assert re.search(r"atom\.global\.sys\.release\.add", ptx) and re.search(r"ld\.acquire\.sys", ptx)


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_to_all_with_per_peer_counts(schedule, world):
    g = et.Graph("a2a")
    S, H, CAP = g.size("S"), g.size("H"), g.size("CAP")
    x = g.input("x", (S, H))
    off = g.input("off", (g.world,), torch.int64)
    cnt = g.input("cnt", (g.world,), torch.int64)
    g.output("y", (g.world, CAP, H))
    recv, recv_cnt, arrived = collectives.all_to_all(g, x, off, cnt, capacity=CAP)

    @g.task(grid=(g.world,), wait=lambda s: arrived[g.rank, s])
    def take(t, s):
        n = int(t.a2a_recv_cnt[s])
        t.y[s, :n] = t.a2a_recv[s, :n]
        t.y[s, n:] = 0

    kernel = et.compile(g, schedule=schedule)
    gen = torch.Generator().manual_seed(world)
    ins, want = [], [torch.zeros(world, 5, 3) for _ in range(world)]
    for r in range(world):
        counts = torch.randint(0, 4, (world,), generator=gen)   # rows for each peer, some zero
        offs = torch.cumsum(counts, 0) - counts
        x_r = torch.randn(4 * world, 3, generator=gen)          # the same S on every rank
        ins.append({"x": x_r, "off": offs, "cnt": counts})
        for p in range(world):
            want[p][r, :counts[p]] = x_r[offs[p]:offs[p] + counts[p]]
    for seed in range(5):
        got = kernel.run(ins, sizes={"CAP": 5}, interleave="random", seed=seed)
        for p in range(world):
            assert torch.equal(got[p]["y"], want[p])


def test_all_to_all_fragment_compiles_for_the_gpu():
    g = et.Graph("a2a_gpu")
    S, H, CAP = g.size("S"), g.size("H", multiple_of=16), g.size("CAP")
    x = g.input("x", (S, H), torch.bfloat16)
    off, cnt = g.input("off", (g.world,), torch.int64), g.input("cnt", (g.world,), torch.int64)
    recv, recv_cnt, arrived = collectives.all_to_all(g, x, off, cnt, capacity=CAP)

    @triton.jit
    def nop(s):
        pass

    @g.task(grid=(g.world,), wait=lambda s: arrived[g.rank, s], triton=nop)
    def take(t, s):
        pass

    ptx = compile_ptx(g.to_ir())
    assert re.search(r"atom\.global\.sys\.release\.add", ptx) and re.search(r"ld\.acquire\.sys", ptx)
