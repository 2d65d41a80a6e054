"""Host time of eager calls on one GPU: which threads of the process keep a core busy, and what a
decode-sized call costs with the main thread alone on a core or sharing it with those threads.

    LABEL=proxy-off torchrun --nproc_per_node=1 experiments/host_path.py
    NVSHMEM_REMOTE_TRANSPORT=ibrc NVSHMEM_DISABLE_LOCAL_ONLY_PROXY=0 LABEL=proxy-on torchrun ... (as before 31db7a5)

Tiny operands, so that each call is bound by its host path: microseconds per call are the wall
time of 300 back-to-back calls and a synchronize, median of 5. Records (workload host_path, the
call in the model field, torch.mm's time as the baseline) go to $OUT/host_path.jsonl.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

import etdist as et
from etdist.bench.measure import records
from etdist.bench.measure.threads import busy_threads, thread_ticks


def per_call_us(fn, calls: int = 300, repeats: int = 5) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


ALLOWED = frozenset(os.sched_getaffinity(0))   # the cores this process may use (a cpuset may limit them)


def pin(main: int, spinners: list, shared) -> None:
    """shared: the main thread and the busy threads on the first allowed core, the rest on the
    others; False: the main thread alone on that core; None: every thread on every allowed core."""
    every = ALLOWED
    core = min(every)
    for tid in thread_ticks():
        try:
            if shared is None:
                os.sched_setaffinity(tid, every)
            elif tid == main or (shared and tid in spinners):
                os.sched_setaffinity(tid, {core})
            else:
                os.sched_setaffinity(tid, every - {core})
        except ProcessLookupError:
            pass   # the thread ended


def main():
    label, out = os.environ.get("LABEL", "default"), os.environ.get("OUT", "/tmp")
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    if mesh.world_size != 1 or len(ALLOWED) < 2:
        raise SystemExit("experiments/host_path.py runs as one process (--nproc_per_node=1) with 2+ cores")
    dev, bf16 = mesh.device, torch.bfloat16
    x, w = torch.randn(64, 512, device=dev, dtype=bf16), torch.randn(512, 1024, device=dev, dtype=bf16)
    xa, wa = torch.randn(64, 1024, device=dev, dtype=bf16), torch.randn(1024, 1024, device=dev, dtype=bf16)
    moe = et.nn.MoE(2048, 768, 128, 8, mesh=mesh, dtype=bf16)       # qwen3_30b_a3b's layer, one token
    tok = torch.randn(1, 2048, device=dev, dtype=bf16)
    calls = {"gemm_rs": (64, lambda: et.ops.gemm_reduce_scatter(x, w, mesh=mesh)),
             "ag_gemm": (64, lambda: et.ops.all_gather_gemm(xa, wa, mesh=mesh)),
             "moe": (1, lambda: moe(tok)),
             "mm": (64, lambda: torch.mm(x, w))}
    for _, fn in calls.values():
        fn()
    main_tid = os.getpid()
    torch.cuda.synchronize()
    busy = busy_threads()
    spinners = [tid for tid, (_, b) in busy.items() if b > 0.5 and tid != main_tid]
    print(f"{label}: {len(busy)} threads; busy while idle: "
          + (", ".join(f"{n} (tid {t}) {b:.0%}" for t, (n, b) in busy.items() if b > 0.05) or "none"))
    env = records.env_info()
    rows = []
    for rnd in range(2):
        for pinning in ("none", "main alone", "shared core"):
            pin(main_tid, spinners, None if pinning == "none" else pinning == "shared core")
            us = {name: per_call_us(fn) for name, (_, fn) in calls.items()}
            rows.append((rnd, pinning, us))
            for name, (M, _) in calls.items():
                if name != "mm":
                    records.append(f"{out}/host_path.jsonl", records.make_record(
                        workload="host_path", model=f"{name} {label} pin={pinning} run {rnd + 1}", M=M, world=1,
                        schedule="static", ours_us=us[name], baselines={"mm": us["mm"]}, floor_us=None,
                        rel_err=0.0, env=env, notes=f"experiments/host_path.py: eager calls, wall time of 300 calls + "
                        f"synchronize, median of 5; {len(spinners)} busy thread(s) besides the main one"))
    pin(main_tid, spinners, None)
    print(f"\n{label}: us per eager call (wall, host-bound shapes)")
    print("run | pinning | " + " | ".join(calls))
    for rnd, pinning, us in rows:
        print(f"{rnd + 1} | {pinning} | " + " | ".join(f"{us[n]:.1f}" for n in calls))
    mesh.close()


if __name__ == "__main__":
    main()
