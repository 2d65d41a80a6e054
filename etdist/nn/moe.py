"""`MoE`: top-k routed SwiGLU experts, expert-parallel over the ranks, one megakernel per call.

    moe = et.nn.MoE(hidden=2048, expert_intermediate=768, num_experts=128, top_k=8)   # under torchrun
    y = moe(x)            # x [tokens, hidden]: this rank's tokens; y the same shape

Each rank holds the router (replicated) and num_experts / world experts (`load_experts` takes
dense weights; `w_gate_up` holds gate and up in interleaved blocks of 128 columns where the
intermediate size allows, `pack_gate_up`). In the kernel, routing
(softmax top-k) decides which expert tiles exist; tokens travel to the rank owning their expert
and back by peer stores + signals (etdist/workloads/moe.py). Every rank passes the same number
of tokens per call. `schedule="dynamic"` (default) runs ready tasks from an on-GPU queue, which
balances skewed routing; "static" plans for the worst case.

Without GPUs, `simulate_world=R` holds all R expert shards here and runs them on the CPU runtime:
the tokens are split over the simulated ranks (padded to a multiple of R). Forward only.
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn

from .. import fusion, knobs
from ..collectives.custom_op import call_op, define_op
from ..fusion.errors import InputError
from ..ops.common import refusal_reaches_peers
from ..ops.config import override_fields
from ..workloads import moe as moe_graph
from ..ops import cpu_path
from .checks import cpu_runtime, float_dtype, hidden_states, layer_mesh, positive_ints

_KERNELS: dict = {}


class GpuTiles(NamedTuple):
    """The GPU kernel's blocks: slots per expert row tile, the contraction / token block, the columns
    of an expert GEMM tile, warps and pipeline stages; then what nn.MoE adds per layer (MoE._plan):
    the columns of a down tile (None: block_n) and whether half-full last row tiles run half-height."""
    block_m: int = 64
    block: int = 64
    block_n: int = 128
    num_warps: int = 8      # two 64x128 fp32 accumulators in the gate/up tile
    num_stages: int = 5     # 205 KB of shared memory; 6-19% faster than 3 (records moe_tiles_ab)
    down_n: Optional[int] = None
    half_tails: bool = False
    small_rows: int = 0     # row tiles with at most this many rows run a body that size (moe_layer's small_rows)
    fused_router: bool = False            # the router's chain in one task kind (moe_layer's fuse_router)
    router_width: Optional[int] = None    # hidden columns per router slice (moe_layer's router_width)


# float32's tiles are twice the bytes: the small class at 3 stages takes 164 KB of shared memory a
# program, at 4 246 KB (sm_90 has 227 KB); the default stages drop to this for 4-byte dtypes
FLOAT32_STAGES = 3


# The large class's tiles (128 rows, 4 stages) win from MoEConfig.large_rows rows an expert (records moe_tiles_ab)
LARGE_TILES = GpuTiles(128, 64, 128, 8, 4)
# The large class's router blocks: tokens per routing task and slots per plan step (moe_layer's
# route_block / plan_block; the small class keeps 16 / 1024, what decode wants): at thousands of
# tokens the small blocks' routing and plan steps held the expert tiles back (records moe_onerank_ab).
LARGE_ROUTE_BLOCK, LARGE_PLAN_BLOCK = 64, 4096
# Where top_k >= FINE_FROM_TOP_K, the routing and the combine run in small blocks: both do top_k
# steps per token (arg-max steps, expert rows summed), and in blocks of the size class the few
# tasks there are ran long on few SMs. The small class sums 16 tokens x 128 columns a combine task,
# at most 256 tasks; the large class routes 16 tokens a task (its logits keep 64) and sums 32 x
# 512, at most 128 tasks. Up to 6% faster at top-8, nothing gained at top-2 (records moe_route_ab).
FINE_FROM_TOP_K = 4
SMALL_FINE = dict(combine_block=16, combine_width=128, combine_tasks=256)
LARGE_FINE = dict(topk_block=16, combine_block=32, combine_width=512, combine_tasks=128)


def graph_blocks(top_k: int, large: bool = False) -> dict:
    """moe_layer's router, plan and combine blocks for nn.MoE's size class (the defaults where
    empty): the large class's router blocks, and small routing / combine blocks at top_k >=
    FINE_FROM_TOP_K."""
    blocks = dict(route_block=LARGE_ROUTE_BLOCK, plan_block=LARGE_PLAN_BLOCK) if large else {}
    if top_k >= FINE_FROM_TOP_K:
        blocks.update(LARGE_FINE if large else SMALL_FINE)
    return blocks


# Down tiles DOWN_WIDE columns wide where the down GEMM's contraction (I) is at most SHORT_DOWN_K: a short
# tile's fixed costs (gathered rows, pipeline fill, store) are paid once per 256 columns (records moe_tiles_ab).
DOWN_WIDE, SHORT_DOWN_K = 256, 2048
# An expert's last row tile, at most half full, runs half-height (moe_layer's half_tails) in tiles of HALF_TAILS_FROM
# rows or more (a wgmma is 64 rows a warpgroup: a smaller half saves nothing) where a rank holds
# HALF_TAILS_MIN_EXPERTS experts or more, whose last tiles are many (records moe_tiles_ab, moe_static_ab).
HALF_TAILS_FROM, HALF_TAILS_MIN_EXPERTS = 128, 32
# A row tile of the small class with at most SMALL_ROWS rows runs a body of that many rows, computed
# transposed (moe_layer's small_rows: a wgmma is 64 rows, so one token's tile did 64x its MMA work),
# up to MoEConfig.small_rows_worlds (records moe_decode_ab: 32 rows gained less).
SMALL_ROWS = 16

# The small class fuses the router's chain (moe_layer's fuse_router: no event hop between logits,
# routing and tile table) in router slices of ROUTER_SLICE_BYTES (qwen3: 16 of 128 columns, twice
# the SMs of 4 * block), up to MoEConfig.fused_router_worlds (records moe_fuse_ab, moe_trace).
ROUTER_SLICE_BYTES = 32768


# w_gate_up holds gate and up in interleaved column blocks of GATE_UP_BLOCK (moe_layer's
# gate_up_interleave), where the intermediate size is a multiple of it and the dtype 2 bytes: a GPU
# gate/up tile (block_n = GATE_UP_BLOCK, weights through TMA: H and I multiples of 16) then reads
# both halves in one box and runs one dot 256 wide, not two 128 wide (5-13% faster standalone).
GATE_UP_BLOCK = 128


# Early push under the dynamic schedule (et.compile's early_push):
# 2, down tiles seeded behind the gate/up tiles (no act_ready walk, no queue hop before a down
# tile): 2-9% faster on one H200 in both size classes (records moe_chain_ab).
EARLY_PUSH = 2


@dataclass(frozen=True)
class MoEConfig:
    """What nn.MoE's kernels take from outside the layer's sizes: the two size classes' tiles, the
    rows per expert from which the large class runs, the down tiles' width. Frozen and hashable
    (part of the compile key); DEFAULT_MOE unless MoE(config=...) or
    DEFAULT_MOE.override("tiles=128,64,64,4,4+large_rows=128") says otherwise (the sweep's
    bench.moe_config, experiments/tune-moe.sh)."""

    tiles: Optional[GpuTiles] = None        # the small class (None: GpuTiles(), FLOAT32_STAGES in float32)
    tiles_large: Optional[GpuTiles] = None  # the large class (None: LARGE_TILES, the same)
    large_rows: int = GpuTiles().block_m    # the large class from this many rows per expert (uniform routing)
    down_n: Optional[int] = None            # down tile columns (None: down_width's choice)
    # the small class's tiles of at most small_rows rows in a body that size (0: none), at expert-
    # parallel worlds up to small_rows_worlds (1: measured on one GPU; 2 after a two-GPU A/B)
    small_rows: int = SMALL_ROWS
    small_rows_worlds: int = 1
    # the small class's fused router (ROUTER_SLICE_BYTES) at expert-parallel worlds up to this (1:
    # measured on one GPU; 2 after a two-GPU A/B)
    fused_router_worlds: int = 1

    def __post_init__(self):
        for name in ("tiles", "tiles_large"):
            t = getattr(self, name)
            if t is None:
                continue
            try:   # blocks powers of two >= 16, warps a power of two <= 16, stages >= 1
                if not isinstance(t, GpuTiles) or any(isinstance(v, bool) or not isinstance(v, int) for v in t[:5]):
                    raise ValueError("want GpuTiles of ints")
                knobs.tile(",".join(map(str, t[:5])), "block_m,block,block_n")
            except ValueError as e:
                raise ValueError(f"MoEConfig.{name}={t!r}: {e}") from None
        if isinstance(self.large_rows, bool) or not isinstance(self.large_rows, int) or self.large_rows < 1:
            raise ValueError(f"MoEConfig.large_rows must be an int >= 1, got {self.large_rows!r}")
        n = self.down_n
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 16 or n & (n - 1)):
            raise ValueError(f"MoEConfig.down_n must be None or a power of two >= 16, got {n!r}")
        n = self.small_rows
        if isinstance(n, bool) or not isinstance(n, int) or (n and (n < 16 or n & (n - 1))):
            raise ValueError(f"MoEConfig.small_rows must be 0 or a power of two >= 16, got {n!r}")
        for name in ("small_rows_worlds", "fused_router_worlds"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"MoEConfig.{name} must be an int >= 1, got {n!r}")

    def override(self, text: str) -> "MoEConfig":
        """This config with the fields `text` names changed: "field=value+field=value" ("" or
        "base": none); tiles "block_m,block,block_n,warps,stages", the others an int (or None)."""
        changes = {}
        for name, value in override_fields("MoEConfig", [f.name for f in dataclasses.fields(self)], text):
            try:
                if value == "None":
                    changes[name] = None
                elif name.startswith("tiles"):
                    changes[name] = GpuTiles(*knobs.tile(value, "block_m,block,block_n"))
                else:
                    changes[name] = int(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"MoEConfig: {name}={value!r}: {e}") from None
        return dataclasses.replace(self, **changes)


DEFAULT_MOE = MoEConfig()


def down_width(intermediate: int, dtype: torch.dtype = torch.bfloat16,
               config: MoEConfig = DEFAULT_MOE) -> Optional[int]:
    """Columns per down tile (None: the class's block_n): DOWN_WIDE for short down contractions in
    2-byte dtypes (in float32 a 256-wide weight tile takes 64 KB a stage: the small class would
    need 240 KB of shared memory, sm_90 has 227 KB); config.down_n overrides."""
    if config.down_n is not None:
        return config.down_n
    return DOWN_WIDE if intermediate <= SHORT_DOWN_K and dtype.itemsize <= 2 else None


def gpu_tiles(large: bool = False, dtype: torch.dtype = torch.bfloat16, config: MoEConfig = DEFAULT_MOE) -> GpuTiles:
    """The size class's tiles: config.tiles / config.tiles_large where given (taken as given), else
    the defaults, at FLOAT32_STAGES in 4-byte dtypes."""
    given = config.tiles_large if large else config.tiles
    if given is not None:
        return given
    tiles = LARGE_TILES if large else GpuTiles()
    return tiles._replace(num_stages=FLOAT32_STAGES) if dtype.itemsize > 2 else tiles


def layer_tiles(intermediate: int, local_experts: int, large: bool = False,
                dtype: torch.dtype = torch.bfloat16, config: MoEConfig = DEFAULT_MOE, world: int = 1) -> GpuTiles:
    """gpu_tiles with what a layer of that expert intermediate size and experts per rank adds (they
    ride with the tiles into the compile key): its down width, half tails (HALF_TAILS_*) and, in
    the small class up to config.small_rows_worlds ranks, small row tiles (SMALL_ROWS), and up to
    config.fused_router_worlds the fused router in slices of ROUTER_SLICE_BYTES (at most the
    graph's own 4 * block columns)."""
    t = gpu_tiles(large, dtype, config)
    half = t.block_m >= HALF_TAILS_FROM and local_experts >= HALF_TAILS_MIN_EXPERTS
    small = config.small_rows if not large and world <= config.small_rows_worlds else 0
    fused = not large and world <= config.fused_router_worlds
    experts = moe_graph.router_block(local_experts * world)
    width = min(4 * t.block, max(16, ROUTER_SLICE_BYTES // (experts * dtype.itemsize))) if fused else None
    return t._replace(down_n=down_width(intermediate, dtype, config), half_tails=half,
                      small_rows=small if small < t.block_m else 0, fused_router=fused, router_width=width)


def _check_gate_up_layout(module, state_dict, prefix, *_) -> None:
    """load_state_dict's pre-hook: the saved w_gate_up's layout must be this layer's."""
    saved, mine = state_dict.get(prefix + "gate_up_layout"), module.gate_up_block or 0
    if saved is not None and int(saved) != mine:
        what = lambda b: f"interleaved blocks of {b} columns" if b else "[gate | up]"   # noqa: E731
        raise InputError(f"MoE.load_state_dict: the saved w_gate_up holds gate and up as {what(int(saved))}, this "
                         f"layer as {what(mine)}; load dense weights with load_experts (or convert with "
                         "pack_gate_up / unpack_gate_up)")


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, expert-parallel over the mesh's ranks (num_experts / world each),
    one megakernel per call (the module docstring says how). Seeded random weights until
    `load_experts`; simulate_world=R: all R shards in this module on the CPU runtime. Forward only."""

    def __init__(self, hidden: int, expert_intermediate: int, num_experts: int, top_k: int, *, mesh=None,
                 schedule: str = "dynamic", dtype: torch.dtype = torch.bfloat16,
                 simulate_world: Optional[int] = None, device=None, config: MoEConfig = DEFAULT_MOE):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE: config must be an etdist.nn.MoEConfig, got {type(config).__name__}")
        self.config = config
        if schedule not in ("static", "dynamic"):
            raise ValueError(f"schedule must be 'static' or 'dynamic', got {schedule!r}")
        positive_ints("MoE", hidden=hidden, expert_intermediate=expert_intermediate, num_experts=num_experts,
                      top_k=top_k)
        float_dtype("MoE", dtype, simulated=simulate_world is not None)
        if simulate_world is not None:
            positive_ints("MoE", simulate_world=simulate_world)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if simulate_world is None:
            mesh = layer_mesh("MoE", mesh)
            world, shards, device = mesh.world_size, 1, device or mesh.device
        else:
            world, shards, device = int(simulate_world), int(simulate_world), device or "cpu"
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split over {world} ranks")
        self.hidden, self.intermediate, self.num_experts, self.top_k = hidden, expert_intermediate, num_experts, top_k
        self.world, self.mesh, self.schedule, self.simulated = world, mesh, schedule, simulate_world is not None
        el, H, I = num_experts // world, hidden, expert_intermediate
        self._compiled: dict = {}   # (target, large tiles) -> the shared compiled kernel (_kernel)
        self.key = f"moe{next(_LAYER_KEYS)}"   # how torch.compile's graphs name this layer (etdist::moe)
        _LAYERS[self.key] = self
        gen = torch.Generator(device=device).manual_seed(0)   # drawn where the weights live (GBs for big MoEs)

        def param(*shape, scale):
            return nn.Parameter((torch.randn(*shape, generator=gen, device=device) * scale).to(dtype),
                                requires_grad=False)
        self.router = param(H, num_experts, scale=H ** -0.5)                       # [H, E], replicated
        # [E_local, H, 2I]: gate and up, in column blocks of gate_up_block interleaved (pack_gate_up)
        self.gate_up_block = GATE_UP_BLOCK if I % GATE_UP_BLOCK == 0 and dtype.itemsize <= 2 else None
        self.w_gate_up = nn.ParameterList([param(el, H, 2 * I, scale=H ** -0.5) for _ in range(shards)])
        # the layout travels with the weights: a state_dict of another one is refused, not misread
        # (one saved before the layout was recorded lacks the key: a strict load names it)
        self.register_buffer("gate_up_layout", torch.tensor(self.gate_up_block or 0, device=device))
        self.register_load_state_dict_pre_hook(_check_gate_up_layout)
        self.w_down = nn.ParameterList([param(el, I, H, scale=I ** -0.5) for _ in range(shards)])

    def load_experts(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, router: torch.Tensor) -> "MoE":
        """Take dense weights: gate, up [E, H, I], down [E, I, H], router [H, E] (x @ router = logits);
        keeps this rank's experts (all of them when simulating)."""
        E, el = self.num_experts, self.num_experts // self.world
        want = {"gate": (E, self.hidden, self.intermediate), "up": (E, self.hidden, self.intermediate),
                "down": (E, self.intermediate, self.hidden), "router": (self.hidden, E)}
        for name, t in (("gate", gate), ("up", up), ("down", down), ("router", router)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"MoE.load_experts: {name} must be a tensor {list(want[name])}, got {type(t).__name__}")
            if tuple(t.shape) != want[name]:
                raise InputError(f"MoE.load_experts: {name} is {list(t.shape)}, expected {list(want[name])}")
            # checked before the first copy: a copy failing half-way would leave the layer half loaded
            if not t.is_floating_point() or t.device.type == "meta":
                raise InputError(f"MoE.load_experts: {name} is a {t.dtype} tensor on {t.device}; pass "
                                 "floating-point weights that hold data (not on the meta device)")
        ranks = range(self.world) if self.simulated else [self.mesh.rank]
        with torch.no_grad():
            self.router.copy_(router)
            for k, r in enumerate(ranks):
                sl = slice(r * el, (r + 1) * el)
                self.w_gate_up[k].copy_(self.pack_gate_up(torch.cat([gate[sl], up[sl]], dim=-1)))
                self.w_down[k].copy_(down[sl])
        return self

    def pack_gate_up(self, w_gate_up: torch.Tensor) -> torch.Tensor:
        """[..., H, 2I] as [gate | up] -> the layout this layer's w_gate_up holds (gate and up in
        interleaved column blocks of gate_up_block; the same tensor where that is None)."""
        return w_gate_up if self.gate_up_block is None else moe_graph.interleave_gate_up(w_gate_up, self.gate_up_block)

    def unpack_gate_up(self, w_gate_up: torch.Tensor) -> torch.Tensor:
        """pack_gate_up's inverse: this layer's w_gate_up layout -> [gate | up]."""
        return w_gate_up if self.gate_up_block is None else moe_graph.deinterleave_gate_up(w_gate_up, self.gate_up_block)

    def extra_repr(self) -> str:
        where = f"simulated ranks={self.world}" if self.simulated else f"rank {self.mesh.rank} of {self.world}"
        return (f"hidden={self.hidden}, expert_intermediate={self.intermediate}, experts={self.num_experts}, "
                f"top_k={self.top_k}, {where}, schedule={self.schedule!r}")

    def large_tiles(self, tokens: int) -> bool:
        """Whether a call with `tokens` per rank takes the large tile class: rows per expert as if
        routing were uniform (every rank passes the same number of tokens). 2-byte dtypes only: in
        float32 the large tiles need 295 KB of shared memory a program (sm_90 has 227 KB)."""
        if self.router.dtype.itemsize > 2:
            return False
        return tokens * self.world * self.top_k >= self.config.large_rows * self.num_experts

    def _plan(self, target: str, large: bool = False):
        """What the compiled layer depends on besides the module's sizes: (the GPU tiles of the size
        class, from self.config, the promised alignment of H and I, the early-push level)."""
        tiles = (layer_tiles(self.intermediate, self.num_experts // self.world, large, self.router.dtype, self.config,
                             self.world) if target == "cuda" else None)
        align = 16 if self.hidden % 16 == 0 and self.intermediate % 16 == 0 else 1
        # down tiles early-pushed behind the gate/up tiles (EARLY_PUSH)
        early = EARLY_PUSH if self.schedule == "dynamic" else None
        return tiles, align, early

    def _graph(self, target: str, tiles: Optional[GpuTiles], align: int, large: bool = False, **options):
        """The layer's graph for `target` (tiles and align from _plan; large: the size class);
        options: moe_layer arguments that replace the layer's own (A/B runs: experiments/moe_ab.py)."""
        dtype = self.router.dtype
        if target == "cpu":
            return moe_graph.moe_layer(self.top_k, block_m=4, dtype=dtype, max_experts=self.num_experts,
                                       gate_up_interleave=self.gate_up_block)
        if self.gate_up_block and self.gate_up_block % tiles.block_n:
            raise InputError(f"MoE: gate/up tiles {tiles.block_n} columns wide (MoEConfig.tiles"
                             f"{'_large' if large else ''}) do not divide the blocks of {self.gate_up_block} this "
                             "layer's w_gate_up interleaves")
        # one GPU: nothing to move or plan, routing places the slots (moe_layer's one_rank)
        args = dict(block_m=tiles.block_m, dtype=dtype, max_experts=self.num_experts, block=tiles.block,
                    block_n=tiles.block_n, down_block_n=tiles.down_n, half_tails=tiles.half_tails,
                    small_rows=tiles.small_rows, fuse_router=tiles.fused_router, router_width=tiles.router_width,
                    align=align,
                    one_rank=self.world == 1, gate_up_interleave=self.gate_up_block,
                    **graph_blocks(self.top_k, large))
        return moe_graph.moe_layer(self.top_k, **{**args, **options})

    def _kernel(self, target: str, large: bool = False):
        """The compiled layer, looked up once per module and size class: one binary per
        configuration, shared by every layer that has it."""
        kernel = self._compiled.get((target, large))
        if kernel is not None:
            return kernel
        tiles, align, early = self._plan(target, large)
        key = (target, self.top_k, self.schedule, self.router.dtype, self.num_experts, tiles, align, early,
               large and target == "cuda", self.world == 1 and target == "cuda", self.gate_up_block)
        if key not in _KERNELS:
            _KERNELS[key] = fusion.compile(self._graph(target, tiles, align, large), schedule=self.schedule, target=target,
                                           early_push=early)
            if target == "cuda":
                _KERNELS[key].num_warps, _KERNELS[key].num_stages = tiles.num_warps, tiles.num_stages
        kernel = self._compiled[target, large] = _KERNELS[key]
        return kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and not self.simulated:   # one opaque node (etdist::moe, below)
            return call_op("moe", x, self.router, self.w_gate_up[0], self.w_down[0], self.key, mesh=self.mesh)
        # refused here on one rank only, the peers' launches stop too (every rank raises)
        with refusal_reaches_peers(None if self.simulated else self.mesh, self._compiled):
            hidden_states("MoE", x, self.hidden, self.router.dtype)
            if self.simulated and x.device.type != "cpu":
                raise InputError(f"MoE: x is on {x.device}; simulated ranks run on the CPU runtime: pass a CPU tensor")
        lead, x2 = x.shape[:-1], x.reshape(-1, self.hidden)
        if x2.shape[0] == 0 and (self.simulated or self.world == 1):   # no peer waits for this call
            return x.new_zeros(x.shape)
        if self.simulated:
            y = self._simulated(x2)
        elif cpu_runtime(self.mesh):   # a cpu mesh: the CPU runtime across the processes
            y = cpu_path.moe(self, x2.contiguous())
        else:
            y = self._kernel("cuda", self.large_tiles(x2.shape[0]))(self.mesh, x=x2.contiguous(), wg=self.router.data,
                                            w_gate_up=self.w_gate_up[0].data, w_down=self.w_down[0].data)["y"]
        return y.reshape(*lead, self.hidden)

    def _simulated(self, x: torch.Tensor) -> torch.Tensor:
        T, R = x.shape[0], self.world
        per = -(-T // R)
        padded = torch.zeros(per * R, self.hidden, dtype=x.dtype)
        padded[:T] = x
        inputs = [{"x": padded[r * per:(r + 1) * per].contiguous(), "wg": self.router.data,
                   "w_gate_up": self.w_gate_up[r].data, "w_down": self.w_down[r].data} for r in range(R)]
        outs = self._kernel("cpu").run(inputs)
        return torch.cat([o["y"] for o in outs])[:T]


# torch.compile: the layer as one custom op, so Dynamo does not trace into the kernel's host path
# (collectives/custom_op.py says why). A custom op takes tensors and plain values: the layer travels as its key
# (a string: torch.compile(dynamic=True) would make an int symbolic).
_LAYERS: "weakref.WeakValueDictionary[str, MoE]" = weakref.WeakValueDictionary()
_LAYER_KEYS = itertools.count(1)


def _moe_op(x, router, w_gate_up, w_down, layer, mesh, token):
    """The weights are arguments so the graph orders the call after whatever writes them; the layer
    runs with its own (the same tensors). Its forward, not its __call__: the module's hooks were
    traced already."""
    moe = _LAYERS.get(layer)
    if moe is None:
        raise InputError(f"etdist::moe: no MoE layer {layer!r} (it was garbage-collected)")
    return moe.forward(x)


define_op("moe(Tensor x, Tensor router, Tensor w_gate_up, Tensor w_down, str layer, str mesh, Tensor(a!) token) "
          "-> Tensor", _moe_op, lambda x, router, w_gate_up, w_down, layer, mesh, token: x.new_empty(x.shape))
