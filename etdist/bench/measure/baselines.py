"""The baselines etdist must beat, measured in the same run (docs/benchmarks.md, "How we measure").

Two tensor-parallel workloads, shapes as seen by one rank (bf16 by default):

  gemm_rs  x [M, K_local] @ w [K_local, N] -> [M, N] partial sums, reduce-scatter over rows
           -> [M / world, N]
  ag_gemm  x [M / world, K] all-gather over rows -> [M, K] @ w [K, N_local] -> [M, N_local]

For each there are builders of zero-arg callables (each call runs the op once and returns its
output tensor):

  *_mm_only   the local torch.mm alone (M unpadded)
  *_eager     torch.mm + NCCL through torch.distributed, op by op
  *_graph     the same ops captured in CUDA graphs and replayed
  *_symm_mem  torch.ops.symm_mem.fused_matmul_reduce_scatter / fused_all_gather_matmul; returns
              (callable, None), or (None, reason) where it cannot run

Every callable rotates over `copies` weight copies (call i uses copy i % copies) so that weights
stream from HBM as in a real forward pass, not from L2.

Ragged M: when M is not a multiple of world, the row dimension is padded up to the next multiple
(gemm_rs: x has ceil(M/world)*world rows; ag_gemm: each rank's shard has ceil(M/world) rows), as a
serving stack pads tokens; the mm then runs over the padded rows. `mm_only` uses exactly M rows.

CUDA graphs: one graph per weight copy (each holding one op, so that one replay = one call, like
the other callables), captured after a warm-up on a side stream that creates the cuBLAS workspaces
and NCCL communicators; a call replays the next graph in turn.

symm_mem: uses torch's default CUDA symmetric-memory backend, never NVSHMEM: etdist owns NVSHMEM
through nvshmem4py in the same process and a process may have one NVSHMEM owner (NOTES.md). It is
skipped (with a reason) when torch's backend is set to NVSHMEM, and can be turned off with
symm_mem=False. The checks that can fail run before any collective, so ranks agree on skipping;
a failure inside the op on one rank only can still hang the others.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ... import knobs
from .timing import time_alternated, time_batched

Fn = Callable[[], torch.Tensor]

# torch >= 2.13 renames reduce_scatter_tensor / all_gather_into_tensor (same signatures)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------------------- inputs

@dataclass
class Operands:
    x: torch.Tensor                 # this rank's activations
    weights: list[torch.Tensor]     # `copies` weight copies, all [K, N]


def _default_device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _require_dist(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs torch.distributed: call dist.init_process_group first "
                           "(a world of 1 works for a single process)")


def padded_rows(M: int, world: int) -> int:
    """M rounded up to a multiple of world: the rows a reduce-scatter / all-gather over M moves."""
    return -(-M // world) * world


def random_operands(rows: int, K: int, N: int, *, copies: int = 4, device=None,
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Operands:
    """x [rows, K] and `copies` weights [K, N], random normal scaled to keep outputs O(1) (never
    zeros). Seed it per rank (seed + rank) so ranks hold different data."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    device = _default_device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
                * scale).to(dtype)
    x = randn(rows, K, scale=1.0)
    weights = [randn(K, N, scale=K ** -0.5) for _ in range(copies)]
    return Operands(x, weights)


def _check(ops: Operands, rows: int, K: int, N: int, what: str) -> Operands:
    want = (rows, K), (K, N)
    got = tuple(ops.x.shape), tuple(ops.weights[0].shape)
    if got != want:
        raise ValueError(f"{what}: operands have x, w shapes {got}, expected {want}")
    return ops


# ------------------------------------------------------------------- eager, graph, symm_mem glue

def rotating(step: Callable[[int], torch.Tensor], copies: int) -> Fn:
    """A zero-arg callable running step(0), step(1), ..., step(copies - 1), step(0), ..."""
    turn = itertools.cycle(range(copies))
    return lambda: step(next(turn))


def graphed(step: Callable[[int], torch.Tensor], copies: int, device: torch.device) -> Fn:
    """step(i) captured in one CUDA graph per weight copy i; a call replays the next graph. The
    callable keeps step (and so its operands) alive. Also how etdist's own ops are timed in a graph
    (their launches replay correctly)."""
    if device.type != "cuda":
        raise RuntimeError("the CUDA-graph baseline needs a CUDA device")
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):            # warm-up: cuBLAS handles, NCCL communicators
            for i in range(copies):
                step(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graphs, outs = [], []
        for i in range(copies):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs.append(step(i))
            graphs.append(g)
        torch.cuda.synchronize()
    turn = itertools.cycle(range(copies))

    def replay() -> torch.Tensor:
        i = next(turn)
        graphs[i].replay()
        return outs[i]
    # The graphs read and write what step's closure holds (operands, outputs), by address: it must
    # live as long as they do. Freed, the next capture's empty_cache() unmapped it, and a replay then
    # faulted (an illegal address) or, before that, read and wrote memory that was no longer its own.
    replay.step = step
    return replay


def _symm_mem_unavailable(device: torch.device) -> Optional[str]:
    """Why torch.ops.symm_mem cannot run here, or None. Selects the CUDA backend if none is set."""
    if device.type != "cuda":
        return "torch.ops.symm_mem needs a CUDA device"
    if knobs.torch_symm_mem_backend() == "NVSHMEM":
        return ("TORCH_SYMMMEM=NVSHMEM: torch would take the process's NVSHMEM, which etdist owns "
                "through nvshmem4py; unset it to use the CUDA backend")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch.distributed._symmetric_memory unavailable: {e}"
    if not hasattr(symm_mem, "get_backend"):
        return None                              # older torch: CUDA is the only backend
    try:
        backend = symm_mem.get_backend(device)
        if backend is None:
            symm_mem.set_backend("CUDA")
    except Exception as e:  # noqa: BLE001
        return f"cannot select torch's CUDA symmetric-memory backend: {type(e).__name__}: {e}"
    if backend is not None and backend.upper() != "CUDA":
        return (f"torch symmetric-memory backend is {backend}; this baseline uses CUDA only "
                "(one NVSHMEM owner per process: etdist's nvshmem4py)")
    return None


def _symm_mem_build(step: Callable[[int], torch.Tensor], copies: int, device: torch.device,
                    op: str) -> tuple[Optional[Fn], Optional[str]]:
    reason = _symm_mem_unavailable(device)
    if reason:
        return None, reason
    if not hasattr(torch.ops.symm_mem, op):
        return None, f"torch.ops.symm_mem.{op} is not in this torch ({torch.__version__})"
    try:
        with torch.cuda.device(device):
            step(0)                              # allocates the symmetric workspace (collective)
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure means "no symm_mem baseline here"
        return None, f"torch.ops.symm_mem.{op} failed: {type(e).__name__}: {e}"
    return rotating(step, copies), None


# ------------------------------------------------------------------------------------ GEMM + RS

def gemm_rs_operands(M: int, K_local: int, N: int, *, group=None, copies: int = 4, device=None,
                     dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Operands:
    """x [padded_rows(M, world), K_local], weights [K_local, N]."""
    return random_operands(padded_rows(M, _world(group)), K_local, N, copies=copies, device=device,
                           dtype=dtype, seed=seed + _rank(group))


def _gemm_rs_ops(M, K_local, N, group, copies, device, dtype, operands) -> Operands:
    if operands is None:
        return gemm_rs_operands(M, K_local, N, group=group, copies=copies, device=device,
                                dtype=dtype)
    return _check(operands, padded_rows(M, _world(group)), K_local, N, "gemm_rs")


def _mm_only(M, K, N, copies, device, dtype, operands) -> Fn:
    if operands is None:
        operands = random_operands(M, K, N, copies=copies, device=device, dtype=dtype)
    elif operands.x.shape[1] != K or operands.weights[0].shape != (K, N):
        raise ValueError(f"mm_only: operands x {tuple(operands.x.shape)}, w "
                         f"{tuple(operands.weights[0].shape)} do not hold [{M}, {K}] @ [{K}, {N}]")
    # ag_gemm's operands hold one rank's chunk of rows: the mm alone runs over M random rows
    x = operands.x[:M] if operands.x.shape[0] >= M else torch.randn(M, K, device=operands.x.device,
                                                                    dtype=operands.x.dtype)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    return rotating(lambda i: torch.mm(x, operands.weights[i], out=out), len(operands.weights))


def gemm_rs_mm_only(M: int, K_local: int, N: int, *, copies: int = 4, device=None,
                    dtype: torch.dtype = torch.bfloat16, operands: Optional[Operands] = None) -> Fn:
    """torch.mm of x [M, K_local] @ w [K_local, N] alone (first M rows of operands.x if given)."""
    return _mm_only(M, K_local, N, copies, device, dtype, operands)


def _gemm_rs_step(M, K_local, N, group, copies, device, dtype, operands):
    _require_dist("gemm_rs baseline")
    device = _default_device(device)
    ops = _gemm_rs_ops(M, K_local, N, group, copies, device, dtype, operands)
    rows = ops.x.shape[0]
    partial = torch.empty(rows, N, device=ops.x.device, dtype=ops.x.dtype)
    out = torch.empty(rows // _world(group), N, device=ops.x.device, dtype=ops.x.dtype)

    def step(i: int) -> torch.Tensor:
        torch.mm(ops.x, ops.weights[i], out=partial)
        _reduce_scatter(out, partial, group=group)
        return out
    return step, len(ops.weights), device


def gemm_rs_eager(M: int, K_local: int, N: int, *, group=None, copies: int = 4, device=None,
                  dtype: torch.dtype = torch.bfloat16, operands: Optional[Operands] = None) -> Fn:
    """torch.mm then torch.distributed reduce-scatter over rows; returns [padded_rows/world, N]."""
    step, n, _ = _gemm_rs_step(M, K_local, N, group, copies, device, dtype, operands)
    return rotating(step, n)


def gemm_rs_graph(M: int, K_local: int, N: int, *, group=None, copies: int = 4, device=None,
                  dtype: torch.dtype = torch.bfloat16, operands: Optional[Operands] = None) -> Fn:
    """gemm_rs_eager captured in CUDA graphs (one per weight copy). Collective to build."""
    step, n, device = _gemm_rs_step(M, K_local, N, group, copies, device, dtype, operands)
    return graphed(step, n, device)


def gemm_rs_symm_mem(M: int, K_local: int, N: int, *, group=None, copies: int = 4, device=None,
                     dtype: torch.dtype = torch.bfloat16, operands: Optional[Operands] = None
                     ) -> tuple[Optional[Fn], Optional[str]]:
    """torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w, "sum", 0, group_name):
    (callable, None), or (None, reason) where it cannot run."""
    _require_dist("gemm_rs symm_mem baseline")
    device = _default_device(device)
    if device.type != "cuda":
        return None, "torch.ops.symm_mem needs a CUDA device"
    ops = _gemm_rs_ops(M, K_local, N, group, copies, device, dtype, operands)
    name = (group or dist.group.WORLD).group_name

    def step(i: int) -> torch.Tensor:
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(ops.x, ops.weights[i], "sum", 0, name)
    return _symm_mem_build(step, len(ops.weights), device, "fused_matmul_reduce_scatter")


# ------------------------------------------------------------------------------------ AG + GEMM

def ag_gemm_operands(M: int, K: int, N_local: int, *, group=None, copies: int = 4, device=None,
                     dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Operands:
    """x shard [padded_rows(M, world) / world, K], weights [K, N_local]."""
    world = _world(group)
    return random_operands(padded_rows(M, world) // world, K, N_local, copies=copies,
                           device=device, dtype=dtype, seed=seed + _rank(group))


def _ag_gemm_ops(M, K, N_local, group, copies, device, dtype, operands) -> Operands:
    if operands is None:
        return ag_gemm_operands(M, K, N_local, group=group, copies=copies, device=device,
                                dtype=dtype)
    world = _world(group)
    return _check(operands, padded_rows(M, world) // world, K, N_local, "ag_gemm")


def ag_gemm_mm_only(M: int, K: int, N_local: int, *, copies: int = 4, device=None,
                    dtype: torch.dtype = torch.bfloat16, operands: Optional[Operands] = None) -> Fn:
    """torch.mm of the gathered x [M, K] @ w [K, N_local] alone, no communication (operands' weights
    if given, and their x if it has M rows; random rows otherwise)."""
    return _mm_only(M, K, N_local, copies, device, dtype, operands)


def _ag_gemm_step(M, K, N_local, group, copies, device, dtype, operands):
    _require_dist("ag_gemm baseline")
    device = _default_device(device)
    ops = _ag_gemm_ops(M, K, N_local, group, copies, device, dtype, operands)
    rows = ops.x.shape[0] * _world(group)
    gathered = torch.empty(rows, K, device=ops.x.device, dtype=ops.x.dtype)
    out = torch.empty(rows, N_local, device=ops.x.device, dtype=ops.x.dtype)

    def step(i: int) -> torch.Tensor:
        _all_gather(gathered, ops.x, group=group)
        torch.mm(gathered, ops.weights[i], out=out)
        return out
    return step, len(ops.weights), device


def ag_gemm_eager(M: int, K: int, N_local: int, *, group=None, copies: int = 4, device=None,
                  dtype: torch.dtype = torch.bfloat16, operands: Optional[Operands] = None) -> Fn:
    """torch.distributed all-gather over rows then torch.mm; returns [padded_rows, N_local]."""
    step, n, _ = _ag_gemm_step(M, K, N_local, group, copies, device, dtype, operands)
    return rotating(step, n)


def ag_gemm_graph(M: int, K: int, N_local: int, *, group=None, copies: int = 4, device=None,
                  dtype: torch.dtype = torch.bfloat16, operands: Optional[Operands] = None) -> Fn:
    """ag_gemm_eager captured in CUDA graphs (one per weight copy). Collective to build."""
    step, n, device = _ag_gemm_step(M, K, N_local, group, copies, device, dtype, operands)
    return graphed(step, n, device)


def ag_gemm_symm_mem(M: int, K: int, N_local: int, *, group=None, copies: int = 4, device=None,
                     dtype: torch.dtype = torch.bfloat16, operands: Optional[Operands] = None
                     ) -> tuple[Optional[Fn], Optional[str]]:
    """torch.ops.symm_mem.fused_all_gather_matmul(x, [w], 0, group_name) (its output [M, N_local]):
    (callable, None), or (None, reason) where it cannot run."""
    _require_dist("ag_gemm symm_mem baseline")
    device = _default_device(device)
    if device.type != "cuda":
        return None, "torch.ops.symm_mem needs a CUDA device"
    ops = _ag_gemm_ops(M, K, N_local, group, copies, device, dtype, operands)
    name = (group or dist.group.WORLD).group_name

    def step(i: int) -> torch.Tensor:
        _, outs = torch.ops.symm_mem.fused_all_gather_matmul(ops.x, [ops.weights[i]], 0, name)
        return outs[0]
    return _symm_mem_build(step, len(ops.weights), device, "fused_all_gather_matmul")


# ------------------------------------------------------------------------------------------ MLP
# The whole sequence-parallel SwiGLU MLP: x [M/world, H] all-gather -> [M, H] @ w_gate_up [H, 2 I_l]
# -> silu(gate) * up [M, I_l] @ w_down [I_l, H] -> reduce-scatter -> [M/world, H]; I_l = I / world.

@dataclass
class MlpOperands:
    x: Optional[torch.Tensor]       # this rank's rows [padded_rows(M, world) / world, H] (replicated: all M)
    gate_up: list[torch.Tensor]     # `copies` x [H, 2 I_l], gate columns then up columns
    down: list[torch.Tensor]        # `copies` x [I_l, H]


def mlp_operands(M: int, H: int, I_local: int, *, group=None, copies: int = 4, device=None,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> MlpOperands:
    world = _world(group)
    up = random_operands(padded_rows(M, world) // world, H, 2 * I_local, copies=copies, device=device,
                         dtype=dtype, seed=seed + _rank(group))
    down = random_operands(1, I_local, H, copies=copies, device=device, dtype=dtype,
                           seed=seed + 1000 + _rank(group))
    return MlpOperands(up.x, up.weights, down.weights)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [rows, 2 I_l] laid out gate | up."""
    n = gate_up.shape[1] // 2
    return torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]


def _mlp_ops(M, H, I_local, group, copies, device, dtype, operands) -> MlpOperands:
    if operands is None:
        return mlp_operands(M, H, I_local, group=group, copies=copies, device=device, dtype=dtype)
    return _shapes_checked("mlp", operands, padded_rows(M, _world(group)) // _world(group), H, I_local)


def _shapes_checked(name: str, operands: MlpOperands, rows: int, H: int, I_local: int) -> MlpOperands:
    """operands, if x is [rows, H] and the weights [H, 2 I_local] and [I_local, H]."""
    want = ((rows, H), (H, 2 * I_local), (I_local, H))
    got = tuple(operands.x.shape), tuple(operands.gate_up[0].shape), tuple(operands.down[0].shape)
    if got != want:
        raise ValueError(f"{name}: operands have x, w_gate_up, w_down shapes {got}, expected {want}")
    return operands


def mlp_mm_only(M: int, H: int, I_local: int, *, copies: int = 4, device=None,
                dtype: torch.dtype = torch.bfloat16, operands: Optional[MlpOperands] = None) -> Fn:
    """Both local mms and the SwiGLU over M gathered rows (random), no communication."""
    device = _default_device(device)
    ops = operands or MlpOperands(None, *(random_operands(1, k, n, copies=copies, device=device, dtype=dtype).weights
                                          for k, n in ((H, 2 * I_local), (I_local, H))))
    x = torch.randn(M, H, device=ops.gate_up[0].device, dtype=ops.gate_up[0].dtype)
    return rotating(lambda i: swiglu(x @ ops.gate_up[i]) @ ops.down[i], len(ops.gate_up))


def _mlp_step(M, H, I_local, group, copies, device, dtype, operands):
    _require_dist("mlp baseline")
    device = _default_device(device)
    ops = _mlp_ops(M, H, I_local, group, copies, device, dtype, operands)
    rows = ops.x.shape[0] * _world(group)
    gathered = torch.empty(rows, H, device=ops.x.device, dtype=ops.x.dtype)
    partial = torch.empty(rows, H, device=ops.x.device, dtype=ops.x.dtype)
    out = torch.empty_like(ops.x)

    def step(i: int) -> torch.Tensor:
        _all_gather(gathered, ops.x, group=group)
        torch.mm(swiglu(gathered @ ops.gate_up[i]), ops.down[i], out=partial)
        _reduce_scatter(out, partial, group=group)
        return out
    return step, len(ops.gate_up), device


def mlp_eager(M: int, H: int, I_local: int, *, group=None, copies: int = 4, device=None,
              dtype: torch.dtype = torch.bfloat16, operands: Optional[MlpOperands] = None) -> Fn:
    """NCCL all-gather, cuBLAS gate/up mm, SwiGLU, cuBLAS down mm, NCCL reduce-scatter, op by op."""
    step, n, _ = _mlp_step(M, H, I_local, group, copies, device, dtype, operands)
    return rotating(step, n)


def mlp_graph(M: int, H: int, I_local: int, *, group=None, copies: int = 4, device=None,
              dtype: torch.dtype = torch.bfloat16, operands: Optional[MlpOperands] = None) -> Fn:
    """mlp_eager captured in CUDA graphs (one per weight copy). Collective to build."""
    step, n, device = _mlp_step(M, H, I_local, group, copies, device, dtype, operands)
    return graphed(step, n, device)


def mlp_symm_mem(M: int, H: int, I_local: int, *, group=None, copies: int = 4, device=None,
                 dtype: torch.dtype = torch.bfloat16, operands: Optional[MlpOperands] = None
                 ) -> tuple[Optional[Fn], Optional[str]]:
    """PyTorch async-TP's MLP: fused_all_gather_matmul, SwiGLU, fused_matmul_reduce_scatter."""
    _require_dist("mlp symm_mem baseline")
    device = _default_device(device)
    if device.type != "cuda":
        return None, "torch.ops.symm_mem needs a CUDA device"
    ops = _mlp_ops(M, H, I_local, group, copies, device, dtype, operands)
    name = (group or dist.group.WORLD).group_name

    def step(i: int) -> torch.Tensor:
        _, (gate_up,) = torch.ops.symm_mem.fused_all_gather_matmul(ops.x, [ops.gate_up[i]], 0, name)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(swiglu(gate_up), ops.down[i], "sum", 0, name)
    return _symm_mem_build(step, len(ops.gate_up), device, "fused_all_gather_matmul")


# ------------------------------------------------------------ MLP, replicated in and out (Megatron)

def mlp_replicated_operands(M: int, H: int, I_local: int, *, group=None, copies: int = 4, device=None,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> MlpOperands:
    """x [M, H], the same on every rank (seeded without the rank), and this rank's weights."""
    x = random_operands(M, H, 1, copies=1, device=device, dtype=dtype, seed=seed).x
    up, down = (random_operands(1, k, n, copies=copies, device=device, dtype=dtype, seed=seed + s + _rank(group))
                for k, n, s in ((H, 2 * I_local, 1), (I_local, H, 1001)))
    return MlpOperands(x, up.weights, down.weights)


def _mlp_replicated_ops(M, H, I_local, group, copies, device, dtype, operands) -> MlpOperands:
    if operands is None:
        return mlp_replicated_operands(M, H, I_local, group=group, copies=copies, device=device, dtype=dtype)
    return _shapes_checked("mlp_replicated", operands, M, H, I_local)


def _mlp_replicated_step(M, H, I_local, group, copies, device, dtype, operands):
    _require_dist("mlp_replicated baseline")
    device = _default_device(device)
    ops = _mlp_replicated_ops(M, H, I_local, group, copies, device, dtype, operands)
    out = torch.empty(M, H, device=ops.x.device, dtype=ops.x.dtype)

    def step(i: int) -> torch.Tensor:
        torch.mm(swiglu(ops.x @ ops.gate_up[i]), ops.down[i], out=out)
        dist.all_reduce(out, group=group)
        return out
    return step, len(ops.gate_up), device


def mlp_replicated_eager(M: int, H: int, I_local: int, *, group=None, copies: int = 4, device=None,
                         dtype: torch.dtype = torch.bfloat16, operands: Optional[MlpOperands] = None) -> Fn:
    """cuBLAS gate/up mm, SwiGLU, cuBLAS down mm, NCCL all-reduce, op by op (Megatron's MLP)."""
    step, n, _ = _mlp_replicated_step(M, H, I_local, group, copies, device, dtype, operands)
    return rotating(step, n)


def mlp_replicated_graph(M: int, H: int, I_local: int, *, group=None, copies: int = 4, device=None,
                         dtype: torch.dtype = torch.bfloat16, operands: Optional[MlpOperands] = None) -> Fn:
    """mlp_replicated_eager captured in CUDA graphs (one per weight copy). Collective to build."""
    step, n, device = _mlp_replicated_step(M, H, I_local, group, copies, device, dtype, operands)
    return graphed(step, n, device)


def mlp_replicated_symm_mem(M: int, H: int, I_local: int, *, group=None, copies: int = 4, device=None,
                            dtype: torch.dtype = torch.bfloat16, operands: Optional[MlpOperands] = None
                            ) -> tuple[Optional[Fn], Optional[str]]:
    """The mms into a symmetric buffer, then torch.ops.symm_mem.one_shot_all_reduce (each rank
    reads every peer's buffer: the decode-sized all-reduce of serving engines)."""
    _require_dist("mlp_replicated symm_mem baseline")
    device = _default_device(device)
    ops = _mlp_replicated_ops(M, H, I_local, group, copies, device, dtype, operands)
    name = (group or dist.group.WORLD).group_name
    buf = []

    def step(i: int) -> torch.Tensor:
        if not buf:                              # allocated at the first (checked) call: collective
            import torch.distributed._symmetric_memory as symm_mem
            buf.append(symm_mem.empty(M, H, dtype=ops.x.dtype, device=ops.x.device))
            symm_mem.rendezvous(buf[0], name)
        torch.mm(swiglu(ops.x @ ops.gate_up[i]), ops.down[i], out=buf[0])
        return torch.ops.symm_mem.one_shot_all_reduce(buf[0], "sum", name)
    return _symm_mem_build(step, len(ops.gate_up), device, "one_shot_all_reduce")


# ------------------------------------------------------------------------- all baselines, timed

BUILDERS = {
    "gemm_rs": (gemm_rs_mm_only, gemm_rs_eager, gemm_rs_graph, gemm_rs_symm_mem),
    "ag_gemm": (ag_gemm_mm_only, ag_gemm_eager, ag_gemm_graph, ag_gemm_symm_mem),
    "mlp": (mlp_mm_only, mlp_eager, mlp_graph, mlp_symm_mem),   # (M, H, I_local)
    "mlp_replicated": (mlp_mm_only, mlp_replicated_eager, mlp_replicated_graph, mlp_replicated_symm_mem),
}


@dataclass
class Measured:
    baselines: dict[str, float] = field(default_factory=dict)   # name -> us, the slowest rank
    fns: dict[str, Fn] = field(default_factory=dict)            # name -> the zero-arg call timed
    skipped: dict[str, str] = field(default_factory=dict)       # name -> why it did not run

    def notes(self) -> Optional[str]:
        """The skip reasons as one line for Record.notes, or None."""
        return "; ".join(f"{k} skipped: {v}" for k, v in self.skipped.items()) or None


def baseline_fns(workload: str, M: int, K: int, N: int, *, group=None, copies: int = 4, device=None,
                 symm_mem: bool = True, graph: bool = True, operands=None) -> Measured:
    """The callables of mm, eager, graph and symm_mem for `workload` ("gemm_rs": K is K_local;
    "ag_gemm": N is N_local; "mlp" and "mlp_replicated": K is H, N is I_local), untimed: `Measured.fns`, and the reasons
    for those left out in `skipped`. symm_mem=False keeps torch's symmetric memory out of the
    process; graph=False where there is no CUDA. `operands` (the workload's *_operands) are shared
    by all four instead of fresh ones each (mm takes the first M rows' weights, for the MLP its
    weights). Collective (the graph's warm-up, symm_mem's rendezvous)."""
    if workload not in BUILDERS:
        raise ValueError(f"unknown workload {workload!r}; baselines exist for {sorted(BUILDERS)}")
    mm_only, eager, graphed, fused = BUILDERS[workload]
    res = Measured()
    kw = dict(copies=copies, device=device, operands=operands)
    res.fns["mm"] = mm_only(M, K, N, **kw)
    res.fns["eager"] = eager(M, K, N, group=group, **kw)
    if graph:
        res.fns["graph"] = graphed(M, K, N, group=group, **kw)
    else:
        res.skipped["graph"] = "graph=False"
    if not symm_mem:
        res.skipped["symm_mem"] = "symm_mem=False"
    else:
        fn, why = fused(M, K, N, group=group, **kw)
        if fn is None:
            res.skipped["symm_mem"] = why
        else:
            res.fns["symm_mem"] = fn
    return res


def measure_baselines(workload: str, M: int, K: int, N: int, *, group=None, copies: int = 4,
                      device=None, symm_mem: bool = True, graph: bool = True, single: bool = False,
                      operands=None, **timer_kwargs) -> Measured:
    """`baseline_fns` timed with timing.time_alternated (rounds of turning order, a barrier before
    each timing, batches of back-to-back calls or single calls if single=True, the slowest rank):
    their times in `baselines`. Collective."""
    res = baseline_fns(workload, M, K, N, group=group, copies=copies, device=device,
                       symm_mem=symm_mem, graph=graph, operands=operands)
    res.baselines = time_alternated(res.fns, group=group, single=single, device=device, **timer_kwargs)
    return res


# ----------------------------------------------------------------------------- floors, ceilings

@dataclass(frozen=True)
class Ceilings:
    copy_TBps: float    # device-to-device copy, bytes read + written per second, 1e12
    mm_TFps: float      # bf16 torch.mm, 1e12 FLOP per second


def mm_floor_us(M: int, K: int, N: int, *, copy_TBps: float, mm_TFps: float,
                itemsize: int = 2) -> float:
    """Lower bound of one [M, K] @ [K, N] mm: max(HBM bytes / copy bandwidth, FLOPs / mm rate).
    Bytes = weights + activations in + output, each once."""
    bytes_ = (K * N + M * K + M * N) * itemsize
    flops = 2 * M * K * N
    return max(bytes_ / (copy_TBps * 1e12), flops / (mm_TFps * 1e12)) * 1e6


def floor_us(M: int, K: int, N: int, world: int, copy_TBps: float, mm_TFps: float, *,
             workload: str = "gemm_rs") -> float:
    """Floor of one rank's local mm for the whole (unsharded) K and N of a TP layer: gemm_rs shards
    K (mm [M, K/world] @ [K/world, N]), ag_gemm shards N (mm [M, K] @ [K, N/world]); bf16.
    mlp (and mlp_replicated): K = H, N = I, both mms of the rank's share ([M, H] @ [H, 2I/world],
    [M, I/world] @ [I/world, H])."""
    if workload in ("mlp", "mlp_replicated"):
        kw = dict(copy_TBps=copy_TBps, mm_TFps=mm_TFps)
        return mm_floor_us(M, K, 2 * N / world, **kw) + mm_floor_us(M, N / world, K, **kw)
    if workload == "gemm_rs":
        dims = (M, K / world, N)
    elif workload == "ag_gemm":
        dims = (M, K, N / world)
    else:
        raise ValueError(f"floor_us knows gemm_rs, ag_gemm and mlp, not {workload!r}")
    return mm_floor_us(*dims, copy_TBps=copy_TBps, mm_TFps=mm_TFps)


def measure_ceilings(device=None, *, copy_bytes: int = 1 << 30, mm_size: int = 8192,
                     dtype: torch.dtype = torch.bfloat16, **timer_kwargs) -> Ceilings:
    """Copy bandwidth (dst.copy_(src) of `copy_bytes` each; read + written bytes counted) and
    square mm rate (mm_size^3, `dtype`) of this device, timed with time_batched (not across ranks:
    wrap the results in slowest_rank/min as the caller needs)."""
    device = _default_device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    src = torch.empty(copy_bytes // itemsize, device=device, dtype=dtype).uniform_()
    dst = torch.empty_like(src)
    copy_us = time_batched(lambda: dst.copy_(src), device=device, **timer_kwargs)
    a = torch.randn(mm_size, mm_size, device=device, dtype=dtype)
    b = torch.randn(mm_size, mm_size, device=device, dtype=dtype)
    out = torch.empty_like(a)
    mm_us = time_batched(lambda: torch.mm(a, b, out=out), device=device, **timer_kwargs)
    moved = 2 * src.numel() * itemsize
    return Ceilings(copy_TBps=moved / (copy_us * 1e-6) / 1e12,
                    mm_TFps=2 * mm_size ** 3 / (mm_us * 1e-6) / 1e12)
