"""A/B of the fused TP ops' plans on one GPU, as one rank of a tensor-parallel group of SHARD ranks
(the layer's intermediate divided by SHARD: the tiles, splits and task counts of a world-SHARD run,
with the partials stored and summed locally), alternated in one process against torch.mm:

    VARIANTS="base;SPLIT_TAIL=0" OPS=gemm_rs MODELS=gemma2_27b,qwen3_32b MS=1000,1024,8192 \
        torchrun --nproc_per_node=1 experiments/ops_ab.py

A variant sets module attributes of the op's plan modules (etdist.ops.gemm_rs, ag_gemm, or mlp
and ag_gemm; OPS names the ops: gemm_rs, ag_gemm, mlp, mlp_replicated = tensor_parallel_mlp with
sequence_parallel=False) while it runs (`NAME=value`, joined by `+`; `base`: the op as it
is), e.g. `SPLIT_TAIL=0`, `MAX_SPLITS=1`, `TAIL_SPLITS=1`, `ROW_POINTERS=0`,
`WHOLE_32=32,128,64,4,6,swap`; the plan caches are cleared around it, and each variant keeps its
own compiled kernels. Each variant's output is checked against a float32 reference before
any timing. Every round times each variant once (etdist.bench.measure.timing, 4 rotating weight copies),
each right after a torch.mm timing (gemm_rs, ag_gemm: x @ w; mlp: both mms, no activation), the
variants' order turning by one every round (a fixed order favoured the later slots by 2-3%); a time
is the median over the rounds. Prints a table with ratios to mm and to the first variant; records
in $OUT/$WORKLOAD.jsonl (default /tmp/ops_ab.jsonl), to be appended to bench/results by hand.
"""
import functools
import math
import os
import statistics

import torch
import torch.distributed as dist

import etdist as et
from etdist.bench.measure import baselines as B
from etdist.bench.measure import records
from etdist.bench.measure.shapes import MLP_SHAPES
from etdist.bench.measure.timing import time_ranks
from etdist.kernels import gemm_tiles
from etdist.ops import ag_gemm as ag_gemm_op
from etdist.ops import gemm_rs as gemm_rs_op
from etdist.ops import mlp as mlp_op

# each op's plan modules (the MLP's whole-gather plan reads ag_gemm's WHOLE_* attributes, every plan
# gemm_rs's ROW_POINTERS), and the tile bodies' module (its TMA_ENABLED shapes the graphs too)
MODULES = {"gemm_rs": (gemm_rs_op, gemm_tiles), "ag_gemm": (ag_gemm_op, gemm_rs_op, gemm_tiles),
           "mlp": (mlp_op, ag_gemm_op, gemm_rs_op, gemm_tiles),
           "mlp_replicated": (mlp_op, ag_gemm_op, gemm_rs_op, gemm_tiles)}
COPIES = 4


def variant(text: str) -> dict:
    """`SPLIT_TAIL=1+MAX_SPLITS=2` -> {"SPLIT_TAIL": "1", "MAX_SPLITS": "2"}; `base` -> {}. Values
    take the attribute's type (a tile config: "block_m,block_n,block_k,warps,stages[,swap]")."""
    return {k: v for k, _, v in (p.partition("=") for p in text.split("+") if p and p != "base")}


def converted(current, text: str):
    """`text` as a value of `current`'s type."""
    if isinstance(current, gemm_rs_op.TileConfig):
        return gemm_rs_op.TileConfig.parse(text)
    return type(current)(int(text))


class patched:
    """The attributes of the op's plan modules set to a variant's values inside the block (each name
    in the first module that has it; plan caches cleared), and each variant's own compiled kernels
    (the ops' caches key on the plan's build arguments, not on every knob a graph reads)."""

    kernels: dict = {}   # (module, variant) -> that variant's kernel cache

    def __init__(self, modules: tuple, values: dict):
        self.modules, self.values, self.saved = modules, values, []

    def __enter__(self):
        for module in self.modules:
            if hasattr(module, "_KERNELS"):
                own = self.kernels.setdefault((module.__name__, tuple(sorted(self.values.items()))), {})
                self.saved.append((module, "_KERNELS", module._KERNELS))
                module._KERNELS = own
        for k, v in self.values.items():
            module = next((m for m in self.modules if hasattr(m, k)), None)
            if module is None:
                raise AttributeError(f"none of {[m.__name__ for m in self.modules]} has {k}")
            self.saved.append((module, k, getattr(module, k)))
            setattr(module, k, converted(getattr(module, k), v))
        et.ops.clear_plan_caches()

    def __exit__(self, *exc):
        for module, k, v in reversed(self.saved):
            setattr(module, k, v)
        self.saved = []
        et.ops.clear_plan_caches()


def operands(op: str, M: int, H: int, I: int, dev):
    """(float32 reference of weight copy 0, torch.mm's step, the op's step): step(i) runs on weight
    copy i of COPIES (etdist.bench.measure.baselines' operand makers)."""
    out = torch.empty(M, H if op == "gemm_rs" else 2 * I, device=dev, dtype=torch.bfloat16)
    if op in ("gemm_rs", "ag_gemm"):   # gemm_rs: h [M, I] @ w_down [I, H]; ag_gemm: x [M, H] @ w_gate_up [H, 2I]
        ops = B.random_operands(M, *((I, H) if op == "gemm_rs" else (H, 2 * I)), copies=COPIES, device=dev)
        x, ws = ops.x, ops.weights
        fused = et.ops.gemm_reduce_scatter if op == "gemm_rs" else et.ops.all_gather_gemm
        return x.float() @ ws[0].float(), (lambda i: torch.mm(x, ws[i], out=out)), (lambda i: fused(x, ws[i]))
    ops = B.mlp_operands(M, H, I, copies=COPIES, device=dev)   # mlp: x [M, H] -> SwiGLU -> [M, I] @ [I, H]
    x, wgu, wd = ops.x, ops.gate_up, ops.down
    ref = B.swiglu(x.float() @ wgu[0].float()) @ wd[0].float()
    down = torch.empty(M, H, device=dev, dtype=torch.bfloat16)

    def mm(i):   # both GEMMs, no activation
        torch.mm(x, wgu[i], out=out)
        return torch.mm(out[:, :I], wd[i], out=down)

    seq = op == "mlp"
    return ref, mm, (lambda i: et.ops.tensor_parallel_mlp(x, wgu[i], wd[i], sequence_parallel=seq))


def main():
    names = os.environ.get("VARIANTS", "base").split(";")
    ops = os.environ.get("OPS", "gemm_rs").split(",")
    models = os.environ.get("MODELS", ",".join(MLP_SHAPES)).split(",")
    Ms = [int(m) for m in os.environ.get("MS", "1000,1024,8192").split(",")]
    shard, rounds = int(os.environ.get("SHARD", "2")), int(os.environ.get("ROUNDS", "3"))
    workload, out = os.environ.get("WORKLOAD", "ops_ab"), os.environ.get("OUT", "/tmp")
    note = os.environ.get("NOTE", "")   # prefixed to every record's notes
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    if mesh.world_size != 1:
        raise SystemExit("ops_ab.py runs on one GPU (torchrun --nproc_per_node=1)")
    env = records.env_info()
    table = []
    for op in ops:
        modules = MODULES[op]
        for model in models:
            H, I = MLP_SHAPES[model].hidden, MLP_SHAPES[model].intermediate // shard
            for M in Ms:
                ref, mm, ours = operands(op, M, H, I, mesh.device)
                errs = []
                for name in names:
                    with patched(modules, variant(name)):
                        y = ours(0).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:
                        raise RuntimeError(f"{op} {model} M={M} {name}: rel err {err:.1e}")
                    errs.append(err)
                # Each variant is timed right after a torch.mm timing, and the variants' order turns
                # by one every round: with a fixed order the second of two identical kernels measured
                # 2-3% faster than the first (records ops_ab_control), a bias this cancels.
                times = {n: [] for n in names}
                mm_before = {n: [] for n in names}    # the torch.mm time taken just before each
                for r in range(rounds):
                    for n in names[r % len(names):] + names[:r % len(names)]:
                        mm_before[n].append(time_ranks(B.rotating(mm, COPIES), device=mesh.device))
                        with patched(modules, variant(n)):
                            times[n].append(time_ranks(B.rotating(ours, COPIES), device=mesh.device))
                med = {n: statistics.median(t) for n, t in times.items()}
                med["mm"] = statistics.median(t for ts in mm_before.values() for t in ts)
                for v, n in enumerate(names):
                    for r, t in enumerate(times[n]):
                        records.append(f"{out}/{workload}.jsonl", records.make_record(
                            workload=workload, model=f"{model} {op} {n} run {r + 1}", M=M, world=1,
                            schedule="static", ours_us=t, baselines={"mm": mm_before[n][r]}, floor_us=None,
                            rel_err=errs[v], env=env, notes=f"{note} experiments/ops_ab.py: one GPU as a rank of "
                            f"{shard} (I = intermediate / {shard}), partials local; variants alternated with "
                            f"torch.mm, order turning every round".strip()))
                table.append((op, model, M, med))
                print(f"{op} {model} M={M}: mm {med['mm']:.1f}  " + "  ".join(
                    f"{n} {med[n]:.1f} ({med[n] / med['mm']:.3f} of mm, {med[n] / med[names[0]]:.3f})"
                    for n in names), flush=True)
                del ref, mm, ours
                torch.cuda.empty_cache()
    print("\nop | model | M | mm us | " + " | ".join(f"{n} us (of mm, of {names[0]})" for n in names))
    for op, model, M, med in table:
        print(f"{op} | {model} | {M} | {med['mm']:.1f} | " + " | ".join(
            f"{med[n]:.1f} ({med[n] / med['mm']:.3f}, {med[n] / med[names[0]]:.3f})" for n in names))
    for op in ops:
        for n in names:
            rows = [med for o, _, _, med in table if o == op]
            if rows:
                g = math.exp(sum(math.log(m[n] / m[names[0]]) for m in rows) / len(rows))
                gm = math.exp(sum(math.log(m[n] / m["mm"]) for m in rows) / len(rows))
                print(f"{op} {n}: geomean {gm:.3f} of mm, {g:.3f} of {names[0]} over {len(rows)} cells")
    mesh.close()


if __name__ == "__main__":
    main()
