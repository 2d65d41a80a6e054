"""What one dependent step between tasks costs: the synchronisation primitives the megakernels are
built from, timed alone (etdist.kernels.sync and etdist.kernels.ready_queue, the same functions the
generated kernels call).

    torchrun --nproc_per_node=2 -m etdist.bench.sync_latency          # 2 GPUs: every case, a table
    TRITON_INTERPRET=1 torchrun --nproc_per_node=2 -m etdist.bench.sync_latency --check   # CPU: the cross-rank cases run, tiny

Each case is a ping-pong between two parties (two programs on one GPU, or one program on each of
two GPUs): a party stores a payload into the other's buffer, then notifies it (a release atomic on
a counter, as an event notify does); the other waits (acquire poll, as an event wait) and checks
the payload. The queue cases hand a task id over the dynamic schedule's ready queue instead (push,
then claim). Reported: one-way latency = round trip / 2, from n and 20 round trips in one launch
each (launch cost subtracted), median of 5. Every receive checks the payload it was sent; a
mismatch or a watchdog expiry fails the run.
"""
import argparse
import statistics

import torch
import triton
import triton.language as tl

import etdist as et
from ..kernels.ready_queue import next_task, push
from ..kernels.sync import notify, peer_base, wait

QSIZE = 64   # a ready queue's ring; each party has at most one entry in flight


@triton.jit
def _receive(lanes, data, stamp, other, ctrl, ctrl_peers, rank, max_spins, offs, WORDS: tl.constexpr,
             BLOCK: tl.constexpr, SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Wait for the other party's turn `stamp`, then count the payload words that are not `stamp`
    (a timed-out wait counts one)."""
    ok = wait(lanes + other, stamp, max_spins, ctrl, ctrl_peers, rank, 2, 1, other, stamp, SCOPE, USE_ASM)
    wrong = 1 - ok
    for w0 in range(0, WORDS, BLOCK):
        got = tl.load(data + other * WORDS + w0 + offs, mask=w0 + offs < WORDS, other=stamp, volatile=True)
        wrong += tl.sum((got != stamp).to(tl.int32), 0)
    return wrong


# n and base change from launch to launch: specialised (divisibility by 16), they would compile
# new binaries inside the timed launches
@triton.jit(do_not_specialize=["rank", "n", "base"])
def _pingpong(lanes, lanes_peers, data, data_peers, bad, ctrl, ctrl_peers, rank, n, base, max_spins,
              WORDS: tl.constexpr, BLOCK: tl.constexpr, CROSS: tl.constexpr, SCOPE: tl.constexpr,
              USE_ASM: tl.constexpr):
    """n round trips between party 0 and party 1 (ranks when CROSS, else programs of one GPU). lanes[s]
    counts the turns party s has sent (event-style counter); data[s*WORDS:] holds its last payload."""
    me = rank if CROSS else tl.program_id(0)
    other = 1 - me
    to_lanes, to_data = lanes, data
    if CROSS:
        to_lanes, to_data = peer_base(lanes_peers, other, lanes), peer_base(data_peers, other, data)
    offs = tl.arange(0, BLOCK)
    wrong = 0
    for i in range(n):
        stamp = base + i + 1
        if me == 1:   # party 1 answers: wait for turn i, then send it back
            wrong += _receive(lanes, data, stamp, other, ctrl, ctrl_peers, rank, max_spins, offs, WORDS, BLOCK,
                              SCOPE, USE_ASM)
        for w0 in range(0, WORDS, BLOCK):
            tl.store(to_data + me * WORDS + w0 + offs, stamp + 0 * offs, mask=w0 + offs < WORDS)
        notify(to_lanes + me, 1, False, SCOPE)
        if me == 0:
            wrong += _receive(lanes, data, stamp, other, ctrl, ctrl_peers, rank, max_spins, offs, WORDS, BLOCK,
                              SCOPE, USE_ASM)
    tl.atomic_add(bad + me, wrong)


@triton.jit(do_not_specialize=["rank", "n", "base"])
def _queue_pingpong(qs, qs_peers, bad, ctrl, ctrl_peers, rank, n, base, max_spins, QSIZE: tl.constexpr,
                    CROSS: tl.constexpr):
    """n round trips over ready queues: each party claims from its own queue (ready_queue.next_task)
    and pushes the next turn's task id into the other's (ready_queue.push; a peer's when CROSS)."""
    me = rank if CROSS else tl.program_id(0)
    other = 1 - me
    stride = 2 + QSIZE
    mine, theirs = qs + me * stride, qs + other * stride
    if CROSS:
        mine, theirs = qs, peer_base(qs_peers, other, qs)
    wrong = 0
    for i in range(n):
        if me == 0:
            push(theirs, base + i, QSIZE, base + i >= 0)   # (a tensor: the mask)
        task = next_task(mine, QSIZE, base + i + 1, 0, 0, base + i + 1, 1, max_spins, ctrl, ctrl_peers, rank, 2, 2,
                         base + i)   # no seeded tasks: every claim reads a pushed slot
        wrong += (task != base + i).to(tl.int32)
        if me == 1:
            push(theirs, base + i, QSIZE, base + i >= 0)   # (a tensor: the mask)
    tl.atomic_add(bad + me, wrong)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="a few round trips, cross-rank cases only (CPU)")
    ap.add_argument("--n", type=int, default=2000, help="round trips per timed launch (>= 100)")
    args = ap.parse_args()
    if args.n < 100:
        ap.error(f"--n {args.n}: at least 100 round trips (20 of them are subtracted as the launch's cost)")
    mesh = et.init_mesh()
    if mesh.world_size != 2:
        raise SystemExit(f"etdist.bench.sync_latency needs exactly 2 ranks, got {mesh.world_size}")
    if why := et.mesh.timing_refused():   # its own CUDA-event timing, not etdist.bench.measure's
        raise SystemExit(f"etdist.bench.sync_latency: {why}")
    gpu = mesh.device.type == "cuda"
    if not gpu and not args.check:
        raise SystemExit("without GPUs run it with --check under TRITON_INTERPRET=1 (a functional run)")
    if not gpu:
        from etdist.kernels.interpret import patch_interpreter
        patch_interpreter()
    n = 3 if args.check else args.n
    if args.check and gpu:
        print("--check: a functional run, untimed", flush=True)
    r = mesh.rank
    # one region per (kind, one GPU or two): counters and queue heads only grow, per region
    lanes, data = mesh.empty((4,), torch.int32), mesh.empty((2 * 8192,), torch.int32)
    qs = mesh.empty((3 * (2 + QSIZE),), torch.int64)
    regions = {("lanes", False): lanes[0:2], ("lanes", True): lanes[2:4],
               ("queue", False): qs[:2 * (2 + QSIZE)], ("queue", True): qs[2 * (2 + QSIZE):]}
    sent = dict.fromkeys(regions, 0)   # round trips made so far in each region
    bad = torch.zeros(2, dtype=torch.int32, device=mesh.device)
    common = dict(ctrl=mesh.ctrl, ctrl_peers=mesh.peer_ptrs(mesh.ctrl), rank=r, max_spins=mesh.watchdog_spins())

    def launch(case, rounds):
        key = (case["kind"], case["cross"])
        buf, words = regions[key], case.get("words", 0)
        grid = (1,) if case["cross"] else (2,)
        if case["kind"] == "lanes":
            block = max(16, min(1024, triton.next_power_of_2(max(words, 1))))
            _pingpong[grid](buf, mesh.peer_ptrs(buf), data, mesh.peer_ptrs(data), bad, n=rounds, base=sent[key],
                            WORDS=words, BLOCK=block, CROSS=case["cross"], SCOPE=case.get("scope", "sys"),
                            USE_ASM=gpu, **common)
        else:
            _queue_pingpong[grid](buf, mesh.peer_ptrs(buf), bad, n=rounds, base=sent[key], QSIZE=QSIZE,
                                  CROSS=case["cross"], **common)
        sent[key] += rounds

    def timed_us(case, rounds):
        """Both ranks start together (a barrier); the launch timed on this rank's stream."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        mesh.barrier()
        start.record()
        launch(case, rounds)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3

    cases = [dict(name="two programs, one GPU", kind="lanes", cross=False, scope="gpu"),
             dict(name="two programs, one GPU", kind="lanes", cross=False, scope="sys"),
             dict(name="two GPUs", kind="lanes", cross=True),
             dict(name="two GPUs, 4 KiB payload", kind="lanes", cross=True, words=1024),
             dict(name="two GPUs, 32 KiB payload", kind="lanes", cross=True, words=8192),
             dict(name="ready queue, one GPU", kind="queue", cross=False),
             dict(name="ready queue, two GPUs", kind="queue", cross=True)]
    if not gpu:   # the interpreter runs a launch's programs one after another: no ping-pong inside one GPU
        cases = [c for c in cases if c["cross"]]
    rows = []
    for case in cases:
        if args.check:   # functional only: the payloads and task ids are checked below
            mesh.barrier()
            if case["cross"] or r == 0:
                launch(case, n)
            us = float("nan")
        elif case["cross"] or r == 0:   # one GPU's cases run on rank 0 alone
            timed_us(case, 20)          # warm-up: the compile, and the first touch of the buffers
            samples = []
            for _ in range(5):
                long, short = timed_us(case, n), timed_us(case, 20)
                samples.append((long - short) / (n - 20) / 2)
            us = statistics.median(samples)
        else:   # rank 1 meets rank 0's barriers
            for _ in range(11):
                mesh.barrier()
            us = float("nan")
        mesh.barrier()
        mesh.check()
        wrong = int(bad.sum())
        if wrong:
            raise SystemExit(f"rank {r}: {case['name']}: {wrong} payload words or task ids were wrong, or a "
                             "wait timed out")
        rows.append((case["name"], case.get("scope", "sys"), 4 * case.get("words", 0), us))
    if r == 0:
        print(f"{'case':<28} {'scope':<5} {'payload B':>9} {'one-way us':>10}")
        for name, scope, nbytes, us in rows:
            print(f"{name:<28} {scope:<5} {nbytes:>9} {us:>10.2f}")
        print(f"OK sync latency ({len(rows)} cases, {'untimed' if args.check else 'GPU'})", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
