"""etdist.bench.report from synthetic records: tables, speedups, geometric means, markers, plots."""
import math
import re

import pytest

from etdist.bench import report
from etdist.bench.measure.records import Record, append

ENV = dict(device="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", commit="abc1234")


def rec(workload="gemm_rs", model="qwen3_8b", M=16, world=2, schedule="static", ours=30.0,
        graph=40.0, eager=50.0, date="2026-11-22T10:00:00+00:00", **extra):
    baselines = {"graph": graph, "eager": eager, "mm": ours * 0.5, **extra}
    return Record(workload=workload, model=model, M=M, world=world, schedule=schedule, ours_us=ours,
                  baselines=baselines, floor_us=ours / 2, rel_err=2e-3, date=date, **ENV)


@pytest.fixture
def results(tmp_path):
    d = tmp_path / "bench" / "results"
    rows = [
        rec(M=16, ours=20.0, graph=40.0, eager=50.0),                 # best 40 -> 2.00x
        rec(M=128, ours=25.0, graph=60.0, eager=50.0),                # best 50 (eager) -> 2.00x
        rec(M=1024, ours=100.0, graph=80.0, eager=90.0),              # 0.80x: slower
        rec(model="llama31_70b", M=16, ours=50.0, graph=75.0, eager=70.0, symm_mem=300.0),  # 1.40x
        rec(schedule="dynamic", M=16, ours=40.0, graph=40.0, eager=50.0),                   # 1.00x
        # an older record of a cell that has a newer one: ignored
        rec(M=16, ours=1.0, date="2026-11-01T10:00:00+00:00"),
    ]
    for r in rows:
        append(d / "gemm_rs.jsonl", r)
    append(d / "ag_gemm.jsonl", rec(workload="ag_gemm", M=8192, ours=1000.0, graph=1200.0,
                                    eager=1100.0))
    return d


def _table_rows(block, workload):
    section = block.split(f"### {workload}")[1].split("###")[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]


def test_tables_speedups_and_geomean(results, tmp_path, capsys):
    out = tmp_path / "benchmarks.md"
    report.main(["--results", str(results), "--out", str(out), "--plots", str(tmp_path / "plots"), "--print"])
    text = out.read_text()
    assert capsys.readouterr().out.split("\n6 cells")[0].strip() in text   # --print: the tables too
    head, *rows = _table_rows(text, "gemm_rs")
    assert "symm_mem us" in head and "best baseline us" in head and "ours/floor" in head
    assert head.endswith("| commit | date |")
    assert len(rows) == 5                                      # the older duplicate cell is gone
    by_cell = {tuple(c.strip() for c in r.split("|")[1:5]): r for r in rows}
    assert "| 40.0 | 2.00x |" in by_cell[("2", "static", "qwen3_8b", "16")]
    assert "| 50.0 | 2.00x |" in by_cell[("2", "static", "qwen3_8b", "128")]
    assert "**0.80x** (slower)" in by_cell[("2", "static", "qwen3_8b", "1024")]
    assert "| 300.0 |" in by_cell[("2", "static", "llama31_70b", "16")]
    assert "| 2.00 | 2.0e-03 | abc1234 | 2026-11-22 |" in by_cell[("2", "static", "qwen3_8b", "16")]   # ours/floor
    # world, schedule, then models in the paper's order (qwen3_8b before llama31_70b), then M
    assert [c[1:] for c in by_cell] == [("dynamic", "qwen3_8b", "16"), ("static", "qwen3_8b", "16"),
                                        ("static", "qwen3_8b", "128"), ("static", "qwen3_8b", "1024"),
                                        ("static", "llama31_70b", "16")]
    geo = re.search(r"gemm_rs static world 2: \*\*([\d.]+)x\*\* over 4 cells", text)
    want = math.prod([2.0, 2.0, 0.8, 70 / 50]) ** 0.25
    assert float(geo.group(1)) == pytest.approx(want, abs=0.01)
    assert "slower than the best baseline in 1: qwen3_8b M=1024" in text
    assert "gemm_rs dynamic world 2: **1.00x** over 1 cells" in text
    assert "| 1000.0 |" in _table_rows(text, "ag_gemm")[1]
    assert "device: NVIDIA H200; torch 2.11.0+cu130; triton 3.6.0; measured 2026-11-22" in text


def test_summary_leads_with_one_row_per_workload_world_and_schedule(results, tmp_path):
    """The summary: cells, faster cells, geomean speedup and ours/floor per (workload, world,
    schedule), the workloads in the document's order (gemm_rs before ag_gemm)."""
    out = tmp_path / "benchmarks.md"
    report.write_report(results, out, tmp_path / "plots")
    text = out.read_text()
    assert text.index("## Summary") < text.index("### gemm_rs")
    rows = [l for l in text.split("## Summary")[1].split("###")[0].splitlines() if l.startswith("| ") and "---" not in l]
    assert rows[0].startswith("| workload | world | schedule | cells | faster | geomean speedup | geomean ours/floor")
    want = math.prod([2.0, 2.0, 0.8, 70 / 50]) ** 0.25
    assert rows[1] == "| gemm_rs | 2 | dynamic | 1 | 1 | 1.00x | 2.00 | 2026-11-22 | abc1234 |"
    assert rows[2] == f"| gemm_rs | 2 | static | 4 | 3 | {want:.2f}x | 2.00 | 2026-11-22 | abc1234 |"
    assert rows[3].startswith("| ag_gemm | 2 | static | 1 | 1 | 1.10x |")


def test_the_document_shows_only_its_workloads_and_keeps_summary_markers(results, tmp_path):
    """The CLI's default reads <results>/<workload>.jsonl for DOC_WORKLOADS alone (A/B files and
    a file's records of another workload stay out; `--workloads all` shows them), and a summary
    with markers of its own is spliced there, not into the tables' block."""
    append(results / "gemm_rs_split_ab.jsonl", rec(workload="gemm_rs_split_ab"))
    append(results / "gemm_rs_bisect.jsonl", rec(M=16, ours=5.0, date="2026-12-01T10:00:00+00:00"))
    out = tmp_path / "benchmarks.md"
    out.write_text(f"# Benchmarks\n\n{report.SUMMARY_BEGIN}\nold\n{report.SUMMARY_END}\n\n## How we measure\n\n"
                   f"protocol\n\n{report.BEGIN}\n{report.END}\n")
    report.main(["--results", str(results), "--out", str(out), "--plots", str(tmp_path / "plots")])
    text = out.read_text()
    assert "gemm_rs_split_ab" not in text and "| 5.0 |" not in text and "old" not in text
    summary = text.split(report.SUMMARY_BEGIN)[1].split(report.SUMMARY_END)[0]
    assert "| gemm_rs | 2 | static | 4 |" in summary and "## Summary" not in text
    assert text.index(report.SUMMARY_END) < text.index("protocol") < text.index("### gemm_rs")
    report.main(["--results", str(results), "--out", str(out), "--plots", str(tmp_path / "plots"), "--workloads", "all"])
    text = out.read_text()
    assert "### gemm_rs_split_ab" in text and "| 5.0 |" in text


def test_a_short_summary_into_a_run_folder_by_default(results, tmp_path, monkeypatch, capsys):
    """`python -m etdist.bench.report` wrote BENCHMARKS.md and bench/plots in the working directory (the
    repository) and printed every table (17k lines); now a new run folder and a few lines."""
    monkeypatch.chdir(tmp_path)
    report.main(["--results", str(results)])
    printed = capsys.readouterr().out.splitlines()
    folder, = (tmp_path / "outputs" / "report").glob("*/*")
    assert (folder / "report.md").exists() and len(list((folder / "plots").glob("*.png"))) == 3
    assert not (tmp_path / "BENCHMARKS.md").exists() and not (tmp_path / "bench" / "plots").exists()
    assert printed[0] == "6 cells (the newest record of each) in 2 record sets"
    assert printed[1].startswith("  gemm_rs: 5 cells; geomean speedup dynamic world 2 1.00x over 1, "
                                 "static world 2 1.45x over 4 (1 slower)")
    assert printed[2].startswith("  ag_gemm: 1 cells") and printed[-1].startswith("wrote outputs/report/")
    assert len(printed) == 4
    report.main(["--results", str(results), "--dir", "mine"])
    assert (tmp_path / "mine" / "report.md").exists() and (tmp_path / "mine" / "plots").is_dir()


def test_repo_writes_the_checkouts_documents(results, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "checkout", lambda: tmp_path)
    report.main(["--repo", "--results", str(results)])
    assert (tmp_path / report.REPO_DOC).exists() and (tmp_path / report.REPO_PLOTS).is_dir()
    with pytest.raises(SystemExit):
        report.main(["--repo", "--dir", "x"])
    assert "no --dir, --out or --plots with it" in capsys.readouterr().err


def test_ceilings_bound_what_a_speedup_target_can_ask(results, tmp_path):
    """Each workload's ceilings: the geomean of best baseline / floor and of best baseline / mm over
    the same cells (rec's floor is ours / 2 and its mm ours x 0.5: both ceilings are 2x the speedup);
    cells without a floor or an mm give none."""
    out = tmp_path / "benchmarks.md"
    report.main(["--results", str(results), "--out", str(out), "--plots", str(tmp_path / "plots")])
    text = out.read_text()
    got = re.search(r"ceilings, gemm_rs static world 2 \(the same 4 cells\): a kernel at the floor would reach "
                    r"\*\*([\d.]+)x\*\* .* with every exchange hidden \*\*([\d.]+)x\*\*", text)
    want = 2 * math.prod([2.0, 2.0, 0.8, 70 / 50]) ** 0.25
    assert float(got.group(1)) == pytest.approx(want, abs=0.01) and float(got.group(2)) == pytest.approx(want, abs=0.01)
    bare = Record(workload="moe", model="m", M=1, world=1, schedule="static", ours_us=1.0, baselines={"eager": 2.0},
                  floor_us=None, rel_err=None, date="2026-11-22T10:00:00+00:00", **ENV)
    assert report.ceilings([bare]) is None and report.ceilings([]) is None


def test_plots_written_and_linked(results, tmp_path):
    out = tmp_path / "benchmarks.md"
    plots = tmp_path / "bench" / "plots"
    report.write_report(results, out, plots)
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["ag_gemm_static_w2.png", "gemm_rs_dynamic_w2.png", "gemm_rs_static_w2.png"]
    assert all((plots / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert "](bench/plots/gemm_rs_static_w2.png)" in out.read_text()


def test_content_outside_markers_is_kept(results, tmp_path):
    out = tmp_path / "benchmarks.md"
    before = "# Benchmarks\n\nintro\n\n"
    after = "\n## Collectives\n\n| size | us |\n|---|---|\n| 4 KiB | 55 |\n"
    out.write_text(f"{before}{report.BEGIN}\nstale table\n{report.END}{after}")
    report.write_report(results, out, tmp_path / "plots")
    text = out.read_text()
    assert text.startswith(before + report.BEGIN) and text.endswith(report.END + after)
    assert "stale table" not in text and "### gemm_rs" in text
    once = text
    report.write_report(results, out, tmp_path / "plots")      # idempotent
    assert out.read_text() == once


def test_splice_creates_appends_and_rejects():
    made = report.splice("", "T\n")
    assert made == f"# Benchmarks\n\n{report.BEGIN}\nT\n{report.END}\n"
    added = report.splice("# B\n\n## Collectives\nx\n", "T")
    assert added.startswith("# B\n\n## Collectives\nx\n\n" + report.BEGIN)
    with pytest.raises(ValueError, match="markers"):
        report.splice(f"{report.END}\n{report.BEGIN}\n", "T")


def test_no_records(tmp_path):
    out = tmp_path / "B.md"
    report.write_report(tmp_path / "none", out, tmp_path / "plots")
    assert "No result records yet." in out.read_text()


def test_slower_cell_never_reads_one_and_ticks_do_not_crowd():
    block = report.workload_table("gemm_rs", [rec(ours=100.0, graph=99.6, eager=120.0)])
    assert "**0.99x** (slower)" in block
    assert report._tick_values({16, 128, 1000, 1024, 8192}) == [16, 128, 1024, 8192]


def test_ours_in_a_cuda_graph_gets_its_own_column_and_geomean(tmp_path):
    """Records with extra.ours_graph_us: a column, a second speedup (the better of ours eager and
    graph against the better of the baselines) and its geometric mean beside the eager one."""
    d = tmp_path / "results"
    slow_eager = rec(M=16, ours=80.0, graph=40.0, eager=50.0)               # eager 0.50x
    slow_eager.extra = {"ours_graph_us": 32.0}                                # graph 40/32 = 1.25x
    fast_eager = rec(M=128, ours=25.0, graph=60.0, eager=50.0)              # 2.00x either way
    fast_eager.extra = {"ours_graph_us": 30.0}                                # eager is the better of ours
    for r in (slow_eager, fast_eager, rec(M=1024, ours=100.0, graph=80.0, eager=90.0)):   # no graph figure
        append(d / "gemm_rs.jsonl", r)
    text = report.render(report.load_results(d))
    head, *rows = _table_rows(text, "gemm_rs")
    assert "ours graph us" in head and "speedup, ours eager or graph" in head
    by_M = {r.split("|")[4].strip(): r for r in rows}
    assert "| 32.0 |" in by_M["16"] and "**0.50x** (slower) | 1.25x |" in by_M["16"]
    assert "| 2.00x | 2.00x |" in by_M["128"] and "| - |" in by_M["1024"]
    line = next(l for l in text.splitlines() if l.startswith("- with ours also captured"))
    assert f"**{math.sqrt(1.25 * 2.0):.2f}x** over the 2 cells" in line and f"{math.sqrt(0.5 * 2.0):.2f}x)" in line


def test_the_repository_document_shows_a_model_by_m_grid():
    """--repo's compact tables: one row per model, one column per M, eager (graph) speedups, bold
    where slower; an empty cell where a model was not measured at that M."""
    a = rec(M=16, ours=80.0, graph=40.0, eager=50.0)
    a.extra = {"ours_graph_us": 32.0}
    b = rec(M=1024, ours=50.0, graph=80.0, eager=90.0)
    c = rec(M=16, ours=20.0, graph=40.0, eager=50.0)
    c.model = "llama31_70b"
    block = report.pivot_table("gemm_rs", [a, b, c])
    lines = block.splitlines()
    assert "| model | M=16 | M=1024 |" in lines
    assert f"| {a.model} | **0.50** (1.25) | 1.60 |" in lines, block
    assert "| llama31_70b | 2.00 |  |" in lines, block


def test_a_decode_sweep_gets_its_own_time_plot(tmp_path):
    """A (workload, schedule, world, model) measured at SWEEP_POINTS or more M values up to 256 gets
    a time plot (ours, the best baseline, the floor against M), linked under its workload's table;
    a model with fewer decode M values gets none."""
    d = tmp_path / "results"
    for M in range(1, 1 + report.SWEEP_POINTS):
        append(d / "gemm_rs.jsonl", rec(M=M * 12, ours=30.0 + M, graph=40.0, eager=50.0))
    append(d / "gemm_rs.jsonl", rec(model="llama31_70b", M=16))
    out = tmp_path / "benchmarks.md"
    block = report.write_report(d, out, tmp_path / "plots")
    sweeps = sorted(p.name for p in (tmp_path / "plots").glob("*_decode.png"))
    assert sweeps == ["gemm_rs_qwen3_8b_static_w2_decode.png"]
    assert "![gemm_rs qwen3_8b at decode sizes, static world 2](plots/gemm_rs_qwen3_8b_static_w2_decode.png)" in block
