"""nn.Modules for users' tensor-parallel models."""
from .mlp import TensorParallelMLP
from .moe import DEFAULT_MOE, MoE, MoEConfig
