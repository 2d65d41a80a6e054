"""Imports flow one way: api -> fusion -> kernels/collectives -> mesh (docs/design.md)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "etdist"
# a package may import the ones listed after it, never those before it
ORDER = ["workloads", "fusion", "kernels", "collectives", "mesh"]
FORBIDDEN = {
    "fusion": {"workloads", "ops", "nn", "bench"},
    "kernels": {"workloads", "fusion", "ops", "nn", "bench", "collectives"},
    "collectives": {"workloads", "fusion", "ops", "nn", "bench"},
    "mesh": {"workloads", "fusion", "kernels", "collectives", "ops", "nn", "bench"},
}


def imported_packages(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.startswith("etdist."):
                names.add(node.module.split(".")[1])
            elif node.level == 2 and node.module:
                names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("etdist."):
                    names.add(a.name.split(".")[1])
    return names


def test_imports_flow_one_way():
    bad = []
    for pkg, forbidden in FORBIDDEN.items():
        for path in (ROOT / pkg).rglob("*.py"):
            hit = imported_packages(path) & forbidden
            if hit:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hit)}")
    assert not bad, bad
