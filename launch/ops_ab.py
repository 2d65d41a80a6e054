"""A/B of the fused TP ops' plans on one GPU, as one rank of a tensor-parallel group of SHARD ranks
(the layer's intermediate divided by SHARD: the tiles, splits and task counts of a world-SHARD run,
with the partials stored and summed locally), alternated in one process against torch.mm:

    VARIANTS="base;SPLIT_TAIL=0" OPS=gemm_rs MODELS=gemma2_27b,qwen3_32b MS=1000,1024,8192 \
        torchrun --nproc_per_node=1 launch/ops_ab.py

A variant sets module attributes of the op's module (etdist.ops.gemm_rs, ag_gemm or mlp; OPS names
the ops) while it runs (`NAME=value`, joined by `+`; `base`: the op as it is), e.g. `SPLIT_TAIL=0`,
`MAX_SPLITS=1`, `TAIL_SPLITS=1`; the plan caches are cleared around it. Each variant's output is
checked against a float32 reference before any timing. Every round times torch.mm (gemm_rs, ag_gemm:
x @ w; mlp: both mms, no activation) and each variant once (etdist.measure.timing, 4 rotating weight
copies), in turn; a time is the median over the rounds. Prints a table with ratios to mm and to the
first variant; records in $OUT/$WORKLOAD.jsonl (default /tmp/ops_ab.jsonl), to be appended to
bench/results by hand.
"""
import functools
import math
import os
import statistics

import torch
import torch.distributed as dist

import etdist as et
from etdist.measure import records
from etdist.measure.shapes import MLP_SHAPES
from etdist.measure.timing import time_ranks
from etdist.ops import ag_gemm as ag_gemm_op
from etdist.ops import gemm_rs as gemm_rs_op
from etdist.ops import mlp as mlp_op

MODULES = {"gemm_rs": gemm_rs_op, "ag_gemm": ag_gemm_op, "mlp": mlp_op}
COPIES = 4


def variant(text: str) -> dict:
    """`SPLIT_TAIL=1+MAX_SPLITS=2` -> {"SPLIT_TAIL": 1, "MAX_SPLITS": 2}; `base` -> {}."""
    return {k: int(v) for k, _, v in (p.partition("=") for p in text.split("+") if p and p != "base")}


class patched:
    """The op module's attributes set to a variant's values inside the block (plan caches cleared)."""

    def __init__(self, module, values: dict):
        self.module, self.values, self.saved = module, values, {}

    def _clear(self):
        for fn in vars(self.module).values():
            if isinstance(fn, functools._lru_cache_wrapper):
                fn.cache_clear()

    def __enter__(self):
        for k, v in self.values.items():
            if not hasattr(self.module, k):
                raise AttributeError(f"{self.module.__name__} has no {k}")
            self.saved[k] = getattr(self.module, k)
            setattr(self.module, k, type(self.saved[k])(v))
        self._clear()

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(self.module, k, v)
        self._clear()


def operands(op: str, M: int, H: int, I: int, dev):
    """(x, weight copies, float32 reference of copy 0, mm step of copy i, op step of copy i)."""
    g = torch.Generator(device=dev).manual_seed(M * 7 + H)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).bfloat16()

    if op == "gemm_rs":   # h [M, I] @ w_down [I, H]
        x = rand(M, I)
        ws = [rand(I, H, scale=I ** -0.5) for _ in range(COPIES)]
        ref = x.float() @ ws[0].float()
        out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
        return ref, (lambda i: torch.mm(x, ws[i], out=out)), (lambda i: et.ops.gemm_reduce_scatter(x, ws[i]))
    if op == "ag_gemm":   # x [M, H] @ w_gate_up [H, 2I]
        x = rand(M, H)
        ws = [rand(H, 2 * I, scale=H ** -0.5) for _ in range(COPIES)]
        ref = x.float() @ ws[0].float()
        out = torch.empty(M, 2 * I, device=dev, dtype=torch.bfloat16)
        return ref, (lambda i: torch.mm(x, ws[i], out=out)), (lambda i: et.ops.all_gather_gemm(x, ws[i]))
    x = rand(M, H)   # mlp: x [M, H] -> [M, 2I] -> SwiGLU -> [M, I] @ [I, H]
    wgu = [rand(H, 2 * I, scale=H ** -0.5) for _ in range(COPIES)]
    wd = [rand(I, H, scale=I ** -0.5) for _ in range(COPIES)]
    gu = x.float() @ wgu[0].float()
    ref = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ wd[0].float()
    mid = torch.empty(M, 2 * I, device=dev, dtype=torch.bfloat16)
    out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)

    def mm(i):
        torch.mm(x, wgu[i], out=mid)
        return torch.mm(mid[:, :I], wd[i], out=out)

    return ref, mm, (lambda i: et.ops.tensor_parallel_mlp(x, wgu[i], wd[i]))


def main():
    names = os.environ.get("VARIANTS", "base").split(";")
    ops = os.environ.get("OPS", "gemm_rs").split(",")
    models = os.environ.get("MODELS", ",".join(MLP_SHAPES)).split(",")
    Ms = [int(m) for m in os.environ.get("MS", "1000,1024,8192").split(",")]
    shard, rounds = int(os.environ.get("SHARD", "2")), int(os.environ.get("ROUNDS", "3"))
    workload, out = os.environ.get("WORKLOAD", "ops_ab"), os.environ.get("OUT", "/tmp")
    session = os.environ.get("SESSION", "")
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    if mesh.world_size != 1:
        raise SystemExit("ops_ab.py runs on one GPU (torchrun --nproc_per_node=1)")
    env = records.env_info()
    table = []
    for op in ops:
        module = MODULES[op]
        for model in models:
            H, I = MLP_SHAPES[model].hidden, MLP_SHAPES[model].intermediate // shard
            for M in Ms:
                ref, mm, ours = operands(op, M, H, I, mesh.device)
                errs = []
                for name in names:
                    with patched(module, variant(name)):
                        y = ours(0).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:
                        raise RuntimeError(f"{op} {model} M={M} {name}: rel err {err:.1e}")
                    errs.append(err)
                steps = [("mm", {}, mm)] + [(n, variant(n), ours) for n in names]
                times = {n: [] for n, _, _ in steps}
                for r in range(rounds):
                    for n, values, step in steps:
                        turn = iter(range(10 ** 9))
                        with patched(module, values):
                            times[n].append(time_ranks(lambda: step(next(turn) % COPIES), device=mesh.device))
                med = {n: statistics.median(t) for n, t in times.items()}
                for v, n in enumerate(names):
                    for r, t in enumerate(times[n]):
                        records.append(f"{out}/{workload}.jsonl", records.make_record(
                            workload=workload, model=f"{model} {op} {n} run {r + 1}", M=M, world=1,
                            schedule="static", ours_us=t, baselines={"mm": times["mm"][r]}, floor_us=None,
                            rel_err=errs[v], env=env, notes=f"{session} launch/ops_ab.py: one GPU as a rank of "
                            f"{shard} (I = intermediate / {shard}), partials local; variants alternated with "
                            f"torch.mm".strip()))
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
