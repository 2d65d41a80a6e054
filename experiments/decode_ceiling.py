"""The decode ceiling on one GPU: how fast the hardware streams one rank's weights, and how close
GEMM tile bodies get to that with the math inside (issue 42: measure the ceiling first).

For each of the 8 MLP shapes at TP=2 (gemm_rs: w_down shard [I/2, H]; ag_gemm: w_gate_up shard
[H, I]), on bf16 weights in 4 rotated copies (the L2 flushed between timings, triton do_bench):
  copy     torch copy of 1 GiB: (read + write) bytes / time
  stream   a persistent Triton kernel that only reads the weights (TMA boxes, pipelined, one
           contiguous byte range per program) and sums them: the stream ceiling for those bytes
  mm       torch.mm of [M, K] @ [K, N] (cuBLAS) at M = 16 and 128
  body     gemm_tiles.gemm_rs_skinny_matmul (the decode tile body of the fused ops) launched as a
           plain grid of split-K tasks with fp32 partials stored locally, for several tile configs
Each body is checked against float32 first. Prints a table (us and ours / stream) last; records
in $OUT/decode_ceiling.jsonl.

    python experiments/decode_ceiling.py            # every shape; SHAPES=qwen3_8b,llama31_70b to pick
"""
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from etdist.kernels import gemm_tiles
from etdist.measure.shapes import MLP_SHAPES

COPIES = 4


@triton.jit
def stream_sum(w, out, K, N, BK: tl.constexpr, BN: tl.constexpr, P: tl.constexpr, STAGES: tl.constexpr):
    """Program p sums the boxes [p * per, (p + 1) * per) of w [K, N] in row-major box order (one
    contiguous byte range when BN spans N)."""
    pid = tl.program_id(0)
    d = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    nb = tl.cdiv(N, BN)
    total = tl.cdiv(K, BK) * nb
    per = tl.cdiv(total, P)
    acc = tl.zeros((BN,), tl.float32)
    for t in tl.range(pid * per, tl.minimum(total, (pid + 1) * per), num_stages=STAGES):
        acc += tl.sum(d.load([(t // nb) * BK, (t % nb) * BN]).to(tl.float32), axis=0)
    tl.store(out + pid * BN + tl.arange(0, BN), acc)


@triton.jit
def skinny_grid(x, w, partial, table, M, K, N, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, USE_ASM: tl.constexpr = True):
    """One split-K task (s, j) of the fused ops' decode body per program, world 1."""
    pid = tl.program_id(0)
    gemm_tiles.gemm_rs_skinny_matmul(pid % SPLITS, pid // SPLITS, x, w, partial, table, M, K, N, 0, 1, SPLITS,
                                     BLOCK_M, BLOCK_N, BLOCK_K, 1, USE_ASM, SWAP_AB)


def bench(fn) -> float:
    """Median us of fn (do_bench: L2 flushed before every call)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    dev = torch.device("cuda", 0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    big = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(big)
    copy_us = bench(lambda: dst.copy_(big))
    copy_tbs = 2 * big.numel() * 2 / copy_us / 1e6
    del big, dst
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs: copy {copy_tbs:.2f} TB/s", flush=True)
    shapes = os.environ.get("SHAPES", ",".join(MLP_SHAPES)).split(",")
    # (block_m, block_n, block_k, warps, stages, tasks per SM, swap): the op's 32-row class first
    configs = [(32, 128, 128, 4, 5, 1, True), (32, 128, 256, 4, 2, 1, True), (32, 256, 128, 8, 3, 1, True),
               (32, 64, 256, 4, 4, 1, True), (32, 128, 128, 4, 5, 2, True), (32, 128, 64, 4, 8, 1, True),
               (128, 128, 128, 8, 3, 1, True)]
    rows, recs = [], []
    for name in shapes:
        H, I = MLP_SHAPES[name].hidden, MLP_SHAPES[name].intermediate
        for what, K, N in (("gemm_rs", I // 2, H), ("ag_gemm", H, I)):
            ws = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(COPIES)]
            gb = K * N * 2 / 1e9
            cells = {"floor": gb / copy_tbs * 1e6}
            for BK, BN, warps, stages in ((64, 256, 8, 4), (64, 256, 8, 6), (128, 128, 8, 4), (32, 256, 4, 6)):
                out = torch.empty(sms * BN, device=dev, dtype=torch.float32)
                it = iter(range(1 << 30))
                t = bench(lambda: stream_sum[(sms,)](ws[next(it) % COPIES], out, K, N, BK, BN, sms, stages,
                                                       num_warps=warps, num_stages=stages))
                cells[f"stream{BK}x{BN}s{stages}"] = t
            cells["stream"] = min(v for k, v in cells.items() if k.startswith("stream"))
            for M in (16, 128):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                it = iter(range(1 << 30))
                cells[f"mm{M}"] = bench(lambda: torch.mm(x, ws[next(it) % COPIES]))
                ref = x.float() @ ws[0].float()
                for bm, bn, bk, warps, stages, per_sm, swap in configs:
                    if bm < M:
                        continue
                    splits = max(1, min(8, int(per_sm * sms / -(-N // bn))))
                    partial = torch.empty(splits, M, N, device=dev, dtype=torch.float32)
                    table = torch.tensor([partial.data_ptr()], device=dev, dtype=torch.int64)
                    grid = (splits * -(-N // bn),)

                    def run(i):
                        skinny_grid[grid](x, ws[i % COPIES], partial, table, M, K, N, splits, bm, bn, bk, swap,
                                          num_warps=warps, num_stages=stages)
                    partial.fill_(float("nan"))
                    run(0)
                    err = ((partial.sum(0) - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:   # reported, not timed
                        print(f"WRONG: {name} {what} M={M} {bm},{bn},{bk}: rel err {err:.1e}", flush=True)
                        continue
                    it = iter(range(1 << 30))
                    label = f"body{M} {bm}x{bn}x{bk} w{warps} s{stages} x{splits}"
                    cells[label] = bench(lambda: run(next(it)))
            rows.append((name, what, gb, cells))
            recs.append({"workload": "decode_ceiling", "model": name, "weights": what, "K": K, "N": N, "GB": gb,
                         "copy_TBps": copy_tbs, "device": torch.cuda.get_device_name(dev),
                         "torch": torch.__version__, "triton": triton.__version__,
                         "commit": os.environ.get("ETDIST_COMMIT", ""), "us": cells})
            line = "  ".join(f"{k} {v:.1f}" for k, v in cells.items())
            print(f"{name} {what} ({gb * 1e3:.0f} MB): {line}", flush=True)
            del ws
    with open(f"{os.environ.get('OUT', '/tmp')}/decode_ceiling.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    print("\nshape weights | floor | stream (TB/s) | mm16 | mm128 | best body16 (of stream) | best body128")
    for name, what, gb, c in rows:
        b16 = min((v, k) for k, v in c.items() if k.startswith("body16 "))
        b128 = min((v, k) for k, v in c.items() if k.startswith("body128 "))
        print(f"{name} {what} | {c['floor']:.1f} | {c['stream']:.1f} ({gb / c['stream'] * 1e3:.2f}) | "
              f"{c['mm16']:.1f} | {c['mm128']:.1f} | {b16[0]:.1f} ({b16[0] / c['stream']:.2f}) {b16[1][7:]} | "
              f"{b128[0]:.1f} ({b128[0] / c['stream']:.2f}) {b128[1][8:]}")
    med = statistics.median(gb / c["stream"] * 1e3 for _, _, gb, c in rows)
    print(f"median stream rate {med:.2f} TB/s (copy {copy_tbs:.2f})")


if __name__ == "__main__":
    main()
