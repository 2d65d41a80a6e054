"""Imports flow one way (docs/design.md), and no etdist module imports itself back through others.

    bench -> etdist (the package root: the public API) -> nn -> ops -> workloads -> fusion
          -> collectives -> kernels -> mesh -> knobs, log

A module may import modules of its own layer and of the layers after it, never of one before it:
nothing in the library imports the benchmark harness (etdist.bench), which may import anything.
Every import counts, those inside functions too: a lazy import hides a circle, it does not break it.
(Importing a.b.c also runs a and a.b first; those implied imports of the parents are not counted.)
"""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "etdist"
LAYERS = ["bench", "<root>", "nn", "ops", "workloads", "fusion", "collectives", "kernels", "mesh", "knobs|log"]
RANK = {name: k for k, layer in enumerate(LAYERS) for name in layer.split("|")}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The etdist modules that module `name` imports anywhere in its file (a package: its __init__)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            for a in node.names:   # `from pkg import sub` imports the submodule pkg.sub
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_every_package_has_a_layer():
    missing = sorted({layer(m) for m in MODULES} - set(RANK))
    assert not missing, f"place {missing} in LAYERS"


def test_imports_flow_one_way():
    bad = [f"{a} imports {b}" for a, targets in GRAPH.items() for b in sorted(targets)
           if RANK[layer(a)] > RANK[layer(b)]]
    assert not bad, bad


def test_library_floors_never_import_the_bench():
    bad = [f"{a} imports {b}" for a, targets in GRAPH.items() for b in targets
           if layer(a) != "bench" and layer(b) == "bench"]
    assert not bad, bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(path_within(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def path_within(graph, component) -> list[str]:
    """A circle through the component's first module: a -> ... -> a (breadth-first, so the shortest)."""
    start = min(component)
    came = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while came[path[-1]] is not None:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in {component}")


def test_no_import_circles():
    found = cycles(GRAPH)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_circle_finder_finds_circles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycles(g) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_importing_the_library_loads_no_bench_module():
    code = ("import sys, etdist, etdist.ops, etdist.nn, etdist.collectives, etdist.workloads; "
            "print(sorted(m for m in sys.modules if m.startswith('etdist.bench') or m.split('.')[0] in "
            "('hydra', 'rich', 'matplotlib')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# Hubs split by concern: each part is a module of its own that never reaches back to the module it was
# split from (the hub imports its parts: that would be a circle)
SPLITS = {
    "etdist.fusion.cuda_runtime": ["etdist.fusion.cuda_agreement", "etdist.fusion.cuda_state",
                                   "etdist.fusion.cuda_layout", "etdist.fusion.cuda_errors"],
    "etdist.ops.common": ["etdist.ops.config", "etdist.ops.plan_model"],
}


def reachable(name: str) -> set[str]:
    """The modules `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for m in GRAPH[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_split_modules_sit_below_their_hub():
    for hub, parts in SPLITS.items():
        missing = [p for p in [hub, *parts] if p not in MODULES]
        assert not missing, f"no module {missing}"
        back = [f"{p} reaches {hub}" for p in parts if hub in reachable(p)]
        assert not back, back
    # the plan configuration needs none of the ops' plumbing, nor the plan models
    assert not reachable("etdist.ops.config") & {"etdist.ops.common", "etdist.ops.plan_model"}
