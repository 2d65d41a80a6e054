"""Environment variables: the few the library reads are read in etdist/knobs.py alone, and a bad
value raises KnobError naming the variable where the code that reads it runs."""
import ast
import pathlib
import re

import pytest

from etdist import knobs

ROOT = pathlib.Path(knobs.__file__).parent

# Reads of os.environ outside knobs.py that are not configuration: (module, what the line holds) -> why
NOT_CONFIGURATION = {
    ("mesh/launch.py", "env = os.environ if env is None"): "the launchers' contract (RANK, OMPI_*, PMI_*, SLURM_*)",
    ("mesh/mesh.py", '"MASTER_ADDR" not in os.environ'): "torch.distributed's rendezvous contract",
    ("mesh/hostcomm.py", 'if k not in os.environ'): "torch.distributed's rendezvous contract (MASTER_ADDR/PORT)",
    ("mesh/nvshmem_backend.py", "env_defaults(os.environ"): "a write: NVSHMEM's defaults where the user set none",
    ("bench/gpu.py", "os.environ.setdefault(k"): "a write: torch.distributed's rendezvous for the bench's process",
}


def test_a_knob_read_where_it_is_used_names_itself(monkeypatch):
    """A knob read when its code first runs (ETDIST_SHARE_GPU at init_mesh, say) names itself in
    the error: a bad value was once int()'s bare ValueError."""
    monkeypatch.setenv("ETDIST_SHARE_GPU", "2")
    with pytest.raises(knobs.KnobError, match=r"ETDIST_SHARE_GPU='2': want 0 or 1"):
        knobs.now("ETDIST_SHARE_GPU", knobs.flag, False)
    monkeypatch.setenv("ETDIST_SHARE_GPU", "")
    assert knobs.now("ETDIST_SHARE_GPU", knobs.flag, False) is False


def test_flag():
    assert knobs.flag("0") is False and knobs.flag("1") is True
    for text in ("abc", "2", "yes"):
        with pytest.raises(ValueError):
            knobs.flag(text)


@pytest.mark.parametrize("value,want", [("1", True), ("true", True), ("ON", True), ("0", False), ("", False),
                                        ("yes", False)])
def test_triton_interpreted_follows_tritons_rule(monkeypatch, value, want):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert knobs.triton_interpreted() is want


def _environ_reads(path: pathlib.Path) -> list:
    """(line number, line) of each use of environ or getenv in `path`'s code (not its strings)."""
    src = path.read_text()
    lines = src.splitlines()
    uses = {n.lineno for n in ast.walk(ast.parse(src))
            if (isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv"))
            or (isinstance(n, ast.Name) and n.id in ("environ", "getenv"))}
    return [(n, lines[n - 1]) for n in sorted(uses)]


def test_no_module_but_knobs_reads_the_environment():
    """The package reads the environment in knobs.py alone (it was read in seven modules, some
    straight from os.environ); the launchers' contracts and the writes are listed above."""
    stray, listed = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "knobs.py":
            continue
        for n, line in _environ_reads(path):
            found = {(m, held) for m, held in NOT_CONFIGURATION if rel == m and held in line}
            listed |= found
            if not found:
                stray.append(f"{rel}:{n}: {line.strip()}")
    assert not stray, stray
    assert listed == set(NOT_CONFIGURATION), set(NOT_CONFIGURATION) - listed   # no entry outlives its read


def test_every_variable_is_listed():
    """No ETDIST_* variable is named in the package, its tests, launchers or experiments that
    knobs.VARIABLES does not list (a test worker takes arguments, not variables of its own)."""
    named = {}
    for folder in ("etdist", "tests", "launch", "experiments"):
        for path in (ROOT.parent / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".sbatch") and path.is_file():
                for name in re.findall(r"ETDIST_[A-Z0-9_]+", path.read_text()):
                    named.setdefault(name, str(path.relative_to(ROOT.parent)))
    unlisted = {name: where for name, where in named.items() if name not in knobs.VARIABLES}
    assert not unlisted, unlisted
    assert len(knobs.VARIABLES) <= 5
