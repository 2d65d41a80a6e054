"""What the fused ops share of their plumbing: the config check, the kernel cache, the repeat of the
last call, the refusal published to the peers and the operand checks. Their plan configuration is
in config.py, the pieces of the plan models more than one op uses in plan_model.py."""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..fusion import compile as et_compile
from ..fusion.cuda_agreement import post_refusal
from ..fusion.errors import InputError
from ..mesh import MeshError, current_mesh
from .config import DEFAULT_PLAN, PlanConfig, TileConfig


def plan_config(op: str, config, compiling: bool = False) -> PlanConfig:
    """The config an op call plans with: DEFAULT_PLAN for None; anything but a PlanConfig is refused,
    and so is any but the default while torch.compile traces the op (its graph node, ops/compiled.py,
    carries no config)."""
    if config is None:
        return DEFAULT_PLAN
    if not isinstance(config, PlanConfig):
        raise InputError(f"et.ops.{op}: config must be an et.ops.PlanConfig (or None), got {type(config).__name__}")
    if compiling and config != DEFAULT_PLAN:
        # refused outside the trace (a raise that Dynamo traced would break the graph and run the
        # op eagerly with the config instead); the wrapper made here, as importing Dynamo at import
        # time costs seconds. With fullgraph=True, Dynamo's error shows this line.
        refuse = torch.compiler.disable(_only_default_plan_under_torch_compile, reason=_ONLY_DEFAULT)
        refuse(op, config)
    return config


_ONLY_DEFAULT = "et.ops run the default PlanConfig only under torch.compile"


def _only_default_plan_under_torch_compile(op: str, config: PlanConfig):
    raise InputError(f"et.ops.{op} under torch.compile runs the default plan only; got config with "
                     f"{config.changes()}: call it outside the compiled region to plan with another")


def kernel_key(config: PlanConfig, cfg: TileConfig, schedule: str, build) -> tuple:
    """What the ops' kernel caches key on: the plan's config, the graph and every argument it is
    built with, and the tile's warps, stages and programs per SM."""
    return config, cfg, schedule, build.func, build.args, tuple(sorted(build.keywords.items()))


def cached_kernel(cache: dict, config: PlanConfig, cfg: TileConfig, schedule: str, build):
    """The op's megakernel for its plan (kernel_key): compiled from build() (a graph) on first use,
    with cfg's warps and stages; one binary per size class, reused for every M."""
    # the plan's own builder (kernel_plan is cached, so a call at a known M brings the same object)
    # remembers its kernel per cache: no key to build and hash on the eager decode path
    memo = build.__dict__.setdefault("kernels", {})
    hit = memo.get(schedule)
    if hit is not None and hit[0] is cache:
        return hit[1]
    key = kernel_key(config, cfg, schedule, build)
    kernel = cache.get(key)
    if kernel is None:
        kernel = cache[key] = et_compile(build(), schedule=schedule, target="cuda",
                                         local_first=bool(config.local_first))
        kernel.num_warps, kernel.num_stages = cfg.num_warps, cfg.num_stages
    memo[schedule] = (cache, kernel)
    return kernel


class RepeatedCall:
    """An op's last GPU launch per (schedule, config and the op's own options): a decode step calls
    an op again and again with operands of the same shapes, and such a repeat needs neither the op's
    checks nor its plan again. `launch` hands the operands to that kernel's repeat launch
    (CudaKernel._launch_hot) if the mesh and M are the last call's, and the kernel takes them only
    if they match its last call on the mesh (shapes, dtypes, sizes, device, contiguity): then the
    op's checks passed on those shapes before, and its plan, a function of them, the config and the
    mesh, names the same kernel. Anything else (another shape or mesh, out=, an error pending)
    returns None: the op's own path runs. An eager decode call's time is its host time: records
    host_path."""

    __slots__ = ("last",)

    def __init__(self):
        self.last: dict = {}   # key -> (weak reference to the mesh, M, kernel, sizes)

    def launch(self, key, mesh, M, inputs: dict) -> Optional[torch.Tensor]:
        try:
            hit = self.last.get(key)
        except TypeError:   # an unhashable config or schedule: the op's checks name it
            return None
        if hit is None:
            return None
        if mesh is None:
            try:
                mesh = current_mesh()
            except MeshError:
                return None   # the op's path raises it
        if hit[0]() is not mesh or hit[1] != M:
            return None
        outs = hit[2]._launch_hot(mesh, hit[3], inputs)
        return None if outs is None else outs["y"]

    def remember(self, key, mesh, M, kernel, sizes) -> None:
        self.last[key] = (weakref.ref(mesh), M, kernel, sizes)   # a closed mesh is not kept alive


class refusal_reaches_peers:
    """Around an op's own argument checks: a refusal on this rank alone is published as this rank's
    call (fusion.cuda_agreement.post_refusal, mesh/calls.py), so the peers' launch of it runs nothing and
    every rank raises, naming it. A class, not a contextlib generator: it wraps every call of the ops
    (a generator cost ~1 us more per call)."""

    __slots__ = ("mesh", "kernels")

    def __init__(self, mesh, kernels: dict):
        self.mesh, self.kernels = mesh, kernels

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, InputError):
            try:
                m = self.mesh or current_mesh()
            except MeshError:
                m = None
            if m is not None:
                post_refusal(m, list(self.kernels.values()), str(exc))
        return False   # the error goes on


def check_operands(op: str, graph: str, x, w, mesh):
    """x [rows, K] and w [K, N]: 2-D, contiguous, on this rank's device (its GPU; the CPU on a cpu
    mesh, where the CPU runtime runs `graph`: ops/cpu_path.py), one dtype among bf16/fp16/fp32; a
    clear error before anything launches. Returns the mesh (the current one if None)."""
    mesh = mesh or current_mesh()
    if getattr(mesh, "backend", None) is None:
        raise InputError(f"et.ops.{op}: mesh must be the Mesh from et.init_mesh() (or None for the current "
                         f"one), got {type(mesh).__name__}")
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise InputError(f"{op}: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != mesh.device:
            raise InputError(f"{op}: {name} is on {t.device}, this rank's device is {mesh.device}")
        if not t.is_contiguous():
            raise InputError(f"{op}: {name} is not contiguous (row-major): pass {name}.contiguous()")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"{op}: x and w must share a dtype among bf16/fp16/fp32, got {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[0]:
        raise InputError(f"{op}: x is [rows, {x.shape[1]}] but w is [{w.shape[0]}, N]: the contraction dims differ")
    if x.shape[1] == 0 or w.shape[1] == 0:   # before any plan code (tile counts, splits divide by them)
        raise InputError(f"{op}: x is {list(x.shape)} and w {list(w.shape)}: a zero-sized "
                         f"{'contraction (K = 0)' if x.shape[1] == 0 else 'output width (N = 0)'} is not supported; "
                         f"skip the call (its result is {'all zeros' if x.shape[1] == 0 else 'empty'})")
    return mesh


def no_rows(op: str, x: torch.Tensor, cols: int, out) -> torch.Tensor:
    """The result at M = 0 (every rank's batch empty: every rank must be told so alike, as the op
    returns without a word to the peers): nothing to launch, so the empty [0, cols] (`out` itself,
    checked, if given)."""
    if x.shape[0]:
        raise InputError(f"{op}: total_rows is 0 but x has {x.shape[0]} rows")
    if out is None:
        return x.new_empty((0, cols))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (0, cols) or out.dtype != x.dtype \
            or out.device != x.device:
        raise InputError(f"{op}: out must be an empty {x.dtype} tensor [0, {cols}] on {x.device} (no rows), got "
                         f"{getattr(out, 'shape', type(out).__name__)}")
    return out


def total_rows_of(op: str, total_rows, x: torch.Tensor, world: int) -> int:
    """M for an op whose x holds this rank's rows: total_rows, or rows x world when not given."""
    if total_rows is None:
        return x.shape[0] * world
    if isinstance(total_rows, bool) or not isinstance(total_rows, int) or total_rows < 0:
        raise InputError(f"{op}: total_rows must be a non-negative int (M, the rows of every rank together), "
                         f"got {total_rows!r}")
    return total_rows
