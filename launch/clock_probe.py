"""How a GEMM's time and the SM clock move when sustained load follows a rest: why a benchmark's
first contender measures fast (BENCHMARKS.md, twenty-fourth session).

    python3 launch/clock_probe.py         (one GPU; OUT=dir for the records, default /tmp)

Twice: rest 2 s, then 30 batches of 10 bf16 8192^3 torch.mm (4 rotating weights) between CUDA
events, while a thread polls nvidia-smi (SM clock, power, temperature) every 0.2 s. Records:
workload clock_probe, M = the batch's index, ours_us = microseconds per mm, the poll nearest the
batch's end in `extra`.
"""
import os
import subprocess
import threading
import time

import torch

from etdist.bench.measure import records


def poll(samples: list, stop: threading.Event, t0: float) -> None:
    while not stop.is_set():
        line = subprocess.run(["nvidia-smi", "-i", str(torch.cuda.current_device()),
                               "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
        clock, power, temp = (float(v) for v in line.strip().split(","))
        samples.append((time.perf_counter() - t0, clock, power, temp))
        time.sleep(0.2)


def main():
    out, dev = os.environ.get("OUT", "/tmp"), torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    y = torch.empty(8192, 8192, device=dev, dtype=torch.bfloat16)
    for i in range(3):
        torch.mm(a, ws[i], out=y)
    torch.cuda.synchronize()
    env = records.env_info()
    for rest in range(2):
        time.sleep(2.0)
        samples, stop, t0 = [], threading.Event(), time.perf_counter()
        watcher = threading.Thread(target=poll, args=(samples, stop, t0))
        watcher.start()
        batches = []
        for b in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(10):
                torch.mm(a, ws[i % 4], out=y)
            end.record()
            end.synchronize()
            batches.append((time.perf_counter() - t0, start.elapsed_time(end) * 100))   # us per mm
        time.sleep(0.3)
        stop.set()
        watcher.join()
        for b, (t, us) in enumerate(batches):
            near = min(samples, key=lambda s: abs(s[0] - t))
            records.append(f"{out}/clock_probe.jsonl", records.make_record(
                workload="clock_probe", model=f"mm 8192^3 bf16 after a 2 s rest, rest {rest + 1}", M=b, world=1,
                schedule="static", ours_us=us, baselines={}, floor_us=None, rel_err=0.0, env=env,
                extra={"t_s": round(t, 3), "poll_t_s": round(near[0], 3), "sm_clock_mhz": near[1],
                       "power_w": near[2], "temp_c": near[3]},
                notes="launch/clock_probe.py: 10 mm per batch between CUDA events; nvidia-smi polled every 0.2 s"))
        print(f"rest {rest + 1}: us per mm by batch (s since the rest ended: us) "
              + "  ".join(f"{t:.2f}:{us:.0f}" for t, us in batches[::3]))
        print("  nvidia-smi (s: MHz, W, C) " + "  ".join(f"{t:.1f}: {c:.0f}, {p:.0f}, {c2:.0f}"
                                                         for t, c, p, c2 in samples))


if __name__ == "__main__":
    main()
