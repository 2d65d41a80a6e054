"""What the fused ops share: their plan configuration (PlanConfig, passed as `config=`), the operand
checks, the kernel cache, and the pieces of the plan models more than one op uses."""
from __future__ import annotations

import dataclasses
import functools
import typing
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from .. import knobs
from ..fusion import compile as et_compile
from ..fusion.cuda_runtime import post_refusal
from ..fusion.errors import InputError
from ..mesh import MeshError, current_mesh


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False   # the tile multiplies transposed, the weights on the MMA's M side (gemm_tiles)

    @classmethod
    def parse(cls, text: str) -> "TileConfig":
        """"block_m,block_n,block_k,warps,stages[,swap]" (knobs.tile's rules for the numbers)."""
        parts = text.replace(" ", "").split(",")
        swap = bool(parts) and parts[-1] == "swap"
        try:
            values = knobs.tile(",".join(parts[:-1] if swap else parts))
        except ValueError as e:
            raise ValueError(f"tile config {text!r}: {str(e).replace('stages', 'stages[,swap]', 1)}") from None
        return cls(*values, swap_ab=swap)

    def text(self) -> str:
        """The form parse reads: parse(cfg.text()) == cfg."""
        return ",".join(map(str, (self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages))) + \
            (",swap" if self.swap_ab else "")


@dataclass(frozen=True)
class PlanConfig:
    """Every choice the plans of gemm_reduce_scatter, all_gather_gemm and tensor_parallel_mlp take
    from outside their models: the size classes' tiles and a few bounds. Frozen and hashable: the
    ops' plan caches and kernel caches key on it. DEFAULT_PLAN is what the ops run unless given
    `config=`; DEFAULT_PLAN.override("whole_max_m=256+max_splits=2") or dataclasses.replace make
    another (launch/regress.py A/Bs them on the GPUs)."""

    # gemm_reduce_scatter: up to 128 rows a skinny split-K class (each M the smallest that holds
    # it), above the large graph's tiles whole or in up to max_splits contraction slices
    skinny_32: TileConfig = TileConfig(32, 128, 128, 4, 5, swap_ab=True)    # M <= 32: gemm_rs_skinny_ab.jsonl
    skinny_64: TileConfig = TileConfig(64, 128, 128, 4, 4)                  # M <= 64: the same
    skinny_128: TileConfig = TileConfig(128, 128, 128, 8, 3, swap_ab=True)  # M <= 128: the same
    large: TileConfig = TileConfig(128, 256, 64, 8, 4)   # above, all_gather_gemm's too: gemm_rs_narrow_ab.jsonl
    max_splits: int = 4                                  # slices of a large tile: gemm_rs_split_ab.jsonl
    local_sums_min_m: int = 65      # from this many rows the skinny slices are summed on their GPU (0: never): gemm_rs_ab.jsonl
    # all_gather_gemm and the MLP: up to whole_max_m rows the whole-gather graph (tiles spanning
    # every row, the weights read once), a tile class per bound; above, per-source tiles
    whole_max_m: int = 128          # ag_gemm_ab.jsonl / mlp_ab.jsonl, variant WHOLE_MAX_M=256 at 7f55834
    whole_32: TileConfig = TileConfig(32, 128, 64, 4, 6, swap_ab=True)     # M <= 32, both ops: whole_swap_ab.jsonl
    whole_ag: TileConfig = TileConfig(64, 128, 128, 4, 4)   # all_gather_gemm's M <= 64: gemm_rs_skinny_ab.jsonl
    whole_mlp: TileConfig = TileConfig(64, 128, 64, 4, 4)   # the MLP's M <= 64 (two weight tiles): the same
    whole_128: TileConfig = TileConfig(128, 128, 64, 8, 4)  # M <= 128, both ops: whole_tiles_ab2.jsonl
    whole_256: TileConfig = TileConfig(256, 128, 64, 8, 3, swap_ab=True)   # M <= 256 if whole_max_m: whole256_ab.jsonl
    whole_256_mlp: TileConfig = TileConfig(256, 64, 64, 8, 3, swap_ab=True)   # the same, the MLP's
    large_narrow: TileConfig = TileConfig(128, 128, 64, 8, 4)   # ragged last waves: ag_gemm_large_ab.jsonl
    # tensor_parallel_mlp above whole_max_m rows
    mlp_tiles: TileConfig = TileConfig(128, 128, 64, 8, 3)   # gate/up tiles (two accumulators: 128 x 256 spills)
    mlp_down_n: int = 256                                    # the down tiles' width: mlp_down_ab.jsonl
    mlp_tail_splits: int = 3        # slices of the last down tiles of a ragged wave (1: whole): mlp_w1_ab.jsonl

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if _TYPES[f.name] is TileConfig:
                if not isinstance(v, TileConfig):
                    raise ValueError(f"PlanConfig.{f.name} must be a TileConfig, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < _LEAST[f.name]:
                raise ValueError(f"PlanConfig.{f.name} must be an int >= {_LEAST[f.name]}, got {v!r}")
        if self.mlp_down_n < 16 or self.mlp_down_n & (self.mlp_down_n - 1):
            raise ValueError(f"PlanConfig.mlp_down_n must be a power of two >= 16, got {self.mlp_down_n}")
        # the plan caches hash it on every call of an op: once here, not per call
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    def override(self, text: str) -> "PlanConfig":
        """This config with the fields `text` names changed: "field=value+field=value" ("" or
        "base": none), each value as its field's type reads it (a tile: TileConfig.parse's
        "block_m,block_n,block_k,warps,stages[,swap]")."""
        changes = {name: _parse(name, value) for name, value in override_fields("PlanConfig", list(_TYPES), text)}
        return dataclasses.replace(self, **changes) if changes else self

    def changes(self) -> str:
        """The fields that differ from DEFAULT_PLAN, as override reads them ("base" if none):
        DEFAULT_PLAN.override(c.changes()) == c."""
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                parts.append(f"{f.name}={v.text() if isinstance(v, TileConfig) else v}")
        return "+".join(parts) or "base"


def override_fields(config: str, fields: list, text: str) -> list:
    """[(field, value text)] of an override "field=value+field=value" ("" or "base": none), each
    field one of `fields` and named once (the parsing of PlanConfig's and nn.MoEConfig's)."""
    pairs: dict = {}
    for part in text.replace(" ", "").split("+"):
        if part in ("", "base"):
            continue
        name, eq, value = part.partition("=")
        if name not in fields:
            raise ValueError(f"{config} has no field {name!r} (in {text!r}); fields: {', '.join(fields)}")
        if not eq:
            raise ValueError(f"{config} override {part!r}: want field=value")
        if name in pairs:
            raise ValueError(f"{config} override {text!r} sets {name} twice")
        pairs[name] = value
    return list(pairs.items())


_TYPES = typing.get_type_hints(PlanConfig)   # field -> TileConfig or int
_LEAST = {"max_splits": 1, "whole_max_m": 0, "mlp_down_n": 16, "mlp_tail_splits": 1, "local_sums_min_m": 0}


def _parse(name: str, text: str):
    kind = _TYPES[name]
    if kind is TileConfig:
        try:
            return TileConfig.parse(text)
        except ValueError as e:
            raise ValueError(f"PlanConfig.{name}: {e}") from None
    if not text.isdigit():   # the other fields are ints
        raise ValueError(f"PlanConfig.{name}={text!r}: want an int >= {_LEAST[name]}")
    return int(text)


DEFAULT_PLAN = PlanConfig()


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


def fp32_config(cfg: TileConfig) -> TileConfig:
    """fp32 tiles take twice the shared memory per stage: halve the contraction step, <= 3 stages."""
    return dataclasses.replace(cfg, block_k=max(16, cfg.block_k // 2), num_stages=min(3, cfg.num_stages))


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Asked once per GPU, not on every call (the op's host time is on the decode path)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def row_pointers(rows: int, block_m: int, at_half: bool = False) -> bool:
    """Whether tiles of block_m rows over `rows` rows (a source's or an owner's) load them through
    pointers (gemm_tiles.use_tma), where a descriptor's box would run far past the rows (its zero
    fill is slow): where the last tile is ragged and is either the only one or less than half full
    (one row tile of 100 rows in 128; 129 rows in two tiles of 128, 1 row in the second); at_half,
    also where it is exactly half full (all_gather_gemm's). Records row_pointers_ab.jsonl and
    ag_gemm_ab.jsonl (variant ROW_POINTERS=1 at 71a23a0)."""
    last = rows % block_m
    return last > 0 and (rows < block_m or 2 * last < block_m or (at_half and 2 * last == block_m))


def interleave_sources(rows: int, block_m: int, world: int) -> bool:
    """Whether the per-source (per-owner) graphs put the sources' tiles side by side
    (workloads.gather.source_order), so that they read each weight tile once: where each source's
    `rows` are one row tile, at two or more ranks. Records rs_interleave_proxy_ab.jsonl."""
    return world > 1 and rows <= block_m


# The plan models' rate: LARGE-sized tiles at ~6 TF/s on one SM (the MLP's down tiles, traced:
# records mlp_trace.jsonl).
SM_TFLOPS = 6.0
SPLIT_COST = 0.03   # per extra contraction slice: its partial's stores and sum, a pipeline fill
SCRATCH_BYTES = 1 << 30   # the most symmetric memory a plan's partials may take (x world x slices)


def tile_us(block_m: int, block_n: int, K: int) -> float:
    """us of one block_m x block_n output tile over a contraction of K on one SM at SM_TFLOPS."""
    return 2 * block_m * block_n * K / (SM_TFLOPS * 1e6)


def wave_splits(tiles: int, sms: int, most: int) -> int:
    """Contraction slices (at most `most`) of `tiles` equal tiles run together on `sms` SMs: the
    fewest that make their waves shortest, counting SPLIT_COST per extra slice (72 tiles on 132
    SMs: 3 slices make 216 tasks, two waves of thirds, 0.67 of a whole tile's time)."""
    costs = [-(-tiles * s // sms) / s * (1 + SPLIT_COST * (s - 1)) for s in range(1, most + 1)]
    return 1 + costs.index(min(costs))


def slices_that_fit(M: int, N: int, world: int, itemsize: int, splits: int) -> int:
    """`splits`, or fewer where the partials [world x splits, rows per owner, N] would outgrow
    SCRATCH_BYTES (NVSHMEM's heap is 4 GiB by default) or the bodies' int32 offsets into them."""
    one = world * -(-M // world) * N                     # elements of one slice's partials
    return max(1, min(splits, SCRATCH_BYTES // (one * itemsize), (2 ** 31 - 1) // one))


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
        kernel = cache[key] = et_compile(build(), schedule=schedule, target="cuda")
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
    call (fusion.cuda_runtime.post_refusal, mesh/calls.py), so the peers' launch of it runs nothing and
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
