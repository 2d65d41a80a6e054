"""Symbolic integer expressions: sizes, task indices, index maps and data-dependent loads.

Index maps are written as ordinary Python lambdas; calling them with `Var`s traces them into
`Expr` trees. One tree then serves every backend: `evaluate` (validation), `to_python` (the CPU
runtime compiles it into a lambda) and, later, Triton source for the GPU kernel. Only integer
arithmetic is allowed, so a map means the same thing on the host and in a kernel.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Union

# The two symbols every graph has: which rank runs the task, and how many ranks there are.
RANK_NAME = "RANK"
WORLD_NAME = "WORLD"

_BINARY = {
    "add": ("+", operator.add),
    "sub": ("-", operator.sub),
    "mul": ("*", operator.mul),
    "floordiv": ("//", operator.floordiv),
    "mod": ("%", operator.mod),
    "lt": ("<", operator.lt),
    "le": ("<=", operator.le),
    "gt": (">", operator.gt),
    "ge": (">=", operator.ge),
    "eq": ("==", operator.eq),
    "ne": ("!=", operator.ne),
    "and": ("and", lambda a, b: bool(a) and bool(b)),
    "or": ("or", lambda a, b: bool(a) or bool(b)),
}
_CALLS = {"min": min, "max": max}


@dataclass(frozen=True)
class Expr:
    """A node: op is one of const, sym, var, load, a binary op name, min, max or where."""

    op: str
    args: tuple

    # Arithmetic builds trees; comparisons too (so `i * BM < counts[e]` is an Expr).
    # `==` keeps Python's structural meaning (Exprs are dict keys): use `eq(a, b)` instead.
    def __add__(self, o): return _bin("add", self, o)
    def __radd__(self, o): return _bin("add", o, self)
    def __sub__(self, o): return _bin("sub", self, o)
    def __rsub__(self, o): return _bin("sub", o, self)
    def __mul__(self, o): return _bin("mul", self, o)
    def __rmul__(self, o): return _bin("mul", o, self)
    def __floordiv__(self, o): return _bin("floordiv", self, o)
    def __rfloordiv__(self, o): return _bin("floordiv", o, self)
    def __mod__(self, o): return _bin("mod", self, o)
    def __rmod__(self, o): return _bin("mod", o, self)
    def __lt__(self, o): return _bin("lt", self, o)
    def __le__(self, o): return _bin("le", self, o)
    def __gt__(self, o): return _bin("gt", self, o)
    def __ge__(self, o): return _bin("ge", self, o)
    def __neg__(self): return _bin("sub", 0, self)

    def __bool__(self):
        raise TypeError(
            f"symbolic expression {self} has no truth value while the graph is traced; "
            "use et.where/et.minimum/et.maximum instead of if/min/max in index maps")

    def __index__(self):
        raise TypeError(f"symbolic expression {self} cannot be used as a Python int while tracing; "
                        "evaluate it inside the tile body with t(expr)")

    def __repr__(self) -> str:
        return self.to_python()

    # -- queries ---------------------------------------------------------------------------
    def walk(self) -> Iterable["Expr"]:
        yield self
        for a in self.args:
            if isinstance(a, Expr):
                yield from a.walk()
            elif isinstance(a, tuple):
                for b in a:
                    if isinstance(b, Expr):
                        yield from b.walk()

    def symbols(self) -> set[str]:
        return {n.args[0] for n in self.walk() if n.op == "sym"}

    def loads(self) -> set[str]:
        """Names of the runtime tensors this expression reads (data-dependent maps)."""
        return {n.args[0] for n in self.walk() if n.op == "load"}

    @property
    def is_data_dependent(self) -> bool:
        return bool(self.loads())

    def substitute(self, mapping: Mapping[str, "Expr"]) -> "Expr":
        """Replace index variables by expressions (e.g. an event's coordinate vars by a task's map)."""
        if self.op == "var":
            return mapping.get(self.args[0], self)
        if self.op in ("const", "sym"):
            return self
        if self.op == "load":
            return Expr("load", (self.args[0], tuple(i.substitute(mapping) for i in self.args[1])))
        return Expr(self.op, tuple(x.substitute(mapping) for x in self.args))

    # -- backends -----------------------------------------------------------------------------
    def to_python(self) -> str:
        op, a = self.op, self.args
        if op == "const":
            return repr(a[0])
        if op in ("sym", "var"):
            return a[0]
        if op == "load":
            name, idx = a
            return f"int({name}[{', '.join(i.to_python() for i in idx)}])"
        if op in _CALLS:
            return f"{op}({a[0].to_python()}, {a[1].to_python()})"
        if op == "where":
            return f"({a[1].to_python()} if {a[0].to_python()} else {a[2].to_python()})"
        if op == "span":
            raise TypeError("et.every(...) is a set of coordinates, usable only directly in a notify map")
        return f"({a[0].to_python()} {_BINARY[op][0]} {a[1].to_python()})"

    def to_triton(self, load: Callable[[str, tuple], str]) -> str:
        """Triton source; `load(tensor, index_sources)` prints a runtime-tensor read."""
        op, a = self.op, self.args
        if op in ("const", "sym", "var"):
            return self.to_python()
        if op == "load":
            return load(a[0], tuple(i.to_triton(load) for i in a[1]))
        if op in _CALLS:
            return f"tl.{'minimum' if op == 'min' else 'maximum'}({a[0].to_triton(load)}, {a[1].to_triton(load)})"
        if op == "where":
            return f"tl.where({a[0].to_triton(load)}, {a[1].to_triton(load)}, {a[2].to_triton(load)})"
        if op in ("and", "or"):  # logical, as on the host: compare with 0 before the bitwise op
            return f"(({a[0].to_triton(load)} != 0) {'&' if op == 'and' else '|'} ({a[1].to_triton(load)} != 0))"
        return f"({a[0].to_triton(load)} {_BINARY[op][0]} {a[1].to_triton(load)})"

    def evaluate(self, env: Mapping[str, Any]) -> int:
        """Value under `env`: sizes, index variables and (for loads) indexable tensors by name."""
        op, a = self.op, self.args
        if op == "const":
            return a[0]
        if op in ("sym", "var"):
            try:
                return env[a[0]]
            except KeyError:
                raise KeyError(f"no value for symbol {a[0]!r}") from None
        if op == "load":
            name, idx = a
            return int(env[name][tuple(i.evaluate(env) for i in idx)])
        if op in _CALLS:
            return _CALLS[op](a[0].evaluate(env), a[1].evaluate(env))
        if op == "where":
            return a[1].evaluate(env) if a[0].evaluate(env) else a[2].evaluate(env)
        if op == "span":
            raise TypeError("et.every(...) is a set of coordinates: expand it with expand_coords()")
        x, y = a[0].evaluate(env), a[1].evaluate(env)
        if op in ("floordiv", "mod") and (x < 0 or y <= 0):
            # Python floors, GPU integer division truncates: the same map would differ on the GPU.
            raise ValueError(f"{self.to_python()} at {x} {_BINARY[op][0]} {y}: index maps may divide "
                             "only non-negative values by positive ones (wrap with et.maximum(0, ...))")
        return _BINARY[op][1](x, y)


Size = Union[int, Expr]


def const(v: int) -> Expr:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"index expressions are integers, got {v!r} ({type(v).__name__})")
    return Expr("const", (v,))


def as_expr(v: Size) -> Expr:
    return v if isinstance(v, Expr) else const(v)


def sym(name: str) -> Expr:
    """A named size, bound at call time (from an input's shape or a keyword)."""
    if not name.isidentifier():
        raise ValueError(f"symbol name {name!r} must be a Python identifier")
    return Expr("sym", (name,))


def var(name: str) -> Expr:
    return Expr("var", (name,))


def load(tensor: str, index: tuple) -> Expr:
    return Expr("load", (tensor, tuple(as_expr(i) for i in index)))


def _bin(op: str, a: Size, b: Size) -> Expr:
    a, b = as_expr(a), as_expr(b)
    if a.op == "const" and b.op == "const" and op not in ("and", "or"):
        return const(int(_BINARY[op][1](a.args[0], b.args[0])))
    if op == "mul" and (a.op == "const" and a.args[0] == 1 or b.op == "const" and b.args[0] == 1):
        return b if a.op == "const" and a.args[0] == 1 else a   # x * 1 (a graph's factor of one)
    zero = lambda e: e.op == "const" and e.args[0] == 0   # noqa: E731
    if (op in ("add", "sub") and zero(b)) or (op == "add" and zero(a)):
        return b if op == "add" and zero(a) else a        # x + 0 (an offset of none)
    return Expr(op, (a, b))


def cdiv(a: Size, b: Size) -> Size:
    """Ceiling division: the number of tiles of size b covering a."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return (as_expr(a) + as_expr(b) - 1) // as_expr(b)


def row_chunks(rows: Size, parts: Size) -> tuple[Size, Callable[[Size], Size]]:
    """Rows split over `parts` ranks in chunks of C = cdiv(rows, parts), ragged at the end:
    returns (C, owned) with owned(r) = the rows rank r holds (0 for ranks past the end)."""
    C = cdiv(rows, parts)
    return C, lambda r: maximum(0, minimum(C, rows - r * C))


def grouped(q: Size, rows: Size, cols: Size, group: int) -> tuple[Size, Size]:
    """Tile q of a rows x cols grid, walked in column-major groups of `group` rows: consecutive
    tiles share a column of weights across `group` row tiles, so one wave of programs reads each
    weight tile once per group instead of once per row tile (L2 reuse; Triton's matmul tutorial).
    Returns (row tile, column tile); a bijection of [0, rows * cols); the last group may be short."""
    per_group = group * cols
    first = (q // per_group) * group
    size = minimum(rows - first, group)
    return first + (q % per_group) % size, (q % per_group) // size


def ungrouped(i: Size, j: Size, rows: Size, cols: Size, group: int) -> Size:
    """The q that grouped(q, rows, cols, group) maps to tile (i, j): its inverse."""
    first = (i // group) * group
    return first * cols + j * minimum(rows - first, group) + i - first


def minimum(a: Size, b: Size) -> Size:
    """min(a, b) of sizes or index expressions (Python's min cannot see inside a symbolic one)."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return Expr("min", (as_expr(a), as_expr(b)))


def maximum(a: Size, b: Size) -> Size:
    """max(a, b) of sizes or index expressions (Python's max cannot see inside a symbolic one)."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return Expr("max", (as_expr(a), as_expr(b)))


def every(start: Size, stop: Size) -> Expr:
    """In a notify map: every coordinate in [start, stop) (one notify per element), e.g. a tile
    that feeds all ranks notifies `arrived[et.every(0, g.world), j]`."""
    return Expr("span", (as_expr(start), as_expr(stop)))


def where(cond: Expr, a: Size, b: Size) -> Expr:
    """`a` where `cond` is nonzero, else `b`: the `if` of a traced map (Python's if cannot branch on it)."""
    return Expr("where", (as_expr(cond), as_expr(a), as_expr(b)))


def eq(a: Size, b: Size) -> Expr:
    """1 where a == b, else 0 (`==` on two expressions compares their structure, not their values)."""
    return _bin("eq", a, b)


def logical_and(a: Size, b: Size) -> Expr:
    """1 where both a and b are nonzero, else 0 (Python's `and` cannot see inside an expression)."""
    return _bin("and", a, b)


def logical_or(a: Size, b: Size) -> Expr:
    """1 where a or b is nonzero, else 0 (Python's `or` cannot see inside an expression)."""
    return _bin("or", a, b)


def evaluate(v: Size, env: Mapping[str, Any]) -> int:
    return v if isinstance(v, int) else v.evaluate(env)


def compile_fn(exprs: tuple[Expr, ...], args: tuple[str, ...]) -> Callable[..., tuple]:
    """Compile expressions into one Python function of `args` (index vars) and `env`.

    Sizes and loaded tensors come from `env`; the generated source is the same text that
    `to_python` prints, so what a debug dump shows is what runs.
    """
    names = sorted(set().union(*(e.symbols() | e.loads() for e in exprs))) if exprs else []
    unpack = "".join(f"    {n} = env[{n!r}]\n" for n in names)
    body = ", ".join(e.to_python() for e in exprs)
    src = f"def _f({', '.join(args + ('env',))}):\n{unpack}    return ({body}{',' if exprs else ''})\n"
    scope: dict = {}
    exec(compile(src, "<etdist index map>", "exec"), scope)  # noqa: S102 - source built from Expr trees only
    fn = scope["_f"]
    fn.source = src
    return fn


def is_span(e: Expr) -> bool:
    return e.op == "span"


def expand_coords(values: tuple) -> list[tuple]:
    """Coordinates from evaluated values where a span contributed a (start, stop) pair."""
    import itertools
    axes = [range(v[0], v[1]) if isinstance(v, tuple) else (v,) for v in values]
    return list(itertools.product(*axes))
