"""docs/benchmarks.md's summary, tables and plots from the result records (docs/design.md,
"Result records").

    python -m etdist.bench.report [--results bench/results] [--dir DIR | --out FILE --plots DIR | --repo]
                                  [--workloads gemm_rs,ag_gemm,...|all] [--print]

Reads <results>/<workload>.jsonl for each of --workloads (default DOC_WORKLOADS: the library's
ops, layers and collectives, not the A/B files beside them; `all`: every *.jsonl), keeps the
newest record per cell (workload, model, M, world, schedule), and writes a summary (one line per
workload, world and schedule) between the summary markers and one table per workload between the
report markers of the report file (the rest of the file is left as it is), one PNG per workload,
schedule and world (speedup over the CUDA-graph baseline against M). They go into a new run folder
(outputs/report/<date>/<time>: report.md, plots/) unless --dir, --out/--plots or --repo (the
repository's own docs/benchmarks.md and bench/plots, with compact model x M grids in place of the
per-cell tables) say otherwise; it prints a short summary (--print adds the tables).

Speedup = best baseline / ours, where the best baseline is the faster of `graph` and `eager`
(at large sizes the graph is sometimes the slower of the two), and for MoE also of `loop` (the
torch layer with one mm pair per expert; older MoE records call it `eager`) and `fused` (a
serving engine's fused MoE kernels, etdist.bench.measure.fused_moe).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import pathlib
import re
import warnings
from collections import defaultdict
from typing import Iterable, Optional, Sequence

from .measure.records import Record, load, newest_per_cell
from .measure.shapes import MLP_SHAPES

# what --repo regenerates, in the checkout that holds this package (and the records it reads there)
REPO_DOC, REPO_PLOTS, REPO_RESULTS = "docs/benchmarks.md", "bench/plots", "bench/results"
BEGIN = "<!-- report:begin -->"
END = "<!-- report:end -->"
SUMMARY_BEGIN = "<!-- summary:begin -->"
SUMMARY_END = "<!-- summary:end -->"
# What docs/benchmarks.md shows, in its order: each from <results>/<workload>.jsonl.
DOC_WORKLOADS = ("gemm_rs", "ag_gemm", "mlp", "mlp_replicated", "moe", "reduce_scatter", "all_gather", "all_reduce")
HEADLINE = ("graph", "eager", "loop", "fused")     # the best baseline is the faster of these
BASELINE_ORDER = ("graph", "eager", "loop", "fused", "symm_mem", "mm")


# ----------------------------------------------------------------------------------- the numbers

def load_results(folder, workloads: Optional[Sequence[str]] = None) -> list[Record]:
    """Every record of every <folder>/*.jsonl, files in name order, lines in file order; with
    `workloads`, only <folder>/<w>.jsonl's records of workload w, for each w given."""
    folder = pathlib.Path(folder)
    if workloads is None:
        return [r for path in sorted(folder.glob("*.jsonl")) for r in load(path)]
    return [r for w in workloads if (folder / f"{w}.jsonl").exists()
            for r in load(folder / f"{w}.jsonl") if r.workload == w]


def best_baseline(rec: Record) -> Optional[float]:
    """The fastest of the headline baselines (HEADLINE), or None if the record has none."""
    times = [rec.baselines[k] for k in HEADLINE if rec.baselines.get(k) is not None]
    return min(times) if times else None


def speedup(rec: Record) -> Optional[float]:
    best = best_baseline(rec)
    return best / rec.ours_us if best is not None and rec.ours_us > 0 else None


def ours_graph_us(rec: Record) -> Optional[float]:
    """Our op captured in a CUDA graph and replayed (as the `graph` baseline is), where measured."""
    v = (rec.extra or {}).get("ours_graph_us")
    return float(v) if v else None


def graph_speedup(rec: Record) -> Optional[float]:
    """The better of the baselines over the better of ours eager and ours in a graph."""
    best, g = best_baseline(rec), ours_graph_us(rec)
    return best / min(rec.ours_us, g) if best is not None and g else None


def ceilings(cells: Sequence[Record]) -> Optional[tuple[float, float, int]]:
    """The geometric-mean speedups over the best baseline that a kernel taking the floor's time, and
    one taking the local mm(s)' time (the communication hidden), would reach on `cells`: the most a
    speedup target can ask of these cells (None without a floor and an mm in every cell)."""
    if not cells or any(not r.floor_us or not r.baselines.get("mm") or best_baseline(r) is None for r in cells):
        return None
    return (geomean(best_baseline(r) / r.floor_us for r in cells),
            geomean(best_baseline(r) / r.baselines["mm"] for r in cells), len(cells))


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        raise ValueError("geomean of no values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _model_key(model: str) -> tuple:
    order = list(MLP_SHAPES)
    return (order.index(model), "") if model in order else (len(order), str(model))


def _row_key(rec: Record) -> tuple:
    return (rec.world, rec.schedule, _model_key(rec.model), rec.M)


# ------------------------------------------------------------------------------------ the tables

def _us(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}"


def _baseline_names(records: Sequence[Record]) -> list[str]:
    present = {k for r in records for k in r.baselines}
    return [k for k in BASELINE_ORDER if k in present] + sorted(present - set(BASELINE_ORDER))


def _distinct(records: Sequence[Record], key: str) -> str:
    return ", ".join(sorted({str(getattr(r, key)) for r in records}))


def _rounded(s: float) -> str:
    """A speedup to two places as the cells and the summary show it: rounded down below 1."""
    return f"{math.floor(s * 100) / 100:.2f}" if s < 1 else f"{s:.2f}"


def _speedup_cell(s: Optional[float], short: bool = False) -> str:
    """A speedup, bold where slower than the best baseline; short: the number alone (a grid cell)."""
    if s is None:
        return "-"
    if s < 1:       # rounded down, so that a slower cell never reads 1.00x
        return f"**{_rounded(s)}**" if short else f"**{_rounded(s)}x** (slower)"
    return f"{s:.2f}" if short else f"{s:.2f}x"


def _date(rec: Record) -> str:
    return str(rec.date)[:10]


def _groups(records: Sequence[Record]) -> list[tuple[str, int, str, list[Record]]]:
    """(workload, world, schedule, cells with a speedup) in DOC_WORKLOADS' order, then by name."""
    order = {w: k for k, w in enumerate(DOC_WORKLOADS)}
    keys = sorted({(r.workload, r.world, r.schedule) for r in records},
                  key=lambda k: (order.get(k[0], len(order)), k[0], k[1], k[2]))
    return [(w, world, sched, [r for r in records if (r.workload, r.world, r.schedule) == (w, world, sched)
                               and speedup(r) is not None]) for w, world, sched in keys]


def summary(records: Sequence[Record]) -> str:
    """One row per workload, world and schedule: cells, how many beat the best baseline, the
    geometric-mean speedup over it and of ours / floor, and the newest date and commit."""
    lines = ["| workload | world | schedule | cells | faster | geomean speedup | geomean ours/floor | measured | commits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for workload, world, schedule, cells in _groups(records):
        if not cells:
            continue
        floors = [r.ours_us / r.floor_us for r in cells if r.floor_us]
        dates = sorted({_date(r) for r in cells})
        lines.append(f"| {workload} | {world} | {schedule} | {len(cells)} | {sum(speedup(r) >= 1 for r in cells)} | "
                     f"{_speedup_cell(geomean(speedup(r) for r in cells))} | "
                     f"{f'{geomean(floors):.2f}' if floors else '-'} | "
                     f"{dates[0] if len(dates) == 1 else f'{dates[0]} .. {dates[-1]}'} | {_distinct(cells, 'commit')} |")
    return "\n".join(lines) + "\n"


def workload_table(workload: str, records: Sequence[Record]) -> str:
    """The markdown section of one workload: provenance, table, geometric means, slow cells."""
    records = sorted(records, key=_row_key)
    names = _baseline_names(records)
    graphed = any(ours_graph_us(r) for r in records)
    head = ["world", "schedule", "model", "M", "ours us", *(["ours graph us"] if graphed else []),
            *[f"{k} us" for k in names], "best baseline us", "speedup",
            *(["speedup, ours eager or graph"] if graphed else []), "ours/floor", "rel_err", "commit", "date"]
    first, last = min(_date(r) for r in records), max(_date(r) for r in records)
    cpu = all(str(r.device).startswith("CPU runtime") for r in records)
    lines = [f"### {workload}", "",
             f"device: {_distinct(records, 'device')}; torch {_distinct(records, 'torch')}; "
             f"triton {_distinct(records, 'triton')}; measured {first if first == last else f'{first} .. {last}'}", ""]
    if cpu:   # what the CPU runtime's times mean
        lines += ["A correctness run: simulated ranks and programs checked against a float64 reference; "
                  "`eager` is that reference run eagerly in one process, so the speedup column is no "
                  "speed claim (speed is measured on GPUs).", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        floor = f"{r.ours_us / r.floor_us:.2f}" if r.floor_us else "-"
        err = "-" if r.rel_err is None else f"{r.rel_err:.1e}"
        row = [str(r.world), r.schedule, str(r.model), str(r.M), _us(r.ours_us),
               *([_us(ours_graph_us(r))] if graphed else []),
               *[_us(r.baselines.get(k)) for k in names], _us(best_baseline(r)), _speedup_cell(speedup(r)),
               *([_speedup_cell(graph_speedup(r))] if graphed else []), floor, err, str(r.commit), _date(r)]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for _, world, schedule, cells in _groups(records):
        if not cells:
            continue
        slow = [r for r in cells if speedup(r) < 1]
        line = (f"- geometric-mean speedup, {workload} {schedule} world {world}: "
                f"**{geomean(speedup(r) for r in cells):.2f}x** over {len(cells)} cells "
                + ("(vs the float64 reference, eager)" if cpu
                   else "(vs the best baseline: the faster of graph and eager, for MoE also loop and fused)"))
        if slow:
            line += f"; slower than the best baseline in {len(slow)}: " + ", ".join(
                f"{r.model} M={r.M}" for r in slow)
        lines.append(line)
        ceiling = ceilings(cells)
        if ceiling and not cpu:
            at_floor, at_mm, n = ceiling
            lines.append(f"- ceilings, {workload} {schedule} world {world} (the same {n} cells): a kernel at the floor "
                         f"would reach **{at_floor:.2f}x** (best baseline / floor), one as fast as the mm alone with "
                         f"every exchange hidden **{at_mm:.2f}x** (best baseline / mm)")
        both = [r for r in cells if graph_speedup(r) is not None]
        if both:
            lines.append(f"- with ours also captured in a CUDA graph (the better of ours eager and graph vs "
                         f"the best baseline), {workload} {schedule} world {world}: "
                         f"**{geomean(graph_speedup(r) for r in both):.2f}x** over the {len(both)} cells "
                         f"measured both ways (eager alone on the same cells: "
                         f"{geomean(speedup(r) for r in both):.2f}x)")
    lines.append("")
    return "\n".join(lines)


def pivot_table(workload: str, records: Sequence[Record]) -> str:
    """The compact form of workload_table (the repository's document): per world and schedule, a
    model x M grid of speedups over the best baseline, `eager (graph)` where ours was also timed in
    a CUDA graph; each record's times, commit and date stay in the records."""
    records = sorted(records, key=_row_key)
    lines = [f"### {workload}", "",
             f"device: {_distinct(records, 'device')}; torch {_distinct(records, 'torch')}; "
             f"triton {_distinct(records, 'triton')}; commits {_distinct(records, 'commit')}", ""]
    for _, world, schedule, cells in _groups(records):
        if not cells:
            continue
        ms = sorted({r.M for r in cells})
        dates = sorted({_date(r) for r in cells})
        lines += [f"world {world}, {schedule}: speedup over the best baseline, ours eager (ours in a CUDA graph); "
                  f"measured {dates[0] if len(dates) == 1 else f'{dates[0]} .. {dates[-1]}'}", "",
                  "| model | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]
        by_cell = {(r.model, r.M): r for r in cells}
        for model in sorted({r.model for r in cells}, key=_model_key):
            row = []
            for m in ms:
                r = by_cell.get((model, m))
                if r is None:
                    row.append("")
                    continue
                text = _speedup_cell(speedup(r), short=True)
                g = graph_speedup(r)
                row.append(text if g is None else f"{text} ({_speedup_cell(g, short=True)})")
            lines.append(f"| {model} | " + " | ".join(row) + " |")
        lines.append("")
        line = f"- geometric mean {_rounded(geomean(speedup(r) for r in cells))}x over {len(cells)} cells"
        both = [r for r in cells if graph_speedup(r) is not None]
        if both:
            line += f"; with ours in a CUDA graph where timed, {_rounded(geomean(graph_speedup(r) for r in both))}x over {len(both)}"
        ceiling = ceilings(cells)
        if ceiling and not all(str(r.device).startswith("CPU runtime") for r in cells):
            line += f"; a kernel at the floor would reach {ceiling[0]:.2f}x, one as fast as the mm alone {ceiling[1]:.2f}x"
        lines += [line, ""]
    return "\n".join(lines)


def render(records: Sequence[Record], plots: Optional[dict[tuple, pathlib.Path]] = None,
           out_dir: pathlib.Path = pathlib.Path("."), source: str = "bench/results",
           with_summary: bool = True, compact: bool = False) -> str:
    """The block that goes between the report markers: (the summary, unless it has markers of its
    own,) a table per workload (compact: pivot_table's grid), each followed by links to its plots."""
    parts = [f"Generated by `python -m etdist.bench.report` from {source}/<workload>.jsonl (newest record "
             "per cell); edits between the report markers are overwritten.", ""]
    by_workload: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_workload[r.workload].append(r)
    if not by_workload:
        parts.append("No result records yet.\n")
    elif with_summary:
        parts += ["## Summary", "", summary(records)]
    order = {w: k for k, w in enumerate(DOC_WORKLOADS)}
    for workload in sorted(by_workload, key=lambda w: (order.get(w, len(order)), w)):
        parts.append((pivot_table if compact else workload_table)(workload, by_workload[workload]))
        for key, p in sorted((plots or {}).items(), key=lambda kv: tuple(map(str, kv[0]))):
            if key[0] == workload:   # (workload, schedule, world) or, a decode sweep's, (..., model)
                rel = pathlib.Path(os.path.relpath(p, out_dir)).as_posix()
                what = f"{key[3]} at decode sizes, " if len(key) > 3 else ""
                parts.append(f"![{workload} {what}{key[1]} world {key[2]}]({rel})")
        parts.append("")
    return "\n".join(parts).rstrip("\n") + "\n"


# ------------------------------------------------------------------------------------- the plots

def plot_speedups(records: Sequence[Record], folder) -> dict[tuple, pathlib.Path]:
    """One PNG per (workload, schedule, world): speedup over the `graph` baseline against M
    (log2 axis), one line per model, a dashed line at 1. A group whose records have no graph
    baseline (CPU-runtime runs) is plotted against `eager` instead, and says so. Returns
    {(workload, schedule, world): file written}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = pathlib.Path(folder)
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        if (r.baselines.get("graph") or r.baselines.get("eager")) and r.ours_us > 0:
            groups[(r.workload, r.schedule, r.world)].append(r)
    written = {}
    for (workload, schedule, world), all_recs in sorted(groups.items()):
        key = "graph" if any(r.baselines.get("graph") for r in all_recs) else "eager"
        recs = [r for r in all_recs if r.baselines.get(key)]
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        models = sorted({r.model for r in recs}, key=_model_key)
        for model in models:
            pts = sorted((r.M, r.baselines[key] / r.ours_us) for r in recs if r.model == model)
            ax.plot([m for m, _ in pts], [s for _, s in pts], marker="o", label=str(model))
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ticks = _tick_values({r.M for r in recs})
        ax.set_xticks(ticks, [str(m) for m in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tokens M (log2 scale)")
        ax.set_ylabel("speedup over cuBLAS+NCCL CUDA graph (x)" if key == "graph"
                      else "speedup over the eager baseline (x)")
        ax.set_title(f"{workload}, {schedule} schedule, world {world}: {key} baseline / ours")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        written[(workload, schedule, world)] = _save(fig, folder, f"{workload}_{schedule}_w{world}.png")
    return written


def _save(fig, folder: pathlib.Path, name: str) -> pathlib.Path:
    """Lay out, write folder/name (characters a file name should not hold, as in "n/a", as "-"),
    close; the path written."""
    import matplotlib.pyplot as plt
    with warnings.catch_warnings():   # a long legend: matplotlib says so once per plot
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / re.sub(r"[^A-Za-z0-9_.-]", "-", name)
    fig.savefig(path)
    plt.close(fig)
    return path


DECODE_M, SWEEP_POINTS = 256, 20   # a decode sweep: at least this many M values up to DECODE_M


def plot_decode_sweeps(records: Sequence[Record], folder) -> dict[tuple, pathlib.Path]:
    """One PNG per (workload, schedule, world, model) measured at SWEEP_POINTS or more M values up
    to DECODE_M: time (us) against M of ours (eager, and in a CUDA graph where timed), the best
    baseline and the floor, so that a cliff between size classes shows. Returns
    {(workload, schedule, world, model): file written}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = pathlib.Path(folder)
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        if r.M <= DECODE_M and r.ours_us > 0 and best_baseline(r) is not None:
            groups[(r.workload, r.schedule, r.world, r.model)].append(r)
    written = {}
    for key, recs in sorted(groups.items(), key=lambda kv: (kv[0][:3], _model_key(kv[0][3]))):
        if len({r.M for r in recs}) < SWEEP_POINTS:
            continue
        workload, schedule, world, model = key
        recs = sorted(recs, key=lambda r: r.M)
        ms = [r.M for r in recs]
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        ax.plot(ms, [r.ours_us for r in recs], marker="o", markersize=3, label="ours")
        graph = [(r.M, ours_graph_us(r)) for r in recs if ours_graph_us(r)]
        if graph:
            ax.plot([m for m, _ in graph], [g for _, g in graph], marker="o", markersize=3, label="ours, CUDA graph")
        ax.plot(ms, [best_baseline(r) for r in recs], marker="s", markersize=3, label="best cuBLAS+NCCL")
        if any(r.floor_us for r in recs):
            ax.plot([r.M for r in recs if r.floor_us], [r.floor_us for r in recs if r.floor_us], color="black",
                    linestyle="--", linewidth=1, label="floor (HBM bytes / FLOPs)")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tokens M")
        ax.set_ylabel("us per call (slower rank)")
        ax.set_title(f"{workload} {model}, world {world}, {schedule}: decode sizes")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        written[key] = _save(fig, folder, f"{workload}_{model}_{schedule}_w{world}_decode.png")
    return written


def _tick_values(ms: set[int]) -> list[int]:
    """The M values to label: powers of two first, then others not crowding them (1000 vs 1024)."""
    ticks: list[int] = []
    for m in sorted(ms, key=lambda m: (m & (m - 1) != 0, m)):
        if all(abs(math.log2(m / t)) > 0.2 for t in ticks):
            ticks.append(m)
    return sorted(ticks)


# ---------------------------------------------------------------------------------- the document

def splice(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """`text` with everything between the `begin` and `end` markers replaced by `block`; the
    markers and block are appended when the text has none. Content outside them is kept as it is."""
    body = block.rstrip("\n") + "\n"
    if begin not in text and end not in text:
        prefix = text.rstrip("\n") + "\n\n" if text.strip() else "# Benchmarks\n\n"
        return f"{prefix}{begin}\n{body}{end}\n"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"expected one {begin} followed by one {end}; fix the markers by hand")
    start = text.index(begin) + len(begin)
    return f"{text[:start]}\n{body}{text[text.index(end):]}"


def write_report(results, out, plots, workloads: Optional[Sequence[str]] = None, compact: bool = False) -> str:
    """Regenerate the summary and tables in `out` and the PNGs in `plots` from `results` (only
    `workloads`' files where given); returns the block written between the report markers."""
    return _write(results, out, plots, workloads, compact)[2]


def _write(results, out, plots, workloads: Optional[Sequence[str]] = None,
           compact: bool = False) -> tuple[list[Record], dict, str]:
    """write_report's work: (the records shown, the plots written, the block)."""
    out = pathlib.Path(out)
    records = newest_per_cell(load_results(results, workloads))
    written = {**plot_speedups(records, plots), **plot_decode_sweeps(records, plots)}
    old = out.read_text() if out.exists() else ""
    own_summary = SUMMARY_BEGIN in old and bool(records)
    block = render(records, written, out.parent, source=os.path.relpath(results, out.parent),
                   with_summary=not own_summary, compact=compact)
    text = splice(old, block)
    if own_summary:
        text = splice(text, summary(records), SUMMARY_BEGIN, SUMMARY_END)
    out.write_text(text)
    return records, written, block


# the workloads the main command and the collectives benchmark measure: named one by one in the
# summary; other record sets (A/B runs, probes) are counted
SUMMARY_WORKLOADS = ("gemm_rs", "ag_gemm", "mlp", "mlp_replicated", "moe", "collectives", "reduce_scatter",
                     "all_gather", "all_reduce", "all_to_all")


def console_summary(records: Sequence[Record], out, plots: dict) -> str:
    """A few lines on what a report holds: for each of SUMMARY_WORKLOADS present its cells and, per
    schedule and world, the geometric-mean speedup (over the float64 reference for CPU-runtime
    records); how many other record sets it holds; where it went."""
    workloads = sorted({r.workload for r in records})
    lines = [f"{len(records)} cells (the newest record of each) in {len(workloads)} record sets"]
    for workload in [w for w in SUMMARY_WORKLOADS if w in workloads]:
        recs = [r for r in records if r.workload == workload]
        groups = []
        for schedule, world in sorted({(r.schedule, r.world) for r in recs}):
            s = [speedup(r) for r in recs if (r.schedule, r.world) == (schedule, world) and speedup(r) is not None]
            if s:
                slow = sum(v < 1 for v in s)
                groups.append(f"{schedule} world {world} {geomean(s):.2f}x over {len(s)}"
                              + (f" ({slow} slower)" if slow else ""))
        cpu = all(str(r.device).startswith("CPU runtime") for r in recs)
        lines.append(f"  {workload}: {len(recs)} cells" + (" (CPU runtime: vs the float64 reference)" if cpu else "")
                     + ("; geomean speedup " + ", ".join(groups) if groups else ""))
    others = [w for w in workloads if w not in SUMMARY_WORKLOADS]
    if others:
        lines.append(f"  and {len(others)} other record sets (A/B runs, probes): their tables are in the report")
    lines.append(f"wrote {out} and {len(plots)} plots in {os.path.commonpath([str(p) for p in plots.values()])}"
                 if plots else f"wrote {out} (no plots)")
    return "\n".join(lines)


def checkout() -> pathlib.Path:
    """The repository checkout this package runs from (--repo writes its documents there)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists() or not (root / "etdist" / "bench").is_dir():
        raise SystemExit(f"--repo: etdist runs from {root}, which is no checkout of the repository "
                         "(an installed wheel?); give --out and --plots instead")
    return root


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m etdist.bench.report",
        description="Markdown tables and plots from result records, written into a new run folder "
                    "(outputs/report/<date>/<time>) unless told where.")
    parser.add_argument("--results", help=f"folder of <workload>.jsonl (default {REPO_RESULTS}; with --repo, the "
                        "checkout's)")
    parser.add_argument("--dir", help="folder for report.md and plots/ (default: a new outputs/report/<date>/<time>)")
    parser.add_argument("--out", help="markdown file to update (default: <dir>/report.md)")
    parser.add_argument("--plots", help="folder for the PNGs (default: <dir>/plots)")
    parser.add_argument("--repo", action="store_true",
                        help=f"update the repository's own {REPO_DOC} and {REPO_PLOTS} (in the checkout)")
    parser.add_argument("--workloads", default=",".join(DOC_WORKLOADS),
                        help="comma-separated workloads to show, or 'all' for every <results>/*.jsonl")
    parser.add_argument("--print", dest="tables", action="store_true", help="print the tables too")
    args = parser.parse_args(argv)
    if args.repo:
        if args.dir or args.out or args.plots:
            parser.error("--repo writes the repository's documents: no --dir, --out or --plots with it")
        root = checkout()
        results = args.results or root / REPO_RESULTS
        out, plots = root / REPO_DOC, root / REPO_PLOTS
    else:
        results = args.results or REPO_RESULTS
        folder = pathlib.Path(args.dir or datetime.datetime.now().strftime("outputs/report/%Y-%m-%d/%H-%M-%S"))
        out = pathlib.Path(args.out) if args.out else folder / "report.md"
        plots = pathlib.Path(args.plots) if args.plots else folder / "plots"
    if not pathlib.Path(results).is_dir():
        raise SystemExit(f"no results folder {results} (give --results)")
    out.parent.mkdir(parents=True, exist_ok=True)
    workloads = None if args.workloads == "all" else [w for w in args.workloads.split(",") if w]
    # the repository's document: compact grids (a cell's times, commit and date are in its record)
    records, written, block = _write(results, out, plots, workloads, compact=args.repo)
    if args.tables:
        print(block)
    print(console_summary(records, out, written))


if __name__ == "__main__":
    main()
