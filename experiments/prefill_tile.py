"""The prefill tile alone on one GPU: how close the fused ops' GEMM tile gets to torch.mm (cuBLAS)
at prefill sizes, before any communication or megakernel machinery is added.

For the 8 MLP shapes at TP=2 (gemm_rs: h [M, I/2] @ w_down [I/2, H]; ag_gemm: x [M, H] @
w_gate_up [H, I]), bf16, weights in 4 rotated copies, timed from a CUDA graph of a few calls back to
back (median of the replays between two CUDA events):
  mm        torch.mm (cuBLAS)
  grid      gemm_tiles.mm_tile (the body every large class runs: TMA descriptors, `large` tile) as a
            plain grid, one program per tile in grouped order
  persist   the same body in a persistent loop, one program per SM, tiles t = pid, pid + SMs, ...
            (the static schedule's order in the megakernel): each tile refills its own pipeline
  flat      a persistent loop whose tile and contraction loops are one flattened loop
            (tl.range(flatten=True)), so the loads of the next tile start while this one finishes
  flat_ws   flat with warp_specialize=True (the loads in their own warps), if Triton builds it here
Each kernel is checked against float32 first. Prints a table (us, TFLOP/s and each / mm) last;
records in $OUT/prefill_tile.jsonl.

    python experiments/prefill_tile.py          # M=8192, every shape; MS=2048,8192 SHAPES=qwen3_8b WHAT=gemm_rs
"""
import os
import statistics

import torch
import triton
import triton.language as tl

from etdist.kernels import gemm_tiles
from etdist.bench.measure import records
from etdist.bench.measure.timing import time_graph as bench
from etdist.bench.measure.shapes import MLP_SHAPES, ag_gemm_dims, gemm_rs_dims

COPIES = 4


@triton.jit
def body_grid(a, b, c, M, K, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_M: tl.constexpr, USE_ASM: tl.constexpr = True):
    i, j = gemm_tiles.grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    gemm_tiles.mm_tile(a, M, b, K, N, c, N, i, j, BLOCK_M, BLOCK_N, BLOCK_K, 1, USE_ASM)


@triton.jit
def body_persist(a, b, c, M, K, N, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, USE_ASM: tl.constexpr = True):
    m_tiles, n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), m_tiles * n_tiles, P):
        i, j = gemm_tiles.grouped_tile(t, m_tiles, n_tiles, GROUP_M)
        gemm_tiles.mm_tile(a, M, b, K, N, c, N, i, j, BLOCK_M, BLOCK_N, BLOCK_K, 1, USE_ASM)


@triton.jit
def flat_persist(a, b, c, M, K, N, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr, SUBTILE: tl.constexpr):
    """Triton's persistent TMA matmul pattern (tutorial 09): the tile loop flattened with the
    contraction loop, so the pipeline runs across tile boundaries."""
    a_d = tl.make_tensor_descriptor(a, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_d = tl.make_tensor_descriptor(b, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    if SUBTILE:
        c_d = tl.make_tensor_descriptor(c, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
    else:
        c_d = tl.make_tensor_descriptor(c, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    m_tiles, n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for t in tl.range(tl.program_id(0), m_tiles * n_tiles, P, flatten=True, num_stages=STAGES, warp_specialize=WS):
        i, j = gemm_tiles.grouped_tile(t, m_tiles, n_tiles, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            acc = tl.dot(a_d.load([i * BLOCK_M, k * BLOCK_K]), b_d.load([k * BLOCK_K, j * BLOCK_N]), acc)
        if SUBTILE:
            acc = tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2))
            acc = tl.permute(acc, (0, 2, 1))
            c0, c1 = tl.split(acc)
            c_d.store([i * BLOCK_M, j * BLOCK_N], c0.to(c.dtype.element_ty))
            c_d.store([i * BLOCK_M, j * BLOCK_N + BLOCK_N // 2], c1.to(c.dtype.element_ty))
        else:
            c_d.store([i * BLOCK_M, j * BLOCK_N], acc.to(c.dtype.element_ty))


# (label, kernel kind, block_m, block_n, block_k, warps, stages, extra): the library's `large` tile first
CONFIGS = [
    ("grid 128x256x64 w8 s4", "grid", 128, 256, 64, 8, 4, {}),
    ("persist 128x256x64 w8 s4", "persist", 128, 256, 64, 8, 4, {}),
    ("persist 128x256x64 w8 s3", "persist", 128, 256, 64, 8, 3, {}),
    ("persist 128x128x64 w8 s4", "persist", 128, 128, 64, 8, 4, {}),
    ("flat 128x256x64 w8 s3", "flat", 128, 256, 64, 8, 3, {}),
    ("flat 128x256x64 w8 s4 sub", "flat", 128, 256, 64, 8, 4, {"SUBTILE": True}),
    ("flat 128x128x64 w8 s4", "flat", 128, 128, 64, 8, 4, {}),
    ("flat 128x256x64 w8 s3 ws", "flat", 128, 256, 64, 8, 3, {"WS": True}),
    ("flat 128x128x64 w4 s4 ws", "flat", 128, 128, 64, 4, 4, {"WS": True}),
]


def main():
    dev = torch.device("cuda", 0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = os.environ.get("SHAPES", ",".join(MLP_SHAPES)).split(",")
    whats = os.environ.get("WHAT", "gemm_rs,ag_gemm").split(",")
    ms = [int(m) for m in os.environ.get("MS", "8192").split(",")]
    env = records.env_info()
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, triton {triton.__version__}", flush=True)
    rows, recs, broken = [], [], set()
    for name in shapes:
        for what, (K, N) in (("gemm_rs", gemm_rs_dims(name, 2)), ("ag_gemm", ag_gemm_dims(name, 2))):
            if what not in whats:
                continue
            ws = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(COPIES)]
            for M in ms:
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                flops = 2 * M * K * N
                calls = max(3, min(20, int(2e12 / flops)))
                ref = x.float() @ ws[0].float()
                cells = {}
                it = iter(range(1 << 30))
                cells["mm"] = bench(lambda: torch.mm(x, ws[next(it) % COPIES], out=c), calls)
                for label, kind, bm, bn, bk, warps, stages, extra in CONFIGS:
                    if label in broken:
                        continue
                    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
                    if kind == "grid":
                        def run(i, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages):
                            body_grid[(tiles,)](x, ws[i % COPIES], c, M, K, N, bm, bn, bk, 8,
                                                num_warps=warps, num_stages=stages)
                    elif kind == "persist":
                        def run(i, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages):
                            body_persist[(sms,)](x, ws[i % COPIES], c, M, K, N, sms, bm, bn, bk, 8,
                                                 num_warps=warps, num_stages=stages)
                    else:
                        def run(i, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, extra=extra):
                            flat_persist[(min(sms, tiles),)](x, ws[i % COPIES], c, M, K, N, min(sms, tiles), bm, bn,
                                                             bk, 8, stages, extra.get("WS", False),
                                                             extra.get("SUBTILE", False), num_warps=warps)
                    try:
                        c.fill_(float("nan"))
                        run(0)
                        torch.cuda.synchronize()
                    except Exception as e:   # a config Triton cannot build here is reported and skipped
                        print(f"SKIP {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                        broken.add(label)
                        continue
                    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:   # reported, not timed
                        print(f"WRONG: {name} {what} M={M} {label}: rel err {err:.1e}", flush=True)
                        continue
                    it = iter(range(1 << 30))
                    cells[label] = bench(lambda: run(next(it)), calls)
                rows.append((name, what, M, flops, cells))
                best = min((v, k) for k, v in cells.items() if k != "mm")
                recs.append(records.make_record(
                    workload="prefill_tile", model=f"{name} {what}", M=M, world=1, schedule="static",
                    ours_us=cells[CONFIGS[1][0]] if CONFIGS[1][0] in cells else best[0],
                    baselines={"mm": cells["mm"], "best_tile": best[0]}, floor_us=cells["mm"], rel_err=None, env=env,
                    notes=f"experiments/prefill_tile.py: one GPU, [{M}, {K}] @ [{K}, {N}] bf16, weights in {COPIES} "
                          f"rotated copies, CUDA graph; ours = the library's body in a persistent loop "
                          f"(best: {best[1]}; extra.us: every contender)",
                    extra={"K": K, "N": N, "us": cells}))
                line = "  ".join(f"{k} {v:.0f}" for k, v in cells.items())
                print(f"{name} {what} M={M}: {line}", flush=True)
            del ws
    for r in recs:
        records.append(f"{os.environ.get('OUT', '/tmp')}/prefill_tile.jsonl", r)
    labels = [label for label, *_ in CONFIGS if label not in broken]
    print("\ncontender / mm per cell (mm in us and TFLOP/s)")
    print("cell | mm us | TFLOP/s | " + " | ".join(labels))
    for name, what, M, flops, c in rows:
        ratios = " | ".join(f"{c[k] / c['mm']:.2f}" if k in c else "-" for k in labels)
        print(f"{name} {what} M={M} | {c['mm']:.0f} | {flops / c['mm'] / 1e6:.0f} | {ratios}")
    for k in labels:
        rs = [c[k] / c["mm"] for *_, c in rows if k in c]
        if rs:
            print(f"geomean {k}: {statistics.geometric_mean(rs):.3f} over {len(rs)}")


if __name__ == "__main__":
    main()
