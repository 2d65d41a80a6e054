"""`TensorParallelMLP`: a Llama/Qwen-style SwiGLU MLP, sharded over ranks, run as one megakernel.

    mlp = et.nn.TensorParallelMLP.from_dense(model.layers[i].mlp)       # under torchrun, on GPUs
    y = mlp(x)

The intermediate dimension is split over the ranks (gate/up by columns, down by rows). In
sequence-parallel mode (the default) each rank passes its rows of the sequence (chunks of
cdiv(M, R), ragged at the end; pass `total_rows=M` when M is not R x rows) and gets its rows of
the output. With `sequence_parallel=False` every rank passes the whole x (the same on every rank)
and gets the whole y: the kernel then gathers nothing and ends in an all-reduce of its own.

Without GPUs, `simulate_world=R` holds all R shards in this one module and runs them on the CPU
runtime (simulated ranks): same graph, same sharding, for tests and for checking a model on a
laptop. Forward only (inference): there is no backward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import fusion
from ..fusion.errors import InputError
from ..ops import mlp as mlp_ops
from ..ops.common import refusal_reaches_peers
from ..ops.mlp import tensor_parallel_mlp
from ..workloads import mlp as mlp_graph
from .checks import float_dtype, hidden_states, layer_mesh, positive_ints

_CPU_TILE = 16


class TensorParallelMLP(nn.Module):
    """A SwiGLU MLP (hidden -> intermediate -> hidden) sharded over the mesh's ranks, one megakernel
    per call (the module docstring says how). `from_dense` shards an existing dense MLP; built
    directly it holds seeded random weights (init_weights=True). simulate_world=R: all R shards in
    this module on the CPU runtime, no mesh. Forward only."""

    def __init__(self, hidden: int, intermediate: int, *, mesh=None, activation: str = "silu",
                 dtype: torch.dtype = torch.bfloat16, sequence_parallel: bool = True,
                 simulate_world: Optional[int] = None, device=None, init_weights: bool = True):
        super().__init__()
        if activation != "silu":
            raise ValueError(f"activation {activation!r} is not supported: SwiGLU ('silu') only")
        positive_ints("TensorParallelMLP", hidden=hidden, intermediate=intermediate)
        float_dtype("TensorParallelMLP", dtype, simulated=simulate_world is not None)
        if simulate_world is not None:
            positive_ints("TensorParallelMLP", simulate_world=simulate_world)
        if simulate_world is None:
            mesh = layer_mesh("TensorParallelMLP", mesh)
            world, shards = mesh.world_size, 1
            device = device or mesh.device
        else:
            world, shards = int(simulate_world), int(simulate_world)
            device = device or "cpu"
        if intermediate % world:
            raise ValueError(f"intermediate size {intermediate} does not split over {world} ranks")
        self.hidden, self.intermediate, self.world, self.mesh = hidden, intermediate, world, mesh
        self.sequence_parallel, self.simulated = sequence_parallel, simulate_world is not None
        n = intermediate // world
        gen = torch.Generator(device=device).manual_seed(0)   # seeded random weights, unless
        # init_weights=False: left as allocated, for a caller that fills them (from_dense)

        def param(*shape, scale):
            if not init_weights:
                return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
            return nn.Parameter((torch.randn(*shape, generator=gen, device=device) * scale).to(dtype),
                                requires_grad=False)
        # one shard per rank held here: ours on GPUs, all of them when simulating
        self.w_gate_up = nn.ParameterList([param(hidden, 2 * n, scale=hidden ** -0.5) for _ in range(shards)])
        self.w_down = nn.ParameterList([param(n, hidden, scale=intermediate ** -0.5) for _ in range(shards)])
        self._kernel = None

    @classmethod
    def from_dense(cls, module: nn.Module, *, mesh=None, sequence_parallel: bool = False,
                   simulate_world: Optional[int] = None) -> "TensorParallelMLP":
        """Shard a dense MLP with gate_proj, up_proj, down_proj (nn.Linear, no bias). Defaults to
        replicated input/output, which drops into a model that is not sequence-parallel."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(module, name, None)
            if not isinstance(lin, nn.Linear) or lin.bias is not None:
                raise TypeError(f"from_dense needs {name} as an nn.Linear without bias (Llama/Qwen MLP)")
        wg, wu, wd = module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight  # [I,H],[I,H],[H,I]
        I, H = wg.shape
        if tuple(wu.shape) != (I, H) or tuple(wd.shape) != (H, I):
            raise InputError(f"from_dense: gate_proj.weight is {list(wg.shape)}, up_proj.weight {list(wu.shape)}, "
                             f"down_proj.weight {list(wd.shape)}; a SwiGLU MLP has [{I}, {H}], [{I}, {H}], "
                             f"[{H}, {I}] (gate_proj and up_proj: Linear({H}, {I}), down_proj: Linear({I}, {H}))")
        act = getattr(module, "act_fn", None)
        probe = torch.linspace(-4, 4, 17)
        if act is not None and not torch.allclose(act(probe), torch.nn.functional.silu(probe)):
            # judged by what it computes: libraries have their own SiLU classes
            raise ValueError(f"from_dense: activation {type(act).__name__} is not supported (SiLU only)")
        mlp = cls(wg.shape[1], wg.shape[0], mesh=mesh, dtype=wg.dtype, sequence_parallel=sequence_parallel,
                  simulate_world=simulate_world, device=None if simulate_world is None else wg.device,
                  init_weights=False)
        gate_up, down = mlp_graph.shard(wg.detach().t(), wu.detach().t(), wd.detach().t(), mlp.world)
        ranks = range(mlp.world) if mlp.simulated else [mlp.mesh.rank]
        with torch.no_grad():
            for k, r in enumerate(ranks):
                mlp.w_gate_up[k].copy_(gate_up[r])
                mlp.w_down[k].copy_(down[r])
        return mlp

    def extra_repr(self) -> str:
        mode = f"simulated ranks={self.world}" if self.simulated else f"rank {self.mesh.rank} of {self.world}"
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, {mode}, "
                f"sequence_parallel={self.sequence_parallel}")

    def forward(self, x: torch.Tensor, total_rows: Optional[int] = None) -> torch.Tensor:
        if torch.compiler.is_compiling():   # checked while torch.compile traces: nothing has launched
            self._check(x, total_rows)
        else:   # refused here on one rank only, the peers' launches stop too (every rank raises)
            with refusal_reaches_peers(None if self.simulated else self.mesh, mlp_ops._KERNELS):
                self._check(x, total_rows)
        lead = x.shape[:-1]
        if self.simulated and total_rows is not None and total_rows != x[..., 0].numel():
            raise InputError(f"TensorParallelMLP: total_rows={total_rows!r} but x has {x[..., 0].numel()} rows; "
                             "simulated ranks take the whole x (total_rows is for sequence-parallel GPU ranks)")
        x2 = x.reshape(-1, self.hidden)  # [M or rows, H]
        y = self._simulated(x2) if self.simulated else self._on_gpus(x2, total_rows)
        return y.reshape(*lead, self.hidden) if not self.sequence_parallel or self.simulated else y

    def _check(self, x: torch.Tensor, total_rows: Optional[int]) -> None:
        hidden_states("TensorParallelMLP", x, self.hidden, self.w_down[0].dtype)
        if not self.sequence_parallel and not self.simulated and total_rows not in (None, x[..., 0].numel()):
            raise InputError(f"TensorParallelMLP: total_rows={total_rows!r} but this module is not sequence-parallel: "
                             f"every rank passes the whole x ({x[..., 0].numel()} rows here); build it with "
                             "sequence_parallel=True to pass each rank's rows")

    def _cpu_kernel(self):
        """The graph the GPU ranks run, on the CPU runtime: sequence-parallel or replicated."""
        if self._kernel is None:
            build = mlp_graph.tp_mlp if self.sequence_parallel else mlp_graph.tp_mlp_replicated
            graph = build(_CPU_TILE, _CPU_TILE, self.w_down[0].dtype)
            self._kernel = fusion.compile(graph, schedule="static", target="cpu")
        return self._kernel

    def _simulated(self, x: torch.Tensor) -> torch.Tensor:
        """The whole x in, the whole y out: sequence-parallel, the rows split like the ranks would
        and every rank's rows of y concatenated; replicated, every rank given x (rank 0's y)."""
        M = x.shape[0]
        C = -(-M // self.world)
        inputs = [{"x": (x[r * C:(r + 1) * C] if self.sequence_parallel else x).contiguous(),
                   "w_gate_up": self.w_gate_up[r].data, "w_down": self.w_down[r].data} for r in range(self.world)]
        outs = self._cpu_kernel().run(inputs, sizes={"M": M})
        return torch.cat([o["y"] for o in outs]) if self.sequence_parallel else outs[0]["y"]

    def _on_gpus(self, x: torch.Tensor, total_rows: Optional[int]) -> torch.Tensor:
        # replicated: one kernel, no gather, its all-reduce inside (workloads.mlp.tp_mlp_replicated)
        M = (total_rows if total_rows is not None else x.shape[0] * self.world) if self.sequence_parallel else None
        return tensor_parallel_mlp(x.contiguous(), self.w_gate_up[0].data, self.w_down[0].data, mesh=self.mesh,
                                   total_rows=M, sequence_parallel=self.sequence_parallel)
