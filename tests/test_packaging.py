"""What a wheel needs beyond the code (.ci/run installs one and runs it from outside the checkout):
the Hydra configs as package data, every third-party import declared, LICENSE and py.typed."""
import ast
import pathlib
import re
import sys

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# import name -> distribution; the optional ones live in extras, imported only where they are used
DISTRIBUTIONS = {"torch": "torch", "numpy": "numpy", "hydra": "hydra-core", "omegaconf": "omegaconf",
                 "rich": "rich", "matplotlib": "matplotlib", "triton": "triton"}
OPTIONAL = {"mpi4py": "mpi4py", "nvshmem": "nvshmem4py-cu13", "cuda": "cuda-python"}


def names(requirements) -> set[str]:
    return {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_third_party_import_is_declared():
    imported = set()
    for path in (ROOT / "etdist").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"etdist"}
    assert third_party <= set(DISTRIBUTIONS) | set(OPTIONAL), sorted(third_party - set(DISTRIBUTIONS) - set(OPTIONAL))
    required = names(PYPROJECT["project"]["dependencies"])
    assert {DISTRIBUTIONS[m] for m in third_party & set(DISTRIBUTIONS)} <= required
    extras = set().union(*(names(v) for v in PYPROJECT["project"]["optional-dependencies"].values()))
    assert {OPTIONAL[m] for m in third_party & set(OPTIONAL)} <= extras
    assert not {OPTIONAL[m] for m in OPTIONAL} & required   # mpi4py, NVSHMEM, cuda-python stay optional


def test_the_configs_are_package_data():
    package_data = PYPROJECT["tool"]["setuptools"]["package-data"]
    conf = ROOT / "etdist" / "bench" / "conf"
    assert (conf / "__init__.py").exists()
    covered = {p for pattern in package_data["etdist.bench.conf"] for p in conf.glob(pattern)}
    assert covered == set(conf.rglob("*.yaml")) and len(covered) > 20
    assert "py.typed" in package_data["etdist"] and (ROOT / "etdist" / "py.typed").exists()


def test_license():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190
