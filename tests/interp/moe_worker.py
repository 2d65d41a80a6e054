"""The expert-parallel MoE graph's GPU kernel (routing in-kernel decides which expert tiles exist)
under Triton's interpreter, one process per rank, against the float64 reference:

    TRITON_INTERPRET=1 torchrun --nproc_per_node=2 tests/interp/moe_worker.py [--dynamic] [options]

--early-push 0|1|2 is compile's early_push (default 1). --fused: only the fused router's cases.
"""
import argparse
import sys

import torch

import etdist as et
from etdist.workloads import moe


def rel_err(y, want):
    return ((y.double() - want).abs().max() / want.abs().max()).item()


def main(args):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--early-push", type=int, choices=(0, 1, 2), default=1)
    ap.add_argument("--local-first", action="store_true")   # et.compile's local_first for the first kernel
    ap.add_argument("--fused", action="store_true")   # only the fused router (moe_layer's fuse_router)
    opts = ap.parse_args(args)
    schedule = "dynamic" if opts.dynamic else "static"
    mesh = et.init_mesh(backend="cpu")
    R, r = mesh.world_size, mesh.rank

    def case(T, H, I, seed, skew=0.0, top_k=2):
        """This rank's inputs, the full weights and this rank's rows of the float64 reference."""
        ranks, weights = moe.make_inputs(R, T, H=H, I=I, E=4 * R, seed=seed, skew=skew)
        return ranks[r], weights, moe.reference([i["x"] for i in ranks], *weights, top_k=top_k)[r]

    one = R == 1   # one rank: the graph nn.MoE builds there, whose bodies move no rows (one_rank)
    if opts.fused:
        # the router's chain in one task kind: the last of a token block's slices (16 columns: 3,
        # the last ragged) to arrive routes it, on one rank the last block routed builds the tile
        # table; 3 token blocks (the last ragged), one token and one whole block, each twice with
        # other tokens (a count left non-zero by a launch would route nothing in the next: its
        # stale routing would give wrong rows); with 16-row tiles in their small body, as nn.MoE decodes
        for small in (0, 16):
            fused = et.compile(moe.moe_layer(top_k=2, block_m=32, max_experts=16, router_width=16, small_rows=small,
                                             one_rank=one, fuse_router=True),
                               schedule=schedule, target="cuda", early_push=opts.early_push)
            for T, seed in ((37, 19), (1, 20), (16, 21)):
                for again in (0, 100):
                    mine, _, want = case(T, 40, 20, seed=seed + again, skew=1.0)
                    assert rel_err(fused(mesh, **mine)["y"], want) < 1e-4, ("fused router", small, T, again, schedule)
        print(f"OK moe {schedule} rank {r}", flush=True)
        mesh.close()
        return
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=16, max_experts=16, one_rank=one), schedule=schedule,
                        target="cuda", early_push=opts.early_push, local_first=opts.local_first)
    for T, skew, seed in ((5, 0.0, 1), (19, 4.0, 2), (3, 0.0, 3)):   # skew: most tokens to few experts
        mine, _, want = case(T, 24, 20, seed, skew)
        for _ in range(2):   # counts differ between calls and sizes: re-armed each launch
            err = rel_err(kernel(mesh, **mine)["y"], want)
            assert err < 1e-4, (schedule, T, skew, err)
    # blocks of 32 (the router keeps 16-token blocks: three route tasks here, each over 32-wide K steps)
    wide = et.compile(moe.moe_layer(top_k=2, block_m=16, max_experts=16, block=32, one_rank=one),
                      schedule=schedule, target="cuda")
    mine, _, want = case(37, 40, 20, seed=5, skew=1.0)
    assert rel_err(wide(mesh, **mine)["y"], want) < 1e-4, ("block 32", schedule)
    # the large class's router blocks (nn.MoE: 64 tokens per logits task, 16 per routing task,
    # 4096 slots per plan step), smaller here: ragged token blocks, two routing tasks per logits
    # block, a plan over several steps, two router slices (64 columns) summed in one unrolled step
    # and the combine in its own blocks (16 tokens x 32 columns), ragged, its 3 x 3 blocks in 2 x 3
    # tasks (combine_tasks 4: the first task row takes token blocks 0 and 2)
    big = et.compile(moe.moe_layer(top_k=2, block_m=16, max_experts=16, route_block=32, plan_block=32,
                                   one_rank=one, topk_block=16, combine_block=16, combine_width=32,
                                   combine_tasks=4),
                     schedule=schedule, target="cuda")
    mine, _, want = case(45, 72, 20, seed=7, skew=1.0)
    assert rel_err(big(mesh, **mine)["y"], want) < 1e-4, ("route/plan blocks", schedule)
    # an expert's last row tile in a half-height body where it has at most 16 of its 32 rows
    # (half_tails), down tiles wider than the gate/up ones: skewed, so experts end in tiles of 1-16
    # rows, of 17-32 and whole ones
    halves = et.compile(moe.moe_layer(top_k=2, block_m=32, max_experts=16, block_n=16, down_block_n=32,
                                      half_tails=True, one_rank=one), schedule=schedule, target="cuda")
    for T, seed in ((45, 8), (29, 9)):
        mine, _, want = case(T, 48, 40, seed=seed, skew=1.0)
        assert rel_err(halves(mesh, **mine)["y"], want) < 1e-4, ("half tails", schedule, T)
    # a hidden size over several router slices (64 columns each) and copy/combine slabs (128),
    # both ragged at the end
    mine, _, want = case(21, 200, 20, seed=6, skew=1.0)
    assert rel_err(kernel(mesh, **mine)["y"], want) < 1e-4, ("slabs", schedule)
    # sizes promised multiples of 16 (nn.MoE's GPU graph when H and I allow it: vectorised loads)
    aligned = et.compile(moe.moe_layer(top_k=2, block_m=16, max_experts=16, align=16, one_rank=one),
                         schedule=schedule, target="cuda")
    mine, _, want = case(7, 32, 16, seed=4, skew=2.0)
    assert rel_err(aligned(mesh, **mine)["y"], want) < 1e-4, ("aligned", schedule)
    # w_gate_up in interleaved blocks of 16 columns (nn.MoE's layout where I allows): with TMA one
    # dot over gate and up (blocks as wide as the tiles); two, from blocks of 32, with TMA and without
    for ilv, bn, align in ((16, 16, 16), (32, 16, 16), (32, 16, 1)):
        mixed = et.compile(moe.moe_layer(top_k=2, block_m=16, max_experts=16, block_n=bn, align=align,
                                         one_rank=one, gate_up_interleave=ilv), schedule=schedule, target="cuda")
        mine, _, want = case(15, 32, 64, seed=12, skew=1.0)
        mine = dict(mine, w_gate_up=moe.interleave_gate_up(mine["w_gate_up"], ilv))
        assert rel_err(mixed(mesh, **mine)["y"], want) < 1e-4, ("interleaved gate/up", ilv, schedule)
    # [gate | up] through one descriptor, I ragged against the tiles: the last gate block's box runs
    # into up's columns, which no store keeps
    ragged = et.compile(moe.moe_layer(top_k=2, block_m=16, max_experts=16, block_n=32, align=16,
                                      one_rank=one), schedule=schedule, target="cuda")
    mine, _, want = case(9, 32, 48, seed=13, skew=1.0)
    assert rel_err(ragged(mesh, **mine)["y"], want) < 1e-4, ("ragged I, one descriptor", schedule)
    # top-3: the routing keeps its picks in a block of 4 (a padded lane that must store nothing)
    three = et.compile(moe.moe_layer(top_k=3, block_m=16, max_experts=16, one_rank=one),
                       schedule=schedule, target="cuda")
    mine, _, want = case(13, 24, 20, seed=11, skew=1.0, top_k=3)
    assert rel_err(three(mesh, **mine)["y"], want) < 1e-4, ("top-3", schedule)
    # tiles of at most 16 rows in a 16-row body (small_rows; transposed through TMA), skewed so that
    # tiles of 1-16 and of 17-32 rows both occur: plain, and through TMA with interleaved gate/up
    # (there the transposed loops in stages of their own: small_stages)
    for ilv, align in ((None, 1), (16, 16)):
        small = et.compile(moe.moe_layer(top_k=2, block_m=32, max_experts=16, block_n=16, align=align, small_rows=16,
                                         small_stages=6 if ilv else 0, one_rank=one, gate_up_interleave=ilv),
                           schedule=schedule, target="cuda")
        for T, seed in ((29, 17), (3, 18)):
            mine, _, want = case(T, 48, 32, seed=seed, skew=1.0)
            if ilv:
                mine = dict(mine, w_gate_up=moe.interleave_gate_up(mine["w_gate_up"], ilv))
            assert rel_err(small(mesh, **mine)["y"], want) < 1e-4, ("small rows", ilv, T, schedule)
    if one:
        # `fill` (route's per-expert places) is zeroed by the runtime when its memory is (re)laid
        # out, and left zero by each launch: garbage there before a new shape must not matter (two
        # new shapes: the second re-lays the least recently used state, poisoned here)
        for st in kernel._states(mesh):
            st.buffers["fill"].fill_(5)
        for T in (11, 10, 12):
            mine, _, want = case(T, 24, 20, seed=10, skew=1.0)
            assert rel_err(kernel(mesh, **mine)["y"], want) < 1e-4, ("fill zeroed at a new shape", T, schedule)
    # the user-facing module on the same kernel path (the GPU codegen, here interpreted)
    mine, (wg, w1, w2), want = case(3, 24, 20, seed=3)
    layer = et.nn.MoE(24, 20, 4 * R, 2, mesh=mesh, schedule=schedule, dtype=torch.float32)
    layer.load_experts(w1[..., :20], w1[..., 20:], w2, wg)
    y = layer(mine["x"].view(1, -1, 24)).view(-1, 24)
    assert rel_err(y, want) < 1e-4, ("nn.MoE", schedule)
    print(f"OK moe {schedule} rank {r}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main(sys.argv[1:])
