"""et.nn.TensorParallelMLP in a real client: a small Llama-style transformers model (random weights,
built from a config, no download) with its MLPs swapped for 2- and 4-rank tensor-parallel ones,
run on the CPU runtime: the logits match the unsharded model."""
import pytest
import torch
from torch import nn

import etdist as et

transformers = pytest.importorskip("transformers")


def tiny_llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("world", [2, 4])
def test_llama_logits_match_with_sharded_mlps(world):
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 13))          # 26 tokens: not a multiple of the world size
    with torch.no_grad():
        want = model(ids).logits
        for layer in model.model.layers:
            layer.mlp = et.nn.TensorParallelMLP.from_dense(layer.mlp, simulate_world=world)
        got = model(ids).logits
    assert isinstance(model.model.layers[0].mlp, et.nn.TensorParallelMLP)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err


def test_from_dense_shards_by_rank():
    dense = tiny_llama().model.layers[0].mlp
    mlp = et.nn.TensorParallelMLP.from_dense(dense, simulate_world=2)
    n = 64  # intermediate 128 over 2 ranks
    torch.testing.assert_close(mlp.w_gate_up[1][:, :n], dense.gate_proj.weight[n:].t())
    torch.testing.assert_close(mlp.w_gate_up[1][:, n:], dense.up_proj.weight[n:].t())
    torch.testing.assert_close(mlp.w_down[0], dense.down_proj.weight[:, :n].t())


def test_bad_modules_and_inputs_are_refused():
    class NoGate(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj, self.down_proj = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
    with pytest.raises(TypeError, match="needs gate_proj as an nn.Linear"):
        et.nn.TensorParallelMLP.from_dense(NoGate(), simulate_world=2)
    dense = tiny_llama().model.layers[0].mlp
    dense.act_fn = nn.GELU()
    with pytest.raises(ValueError, match="GELU is not supported"):
        et.nn.TensorParallelMLP.from_dense(dense, simulate_world=2)
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        et.nn.TensorParallelMLP(64, 128, simulate_world=3)
    mlp = et.nn.TensorParallelMLP(64, 128, simulate_world=2, dtype=torch.float32)
    with pytest.raises(et.InputError, match="x has 32 features, the layer 64"):
        mlp(torch.randn(3, 32))
    with pytest.raises(et.MeshError, match="call etdist.init_mesh"):
        et.nn.TensorParallelMLP(64, 128)  # no mesh and nothing simulated
    with pytest.raises(et.InputError, match=r"or torch.float32\), got torch.float64"):
        et.nn.TensorParallelMLP(64, 128, dtype=torch.float64)    # GPUs: no float64 kernels
    et.nn.TensorParallelMLP(64, 128, simulate_world=2, dtype=torch.float64)   # simulated ranks: fine


def test_a_layer_built_without_weights_has_random_ones():
    """Built from sizes (not from_dense), the weights were torch.empty: NaN or garbage out. They are
    seeded random, as nn.MoE's, so a layer is usable (and reproducible) before real weights load."""
    a = et.nn.TensorParallelMLP(64, 128, simulate_world=2, dtype=torch.float32)
    b = et.nn.TensorParallelMLP(64, 128, simulate_world=2, dtype=torch.float32)
    x = torch.randn(5, 64)
    y = a(x)
    assert torch.isfinite(y).all() and y.abs().max() > 0
    torch.testing.assert_close(y, b(x))


def test_from_dense_refuses_mismatched_projections():
    """A down_proj wider than gate/up was silently cut to their width (wrong weights, no error); an
    up_proj or down_proj of another size failed inside torch.cat."""
    class Dense(nn.Module):
        def __init__(self, H=16, I=32, up_out=None, down_in=None, down_out=None):
            super().__init__()
            self.gate_proj = nn.Linear(H, I, bias=False)
            self.up_proj = nn.Linear(H, up_out or I, bias=False)
            self.down_proj = nn.Linear(down_in or I, down_out or H, bias=False)
    for bad in (dict(down_in=48), dict(up_out=24), dict(down_out=8)):
        with pytest.raises(et.InputError, match=r"from_dense: gate_proj.weight is \[32, 16\].*a SwiGLU MLP has "
                                                r"\[32, 16\], \[32, 16\], \[16, 32\]"):
            et.nn.TensorParallelMLP.from_dense(Dense(**bad), simulate_world=2)
    dense = Dense()
    mlp = et.nn.TensorParallelMLP.from_dense(dense, simulate_world=2)
    x = torch.randn(5, 16)
    with torch.no_grad():
        want = dense.down_proj(nn.functional.silu(dense.gate_proj(x)) * dense.up_proj(x))
        assert ((mlp(x) - want).abs().max() / want.abs().max()).item() < 1e-5


def test_bad_sizes_dtypes_and_inputs_are_refused_before_running():
    """simulate_world=0 was a ZeroDivisionError, a negative one built a layer with no weights,
    non-positive sizes failed in torch.empty, an int dtype inside a tile body, a list or 0-d x with
    AttributeError / IndexError; a following good call is right."""
    TP = et.nn.TensorParallelMLP
    for kwargs, msg in ((dict(simulate_world=0), "simulate_world must be a positive int, got 0"),
                        (dict(simulate_world=-2), "simulate_world must be a positive int, got -2"),
                        (dict(simulate_world=2, dtype=torch.int32), "dtype must be a floating-point torch.dtype")):
        with pytest.raises(et.InputError, match=msg):
            TP(64, 128, **kwargs)
    for hidden, intermediate, name in ((0, 128, "hidden"), (64, -4, "intermediate")):
        with pytest.raises(et.InputError, match=f"{name} must be a positive int"):
            TP(hidden, intermediate, simulate_world=2)
    mlp = TP(64, 128, simulate_world=2, dtype=torch.float32)
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.1)
    x = torch.randn(5, 64)
    want = mlp(x)
    for bad, msg in (([0.0] * 64, r"x must be a tensor \[..., 64\], got list"),
                     (torch.tensor(1.0), "got a 0-d tensor"),
                     (x.long(), "x is torch.int64; pass the hidden states as a floating-point tensor"),
                     (x.double(), r"x is torch.float64, the layer's weights torch.float32: pass x.to\(torch.float32\)")):
        with pytest.raises(et.InputError, match=msg):
            mlp(bad)
    with pytest.raises(et.InputError, match="total_rows=17 but x has 5 rows"):
        mlp(x, total_rows=17)
    torch.testing.assert_close(mlp(x), want)
