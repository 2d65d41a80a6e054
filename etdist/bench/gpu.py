"""The GPU cells of `python -m etdist.bench` (docs/benchmarks.md's protocol), one process per GPU.

A cell is (workload, model shape, M). Every rank takes part in every cell: our fused op and the
baselines run in the same process on the same operands (weights rotated over 4 copies so they
stream from HBM; the baselines take the same operands as ours), each timed as batches of
back-to-back calls in rounds of turning order (`timing.time_alternated`: no contender keeps the
same slot), the slowest rank reported. Before
timing, our output (written over NaN-poisoned memory) is checked against a float32 reference of
the whole layer: the relative error goes into the record.

    gemm_rs  x [M, I/R] @ w_down [I/R, H], reduce-scatter over rows     et.ops.gemm_reduce_scatter
    ag_gemm  x [M/R, H] all-gather, @ w_gate_up [H, 2I/R]               et.ops.all_gather_gemm
    mlp      all-gather, gate/up mm, SwiGLU, down mm, reduce-scatter    et.ops.tensor_parallel_mlp
    mlp_replicated  x [M, H] whole on every rank, mms, all-reduce       ...(sequence_parallel=False)
    moe      M tokens per rank, top-k routed SwiGLU experts, EP          et.nn.MoE (vs the torch layer)
             (`separate` baseline: etdist's two ops chained with a torch SwiGLU between them)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

import etdist as et

from .measure import baselines as B
from .measure.ranks import chunk, gather_rows, rel_err
from .measure.timing import slowest_rank as max_over_ranks, time_alternated
from .report import best_baseline

GPU_WORKLOADS = ("gemm_rs", "ag_gemm", "mlp", "mlp_replicated", "moe")


@dataclass
class CellResult:
    ours_us: float
    baselines: dict[str, float]
    floor_us: float
    rel_err: float
    notes: Optional[str]
    ours_graph_us: Optional[float] = None   # our op captured in a CUDA graph, as the `graph` baseline is
    extra: Optional[dict] = None            # more of the cell for its record (e.g. a baseline's tuned config)

    def record_extra(self) -> Optional[dict]:
        extra = {**({"ours_graph_us": self.ours_graph_us} if self.ours_graph_us else {}), **(self.extra or {})}
        return extra or None


def _timed(fns: dict[str, Callable[[], object]], mesh, rounds: int) -> dict[str, float]:
    """Every contender of a cell (name -> zero-arg call), timed in `rounds` rounds of turning order
    (timing.turns), 2 batches of ~10 ms each a round (timing.batch_calls; slowest rank, us). rounds=1
    is a fixed order, ours first."""
    return time_alternated(fns, rounds=rounds, calls=None, device=mesh.device)


def _graphed_checked(step: Callable[[int], object], mesh, copies: int = 4) -> Callable[[], object]:
    """Our op with weight copy i captured in a CUDA graph per copy, replayed like the `graph`
    baseline: what a server that captures its decode step gets (no host time per call). The first
    replay is checked against an eager call on the same operands before anything is timed."""
    replay = B.graphed(step, copies, mesh.device)
    got = replay().clone()          # graph 0: weight copy 0
    err = max_over_ranks(rel_err(got, step(0).float()))
    if not err < 1e-3:
        raise RuntimeError(f"our op replayed from a CUDA graph differs from the eager call (rel err {err:.1e})")
    return replay


def _result(times: dict[str, float], floor: float, err: float, notes, extra=None) -> CellResult:
    """A cell from its timings: `ours` and `ours_graph` are ours, every other name a baseline."""
    times = dict(times)
    ours, graph = times.pop("ours"), times.pop("ours_graph")
    return CellResult(ours, times, floor, err, notes, graph, extra)


def _poisoned(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), device=like.device, dtype=like.dtype)


# ---------------------------------------------------------------------------------------- cells

def gemm_rs_cell(mesh, model, M: int, ceil: B.Ceilings, symm_mem: bool, schedule: str = "static",
                 rounds: int = 4) -> CellResult:
    R, H, I = mesh.world_size, model.hidden, model.intermediate
    K, N = I // R, H
    ops = B.gemm_rs_operands(M, K, N, copies=4, device=mesh.device)
    x = ops.x[:M].contiguous()  # the baselines pad M up to the world; we take it as it is
    lo, hi = chunk(M, R, mesh.rank)
    y = et.ops.gemm_reduce_scatter(x, ops.weights[0], mesh=mesh, out=_poisoned(hi - lo, N, x), schedule=schedule)
    part = x.float() @ ops.weights[0].float()
    dist.all_reduce(part)
    err = max_over_ranks(rel_err(y, part[lo:hi]))

    def ours(i):   # weight copy i
        return et.ops.gemm_reduce_scatter(x, ops.weights[i], mesh=mesh, schedule=schedule)

    base = B.baseline_fns("gemm_rs", M, K, N, copies=4, device=mesh.device, symm_mem=symm_mem, operands=ops)
    times = _timed({"ours": B.rotating(ours, 4), "ours_graph": _graphed_checked(ours, mesh), **base.fns}, mesh, rounds)
    floor = B.floor_us(M, I, H, R, ceil.copy_TBps, ceil.mm_TFps, workload="gemm_rs")
    return _result(times, floor, err, base.notes())


def ag_gemm_cell(mesh, model, M: int, ceil: B.Ceilings, symm_mem: bool, schedule: str = "static",
                 rounds: int = 4) -> CellResult:
    R, H, I = mesh.world_size, model.hidden, model.intermediate
    K, N = H, 2 * I // R
    ops = B.ag_gemm_operands(M, K, N, copies=4, device=mesh.device)
    lo, hi = chunk(M, R, mesh.rank)
    x = ops.x[:hi - lo].contiguous()  # the baselines pad every chunk; we take the ragged one
    y = et.ops.all_gather_gemm(x, ops.weights[0], mesh=mesh, total_rows=M, out=_poisoned(M, N, x), schedule=schedule)
    err = max_over_ranks(rel_err(y, gather_rows(x, M, R) @ ops.weights[0].float()))

    def ours(i):
        return et.ops.all_gather_gemm(x, ops.weights[i], mesh=mesh, total_rows=M, schedule=schedule)

    base = B.baseline_fns("ag_gemm", M, K, N, copies=4, device=mesh.device, symm_mem=symm_mem, operands=ops)
    times = _timed({"ours": B.rotating(ours, 4), "ours_graph": _graphed_checked(ours, mesh), **base.fns}, mesh, rounds)
    floor = B.floor_us(M, K, 2 * I, R, ceil.copy_TBps, ceil.mm_TFps, workload="ag_gemm")
    return _result(times, floor, err, base.notes())


def mlp_cell(mesh, model, M: int, ceil: B.Ceilings, symm_mem: bool, schedule: str = "static",
             rounds: int = 4) -> CellResult:
    R, H, I = mesh.world_size, model.hidden, model.intermediate
    ops = B.mlp_operands(M, H, I // R, copies=4, device=mesh.device)
    lo, hi = chunk(M, R, mesh.rank)
    x = ops.x[:hi - lo].contiguous()
    y = et.ops.tensor_parallel_mlp(x, ops.gate_up[0], ops.down[0], mesh=mesh, total_rows=M,
                                   out=_poisoned(hi - lo, H, x), schedule=schedule)
    full = B.swiglu(gather_rows(x, M, R) @ ops.gate_up[0].float()) @ ops.down[0].float()
    dist.all_reduce(full)
    err = max_over_ranks(rel_err(y, full[lo:hi]))

    def ours(i):
        return et.ops.tensor_parallel_mlp(x, ops.gate_up[i], ops.down[i], mesh=mesh, total_rows=M, schedule=schedule)

    def separate(i):  # etdist's two fused ops, chained
        h = et.ops.all_gather_gemm(x, ops.gate_up[i], mesh=mesh, total_rows=M, schedule=schedule)
        return et.ops.gemm_reduce_scatter(B.swiglu(h), ops.down[i], mesh=mesh, schedule=schedule)

    base = B.baseline_fns("mlp", M, H, I // R, copies=4, device=mesh.device, symm_mem=symm_mem, operands=ops)
    times = _timed({"ours": B.rotating(ours, 4), "ours_graph": _graphed_checked(ours, mesh), **base.fns,
                    "separate": B.rotating(separate, 4)}, mesh, rounds)
    floor = B.floor_us(M, H, I, R, ceil.copy_TBps, ceil.mm_TFps, workload="mlp")
    return _result(times, floor, err, base.notes())


def mlp_replicated_cell(mesh, model, M: int, ceil: B.Ceilings, symm_mem: bool, schedule: str = "static",
                        rounds: int = 4) -> CellResult:
    """The MLP of a model that is not sequence-parallel: the whole x on every rank, the whole y
    back (ours: sequence_parallel=False; torch: the mms and an NCCL or symm_mem all-reduce)."""
    R, H, I = mesh.world_size, model.hidden, model.intermediate
    ops = B.mlp_replicated_operands(M, H, I // R, copies=4, device=mesh.device)
    x = ops.x
    y = et.ops.tensor_parallel_mlp(x, ops.gate_up[0], ops.down[0], mesh=mesh, sequence_parallel=False,
                                   out=_poisoned(M, H, x), schedule=schedule)
    full = B.swiglu(x.float() @ ops.gate_up[0].float()) @ ops.down[0].float()
    dist.all_reduce(full)
    err = max_over_ranks(rel_err(y, full))

    def ours(i):
        return et.ops.tensor_parallel_mlp(x, ops.gate_up[i], ops.down[i], mesh=mesh, sequence_parallel=False,
                                          schedule=schedule)

    base = B.baseline_fns("mlp_replicated", M, H, I // R, copies=4, device=mesh.device, symm_mem=symm_mem,
                          operands=ops)
    times = _timed({"ours": B.rotating(ours, 4), "ours_graph": _graphed_checked(ours, mesh), **base.fns}, mesh, rounds)
    floor = B.floor_us(M, H, I, R, ceil.copy_TBps, ceil.mm_TFps, workload="mlp_replicated")
    return _result(times, floor, err, base.notes())


def moe_operands(mesh, H: int, I: int, E: int, M: int, skew: float, copies: int = 2):
    """An MoE layer's bf16 operands on this rank: (x [M, H], router [H, E], `copies` w_gate_up
    [E_local, H, 2I] as [gate | up], `copies` w_down [E_local, I, H]). The router and the skew
    direction are the same on every rank (seed 0), the experts and tokens this rank's (seed 1 +
    rank); skew > 0 routes Zipf-like (etdist.workloads.moe.skew_router)."""
    from ..workloads.moe import skew_router, skew_tokens
    el, dev, bf16 = E // mesh.world_size, mesh.device, torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    u = torch.randn(H, generator=gen, device=dev)
    u = u / u.norm()
    router = skew_router(torch.randn(H, E, generator=gen, device=dev), u, skew)
    gen.manual_seed(1 + mesh.rank)
    wgu = [(torch.randn(el, H, 2 * I, generator=gen, device=dev) * H ** -0.5).to(bf16) for _ in range(copies)]
    wd = [(torch.randn(el, I, H, generator=gen, device=dev) * I ** -0.5).to(bf16) for _ in range(copies)]
    x = skew_tokens(torch.randn(M, H, generator=gen, device=dev), u, skew).to(bf16)
    return x, router.to(bf16), wgu, wd


def moe_cell(mesh, model, M: int, ceil: B.Ceilings, symm_mem: bool, schedule: str = "dynamic",
             rounds: int = 4, moe_config: str = "") -> CellResult:
    """M tokens per rank through et.nn.MoE vs the torch layer (etdist.bench.measure.moe_baseline): `eager`
    = grouped experts (torch._grouped_mm) with exchanged split sizes, `graph` = grouped experts with
    fixed padded all_to_all blocks captured in a CUDA graph, `loop` = one mm pair per expert, `fused`
    = a serving engine's fused MoE kernels (etdist.bench.measure.fused_moe, tuned here per M) behind the
    padded all_to_all, in a CUDA graph. moe_config: overrides of nn.MoE's MoEConfig (tuning runs)."""
    from .measure import fused_moe as F
    from .measure.moe_baseline import torch_moe
    R, H, I, E, k = mesh.world_size, model.hidden, model.expert_intermediate, model.num_experts, model.top_k
    el, dev, bf16 = E // R, mesh.device, torch.bfloat16
    x, router, wgu, wd = moe_operands(mesh, H, I, E, M, model.routing_skew, copies=2)
    layers = []
    for a, b in zip(wgu, wd):                                  # two weight copies, rotated
        layer = et.nn.MoE(H, I, E, k, mesh=mesh, schedule=schedule, dtype=bf16,
                          config=et.nn.DEFAULT_MOE.override(moe_config))
        layer.router.data, layer.w_gate_up[0].data, layer.w_down[0].data = router, layer.pack_gate_up(a), b
        layers.append(layer)
    y = layers[0](x)
    want = torch_moe(x.float(), router.float(), wgu[0].float(), wd[0].float(), k, experts="loop")
    err = max_over_ranks(rel_err(y, want))

    def torch_layer(experts, dispatch="exact"):
        return lambda i: torch_moe(x, router, wgu[i], wd[i], k, experts=experts, dispatch=dispatch)

    grouped, padded = torch_layer("grouped"), torch_layer("grouped", "padded")
    base_err = max_over_ranks(max(rel_err(grouped(0), want), rel_err(padded(0), want)))
    if not base_err < REL_ERR_LIMIT["moe"]:
        raise RuntimeError(f"the grouped torch MoE baseline is off its float32 loop (rel err {base_err:.1e})")
    ours = lambda i: layers[i](x)  # noqa: E731
    fns = {"ours": B.rotating(ours, 2), "ours_graph": _graphed_checked(ours, mesh, copies=2),
           "eager": B.rotating(grouped, 2), "loop": B.rotating(torch_layer("loop"), 2)}
    fns["graph"] = B.graphed(padded, 2, dev)
    graph_err = max_over_ranks(rel_err(fns["graph"](), want))   # graph 0: weight copy 0
    if not graph_err < REL_ERR_LIMIT["moe"]:
        raise RuntimeError(f"the torch MoE baseline replayed from a CUDA graph is off (rel err {graph_err:.1e})")
    fns["fused"] = B.graphed(torch_layer("fused", "padded"), 2, dev)   # its warm-up tunes it, before the capture
    # the config it picked: one rank's slots, or expert-parallel the padded rows of every rank, one slot each
    picked = F.tuned(H, I, el, *((k, M * k) if R == 1 else (1, R * M * k)), bf16, dev)
    fused_err = max_over_ranks(rel_err(fns["fused"](), want))
    if not fused_err < REL_ERR_LIMIT["moe"]:
        raise RuntimeError(f"the fused MoE baseline is off its float32 loop (rel err {fused_err:.1e})")
    floor = _moe_floor_us(x, router, k, el, H, I, ceil, dev)
    return _result(_timed(fns, mesh, rounds), floor, err,
                   "ours graph: the layer captured in a CUDA graph (routing runs in the kernel); "
                   "torch layer: eager = torch._grouped_mm experts + exact all_to_all; graph = the same with "
                   "padded all_to_all blocks in a CUDA graph; loop = one mm pair per expert; fused = a serving "
                   "engine's fused MoE (Triton, slots aligned per expert, tuned per M) in a CUDA graph; floor: on the "
                   "busiest rank, the weights of the experts this routing reaches read once, or the FLOPs of "
                   "the slots routed to them", {"fused_config": picked.label})


def _moe_floor_us(x, router, k: int, el: int, H: int, I: int, ceil: B.Ceilings, dev) -> float:
    """No rank can finish before it has read the weights of every local expert that received a slot
    (bf16, once) nor before it has done the FLOPs of the slots it received: the larger of the two on
    the busiest rank. The routing is the layer's own (fp32 scores of the bf16 inputs, top-k), counted
    over every rank's tokens."""
    ids = torch.softmax(x.float() @ router.float(), dim=-1).topk(k, dim=-1).indices
    slots = torch.bincount(ids.flatten(), minlength=router.shape[1]).to(dev)   # per expert, all ranks
    if dist.is_initialized():
        dist.all_reduce(slots)
    per_rank = slots.view(-1, el)                                              # [rank, local expert]
    weights = (per_rank > 0).sum(1).double() * 3 * H * I * 2 / (ceil.copy_TBps * 1e12)
    flops = per_rank.sum(1).double() * 2 * 3 * H * I / (ceil.mm_TFps * 1e12)
    return torch.maximum(weights, flops).max().item() * 1e6


CELLS = {"gemm_rs": gemm_rs_cell, "ag_gemm": ag_gemm_cell, "mlp": mlp_cell, "mlp_replicated": mlp_replicated_cell,
         "moe": moe_cell}
# largest relative error a cell may show (bf16 against float32); MoE keeps more intermediates in bf16
# (activations, expert outputs on the way back): ~2e-2 in its own check
REL_ERR_LIMIT = {"gemm_rs": 2e-2, "ag_gemm": 2e-2, "mlp": 2e-2, "mlp_replicated": 2e-2, "moe": 5e-2}


def startup_times(mesh, H: int, I: int) -> dict:
    """GEMM+RS: cold compile + first call, first call at an unseen M, and capturing the CUDA-graph
    baseline for 50 batch sizes (what a graph-captured server does instead). Run it first, while
    nothing is compiled."""
    K, N = I // mesh.world_size, H
    w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16)

    def first_call(M):
        x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    out = {"cold_first_call_s": first_call(3000), "unseen_M_first_call_s": first_call(3001)}
    t0 = time.perf_counter()
    for M in range(2048, 2048 + 50 * 16, 16):
        B.gemm_rs_graph(M, K, N, copies=1, device=mesh.device)
    torch.cuda.synchronize()
    out["capture_50_graphs_s"] = time.perf_counter() - t0
    return out


# -------------------------------------------------------------------------------- the Hydra sweep

_PROCESS: dict = {}   # one process group, mesh and ceilings per process, shared by a -m sweep's jobs


def _value(x) -> str:
    return x.value if hasattr(x, "value") else str(x)


def process_mesh():
    """torch.distributed (NCCL for the baselines, gloo for host data) and the etdist mesh, set up
    once per process from the launcher's variables (torchrun, mpirun, srun, or none: one GPU)."""
    if "mesh" not in _PROCESS:
        import os

        from ..mesh.launch import detect_launch
        launch = detect_launch()
        env = {"RANK": launch.rank, "WORLD_SIZE": launch.world_size, "LOCAL_RANK": launch.local_rank,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29517}   # single node unless the launcher said
        for k, v in env.items():
            os.environ.setdefault(k, str(v))
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        if not dist.is_initialized():
            dist.init_process_group("cpu:gloo,cuda:nccl")
        _PROCESS["mesh"] = mesh = et.init_mesh()
        _PROCESS["ceilings"] = B.measure_ceilings(mesh.device)
    return _PROCESS["mesh"], _PROCESS["ceilings"]


def plan(cfg) -> tuple[list[tuple[str, str, int]], list[str]]:
    """The (workload, schedule, M) cells a GPU run does for `cfg`, and a line per thing it leaves out."""
    if cfg.bench.rounds < 1:
        raise ValueError(f"bench.rounds={cfg.bench.rounds}: a cell needs at least one round of timings")
    names = [_value(w) for w in cfg.workload.names]
    schedules = [_value(s) for s in cfg.schedule.names]
    left_out = [f"workload {w}: not here (python -m etdist.bench.collectives)" for w in names
                if w not in GPU_WORKLOADS]
    if "moe" in names and cfg.model.num_experts == 0:
        left_out.append(f"workload moe: model {cfg.model.name} is dense")
        names = [w for w in names if w != "moe"]
    if cfg.model.num_experts and any(w != "moe" for w in names if w in GPU_WORKLOADS):
        left_out.append(f"gemm_rs/ag_gemm/mlp: model {cfg.model.name} is an MoE; its dense MLP shape is used")
    return [(w, s, int(M)) for w in names if w in GPU_WORKLOADS for s in schedules for M in cfg.bench.tokens], left_out


def run_sweep(cfg, console, folder) -> list:
    """Every cell of `plan(cfg)` on this process's GPU (all ranks in every cell); rank 0 prints a row
    per cell as it finishes and appends the records under folder/results (and cfg.bench.results_dir).
    Returns the records (rank 0) or []."""
    import pathlib

    from .measure import records
    mesh, ceil = process_mesh()
    lead = mesh.rank == 0
    cells, left_out = plan(cfg)
    H, I = cfg.model.hidden, cfg.model.intermediate
    if lead:
        for line in left_out:
            console.print(f"[yellow]{line}[/]")
        console.print(f"{cfg.model.name} H={H} I={I} on {mesh.world_size} GPUs ({torch.cuda.get_device_name()}): "
                      f"copy {ceil.copy_TBps:.2f} TB/s, mm {ceil.mm_TFps:.0f} TF/s; {len(cells)} cells")
    if cfg.bench.startup and not _PROCESS.get("startup"):   # once per process: later jobs are warm
        _PROCESS["startup"] = s = startup_times(mesh, H, I)
        if lead:
            console.print("startup (gemm_rs): " + "  ".join(f"{k} {v:.2f}" for k, v in s.items()))
    env = records.env_info()
    # skewed routing is its own cell (the record key has no routing field): the model name says it
    name = cfg.model.name + (f"-zipf{cfg.model.routing_skew:g}" if cfg.model.routing_skew else "")
    out = []
    if cfg.model.num_experts % mesh.world_size:
        cells = [c for c in cells if c[0] != "moe"]
        if lead:
            console.print(f"[yellow]workload moe: {cfg.model.num_experts} experts do not split over "
                          f"{mesh.world_size} ranks[/]")
    for n, (workload, schedule, M) in enumerate(cells, 1):
        extra = {"moe_config": cfg.bench.moe_config} if workload == "moe" else {}
        if n == 1 and cfg.bench.warm_cell:
            # The first cell of a Hydra job once timed a slower host (records moe_first_cell): cheap
            # insurance, one cell a job, whose timing is printed, not recorded.
            warm = CELLS[workload](mesh, cfg.model, M, ceil, cfg.bench.symm_mem, schedule, rounds=cfg.bench.rounds,
                                   **extra)
            if lead:
                console.print(f"[dim]warm-up (dropped): {workload} {schedule[:3]} M={M} ours {warm.ours_us:.1f} us"
                              + (f", in a graph {warm.ours_graph_us:.1f} us" if warm.ours_graph_us else "")
                              + "; " + "  ".join(f"{k} {v:.1f}" for k, v in warm.baselines.items()) + "[/]")
        res = CELLS[workload](mesh, cfg.model, M, ceil, cfg.bench.symm_mem, schedule, rounds=cfg.bench.rounds, **extra)
        if not lead:
            continue
        rec = records.make_record(workload=workload, model=name, M=M, world=mesh.world_size,
                                  schedule=schedule, ours_us=res.ours_us, baselines=res.baselines,
                                  floor_us=res.floor_us, rel_err=res.rel_err, notes=res.notes, env=env,
                                  extra={**(res.record_extra() or {}), "timing_rounds": cfg.bench.rounds})
        for where in filter(None, (pathlib.Path(folder) / "results", cfg.bench.results_dir)):
            records.append(pathlib.Path(where) / f"{workload}.jsonl", rec)
        best = best_baseline(rec)
        console.print(f"[{n}/{len(cells)}] {workload:8} {schedule[:3]} {name:>13} M={M:<5} ours {res.ours_us:8.1f} us  "
                      f"best baseline {best:8.1f} us  speedup {best / res.ours_us:5.2f}x  "
                      f"ours/floor {res.ours_us / res.floor_us:5.2f}  rel err {res.rel_err:.1e}"
                      + (f"  in a graph {res.ours_graph_us:8.1f} us ({best / res.ours_graph_us:5.2f}x)"
                         if res.ours_graph_us else ""))
        out.append(rec)
    return out
