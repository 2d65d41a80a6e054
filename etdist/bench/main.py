"""The main command: `python -m etdist.bench [model=... workload=... schedule=... mesh=... bench=...]`.

On GPUs (mesh=nvshmem, or mesh=auto where CUDA is present; one process per GPU under torchrun or
mpirun) it runs the fused megakernels against cuBLAS+NCCL baselines (etdist.bench.gpu: gemm_rs,
ag_gemm, mlp; static schedule), every rank in every cell, and rank 0 prints a row per cell, then
the table. Add bench=gpu for the issue's token counts and bench.results_dir=bench/results to add
the records to the committed ones.

Without GPUs it runs each workload graph on the CPU runtime for every (world size, schedule, M)
cell: simulated ranks x simulated programs, several seeded interleavings per cell, checked against
the float64 reference and timed against it run eagerly in one process.

Under `torchrun --nproc_per_node=N` or `mpirun -n N` every process takes part: the cells are
split round-robin over the processes, and rank 0 alone gathers the rows, prints the table and
writes the records (docs/design.md's record schema) plus a markdown table and plots (etdist.bench.report) into
its output folder (each rank has its own: etdist/bench/conf/config.yaml). `-m` sweeps work the same way.
"""
from __future__ import annotations

import os
import pathlib
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import etdist as et

from .config import Config, register
from .measure import records
from ..mesh.hostcomm import HostComm, make_host_comm
from ..mesh.launch import detect_launch
from ..workloads import WORKLOADS, max_rel_err

register()


@dataclass(frozen=True)
class Row:
    workload: str
    model: str
    world: int
    schedule: str
    M: int
    tasks: int          # tasks run per launch, all ranks (data-dependent for MoE)
    skipped: int        # tasks the routing decided do not exist
    max_rel_err: float  # worst over ranks and interleavings
    wall_ms: float      # median wall time of one launch on the CPU runtime
    reference_ms: float  # the float64 torch reference, eager, one process
    target: str


def _value(x) -> str:
    return x.value if hasattr(x, "value") else str(x)


def cells(cfg: Config):
    for w in cfg.workload.names:
        name = _value(w)
        if WORKLOADS[name].needs_experts and cfg.model.num_experts == 0:
            continue  # dense models have no MoE layer
        for s in cfg.schedule.names:
            for world in cfg.mesh.worlds:
                if WORKLOADS[name].needs_experts and cfg.model.num_experts % world:
                    continue
                for M in cfg.bench.tokens:
                    yield name, _value(s), int(world), int(M)


def skipped_cells(cfg: Config) -> list[str]:
    """The workload/world pairs of the sweep that cells() leaves out, and why (said, not hidden)."""
    why = []
    for w in cfg.workload.names:
        name = _value(w)
        if not WORKLOADS[name].needs_experts:
            continue
        if cfg.model.num_experts == 0:
            why.append(f"{name}: model {cfg.model.name!r} is dense (no experts)")
            continue
        for world in cfg.mesh.worlds:
            if cfg.model.num_experts % world:
                why.append(f"{name} at {world} ranks: {cfg.model.num_experts} experts do not split over {world} "
                           "ranks (the expert count must be a multiple of the world size)")
    return why


def check_config(cfg: Config) -> None:
    """Values the config's types let through but no cell can run with (a negative token count, no
    ranks, no interleaving...): refused before any cell runs, naming the override to fix."""
    bad = []

    def need(ok: bool, key: str, value, want: str) -> None:
        if not ok:
            bad.append(f"{key}={value}: {want}")

    need(all(int(M) >= 1 for M in cfg.bench.tokens), "bench.tokens", list(cfg.bench.tokens), "token counts must be >= 1")
    need(all(int(w) >= 1 for w in cfg.mesh.worlds), "mesh.worlds", list(cfg.mesh.worlds), "world sizes must be >= 1")
    for key in ("interleavings", "programs", "block_m", "block_n"):
        need(getattr(cfg.bench, key) >= 1, f"bench.{key}", getattr(cfg.bench, key), "must be >= 1")
    m = cfg.model
    for key in ("hidden", "intermediate"):
        need(getattr(m, key) >= 1, f"model.{key}", getattr(m, key), "must be >= 1")
    need(m.num_experts >= 0, "model.num_experts", m.num_experts, "must be >= 0 (0: a dense model)")
    if m.num_experts > 0:
        need(1 <= m.top_k <= m.num_experts, "model.top_k", m.top_k, f"must be between 1 and model.num_experts={m.num_experts}")
        need(m.expert_intermediate >= 1, "model.expert_intermediate", m.expert_intermediate, "must be >= 1")
    if bad:
        raise SystemExit("bad config: " + "; ".join(bad))


def run(cfg: Config, console: Optional[Console] = None, part: tuple[int, int] = (0, 1)) -> list[Row]:
    """Run the cells of this process's part (index, count) of the sweep; returns their rows."""
    check_config(cfg)
    todo = list(cells(cfg))
    if not todo:
        raise SystemExit("no cells to run: check workload/schedule/mesh.worlds/bench.tokens"
                         + "".join(f"; skipped {w}" for w in skipped_cells(cfg)))
    mine = todo[part[0]::part[1]]
    kernels: dict = {}
    rows = []
    with Progress(console=console, transient=True, disable=part[0] != 0) as progress:
        bar = progress.add_task("cells", total=len(mine))
        for name, sched, world, M in mine:
            w = WORKLOADS[name]
            if (name, sched) not in kernels:
                graph = w.build(cfg.bench.block_m, cfg.bench.block_n, cfg.model)
                kernels[name, sched] = et.compile(graph, schedule=sched, target="cpu", programs=cfg.bench.programs)
            kernel = kernels[name, sched]
            case = w.case(cfg.model, world, M, cfg.bench.seed + world)
            errs, times = [], []
            for seed in range(cfg.bench.interleavings):
                t0 = time.perf_counter()
                out = kernel.run(case.inputs, sizes=case.sizes, interleave="random", seed=seed)
                times.append(time.perf_counter() - t0)
                errs.append(max_rel_err(out, case.reference))
            ref_times = []
            for _ in range(max(1, cfg.bench.interleavings)):
                t0 = time.perf_counter()
                case.compute_reference()
                ref_times.append(time.perf_counter() - t0)
            stats = kernel.last_stats
            rows.append(Row(name, cfg.model.name, world, sched, M, stats.tasks_run, stats.tasks_skipped,
                            max(errs), 1e3 * statistics.median(times), 1e3 * statistics.median(ref_times), "cpu"))
            progress.advance(bar)
    return rows


def table(rows: list[Row]) -> Table:
    t = Table(title="etdist on the CPU runtime: each graph vs its float64 reference")
    for col in ("workload", "model", "ranks", "schedule", "M", "tasks", "skipped", "max rel err", "wall ms",
                "reference ms"):
        t.add_column(col, justify="left" if col in ("workload", "model", "schedule") else "right")
    for r in rows:
        t.add_row(r.workload, r.model, str(r.world), r.schedule, str(r.M), str(r.tasks), str(r.skipped),
                  f"{r.max_rel_err:.1e}", f"{r.wall_ms:.1f}", f"{r.reference_ms:.2f}")
    return t


def write_results(rows: list[Row], folder: pathlib.Path, also: Optional[str] = None) -> pathlib.Path:
    """Records (docs/design.md's record schema; `eager` = the float64 torch reference in one process), then
    the report tables and plots made from them, all under `folder`; the records also appended
    under `also`/cpu (bench.results_dir) when given: apart from GPU records, whose cells they would
    otherwise replace in a report (a cell is keyed without its device)."""
    from . import report

    env = {**records.env_info(), "device": "CPU runtime (simulated ranks)"}
    results = folder / "results"
    for r in rows:
        rec = records.make_record(
            workload=r.workload, model=r.model, M=r.M, world=r.world, schedule=r.schedule,
            ours_us=1e3 * r.wall_ms, baselines={"eager": 1e3 * r.reference_ms}, floor_us=None,
            rel_err=r.max_rel_err, env=env, notes=f"{r.tasks} tasks, {r.skipped} skipped by the routing")
        for where in filter(None, (results, also and pathlib.Path(also) / "cpu")):
            records.append(pathlib.Path(where) / f"{r.workload}.jsonl", rec)
    report.write_report(str(results), str(folder / "report.md"), str(folder / "plots"))
    return results


_COMM: dict = {}


def _host_comm() -> tuple[int, int, HostComm]:
    """This process's rank and count, and one host communicator for every job of a -m sweep."""
    launch = detect_launch()
    if "comm" not in _COMM:
        _COMM["comm"] = make_host_comm(launch, timeout_s=600)
    return launch.rank, launch.world_size, _COMM["comm"]


def on_gpus(cfg: Config) -> bool:
    """mesh=nvshmem: the GPU megakernels (an error without GPUs); auto: GPUs when there are any. A GPU
    sweep (bench=gpu, gpu_moe) that would land on the CPU runtime is refused here, before any work."""
    backend = _value(cfg.mesh.backend)
    if backend == "nvshmem" and not torch.cuda.is_available():
        raise SystemExit("mesh=nvshmem needs CUDA GPUs; use mesh=cpu (or auto) for the CPU runtime")
    gpus = backend == "nvshmem" or (backend == "auto" and torch.cuda.is_available())
    if cfg.bench.needs_gpu and not gpus:
        why = "mesh=cpu picks the CPU runtime" if backend == "cpu" else "this machine has no CUDA GPU"
        raise SystemExit(f"this bench config is a GPU sweep (bench.needs_gpu=true: bench=gpu or gpu_moe) and {why}; "
                         "use bench=cpu (the default) for the CPU runtime")
    return gpus


def gpu_main(cfg: Config, console: Console) -> None:
    from . import gpu as bench_gpu, report
    check_config(cfg)   # (the CPU path checks in run())
    folder = pathlib.Path(HydraConfig.get().runtime.output_dir)
    recs = bench_gpu.run_sweep(cfg, console, folder)
    if recs:  # rank 0
        console.print(report.render(recs))
        report.write_report(str(folder / "results"), str(folder / "report.md"), str(folder / "plots"))
        console.print(f"records: {os.path.relpath(folder / 'results')}"
                      + (f" and {cfg.bench.results_dir}" if cfg.bench.results_dir else "")
                      + f"  report: {os.path.relpath(folder / 'report.md')}")
        bad = [r for r in recs if r.rel_err > bench_gpu.REL_ERR_LIMIT[r.workload]]
        if bad:
            raise SystemExit("relative error over the limit (bench_gpu.REL_ERR_LIMIT): " + ", ".join(
                f"{r.workload} {r.model} M={r.M} {r.schedule} {r.rel_err:.2e}" for r in bad))


@hydra.main(version_base="1.3", config_path="pkg://etdist.bench.conf", config_name="config")
def main(cfg: Config) -> None:
    console = Console(width=None if os.isatty(1) else 140)
    if on_gpus(cfg):
        return gpu_main(cfg, console)
    rank, nprocs, comm = _host_comm()
    mine = run(cfg, console, part=(rank, nprocs))
    rows = [row for part in comm.allgather(mine) for row in part]
    if rank != 0:
        return
    order = {cell: k for k, cell in enumerate(cells(cfg))}
    rows.sort(key=lambda r: order[(r.workload, r.schedule, r.world, r.M)])
    console.print(table(rows))
    for why in skipped_cells(cfg):
        console.print(f"skipped {why}")
    if nprocs > 1:
        console.print(f"{len(rows)} cells over {nprocs} processes")
    folder = pathlib.Path(HydraConfig.get().runtime.output_dir)
    results = write_results(rows, folder, cfg.bench.results_dir)
    console.print(f"records: {os.path.relpath(results)}"
                  + (f" and {pathlib.Path(cfg.bench.results_dir) / 'cpu'}" if cfg.bench.results_dir else "")
                  + f"  report: {os.path.relpath(folder / 'report.md')}")
    worst = max(r.max_rel_err for r in rows)
    if worst > 1e-4:
        raise SystemExit(f"max relative error {worst:.2e} exceeds 1e-4")


if __name__ == "__main__":
    main()
