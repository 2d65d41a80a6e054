"""The torch MoE baseline (issue 7) matches the float64 reference, on one rank and expert-parallel
over two gloo ranks, every way it runs: experts grouped (torch._grouped_mm), one mm pair each or
the serving engine's fused Triton kernels (etdist.bench.measure.fused_moe, run by the Triton
interpreter here), dispatch with exchanged sizes or fixed padded blocks (the CUDA-graph-capturable
form)."""
import pytest
import torch
import torch.distributed as dist

from etdist.bench.measure.fused_moe import CONFIGS
from etdist.bench.measure.moe_baseline import torch_moe
from etdist.workloads import moe

WAYS = [(experts, dispatch) for experts in ("grouped", "loop", "fused") for dispatch in ("exact", "padded")]


def _run(rank, world, store, skew):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ranks, (wg, w1, w2) = moe.make_inputs(world, 11, 16, 12, 4 * world, seed=5, skew=skew)
        want = moe.reference([i["x"] for i in ranks], wg, w1, w2, top_k=2)[rank]
        for experts, dispatch in WAYS:
            got = torch_moe(ranks[rank]["x"], wg, ranks[rank]["w_gate_up"], ranks[rank]["w_down"], top_k=2,
                            experts=experts, dispatch=dispatch)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, (world, skew, experts, dispatch, err)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_torch_moe_one_and_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")     # read when the spawned ranks import the kernels
    for world, skew in ((1, 0.0), (2, 0.0), (2, 4.0)):
        store = tmp_path / f"s{world}{skew}"
        torch.multiprocessing.spawn(_run, args=(world, str(store), skew), nprocs=world)


def test_experts_no_token_routes_to_are_skipped():
    """Grouped experts with empty groups (skewed routing leaves most experts idle) and padding rows
    (expert -1) that belong to no group."""
    from etdist.bench.measure.moe_baseline import _grouped_experts, _looped_experts
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 16, generator=gen)
    local = torch.tensor([3, -1, 0, 3, 3, -1, 0, 3, 3])
    wgu, wd = torch.randn(5, 16, 24, generator=gen), torch.randn(5, 12, 16, generator=gen)
    got, want = _grouped_experts(rows, local, wgu, wd), _looped_experts(rows, local, wgu, wd)
    used = local >= 0
    assert torch.allclose(got[used], want[used], rtol=1e-5, atol=1e-5)


def test_bad_way_is_refused():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="experts must be 'grouped', 'loop' or 'fused'"):
        torch_moe(x, torch.randn(16, 4), torch.randn(4, 16, 24), torch.randn(4, 12, 16), 2, experts="fast")


def test_align_pads_each_expert_to_whole_row_blocks():
    """The fused baseline's slot list: each expert's slots in order, padded to a multiple of the row
    block with the out-of-range slot, experts with no slot take no block, left-out slots (-1) are
    nowhere, and each used block names its expert."""
    from etdist.bench.measure.fused_moe import align
    ids = torch.tensor([[3, 0], [3, -1], [0, 3], [3, 3]])   # slot t*2+j; experts 1, 2 get none
    al = align(ids, num_experts=4, block_m=4)
    S = al.slots
    assert S == 8 and al.rows_used.item() == 12             # expert 0: 2 slots -> 4 rows, expert 3: 5 -> 8
    assert al.slot_of_row[:12].tolist() == [1, 4, S, S, 0, 2, 5, 6, 7, S, S, S]
    assert al.expert_of_block[:3].tolist() == [0, 3, 3]
    assert (al.slot_of_row[12:] == S).all() and 3 not in al.slot_of_row.tolist()   # the left-out slot
    assert al.slot_of_row.numel() % 4 == 0 and al.slot_of_row.numel() >= 12


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_every_fused_config_builds_for_sm90_and_fits(cfg):
    """Every entry of the fused baseline's tuning table compiles for sm_90 (no GPU needed) within its
    227 KB of shared memory, on the tensor cores (wgmma from 64-row blocks, mma.sync below): a
    config that fails there would silently drop out of the tuning."""
    import triton
    from triton.backends.compiler import GPUTarget

    from etdist.bench.measure.fused_moe import _expert_gemm
    ptrs = ("a_ptr", "b_ptr", "c_ptr", "scale_ptr", "slot_ptr", "expert_ptr", "rows_used_ptr")
    sig = {**{p: "*bf16" for p in ptrs[:4]}, **{p: "*i32" for p in ptrs[4:]},
           **{n: "i32" for n in ("max_rows", "N", "slots", "sa_m", "sa_k", "sb_e", "sb_k", "sb_n", "sc_m", "sc_n")}}
    sig = {name: sig.get(name, "constexpr") for name in _expert_gemm.arg_names}
    consts = dict(K=4096, A_ROWS_PER_TOKEN=2, SCALED=True, EVEN_K=True, PRECISION="tf32", BM=cfg.block_m,
                  BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(_expert_gemm.arg_names) if name in ptrs}
    src = triton.compiler.ASTSource(_expert_gemm, sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    assert compiled.metadata.shared <= 232448, compiled.metadata.shared
    assert ("wgmma.mma_async" if cfg.block_m >= 64 else "mma.sync") in compiled.asm["ptx"]
