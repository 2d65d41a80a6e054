"""The library logs through `logging.getLogger("etdist")`, silent unless asked; it does not print."""
import ast
import logging
import os
import pathlib
import subprocess
import sys

import etdist as et

ROOT = pathlib.Path(__file__).resolve().parents[1]
# command-line tools, whose output is their point (the benchmark harness is one as a whole)
PRINTS = {"etdist/collectives/selfcheck.py"}


def chain():
    g = et.Graph("chain")
    n = g.size("n")
    g.input("x", (n,))
    done = g.event("done", (n,))

    @g.task(grid=(n,), notify=lambda i: done[i])
    def a(t, i):
        pass

    @g.task(grid=(n,), wait=lambda i: done[i])
    def b(t, i):
        pass

    return g


def test_the_library_does_not_print():
    found = []
    for path in sorted((ROOT / "etdist").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("etdist/bench/") or rel in PRINTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"print in the library (log through logging.getLogger(__name__)): {found}"


def test_silent_by_default_and_debug_records_on_request(caplog, capsys):
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("etdist").handlers)
    et.compile(chain())
    assert capsys.readouterr() == ("", "")
    with caplog.at_level(logging.DEBUG, logger="etdist"):
        et.compile(chain())
    messages = [(r.name, r.getMessage().split()[0]) for r in caplog.records]
    assert messages == [("etdist.fusion.compile", step) for step in ("canonicalise", "validate", "build")]
    assert capsys.readouterr().out == ""


def test_etdist_debug_logs_each_pass_to_stderr():
    code = ("import etdist as et\n"
            "g = et.Graph('one'); n = g.size('n'); g.input('x', (n,))\n"
            "@g.task(grid=(n,))\n"
            "def a(t, i): pass\n"
            "et.compile(g)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "ETDIST_DEBUG": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert "[etdist.fusion.compile] canonicalise one: 1 device functions" in out.stderr
    assert "[etdist.fusion.compile] build one:" in out.stderr
