"""CI, after the wheel install: the API from the installed package, run from outside the checkout."""
import sys

import torch
from torch import nn

import etdist as et

assert et.__file__.startswith(sys.prefix), f"etdist imported from {et.__file__}, not the installed wheel"


class Dense(nn.Module):   # a Llama-style MLP
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


dense = Dense(64, 128)
mlp = et.nn.TensorParallelMLP.from_dense(dense, simulate_world=2)
x = torch.randn(8, 64)
with torch.no_grad():
    want = dense(x)
    err = ((mlp(x) - want).abs().max() / want.abs().max()).item()
assert err < 1e-5, err
print(f"the API from the wheel: TensorParallelMLP over 2 simulated ranks = the dense MLP (rel err {err:.1e})")
