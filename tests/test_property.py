"""Property tests: random graphs, sizes, program counts and interleavings all give the reference."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import etdist as et
from etdist.workloads import gemm_rs

from conftest import rel_err


def layered(widths, mix, shifts, pinned=0, tail=0):
    """Layer l has widths[l] tasks; task (l, i) on rank r reads two elements of layer l-1 on rank r
    (i % n and (a*i + b) % n) and writes its value into rank (r + shift_l)'s copy, then signals there.
    The first `pinned` layers are pinned (dynamic schedule: the static formula first; the layer after
    them, waiting on pinned work alone, is pushed early, and with early push's chains the layers
    after it too). The last `tail` task functions (the output
    copy, then layers from the last) are the tail (dynamic: the static formula once the queue is drained)."""
    g = et.Graph("layered")
    R, me = g.world, g.rank
    g.input("x", (widths[0],))
    g.output("y", (widths[-1],))
    vals = [g.scratch(f"v{l}", (n,), symmetric=True) for l, n in enumerate(widths)]
    evs = [g.event(f"e{l}", (R, n), distributed=True) for l, n in enumerate(widths)]

    def layer(l):
        n_prev = widths[l - 1] if l else 0
        a, b = mix[l]
        sh = shifts[l]
        wait = (lambda i: [evs[l - 1][me, i % n_prev], evs[l - 1][me, (a * i + b) % n_prev]]) if l else None

        @g.task(grid=(widths[l],), wait=wait, notify=lambda i: evs[l][(me + sh) % R, i], name=f"layer{l}",
                pinned=l < pinned, tail=l >= len(widths) - (tail - 1) if tail else False)
        def body(t, i):
            if l == 0:
                v = t.x[i] * (t.rank + 1)
            else:
                prev = getattr(t, f"v{l - 1}")
                v = prev[i % n_prev] + 2 * prev[(a * i + b) % n_prev] + (l + i + t.rank)
            getattr(t.peer((t.rank + sh) % t.world), f"v{l}")[i] = v

    for l in range(len(widths)):
        layer(l)

    @g.task(grid=(widths[-1],), wait=lambda i: evs[-1][me, i], tail=tail > 0)
    def out(t, i):
        t.y[i] = getattr(t, f"v{len(widths) - 1}")[i]

    return g


def layered_reference(xs, widths, mix, shifts):
    """Direct evaluation, layer by layer, of what the graph computes."""
    R = len(xs)
    vals = [[None] * R for _ in widths]  # vals[l][rank holding it]
    for l, n in enumerate(widths):
        for r in range(R):  # rank r computes, rank (r + shift) holds
            dst = (r + shifts[l]) % R
            if l == 0:
                vals[0][dst] = xs[r] * (r + 1)
            else:
                a, b = mix[l]
                prev = vals[l - 1][r]
                vals[l][dst] = torch.stack([prev[i % widths[l - 1]] + 2 * prev[(a * i + b) % widths[l - 1]]
                                            + (l + i + r) for i in range(n)])
    return vals[-1]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), world=st.integers(1, 4), layers=st.integers(1, 4), programs=st.integers(1, 4),
       schedule=st.sampled_from(["static", "dynamic"]), seed=st.integers(0, 2**16),
       interleave=st.sampled_from(["random", "round_robin"]), early=st.sampled_from([0, 1, 2]))
def test_random_layered_graphs(data, world, layers, programs, schedule, seed, interleave, early):
    widths = data.draw(st.lists(st.integers(1, 6), min_size=layers, max_size=layers))
    mix = data.draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=layers, max_size=layers))
    shifts = data.draw(st.lists(st.integers(0, 3), min_size=layers, max_size=layers))
    pinned = data.draw(st.integers(0, layers))   # pinned layers, then (dynamic) an early-pushed one
    tail = data.draw(st.integers(0, layers - pinned + 1))   # the output copy and the layers before it
    kernel = et.compile(layered(widths, mix, shifts, pinned, tail), schedule=schedule, programs=programs,
                        samples=[{"WORLD": world}], early_push=early)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(widths[0], generator=gen) for _ in range(world)]
    got = kernel.run([{"x": x} for x in xs], interleave=interleave, seed=seed)
    want = layered_reference(xs, widths, mix, shifts)  # same float32 ops in the same order
    for r in range(world):
        assert torch.equal(got[r]["y"], want[r])


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 5), M=st.integers(1, 40), K=st.integers(1, 9), N=st.integers(1, 20),
       bm=st.sampled_from([1, 4, 16]), bn=st.sampled_from([3, 8]), programs=st.integers(1, 5),
       schedule=st.sampled_from(["static", "dynamic"]), seed=st.integers(0, 2**16),
       splits=st.integers(1, 3), wave=st.integers(0, 9), interleave=st.booleans())
@pytest.mark.slow
def test_gemm_reduce_scatter_any_size(world, M, K, N, bm, bn, programs, schedule, seed, splits, wave, interleave):
    """Any sizes, tiles, contraction slices, waves (the tail plan) and tile orders."""
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=bm, block_n=bn, block_k=1, splits=splits, wave=wave,
                                                    interleave=interleave), schedule=schedule, programs=programs)
    inputs = gemm_rs.make_inputs(world, M, K, N, seed=seed)
    want = gemm_rs.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
    got = kernel.run(inputs, interleave="random", seed=seed)
    for r in range(world):
        assert got[r]["y"].shape == want[r].shape
        assert rel_err(got[r]["y"], want[r]) < 1e-5
