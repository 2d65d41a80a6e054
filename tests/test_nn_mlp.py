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
