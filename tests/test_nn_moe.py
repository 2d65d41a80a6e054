"""et.nn.MoE on the CPU runtime (simulated expert-parallel ranks) against a plain torch top-k MoE."""
import pytest
import torch
from torch.nn import functional as F

import etdist as et
from etdist.fusion.expr import evaluate
from etdist.mesh import liveness

H, I, E, K = 24, 20, 8, 2


def dense_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, I, generator=g) / H ** 0.5, torch.randn(E, H, I, generator=g) / H ** 0.5,
            torch.randn(E, I, H, generator=g) / I ** 0.5, torch.randn(H, E, generator=g))


def torch_moe(x, gate, up, down, router, k=K):
    """The layer as a serving stack writes it: tokens sorted by expert, one mm per expert."""
    p = torch.softmax(x.double() @ router.double(), -1)
    w, ids = p.topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    y = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(E):
        tok, j = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            xe = x[tok].double()
            h = F.silu(xe @ gate[e].double()) * (xe @ up[e].double())
            y.index_add_(0, tok, w[tok, j, None] * (h @ down[e].double()))
    return y


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_moe_matches_torch_layer(world, schedule):
    gate, up, down, router = dense_weights()
    moe = et.nn.MoE(H, I, E, K, simulate_world=world, schedule=schedule, dtype=torch.float32)
    moe.load_experts(gate, up, down, router)
    for T in (13, 1, 40):                         # 13, 1: not a multiple of the ranks (padded)
        x = torch.randn(T, H)
        want = torch_moe(x, gate, up, down, router)
        got = moe(x.view(1, T, H)).view(T, H)     # leading dims are kept
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_bad_configs_and_inputs_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        et.nn.MoE(H, I, 6, 2, simulate_world=4)
    with pytest.raises(ValueError, match="top_k"):
        et.nn.MoE(H, I, E, 9, simulate_world=2)
    with pytest.raises(ValueError, match="schedule"):
        et.nn.MoE(H, I, E, 2, simulate_world=2, schedule="fifo")
    moe = et.nn.MoE(H, I, E, K, simulate_world=2, dtype=torch.float32)
    with pytest.raises(et.InputError, match="features"):
        moe(torch.randn(3, H + 1))
    with pytest.raises(et.InputError, match="expected"):
        moe.load_experts(*(torch.randn(2, 2) for _ in range(4)))


def test_bad_sizes_and_inputs_are_refused_before_running():
    """simulate_world=0 (ZeroDivisionError), hidden or expert_intermediate 0 (ZeroDivisionError in
    the weight scale), an int dtype (a tile body's softmax error), a list or 0-d x, an int x
    (silently cast to floats) and a meta x: all InputErrors; a following good call is unchanged."""
    for args, kwargs, msg in (((H, I, E, K), dict(simulate_world=0), "simulate_world must be a positive int"),
                              ((0, I, E, K), {}, "hidden must be a positive int, got 0"),
                              ((H, 0, E, K), {}, "expert_intermediate must be a positive int, got 0"),
                              ((H, I, E, 2.5), {}, "top_k must be a positive int, got 2.5"),
                              ((H, I, E, K), dict(dtype=torch.int32), "dtype must be a floating-point torch.dtype"),
                              ((H, I, E, K), dict(dtype=torch.float8_e4m3fn), "got torch.float8_e4m3fn")):
        with pytest.raises(et.InputError, match=msg):
            et.nn.MoE(*args, **{"simulate_world": 2, **kwargs})
    moe = et.nn.MoE(H, I, E, K, simulate_world=2, dtype=torch.float32)
    x = torch.randn(7, H)
    want = moe(x)
    for bad, msg in (([0.0] * H, r"x must be a tensor \[..., 24\], got list"), (torch.tensor(1.0), "0-d tensor"),
                     (torch.ones(3, H, dtype=torch.int64), "x is torch.int64; pass the hidden states as a floating"),
                     (torch.randn(3, H, device="meta"), "simulated ranks run on the CPU runtime"),
                     (torch.randn(3, H, dtype=torch.bfloat16), r"x is torch.bfloat16, the layer's weights torch.float32")):
        with pytest.raises(et.InputError, match=msg):
            moe(bad)
    torch.testing.assert_close(moe(x), want)


def test_refused_load_leaves_the_layer_as_it_was():
    """load_experts copied the router and some experts before a later weight failed to copy (on the
    meta device, say): the layer was left half loaded. Every weight is checked first now."""
    moe = et.nn.MoE(H, I, E, K, simulate_world=2, dtype=torch.float32)
    x = torch.randn(7, H)
    want = moe(x)
    gate, up, down, router = dense_weights(seed=1)
    for args, msg in (((gate, up, down.to("meta"), router), "down is a torch.float32 tensor on meta"),
                      ((gate, up, down.tolist(), router), r"down must be a tensor \[8, 20, 24\], got list"),
                      ((gate.to(torch.complex64), up, down, router), "gate is a torch.complex64 tensor"),
                      ((gate, up, down, None), "router must be a tensor")):
        with pytest.raises(et.InputError, match=msg):
            moe.load_experts(*args)
        torch.testing.assert_close(moe(x), want)
    moe.load_experts(gate, up, down, router)
    assert ((moe(x).double() - torch_moe(x, gate, up, down, router)).abs().max()).item() < 1e-4


def test_gpu_tiles_and_the_moe_config():
    from etdist.nn.moe import GpuTiles, MoEConfig, gpu_tiles
    assert gpu_tiles() == GpuTiles(64, 64, 128, 8, 5) and gpu_tiles(large=True) == GpuTiles(128, 64, 128, 8, 4)
    # float32 tiles are twice the bytes: 3 stages fit in shared memory, 4 do not
    f32 = torch.float32
    assert gpu_tiles(dtype=f32) == GpuTiles(64, 64, 128, 8, 3) and gpu_tiles(True, f32) == GpuTiles(128, 64, 128, 8, 3)
    assert gpu_tiles(dtype=torch.float16) == gpu_tiles()
    cfg = et.nn.DEFAULT_MOE.override("tiles_large=64,64,64,4,4")
    assert gpu_tiles(large=True, config=cfg) == GpuTiles(64, 64, 64, 4, 4) and gpu_tiles(config=cfg) == gpu_tiles()
    cfg = cfg.override("tiles=128,64,64,4,4+large_rows=256+down_n=128")
    assert gpu_tiles(config=cfg) == GpuTiles(block_m=128, block=64, block_n=64, num_warps=4, num_stages=4)
    assert gpu_tiles(dtype=f32, config=cfg) == gpu_tiles(config=cfg)     # given tiles are taken as given
    assert (cfg.large_rows, cfg.down_n) == (256, 128) and hash(cfg) != hash(et.nn.DEFAULT_MOE)
    for bad in ("tiles=128,64,64", "tiles=8,64,64,4,4", "tiles=64,64,128,0,3", "tiles=48,64,64,4,4",
                "tiles=64,64,64,6,3", "tiles=64,64,64,4,0", "large_rows=0", "down_n=48", "block=3", "tiles"):
        with pytest.raises(ValueError, match="MoEConfig"):
            et.nn.DEFAULT_MOE.override(bad)
    with pytest.raises(ValueError, match="MoEConfig.tiles"):
        MoEConfig(tiles=GpuTiles(64, 64, 100, 8, 3))
    with pytest.raises(TypeError, match="MoEConfig"):
        et.nn.MoE(32, 16, E, K, simulate_world=2, config="tiles=64,64,64,4,4")


def test_graph_blocks_are_small_where_top_k_is_large():
    """nn.MoE's router / combine blocks: the large class routes from 64-token logits blocks; at top-k
    >= 4 the routing takes 16 tokens a task and the combine small blocks, capped in tasks; top-2
    keeps the class's blocks."""
    from etdist.nn import moe as m
    assert m.graph_blocks(2) == {} and m.graph_blocks(2, large=True) == dict(route_block=64, plan_block=4096)
    assert m.graph_blocks(8) == dict(combine_block=16, combine_width=128, combine_tasks=256)
    assert m.graph_blocks(4, large=True) == dict(route_block=64, plan_block=4096, topk_block=16, combine_block=32,
                                                 combine_width=512, combine_tasks=128)
    for top_k in (2, 8):   # every set of blocks builds
        for large in (False, True):
            m.moe_graph.moe_layer(top_k, block_m=64, block=64, max_experts=128, **m.graph_blocks(top_k, large))


def test_layer_tiles_add_the_down_width_and_half_tails():
    """A layer's tiles: 256-wide down tiles where its expert intermediate size (the down GEMM's
    contraction) is at most 2048 in 2-byte dtypes; half-height last row tiles in 128-row classes
    with at least 32 experts per rank; MoEConfig.down_n overrides. They are part of the compile key."""
    from etdist.nn import moe as m
    assert m.layer_tiles(768, 128).down_n == 256 and m.layer_tiles(2048, 8, large=True).down_n == 256
    assert m.layer_tiles(2049, 128).down_n is None and m.layer_tiles(14336, 8, large=True).down_n is None
    assert m.layer_tiles(768, 128, dtype=torch.float32).down_n is None   # 64 KB a stage: no room
    assert m.layer_tiles(768, 32, large=True).half_tails and m.layer_tiles(768, 128, large=True).half_tails
    assert not m.layer_tiles(768, 128).half_tails and not m.layer_tiles(768, 31, large=True).half_tails
    assert m.layer_tiles(768, 128, large=True)[:5] == m.gpu_tiles(large=True)[:5]
    assert m.layer_tiles(768, 128, config=m.DEFAULT_MOE.override("down_n=128")).down_n == 128
    short, long = (et.nn.MoE(32, i, E, K, simulate_world=2) for i in (16, 4096))
    assert short._kernel("cuda") is not long._kernel("cuda")
    narrow = et.nn.MoE(32, 16, E, K, simulate_world=2, config=m.DEFAULT_MOE.override("down_n=128"))
    assert narrow._kernel("cuda") is not short._kernel("cuda")   # the config is part of the key
    many = et.nn.MoE(32, 16, 64, K, simulate_world=2)     # 32 experts a rank: half tails
    assert many._plan("cuda", large=True)[0].half_tails and not short._plan("cuda", large=True)[0].half_tails


def test_small_row_tiles_in_the_small_class_up_to_their_worlds():
    """Row tiles of at most SMALL_ROWS rows run a body that size in the small class, at expert-
    parallel worlds up to MoEConfig.small_rows_worlds (1 by default: measured on one GPU)."""
    from etdist.nn import moe as m
    assert m.layer_tiles(768, 128).small_rows == m.SMALL_ROWS == 16
    assert m.layer_tiles(768, 128, large=True).small_rows == 0 and m.layer_tiles(768, 64, world=2).small_rows == 0
    two = m.DEFAULT_MOE.override("small_rows_worlds=2")
    assert m.layer_tiles(768, 64, world=2, config=two).small_rows == 16
    assert m.layer_tiles(768, 128, config=m.DEFAULT_MOE.override("small_rows=0")).small_rows == 0
    assert m.layer_tiles(768, 128, config=m.DEFAULT_MOE.override("small_rows=64")).small_rows == 0   # not below 64
    for bad in ("small_rows=8", "small_rows=24", "small_rows_worlds=0"):
        with pytest.raises(ValueError, match="MoEConfig.small_rows"):
            m.DEFAULT_MOE.override(bad)
    one = et.nn.MoE(32, 16, E, K, simulate_world=1)
    assert one._plan("cuda")[0].small_rows == 16 and et.nn.MoE(32, 16, E, K, simulate_world=2)._plan("cuda")[0].small_rows == 0
    with pytest.raises(et.GraphError, match="small_rows"):
        m.moe_graph.moe_layer(2, block_m=16, small_rows=16)


def test_fused_router_in_the_small_class_up_to_its_worlds():
    """The small class fuses the router's chain in slices of ROUTER_SLICE_BYTES (at most 4 * block
    columns) at expert-parallel worlds up to MoEConfig.fused_router_worlds (1 by default: measured
    on one GPU); the large class keeps its three steps."""
    from etdist.nn import moe as m
    qwen = m.layer_tiles(768, 128)                               # 128 experts in bf16: 32 KB = 128 columns
    assert qwen.fused_router and qwen.router_width == 128 == m.ROUTER_SLICE_BYTES // (128 * 2)
    assert m.layer_tiles(768, 128, dtype=torch.float32).router_width == 64
    assert m.layer_tiles(14336, 8).router_width == 256            # mixtral's 8 experts: the block's 4 * 64
    assert not m.layer_tiles(768, 128, large=True).fused_router and m.layer_tiles(768, 128, large=True).router_width is None
    assert not m.layer_tiles(768, 64, world=2).fused_router
    assert m.layer_tiles(768, 64, world=2, config=m.DEFAULT_MOE.override("fused_router_worlds=2")).router_width == 128
    with pytest.raises(ValueError, match="MoEConfig.fused_router_worlds must be an int >= 1"):
        m.DEFAULT_MOE.override("fused_router_worlds=0")
    layer = et.nn.MoE(256, 128, 128, 8, simulate_world=1)
    tiles, align, _ = layer._plan("cuda")
    names = [t.name for t in layer._graph("cuda", tiles, align).to_ir().tasks]
    assert names[0] == "router" and "tile_table" not in names
    # no tokens: that graph refuses T = 0 (no router task would build the table); one rank (no
    # peer waits for the call) returns the empty output without a launch
    empty = et.nn.MoE(32, 16, 4, 2, simulate_world=1, dtype=torch.float32)(torch.zeros(2, 0, 32))
    assert empty.shape == (2, 0, 32)


def test_gpu_kernels_are_keyed_by_alignment():
    """Layers whose sizes allow 16-aligned loads get the aligned GPU graph, the others not; a
    module resolves its kernel once."""
    aligned = et.nn.MoE(32, 16, E, K, simulate_world=2, dtype=torch.float32)
    ragged = et.nn.MoE(24, 16, E, K, simulate_world=2, dtype=torch.float32)
    a, r = aligned._kernel("cuda"), ragged._kernel("cuda")
    assert a is not r and aligned._kernel("cuda") is a
    big = aligned._kernel("cuda", large=True)      # the large size class: its own tiles
    assert big is not a and aligned._kernel("cuda", large=True) is big
    assert dict(a.ir.multiples) == {"H": 16, "I": 16} and not dict(r.ir.multiples)


def test_large_tiles_serve_large_expert_batches():
    """The 128-row tiles where the average expert gets >= 64 rows (measured on one H200: faster for
    mixtral from 256 tokens, for qwen3_30b_a3b at 1024, slower for qwen3 at 128-512 tokens), in
    2-byte dtypes (float32's would not fit in shared memory); MoEConfig.large_rows moves the bound."""
    mixtral = et.nn.MoE(32, 16, 8, 2, simulate_world=2, dtype=torch.bfloat16)
    qwen = et.nn.MoE(32, 16, 128, 8, simulate_world=2, dtype=torch.bfloat16)
    assert [mixtral.large_tiles(t) for t in (1, 64, 128, 1024)] == [False, False, True, True]
    assert [qwen.large_tiles(t) for t in (16, 256, 512, 4096)] == [False, False, True, True]
    assert not et.nn.MoE(32, 16, 8, 2, simulate_world=2, dtype=torch.float32).large_tiles(4096)
    later = et.nn.MoE(32, 16, 8, 2, simulate_world=2, dtype=torch.bfloat16,
                      config=et.nn.DEFAULT_MOE.override("large_rows=256"))
    assert [later.large_tiles(t) for t in (256, 512)] == [False, True]


def test_the_layers_run_on_a_cpu_mesh(monkeypatch, tmp_path):
    """On a CPU mesh the layers built fine and failed at the first call ("compiled for GPUs"), then
    refused at construction; they now run on the CPU runtime (ops/cpu_path.py; across processes:
    tests/test_cpu_mesh_ops.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(liveness, "SHM_DIR", str(tmp_path))
    mesh = et.init_mesh(backend="cpu", world_size=1, rank=0)
    try:
        gate, up, down, router = dense_weights()
        moe = et.nn.MoE(H, I, E, K, mesh=mesh, dtype=torch.float32).load_experts(gate, up, down, router)
        x = torch.randn(5, H)
        want = torch_moe(x.double(), gate.double(), up.double(), down.double(), router.double())
        assert ((moe(x).double() - want).abs().max() / want.abs().max()).item() < 1e-5
        mlp = et.nn.TensorParallelMLP(32, 64, mesh=mesh, dtype=torch.float32)
        w = mlp.w_gate_up[0].double()
        xm = torch.randn(7, 32)
        ref = (torch.nn.functional.silu(xm.double() @ w[:, :64]) * (xm.double() @ w[:, 64:])) @ mlp.w_down[0].double()
        assert ((mlp(xm).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
        with pytest.raises(et.InputError, match="mesh must be the Mesh from et.init_mesh"):
            et.nn.MoE(H, I, E, K, mesh="cpu")
    finally:
        mesh.close()


def test_float64_is_for_simulated_ranks_only():
    """The GPU kernels take bf16/fp16/fp32 (refused before any mesh is looked up); simulated ranks
    run float64 too, and match the float64 reference."""
    with pytest.raises(et.InputError, match=r"or torch.float32\), got torch.float64"):
        et.nn.MoE(H, I, E, K, dtype=torch.float64)
    gate, up, down, router = (w.double() for w in dense_weights())
    moe = et.nn.MoE(H, I, E, K, simulate_world=2, dtype=torch.float64).load_experts(gate, up, down, router)
    x = torch.randn(5, H, dtype=torch.float64)
    got, want = moe(x), torch_moe(x, gate, up, down, router)
    assert got.dtype == torch.float64 and ((got - want).abs().max() / want.abs().max()).item() < 1e-5   # logits in fp32


def test_early_push_in_every_tile_class():
    """Under the dynamic schedule both classes seed their down tiles behind the gate/up tiles
    (early push's chains), short experts and long ones (as measured on one H200); the static
    schedule has no queue."""
    moe = et.nn.MoE(32, 16, E, K, simulate_world=2, dtype=torch.bfloat16)
    assert moe._kernel("cuda").early == {"gate_up", "down"} and moe._kernel("cpu").early == {"gate_up", "down"}
    assert moe._kernel("cuda", large=True).early == {"gate_up", "down"}
    long = et.nn.MoE(32, 4096, E, K, simulate_world=2, dtype=torch.bfloat16)
    assert long._kernel("cuda", large=True).early == {"gate_up", "down"} == long._kernel("cuda").early
    static = et.nn.MoE(32, 16, E, K, simulate_world=2, dtype=torch.bfloat16, schedule="static")
    assert static._kernel("cuda").early == frozenset()


def test_gate_up_blocks_interleave_where_the_intermediate_size_allows():
    """bf16 with I a multiple of 128: w_gate_up holds gate and up in interleaved blocks of 128
    columns (one GPU dot over both), and the layer still computes the torch layer; pack_gate_up
    converts [gate | up] to it. I = 200 or float32: the plain layout."""
    h, i = 16, 256
    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(E, h, i, generator=g) / h ** 0.5, torch.randn(E, h, i, generator=g) / h ** 0.5
    down, router = torch.randn(E, i, h, generator=g) / i ** 0.5, torch.randn(h, E, generator=g)
    moe = et.nn.MoE(h, i, E, K, simulate_world=2, dtype=torch.bfloat16).load_experts(gate, up, down, router)
    assert moe.gate_up_block == 128
    stored = moe.w_gate_up[1]                                  # rank 1's experts 4..7
    torch.testing.assert_close(stored[..., 128:256], up[4:, :, :128].to(torch.bfloat16))
    torch.testing.assert_close(stored[..., 256:384], gate[4:, :, 128:].to(torch.bfloat16))
    torch.testing.assert_close(moe.pack_gate_up(torch.cat([gate, up], -1)[4:].to(torch.bfloat16)), stored)
    x = torch.randn(13, h, generator=g)
    want = torch_moe(x.to(torch.bfloat16), *(w.to(torch.bfloat16) for w in (gate, up, down, router)))
    got = moe(x.to(torch.bfloat16)).double()
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
    assert et.nn.MoE(h, 200, E, K, simulate_world=2, dtype=torch.bfloat16).gate_up_block is None
    assert et.nn.MoE(h, i, E, K, simulate_world=2, dtype=torch.float32).gate_up_block is None


def test_gpu_tiles_that_split_an_interleaved_block_are_refused():
    """MoEConfig.tiles with gate/up tiles wider than the interleaved blocks: refused by name."""
    moe = et.nn.MoE(16, 256, E, K, simulate_world=2, dtype=torch.bfloat16,
                    config=et.nn.DEFAULT_MOE.override("tiles=64,64,256,8,3"))
    tiles, align, _ = moe._plan("cuda")
    with pytest.raises(et.InputError, match="do not divide the blocks of 128"):
        moe._graph("cuda", tiles, align)


def test_the_gate_up_layout_travels_with_the_state_dict():
    """The layout is saved beside the weights: a state_dict loads into a layer of the same layout
    and is refused by one of the other (it would be misread); unpack_gate_up undoes pack_gate_up."""
    h, i = 16, 256
    packed = et.nn.MoE(h, i, E, K, simulate_world=2, dtype=torch.bfloat16)
    again = et.nn.MoE(h, i, E, K, simulate_world=2, dtype=torch.bfloat16)
    again.load_state_dict(packed.state_dict())
    assert torch.equal(again.w_gate_up[0], packed.w_gate_up[0]) and int(again.gate_up_layout) == 128
    plain = et.nn.MoE(h, i, E, K, simulate_world=2, dtype=torch.float16)
    plain.gate_up_block, plain.gate_up_layout = None, torch.tensor(0)   # as a layer of the plain layout
    with pytest.raises(et.InputError, match=r"saved w_gate_up holds gate and up as interleaved blocks of 128 "
                                            r"columns, this layer as \[gate \| up\]"):
        plain.load_state_dict(packed.state_dict())
    w = torch.randn(2, h, 2 * i)
    assert torch.equal(packed.unpack_gate_up(packed.pack_gate_up(w)), w)


def test_graph_options_replace_the_layers_own_for_ab_runs():
    """MoE._graph(**options) (what experiments/moe_ab.py's variants pass): moe_layer arguments
    replace the layer's own."""
    layer = et.nn.MoE(512, 128, 16, 8, simulate_world=1)
    tiles, align, _ = layer._plan("cuda", True)
    grids = {}
    for options in ({}, {"route_block": 16}):
        ir = layer._graph("cuda", tiles, align, True, **options).to_ir()
        grids[bool(options)] = next(t.grid for t in ir.tasks if t.name == "logits")
    sizes = dict(T=4096, H=512)
    assert [evaluate(n, sizes) for n in grids[False]] == [64, 2]      # 64-token blocks, 256-column slices
    assert [evaluate(n, sizes) for n in grids[True]] == [256, 2]     # 16-token blocks
