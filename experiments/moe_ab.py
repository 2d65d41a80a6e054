"""A/B of nn.MoE graph variants, alternated in one process (EP = world; one GPU is EP=1):

    VARIANTS="base;route_block=32" MODELS=qwen3_30b_a3b,mixtral_8x7b TOKENS=128,1024,4096 \
        SKEW=1.5 SCHED=dynamic ROUNDS=3 torchrun --nproc_per_node=1 experiments/moe_ab.py

A variant is moe_layer arguments replacing the layer's own (`key=value`, joined by `+`; `base`: the
layer as it is; `local_first=true` is et.compile's, `stages=N` / `warps=N` the kernel's pipeline
stages and warps), compiled through the layer's own plan (tiles, alignment, early push) with the
weights packed as nn.MoE packs them. Every round times each variant once (etdist.bench.measure.timing,
the slowest rank), in turn, the order turning by one every round (with a fixed order, the former ops_ab.py's
later slot measured 2-3% faster for identical kernels); a variant's time is its median over the
rounds. Each variant's output is checked against the float32 loop of the torch layer before any
timing. Prints a table, ratios
to the first variant; records (one per variant and round) in $OUT/$WORKLOAD.jsonl (default
/tmp/moe_ab.jsonl), to be appended to bench/results by hand.
"""
import os
import statistics

import torch.distributed as dist

import etdist as et
from etdist.bench.gpu import REL_ERR_LIMIT, moe_operands
from etdist.bench.measure import records
from etdist.bench.measure.moe_baseline import torch_moe
from etdist.bench.measure.shapes import MOE_SHAPES
from etdist.bench.measure.timing import time_ranks


def variant(text: str) -> dict:
    """`half_tails=false+route_block=32` -> {"half_tails": False, "route_block": 32}; `base` -> {}."""
    options = {}
    for part in filter(None, text.split("+")):
        if part != "base":
            key, _, value = part.partition("=")
            options[key] = {"true": True, "false": False}[value] if value in ("true", "false") else int(value)
    return options


def main():
    names = os.environ.get("VARIANTS", "base").split(";")
    models = os.environ.get("MODELS", "qwen3_30b_a3b").split(",")
    tokens = [int(t) for t in os.environ.get("TOKENS", "128,1024").split(",")]
    skew, rounds = float(os.environ.get("SKEW", "1.5")), int(os.environ.get("ROUNDS", "3"))
    schedules = os.environ.get("SCHED", "dynamic").split(",")
    workload, out = os.environ.get("WORKLOAD", "moe_ab"), os.environ.get("OUT", "/tmp")
    note = os.environ.get("NOTE", "")   # prefixed to every record's notes
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    env = records.env_info()
    table = []
    for model in models:
        m = MOE_SHAPES[model]
        H, I, E, k = m.hidden, m.expert_intermediate, m.num_experts, m.top_k
        for T in tokens:
            x, router, (wgu,), (wd,) = moe_operands(mesh, H, I, E, T, skew, copies=1)   # bench_gpu.moe_cell's
            want = torch_moe(x.float(), router.float(), wgu.float(), wd.float(), k, experts="loop")
            for sched in schedules:
                layer = et.nn.MoE(H, I, E, k, mesh=mesh, schedule=sched)
                layer.router.data, layer.w_gate_up[0].data, layer.w_down[0].data = router, layer.pack_gate_up(wgu), wd
                large = layer.large_tiles(T)
                tiles, align, early = layer._plan("cuda", large)
                calls, errs = [], []
                for name in names:
                    options = variant(name)
                    first = bool(options.pop("local_first", False))   # et.compile's, not the graph's
                    warps, stages = options.pop("warps", None), options.pop("stages", None)   # the kernel's
                    kernel = et.compile(layer._graph("cuda", tiles, align, large, **options), schedule=sched,
                                        target="cuda", early_push=early, local_first=first)
                    kernel.num_warps, kernel.num_stages = warps or tiles.num_warps, stages or tiles.num_stages
                    args = dict(x=x, wg=router, w_gate_up=layer.w_gate_up[0].data, w_down=wd)
                    y = kernel(mesh, **args)["y"]
                    err = ((y.float() - want).abs().max() / want.abs().max()).item()
                    if not err < REL_ERR_LIMIT["moe"]:
                        raise RuntimeError(f"{model} T={T} {sched} {name}: rel err {err:.1e}")
                    calls.append(lambda kernel=kernel, args=args: kernel(mesh, **args))
                    errs.append(err)
                times = [[] for _ in names]
                for r in range(rounds):   # the order turns by one every round (a fixed one was biased)
                    for v in [*range(r % len(calls), len(calls)), *range(r % len(calls))]:
                        times[v].append(time_ranks(calls[v], device=mesh.device))
                        if mesh.rank == 0:
                            records.append(f"{out}/{workload}.jsonl", records.make_record(
                                workload=workload, model=f"{model}-zipf{skew:g} {names[v]} run {r + 1}", M=T,
                                world=mesh.world_size, schedule=sched, ours_us=times[v][-1], baselines={},
                                floor_us=None, rel_err=errs[v], env=env,
                                notes=f"{note} experiments/moe_ab.py, one process, variants alternated".strip()))
                med = [statistics.median(t) for t in times]
                table.append((model, T, sched, med))
                if mesh.rank == 0:
                    print(f"{model} T={T} {sched}: " + "  ".join(
                        f"{n} {m:.1f} ({m / med[0]:.3f})" for n, m in zip(names, med)), flush=True)
    if mesh.rank == 0:
        print("\nmodel | tokens | schedule | " + " | ".join(names))
        for model, T, sched, med in table:
            print(f"{model} | {T} | {sched} | " + " | ".join(f"{m:.1f} us ({m / med[0]:.3f}x)" for m in med))
    mesh.close()


if __name__ == "__main__":
    main()
