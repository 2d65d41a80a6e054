"""The fused ops' plan configuration (etdist/ops/config.py): PlanConfig's fields and overrides, the
config as part of every plan and kernel cache key, its refusal under torch.compile, and a few
representative plans of the default config."""
import dataclasses
import types

import pytest
import torch

import etdist as et
from etdist.bench.measure.shapes import MLP_SHAPES
from etdist.ops import ag_gemm, gemm_rs, mlp
from etdist.ops.common import kernel_key
from etdist.ops.config import DEFAULT_PLAN, PlanConfig, TileConfig

P = DEFAULT_PLAN
bf, f32 = torch.bfloat16, torch.float32


def test_tile_configs_parse_and_write_one_form():
    """"bm,bn,bk,warps,stages[,swap]"; a bad one is refused with the format named; text() writes
    what parse reads."""
    assert TileConfig.parse("32,128,64,4,4,swap") == TileConfig(32, 128, 64, 4, 4, swap_ab=True)
    assert TileConfig.parse("128,128,64,8,3") == TileConfig(128, 128, 64, 8, 3)
    for bad in ("32,128,64,4,4,2/sm", "32,128,64,4"):
        with pytest.raises(ValueError, match=r"stages\[,swap\]"):
            TileConfig.parse(bad)
    for cfg in (TileConfig(32, 128, 64, 4, 4, swap_ab=True), P.large, P.whole_32):
        assert TileConfig.parse(cfg.text()) == cfg


def test_override_reads_each_field_by_its_type():
    c = P.override("whole_max_m=256+large=128,128,64,8,3+local_sums_min_m=0+whole_32=32,64,64,4,4,swap")
    assert (c.whole_max_m, c.large, c.local_sums_min_m, c.whole_32) == \
        (256, TileConfig(128, 128, 64, 8, 3), 0, TileConfig(32, 64, 64, 4, 4, swap_ab=True))
    assert dataclasses.replace(c, whole_max_m=128, large=P.large, local_sums_min_m=65, whole_32=P.whole_32) == P
    assert P.override("base") is P and P.override("") is P
    assert P.override("local_sums_min_m=0").override("local_sums_min_m=65") == P
    assert P.changes() == "base"
    assert c.changes() == "large=128,128,64,8,3+local_sums_min_m=0+whole_max_m=256+whole_32=32,64,64,4,4,swap"
    assert P.override(c.changes()) == c and hash(P.override(c.changes())) == hash(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.max_splits = 2


@pytest.mark.parametrize("text,error", [
    ("max_split=2", r"PlanConfig has no field 'max_split'.*fields: skinny_32, "),
    ("max_splits", r"want field=value"),
    ("max_splits=0", r"max_splits must be an int >= 1, got 0"),
    ("max_splits=two", r"max_splits='two': want an int >= 1"),
    ("whole_max_m=-5", r"whole_max_m='-5': want an int >= 0"),
    ("mlp_down_n=96", r"mlp_down_n must be a power of two >= 16, got 96"),
    ("mlp_tail_splits=0", r"mlp_tail_splits must be an int >= 1"),
    ("large=128,256", r"PlanConfig.large: tile config '128,256': want block_m,block_n,block_k,warps,stages"),
    ("whole_128=48,128,64,8,4", r"PlanConfig.whole_128: tile config"),
    ("max_splits=2+max_splits=3", r"sets max_splits twice"),
])
def test_override_refuses_what_it_cannot_use(text, error):
    with pytest.raises(ValueError, match=error):
        P.override(text)


def test_a_config_built_directly_is_checked_too():
    with pytest.raises(ValueError, match="PlanConfig.large must be a TileConfig"):
        PlanConfig(large="128,256,64,8,4")
    with pytest.raises(ValueError, match="max_splits must be an int >= 1, got True"):
        dataclasses.replace(P, max_splits=True)


def test_every_plan_cache_keys_on_the_config():
    """Two configs' plans stand side by side in the caches (no cache to clear); the kernel cache key
    names the config too."""
    one = P.override("max_splits=1+mlp_tail_splits=1+whole_max_m=256")
    for _ in range(2):
        assert gemm_rs.kernel_plan(1024, 18432, 4608, bf, 132, 2, P)[1] == 4
        assert gemm_rs.kernel_plan(1024, 18432, 4608, bf, 132, 2, one)[1] == 1
        assert mlp.kernel_plan(1024, 4608, 18432, bf, 132, 2, P)[2] == {"M": 1024, "TAIL": 12}
        assert mlp.kernel_plan(1024, 4608, 18432, bf, 132, 2, one)[2] == {"M": 1024}
        assert mlp.replicated_plan(1024, 4608, 18432, bf, 132, 2, one)[2] == {"M": 1024}
        assert ag_gemm.kernel_plan(200, 8192, 28672, bf, 132, 2, P)[1].func.__name__ == "all_gather_gemm"
        assert ag_gemm.kernel_plan(200, 8192, 28672, bf, 132, 2, one)[1].func.__name__ == "all_gather_gemm_whole"
    cfg, build = ag_gemm.kernel_plan(16, 4096, 12288, bf, 132, 2, P)
    other = P.override("max_splits=2")   # the same whole-gather graph: its own kernel all the same
    assert ag_gemm.kernel_plan(16, 4096, 12288, bf, 132, 2, other)[1].args == build.args
    assert kernel_key(P, cfg, "static", build) != kernel_key(other, cfg, "static", build)


def _fake_mesh():
    return types.SimpleNamespace(backend="nvshmem", device=torch.device("cpu"), world_size=2)


def _calls(config):
    x, w, wd = torch.randn(4, 16, dtype=bf), torch.randn(16, 32, dtype=bf), torch.randn(16, 16, dtype=bf)
    mesh = _fake_mesh()
    return {"gemm_reduce_scatter": lambda: et.ops.gemm_reduce_scatter(x, w, mesh=mesh, config=config),
            "all_gather_gemm": lambda: et.ops.all_gather_gemm(x, w, mesh=mesh, config=config),
            "tensor_parallel_mlp": lambda: et.ops.tensor_parallel_mlp(x, w, wd, mesh=mesh, config=config)}


def test_the_ops_plan_with_the_config_given(monkeypatch):
    """config= reaches each op's plan and its kernel cache (caught before the compile); anything
    but a PlanConfig is refused before a plan is made."""
    asked = []

    def caught(cache, config, cfg, schedule, build):
        asked.append(config)
        raise LookupError("caught before the compile")
    for module in (gemm_rs, ag_gemm, mlp):
        monkeypatch.setattr(module, "cached_kernel", caught)
        monkeypatch.setattr(module, "sm_count", lambda index: 132)
    one = P.override("max_splits=1")
    for config in (None, one):
        for name, call in _calls(config).items():
            with pytest.raises(LookupError):
                call()
    assert asked == [P] * 3 + [one] * 3
    for name, call in _calls({"max_splits": 1}).items():
        with pytest.raises(et.InputError, match=rf"et.ops.{name}: config must be an et.ops.PlanConfig .*got dict"):
            call()


def test_under_torch_compile_only_the_default_config(monkeypatch):
    """A compiled graph's node carries no config: while torch.compile traces the ops, another config
    is refused by name before anything launches (DEFAULT_PLAN itself passes)."""
    import torch._dynamo   # noqa: F401  its first import caches rules by function: the real is_compiling, not a lambda
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    reached = []
    for module in (gemm_rs, ag_gemm, mlp):
        monkeypatch.setattr(module, "call_op", lambda name, *a, **k: reached.append(name))
    for name, call in _calls(P.override("whole_max_m=256")).items():
        with pytest.raises(et.InputError, match=rf"et.ops.{name} under torch.compile runs the default plan only; "
                                                r"got config with whole_max_m=256"):
            call()
    assert not reached
    for name, call in _calls(DEFAULT_PLAN).items():
        call()
    assert reached == list(_calls(None))


# (op, model, M, world, dtype) -> (tile, graph, its arguments, sizes): the default plans at a few
# representative cells (132 SMs), from the dump taken before PlanConfig replaced the module knobs
_PLANS = {
    ("gemm_rs", "qwen3_8b", 16, 2, bf): ("32,128,128,4,5,swap", "gemm_reduce_scatter_skinny",
                                         (32, 128, bf, 128, 4, 16, True), {"reduce_n": 32}, 4),
    ("gemm_rs", "gemma2_27b", 1024, 2, bf): ("128,256,64,8,4", "gemm_reduce_scatter", (128, 256, bf, 64, 16),
                                             {"interleave": False, "row_pointers": False, "splits": 4, "wave": 132}, 4),
    ("gemm_rs", "llama31_405b", 256, 2, bf): ("128,256,64,8,4", "gemm_reduce_scatter", (128, 256, bf, 64, 16),
                                              {"interleave": True, "row_pointers": False, "splits": 1, "wave": 0}, 1),
    ("gemm_rs", "llama31_70b", 8192, 4, f32): ("128,256,32,8,3", "gemm_reduce_scatter", (128, 256, f32, 32, 16),
                                               {"interleave": False, "row_pointers": False, "splits": 1, "wave": 0}, 1),
    ("gemm_rs", "qwen3_32b", 129, 1, bf): ("128,256,64,8,4", "gemm_reduce_scatter", (128, 256, bf, 64, 16),
                                           {"interleave": False, "row_pointers": True, "splits": 3, "wave": 0}, 3),
    ("ag_gemm", "qwen3_8b", 16, 2, bf): ("32,128,64,4,6,swap", "all_gather_gemm_whole", (32, 128, bf, 64, 16),
                                         {"gemm_n": 128, "row_pointers": True, "swap_ab": True}, None),
    ("ag_gemm", "llama31_8b", 1000, 2, bf): ("128,128,64,8,4", "all_gather_gemm", (128, 128, bf, 64, 16),
                                             {"interleave": False, "own_from_x": True, "row_pointers": False}, None),
    ("ag_gemm", "llama31_8b", 384, 2, bf): ("128,256,64,8,4", "all_gather_gemm", (128, 256, bf, 64, 16),
                                            {"interleave": False, "own_from_x": True, "row_pointers": True}, None),
    ("ag_gemm", "llama31_70b", 384, 2, bf): ("128,256,64,8,4", "all_gather_gemm_whole", (128, 256, bf, 64, 16),
                                             {"swap_ab": False, "gemm_n": 256, "row_pointers": False}, None),
    ("ag_gemm", "gemma2_9b", 100, 4, f32): ("128,128,32,8,3", "all_gather_gemm_whole", (128, 128, f32, 32, 16),
                                            {"gemm_n": 64, "row_pointers": True, "swap_ab": False}, None),
    ("mlp", "gemma2_27b", 1024, 2, bf): ("128,128,64,8,3", "tp_mlp", (128, 128, bf, 64, 16),
                                         {"down_n": 256, "interleave": False, "own_from_x": True, "padded": True,
                                          "row_pointers": False, "tail_splits": 3}, {"M": 1024, "TAIL": 12}),
    ("mlp", "llama31_70b", 129, 2, bf): ("128,128,64,8,3", "tp_mlp", (128, 128, bf, 64, 16),
                                         {"down_n": 256, "interleave": True, "own_from_x": False, "padded": True,
                                          "row_pointers": True, "tail_splits": 2}, {"M": 129, "TAIL": 64}),
    ("mlp", "qwen3_8b", 64, 2, bf): ("64,128,64,4,4", "tp_mlp_whole", (64, 128, bf, 64, 16),
                                     {"down_splits": 4, "row_pointers": False, "swap_ab": False, "up_n": 64},
                                     {"M": 64}),
    ("mlp_replicated", "qwen3_8b", 16, 2, bf): ("32,128,64,4,6,swap", "tp_mlp_replicated", (32, 128, bf, 64, 16),
                                                {"down_splits": 4, "row_pointers": True, "swap_ab": True, "up_n": 64},
                                                {"M": 16, "TAIL": 32}),
    ("mlp_replicated", "gemma2_27b", 1024, 2, bf): ("128,128,64,8,3", "tp_mlp_replicated", (128, 256, bf, 64, 16),
                                                    {"down_splits": 3, "row_pointers": False, "swap_ab": False,
                                                     "up_n": 128}, {"M": 1024, "TAIL": 12}),
}


@pytest.mark.parametrize("cell", list(_PLANS), ids=lambda c: "-".join(map(str, c)))
def test_representative_default_plans(cell):
    op, model, M, world, dtype = cell
    H, I = MLP_SHAPES[model].hidden, MLP_SHAPES[model].intermediate
    if op == "gemm_rs":
        cfg, splits, _, build = gemm_rs.kernel_plan(M, I // world, H, dtype, 132, world, P)
        extra = splits
    elif op == "ag_gemm":
        (cfg, build), extra = ag_gemm.kernel_plan(M, H, 2 * I // world, dtype, 132, world, P), None
    else:
        plan = mlp.kernel_plan if op == "mlp" else mlp.replicated_plan
        cfg, build, extra = plan(M, H, I // world, dtype, 132, world, P)
    assert (cfg.text(), build.func.__name__, build.args, build.keywords, extra) == _PLANS[cell]


def test_local_sums_from_a_row_count_on():
    """local_sums_min_m: the skinny classes from that many rows sum each rank's slices before they
    cross the links; below it, with one rank or with one slice, the slices go to the owners."""
    from etdist.ops import gemm_rs as rs_op
    cfg = DEFAULT_PLAN
    assert cfg.local_sums_min_m == 65 and cfg.override("local_sums_min_m=0").changes() == "local_sums_min_m=0"
    bf = torch.bfloat16
    local = lambda M, world=2, config=cfg: rs_op.kernel_plan(M, 6144, 4096, bf, 132, world, config)[3].keywords.get(  # noqa: E731
        "local_sums", False)
    assert [local(M) for M in (16, 64, 65, 128)] == [False, False, True, True]
    assert not local(128, world=1) and not local(128, config=DEFAULT_PLAN.override("local_sums_min_m=0"))
    assert rs_op.kernel_plan(129, 6144, 4096, bf, 132, 2, cfg)[3].func.__name__ == "gemm_reduce_scatter"   # large
    # with local sums the combine tasks (owners x column parts) fit one wave of SMs: qwen3_8b's 32
    # column tiles cut in 2 parts (2 x 32 x 2 = 128 tasks), not 4 (256, two waves); llama31_70b's 64 whole.
    # Without (fewer rows, or one rank) the reduce tasks alone: 4 parts of 32
    width = lambda M, N, world=2: rs_op.kernel_plan(M, 6144, N, bf, 132, world, cfg)[3].keywords["reduce_n"]  # noqa: E731
    assert width(128, 4096) == 64 and width(128, 8192) == 128
    assert width(16, 4096) == 32 and width(128, 4096, world=1) == 32
    with pytest.raises(ValueError, match="combine_one_wave"):   # an A/B option, decided and gone
        cfg.override("combine_one_wave=1")


def test_replicated_owners_in_the_whole_classes_above_32_rows():
    """The replicated MLP's output tiles are summed on one owner rank each in the whole-gather
    classes from replicated_owners_min_m (33) rows: not at 32 rows or fewer, not above
    whole_max_m (the sequence-parallel tiles), never on one rank, at four only with plan_worlds=4
    (measured on two GPUs); 0 turns it off."""
    from etdist.ops import mlp as mlp_op
    bf = torch.bfloat16
    owners = lambda M, world, config: mlp_op.replicated_plan(M, 4096, 6144, bf, 132, world, config)[1].keywords.get(  # noqa: E731
        "owners", False)
    assert DEFAULT_PLAN.replicated_owners_min_m == 33
    assert [owners(M, 2, DEFAULT_PLAN) for M in (16, 32, 33, 64, 128, 129, 1024)] == \
        [False, False, True, True, True, False, False]
    assert not owners(128, 1, DEFAULT_PLAN) and not owners(128, 4, DEFAULT_PLAN)
    assert owners(128, 4, DEFAULT_PLAN.override("plan_worlds=4"))
    assert not owners(128, 2, DEFAULT_PLAN.override("replicated_owners_min_m=0"))
    assert [owners(M, 2, DEFAULT_PLAN.override("replicated_owners_min_m=65")) for M in (64, 65)] == [False, True]


def test_skinny_slices_take_more_waves_only_where_one_leaves_a_quarter_idle():
    """The skinny classes' slices: one wave of tasks at most, unless that leaves over a quarter of
    the SMs idle (gpt3_175b's 96 column tiles: 4 slices in 3 waves); gemma2_27b's 36 tiles keep 3
    slices (108 busy SMs; 7 in 2 waves measured slower); at most 8."""
    from etdist.ops import gemm_rs as rs_op
    from etdist.ops.gemm_rs import skinny_splits
    assert [skinny_splits(N, 132, 128) for N in (4096, 3584, 4608, 5120, 8192, 12288, 16384)] == [4, 4, 3, 3, 2, 4, 1]
    assert skinny_splits(128, 132, 64) == 8 and skinny_splits(12288, 100, 128) == 1   # 96 of 100 busy
    for M in (16, 64, 128):
        assert rs_op.kernel_plan(M, 24576, 12288, torch.bfloat16, 132, 2, DEFAULT_PLAN)[1] == 4
    with pytest.raises(ValueError, match="skinny_waves"):   # an A/B option, decided and gone
        DEFAULT_PLAN.override("skinny_waves=3")


def test_ag_gemm_rows_just_past_the_whole_class_take_a_tail():
    """whole_tail_m (32): all_gather_gemm from whole_max_m + 1 rows up to the class's block_m +
    whole_tail_m runs one task per column tile over every row (a tail accumulator), aligned sizes on
    two or more ranks only; above it, the per-source graph; 0 turns it off."""
    from etdist.ops import ag_gemm as ag_op
    bf = torch.bfloat16
    plan = lambda M, config, world=2, K=8192: ag_op.kernel_plan(M, K, 28672, bf, 132, world, config)[1]  # noqa: E731
    assert DEFAULT_PLAN.whole_tail_m == 32 and "tail_m" not in plan(129, DEFAULT_PLAN.override("whole_tail_m=0")).keywords
    cfg = DEFAULT_PLAN
    assert [plan(M, cfg).keywords.get("tail_m") for M in (128, 129, 160, 161)] == [None, 32, 32, None]
    assert plan(161, cfg).func.__name__ == "all_gather_gemm"
    assert "tail_m" not in plan(129, cfg, world=1).keywords and "tail_m" not in plan(129, cfg, K=8190).keywords
    assert "tail_m" not in plan(129, cfg, world=4).keywords and plan(129, cfg.override("plan_worlds=4"), world=4).keywords[
        "tail_m"] == 32
    # no whole-gather graph (whole_max_m=0) stays none; past a 256-row class no tail (its accumulators spill)
    assert all(plan(M, cfg.override("whole_max_m=0")).func.__name__ == "all_gather_gemm" for M in (1, 16, 48))
    assert "tail_m" not in plan(257, cfg.override("whole_max_m=256")).keywords
    with pytest.raises(ValueError, match="whole_tail_m must be 0 or a power of two from 16 to 64"):
        DEFAULT_PLAN.override("whole_tail_m=24")


def test_the_mlp_takes_no_tail():
    """The MLP's tail form (four accumulators) was 5% slower on two GPUs and is gone: past
    whole_max_m rows both MLPs take their per-source and sequence-parallel plans."""
    from etdist.ops import mlp as mlp_op
    bf = torch.bfloat16
    for M in (129, 160):
        assert "tail_m" not in mlp_op.kernel_plan(M, 8192, 14336, bf, 132, 2, DEFAULT_PLAN)[1].keywords
        assert "tail_m" not in mlp_op.replicated_plan(M, 8192, 14336, bf, 132, 2, DEFAULT_PLAN)[1].keywords


def test_ag_gemm_past_256_rows_gathers_whole_where_large_tiles_fill_their_waves():
    """whole_large_m (640): all_gather_gemm from 257 rows to 640 takes the whole-gather graph with
    PlanConfig.large's tiles where those fill at least 3/4 of their waves (gemma2_27b's 144 column
    tiles at 384 rows: 432 tiles, 4 waves), else the per-source graph (llama31_8b's 56 at 384: 168
    tiles, 2 waves); aligned sizes; only at world 2 (where it was measured) unless plan_worlds
    says more; never where whole_max_m is 0 or reaches M; 0 turns it off."""
    from etdist.ops import ag_gemm as ag_op
    bf = torch.bfloat16
    name = lambda M, N, world=2, config=DEFAULT_PLAN: ag_op.kernel_plan(M, 4096, N, bf, 132, world, config)[1].func.__name__  # noqa: E731
    assert [name(M, 36864) for M in (256, 257, 384, 640, 641)] == \
        ["all_gather_gemm", "all_gather_gemm_whole", "all_gather_gemm_whole", "all_gather_gemm_whole", "all_gather_gemm"]
    assert name(384, 14336) == "all_gather_gemm" and name(640, 12288) == "all_gather_gemm_whole"
    assert name(384, 36864, world=4) == "all_gather_gemm" and name(384, 36864, world=1) == "all_gather_gemm"
    assert name(384, 36864, config=DEFAULT_PLAN.override("whole_large_m=0")) == "all_gather_gemm"
    assert name(384, 36864, world=4, config=DEFAULT_PLAN.override("plan_worlds=4")) == "all_gather_gemm_whole"
    assert name(384, 36866) == "all_gather_gemm"   # unaligned
    assert name(384, 36864, config=DEFAULT_PLAN.override("whole_max_m=0")) == "all_gather_gemm"
    wide = DEFAULT_PLAN.override("whole_max_m=640")   # its own whole classes serve up to 640, not large's tiles
    assert ag_op.kernel_plan(384, 4096, 36864, bf, 132, 2, wide)[0] is wide.whole_256
    cfg, build = ag_op.kernel_plan(384, 4096, 36864, bf, 132, 2, DEFAULT_PLAN)
    assert cfg is DEFAULT_PLAN.large and build.keywords["gemm_n"] == DEFAULT_PLAN.large.block_n


def test_gemm_rs_rows_just_past_the_skinny_classes_take_a_tail():
    """skinny_tail_m (an option, 0 by default): gemm_reduce_scatter from 129 rows up to
    skinny_tail's block_m + skinny_tail_m runs the skinny graph with a tail accumulator, its slices
    summed locally; aligned sizes on two ranks or more only; past it, the large graph."""
    from etdist.ops import gemm_rs as rs_op
    bf = torch.bfloat16
    plan = lambda M, config, world=2, K=6144: rs_op.kernel_plan(M, K, 4096, bf, 132, world, config)[3]  # noqa: E731
    assert DEFAULT_PLAN.skinny_tail_m == 0 and plan(129, DEFAULT_PLAN).func.__name__ == "gemm_reduce_scatter"
    cfg = DEFAULT_PLAN.override("skinny_tail_m=32")
    assert [plan(M, cfg).keywords.get("tail_m") for M in (128, 129, 160, 161)] == [None, 32, 32, None]
    assert plan(129, cfg).keywords["local_sums"] and plan(161, cfg).func.__name__ == "gemm_reduce_scatter"
    assert rs_op.kernel_plan(129, 6144, 4096, bf, 132, 2, cfg)[0] is cfg.skinny_tail
    assert "tail_m" not in plan(129, cfg, world=1).keywords and "tail_m" not in plan(129, cfg, K=6143).keywords
    with pytest.raises(ValueError, match="skinny_tail_m must be 0 or a power of two from 16 to 64"):
        DEFAULT_PLAN.override("skinny_tail_m=24")


def test_skinny_partials_cross_in_x_dtype_as_an_option():
    """skinny_x_partials (an option, 0 by default; 0 or 1): the skinny classes' partials cross to
    the owners in x's dtype, at two ranks or more and for bf16/fp16 only."""
    from etdist.ops import gemm_rs as rs_op
    kw = lambda M, config, world=2, dt=torch.bfloat16: rs_op.kernel_plan(M, 6144, 4096, dt, 132, world, config)[3].keywords  # noqa: E731
    assert DEFAULT_PLAN.skinny_x_partials == 0 and "x_partials" not in kw(16, DEFAULT_PLAN)
    cfg = DEFAULT_PLAN.override("skinny_x_partials=1")
    assert all(kw(M, cfg)["x_partials"] for M in (1, 16, 64, 128))
    assert "x_partials" not in kw(16, cfg, world=1) and "x_partials" not in kw(16, cfg, dt=torch.float32)
    assert "x_partials" not in kw(1024, cfg)   # the large graph's partials are in x's dtype already
    with pytest.raises(ValueError, match="skinny_x_partials must be 0 or 1"):
        DEFAULT_PLAN.override("skinny_x_partials=2")


def test_tail_rows_through_a_descriptor_as_an_option():
    """tail_row_tma (an option, 0 by default; 0 or 1): the tail classes (all_gather_gemm's
    whole_tail_m, gemm_reduce_scatter's skinny_tail_m, and the MLP's mlp_tail_m:
    test_mlp_rows_just_past_the_whole_class_take_a_tail_as_an_option) load their first 128 rows
    through a descriptor; no other class of the first two takes it."""
    from etdist.ops import ag_gemm as ag_op, gemm_rs as rs_op
    bf = torch.bfloat16
    ag = lambda M, config: ag_op.kernel_plan(M, 8192, 28672, bf, 132, 2, config)[1].keywords  # noqa: E731
    rs = lambda M, config: rs_op.kernel_plan(M, 6144, 4096, bf, 132, 2, config)[3].keywords  # noqa: E731
    assert DEFAULT_PLAN.tail_row_tma == 0 and "tail_row_tma" not in ag(129, DEFAULT_PLAN)
    cfg = DEFAULT_PLAN.override("tail_row_tma=1+skinny_tail_m=32")
    assert ag(129, cfg)["tail_row_tma"] and rs(160, cfg)["tail_row_tma"]
    assert all("tail_row_tma" not in ag(M, cfg) and "tail_row_tma" not in rs(M, cfg) for M in (16, 128, 161, 1024))
    with pytest.raises(ValueError, match="tail_row_tma must be 0 or 1"):
        DEFAULT_PLAN.override("tail_row_tma=2")


def test_mlp_rows_just_past_the_whole_class_take_a_tail_as_an_option():
    """mlp_tail_m (an option, 0 by default): tensor_parallel_mlp from whole_max_m + 1 rows up to
    128 + mlp_tail_m runs the whole-gather graph with a tail accumulator, its gate/up tiles at most
    TAIL_UP_N and block_k wide; aligned sizes on two ranks or more only (plan_worlds); past it, the
    per-source graph."""
    from etdist.ops import mlp as mlp_op
    bf = torch.bfloat16
    plan = lambda M, config, world=2, H=8192, dt=bf: mlp_op.kernel_plan(M, H, 14336, dt, 132, world, config)[1]  # noqa: E731
    assert DEFAULT_PLAN.mlp_tail_m == 0 and plan(129, DEFAULT_PLAN).func.__name__ == "tp_mlp"
    cfg = DEFAULT_PLAN.override("mlp_tail_m=32")
    assert [plan(M, cfg).keywords.get("tail_m") for M in (128, 129, 160, 161)] == [None, 32, 32, None]
    assert plan(161, cfg).func.__name__ == "tp_mlp" and plan(129, cfg).keywords["up_n"] == mlp_op.TAIL_UP_N
    assert plan(129, cfg, dt=torch.float32).keywords["up_n"] == 32   # fp32 tiles step 32 columns of K
    assert "tail_m" not in plan(129, cfg, world=1).keywords and "tail_m" not in plan(129, cfg, H=8190).keywords
    assert "tail_m" not in plan(129, cfg, world=4).keywords
    assert plan(129, cfg.override("tail_row_tma=1")).keywords["tail_row_tma"]
    for bad in (24, 128):   # 128 more rows spill the tail tiles' accumulators
        with pytest.raises(ValueError, match="mlp_tail_m must be 0 or a power of two from 16 to 64"):
            DEFAULT_PLAN.override(f"mlp_tail_m={bad}")
    # the MLP's own whole class under the tail (whole_max_m=64: whole_mlp's 64-row tile, not all_gather_gemm's)
    cfg64 = DEFAULT_PLAN.override("whole_max_m=64+mlp_tail_m=32")
    assert mlp_op.kernel_plan(80, 8192, 14336, bf, 132, 2, cfg64)[0] == DEFAULT_PLAN.whole_mlp


def test_whole_classes_slice_their_ragged_last_wave_as_an_option():
    """whole_ragged_splits (an option, 0 by default): the whole classes' GEMM tiles past their last
    full wave run in as many contraction slices as fill the SMs, at most the option's (gemma2_27b's
    288 tiles of 128 leave 24 on 132 SMs: 5; llama31_405b's 416 leave 20: 6, or the cap); none
    where the tiles fill their waves or fit in one, or where slices would be fewer than 2."""
    from etdist.ops import ag_gemm as ag_op
    bf = torch.bfloat16
    kw = lambda M, N, config: ag_op.kernel_plan(M, 4608, N, bf, 132, 2, config)[1].keywords  # noqa: E731
    assert "ragged_tiles" not in kw(16, 36864, DEFAULT_PLAN)
    cfg = DEFAULT_PLAN.override("whole_ragged_splits=8")
    assert [(kw(M, 36864, cfg)["ragged_tiles"], kw(M, 36864, cfg)["ragged_splits"]) for M in (16, 64, 128)] == [(24, 5)] * 3
    assert (kw(16, 53248, cfg)["ragged_tiles"], kw(16, 53248, cfg)["ragged_splits"]) == (20, 6)
    assert kw(16, 53248, DEFAULT_PLAN.override("whole_ragged_splits=4"))["ragged_splits"] == 4
    for N in (12288, 25600, 33792):   # one wave; 200 tiles leave 68 (one slice each); 264: two full waves
        assert "ragged_tiles" not in kw(16, N, cfg), N
    assert "ragged_tiles" not in kw(129, 36864, cfg) and "ragged_tiles" not in kw(384, 36864, cfg)   # tail; large
