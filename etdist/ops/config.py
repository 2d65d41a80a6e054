"""The fused ops' plan configuration: PlanConfig (`config=`), its TileConfigs, DEFAULT_PLAN and its override text."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from .. import knobs


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
    # just past the skinny classes, up to skinny_tail's block_m + skinny_tail_m rows: the skinny graph
    # with each task's rows in skinny_tail's accumulator and the tail rows, transposed, in a second
    # one, over one load of each weight tile; its slices summed locally (0: none; a power of two
    # >= 16); an option until a two-GPU A/B decides it
    skinny_tail: TileConfig = TileConfig(128, 128, 64, 8, 4)
    skinny_tail_m: int = 0
    # 1: the skinny classes' partials cross the links in x's dtype (bf16/fp16: half of fp32's
    # bytes), summed in fp32 by the owner; an option until a two-GPU A/B decides it
    skinny_x_partials: int = 0
    # 1: the tail classes' tasks (whole_tail_m, skinny_tail_m, mlp_tail_m) load their first 128 rows
    # through a descriptor, the tail through pointers (gemm_tiles.rows_and_tail_acc): alone on one H200 at
    # M 129/160 12% faster in one slice, the same in several (records mid_tile); an option until a
    # two-GPU A/B decides it
    tail_row_tma: int = 0
    # 1: the ops' kernels run their leading local tasks (the skinny slices' matmuls with
    # local_sums) while the ranks' call agreement is under way (et.compile's local_first); an option
    # until a two-GPU A/B decides it
    local_first: int = 0
    # tensor_parallel_mlp just past whole_max_m: up to whole_128's block_m + mlp_tail_m rows, the
    # whole-gather graph with every row in each gate/up and down task (a tail accumulator), each
    # down slice waiting only for its part of h (0: none; a power of two, 16 to 64). Its tiles alone on
    # one H200 (records mid_tile) read the weights once at 1.2-1.4x mm where the per-source tiles
    # take ~2x; an option until a two-GPU A/B decides it (a form without tail_row_tma and with one
    # wait for all of h was 5% slower than the per-source plan at 28cbec2: records mlp_ab)
    mlp_tail_m: int = 0
    local_sums_min_m: int = 65      # from this many rows the skinny slices are summed on their GPU (0: never): gemm_rs_ab.jsonl
    # all_gather_gemm and the MLP: up to whole_max_m rows the whole-gather graph (tiles spanning
    # every row, the weights read once), a tile class per bound; above, per-source tiles (but for
    # all_gather_gemm's tail and whole_large_m below; 0: no whole-gather graph at all)
    whole_max_m: int = 128          # ag_gemm_ab.jsonl / mlp_ab.jsonl, variant WHOLE_MAX_M=256
    # all_gather_gemm just past it: up to the class's block_m + whole_tail_m rows, one task per column
    # tile holds every row, a second accumulator for the tail over one load of each weight tile (0:
    # none; a power of two >= 16). Two GPUs at 28cbec2, M 129/144/160 x 8 shapes (records ag_gemm_ab,
    # mlp_ab): ag_gemm 5% faster in geomean (7 of 8 shapes; llama31_405b 10% slower at 144-160);
    # the MLP's form 5% slower (its four accumulators): gone.
    whole_tail_m: int = 32
    # all_gather_gemm from 257 rows up to whole_large_m: the whole-gather graph with `large` tiles
    # where they fill their waves (ops.ag_gemm.whole_large; 0: never)
    whole_large_m: int = 640
    # the plans measured on two GPUs only (whole_tail_m, whole_large_m, replicated_owners_min_m; and
    # the option mlp_tail_m) apply at worlds 2 .. plan_worlds (4: try them at four ranks, as a
    # four-GPU A/B's variant)
    plan_worlds: int = 2
    # the whole classes' tiles past their last full wave of SMs in up to this many contraction slices
    # each, summed per tile (ops.ag_gemm.ragged_wave; 0: none); an option until a two-GPU A/B decides it
    whole_ragged_splits: int = 0
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
    # the replicated MLP's whole-gather classes (M <= whole_max_m) from this many rows (0: never):
    # each output tile's partials go to one owner rank, who sends the sum to every rank
    # (workloads.mlp.tp_mlp_replicated(owners=True)), instead of every rank's partials to every
    # rank. Two GPUs at 28cbec2 (records mlp_replicated_ab): M=128 16-22% faster on the 8-9B shapes,
    # M=64 within 1-3%, M=256 mixed (-5..+4%), M=1024 2-6% slower: the whole classes above 32 rows.
    # Its y_all (M x H more symmetric memory) is outside ops.mlp.replicated_rows' budget: M <= whole_max_m.
    replicated_owners_min_m: int = 33

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if _TYPES[f.name] is TileConfig:
                if not isinstance(v, TileConfig):
                    raise ValueError(f"PlanConfig.{f.name} must be a TileConfig, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < _LEAST[f.name]:
                raise ValueError(f"PlanConfig.{f.name} must be an int >= {_LEAST[f.name]}, got {v!r}")
        for name in ("skinny_x_partials", "tail_row_tma", "local_first"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"PlanConfig.{name} must be 0 or 1, got {getattr(self, name)}")
        for name in ("whole_tail_m", "skinny_tail_m", "mlp_tail_m"):
            v = getattr(self, name)
            if v and (v < 16 or v > 64 or v & (v - 1)):   # 128 more rows spill the tail tiles' accumulators
                raise ValueError(f"PlanConfig.{name} must be 0 or a power of two from 16 to 64, got {v}")
        if self.mlp_down_n < 16 or self.mlp_down_n & (self.mlp_down_n - 1):
            raise ValueError(f"PlanConfig.mlp_down_n must be a power of two >= 16, got {self.mlp_down_n}")
        # the plan caches hash it on every call of an op: once here, not per call
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    def measured_world(self, world: int) -> bool:
        """Whether the plans measured on two GPUs only (whole_tail_m, whole_large_m,
        replicated_owners_min_m; the option mlp_tail_m) apply at `world` ranks: 2 .. plan_worlds."""
        return 2 <= world <= self.plan_worlds

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
_LEAST = {"max_splits": 1, "whole_max_m": 0, "mlp_down_n": 16, "mlp_tail_splits": 1, "local_sums_min_m": 0,
          "replicated_owners_min_m": 0,
          "whole_tail_m": 0, "whole_large_m": 0, "skinny_tail_m": 0, "skinny_x_partials": 0, "tail_row_tma": 0,
          "mlp_tail_m": 0, "plan_worlds": 2, "whole_ragged_splits": 0, "local_first": 0}


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


def fp32_config(cfg: TileConfig) -> TileConfig:
    """fp32 tiles take twice the shared memory per stage: halve the contraction step, <= 3 stages."""
    return dataclasses.replace(cfg, block_k=max(16, cfg.block_k // 2), num_stages=min(3, cfg.num_stages))
