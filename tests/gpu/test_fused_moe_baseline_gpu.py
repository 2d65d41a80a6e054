"""The serving-style fused MoE baseline (etdist.bench.measure.fused_moe) on a GPU: every config of its
tuning table against the float32 loop, in bf16, on ragged sizes and skewed routing; the tuned pick
replays from a CUDA graph. Run: pytest -m gpu tests/gpu."""
import pytest
import torch

from etdist.bench.measure import fused_moe as F
from etdist.bench.measure.moe_baseline import torch_moe
from etdist.workloads.moe import skew_router

pytestmark = pytest.mark.gpu


def _layer(T, H, I, E, k, skew, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    u = torch.randn(H, generator=gen, device="cuda")
    router = skew_router(torch.randn(H, E, generator=gen, device="cuda"), u / u.norm(), skew)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    wgu = (torch.randn(E, H, 2 * I, generator=gen, device="cuda") * H ** -0.5).to(torch.bfloat16)
    wd = (torch.randn(E, I, H, generator=gen, device="cuda") * I ** -0.5).to(torch.bfloat16)
    return x, router.to(torch.bfloat16), wgu, wd


def _routing(x, router, k):
    w, ids = torch.softmax(x.float() @ router.float(), dim=-1).topk(k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(x.dtype)


@pytest.mark.parametrize("T,H,I,E,k,skew", [(1, 256, 136, 8, 2, 0.0), (37, 256, 136, 8, 2, 1.5),
                                            (300, 256, 136, 16, 4, 1.5)])
def test_every_config_matches_the_float32_loop(T, H, I, E, k, skew):
    x, router, wgu, wd = _layer(T, H, I, E, k, skew)
    want = torch_moe(x.float(), router.float(), wgu.float(), wd.float(), k, experts="loop")
    ids, w = _routing(x, router, k)
    for cfg in F.CONFIGS:
        got = F.fused_moe(x, ids, w, wgu, wd, cfg)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, (cfg, err)


def test_tuned_pick_replays_from_a_cuda_graph():
    x, router, wgu, wd = _layer(64, 256, 136, 8, 2, 1.5, seed=1)
    want = torch_moe(x.float(), router.float(), wgu.float(), wd.float(), 2, experts="loop")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="never tuned"):
        with torch.cuda.graph(graph):
            torch_moe(x, router, wgu, wd, 2, experts="fused")
    torch_moe(x, router, wgu, wd, 2, experts="fused")                  # tunes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch_moe(x, router, wgu, wd, 2, experts="fused")
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert ((y.float() - want).abs().max() / want.abs().max()).item() < 2e-2
