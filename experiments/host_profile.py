"""Where an eager decode call's host time goes, on the GPU machine, at world 2: host time per call
(300 calls back to back, fewer than the launch queue holds, so the GPU never pushes back; median of
7 runs) of the op, of its CudaKernel call alone, of Triton's launch alone (its Python wrapper, then
the C launcher called directly, cooperative and not), of the output's torch.empty and of a torch.mm
launch for scale; then each step of the op's path alone on each rank (best of 7 x 300); then
cProfile of the op's calls (rank 0 prints).

    torchrun --nproc_per_node=2 experiments/host_profile.py [M] [N] [K_full]   # default 16 4096 12288
"""
import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

import etdist as et
from triton.runtime import _allocation as triton_allocation
from etdist.ops import common
from etdist.ops import gemm_rs as op

M, N, KF = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (16, 4096, 12288)))
dist.init_process_group("cpu:gloo,cuda:nccl")
mesh = et.init_mesh()
K = KF // mesh.world_size
w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5
x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
call = lambda: et.ops.gemm_reduce_scatter(x, w, mesh=mesh)  # noqa: E731
call()
cfg, splits, align, build = op.kernel_plan(M, K, N, x.dtype, op.sm_count(mesh.device.index), mesh.world_size,
                                           et.ops.DEFAULT_PLAN)
kernel = op.cached_kernel(op._KERNELS, et.ops.DEFAULT_PLAN, cfg, "static", build)
st = kernel.state(mesh)
inner = lambda: kernel(mesh, x=x, w=w)  # noqa: E731
y = torch.empty(-(-M // mesh.world_size), N, device=mesh.device, dtype=x.dtype)
flat = st.shape.direct_args({"x": x, "w": w, "y": y, "call_sig": st.word})
stream = torch.cuda.current_stream().cuda_stream
k = st.compiled
launcher = k.run            # Triton's CudaLauncher: a Python __call__ around the C launch
c_launch = launcher.launch  # the C function itself
scratch = st.allocate_scratch(max(1, k.run.global_scratch_size * st.programs), 128, stream).data_ptr() \
    if k.run.global_scratch_size else None
launch = lambda: k.run(st.programs, 1, 1, stream, k.function, k.packed_metadata, None, None, None,  # noqa: E731
                       *flat, st.programs, True)
c_coop = lambda: c_launch(st.programs, 1, 1, stream, k.function, 1, 0, scratch, None,  # noqa: E731
                          k.packed_metadata, None, None, None, *flat, st.programs, True)
c_plain = lambda: c_launch(st.programs, 1, 1, stream, k.function, 0, 0, scratch, None,  # noqa: E731
                           k.packed_metadata, None, None, None, *flat, st.programs, True)
empty = lambda: torch.empty(y.shape, dtype=y.dtype, device=mesh.device)  # noqa: E731
ws = torch.randn(K, 256, device=mesh.device, dtype=torch.bfloat16)
mm = lambda: torch.mm(x, ws)  # noqa: E731


def per_call(fn, n=300, runs=7):
    hosts, totals = [], []
    for _ in range(runs):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        hosts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
        totals.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(hosts), statistics.median(totals)


triton_allocation._allocator.set(st.allocate_scratch)   # as the runtime sets it around its launches
rows = []
for name, fn in (("op", call), ("kernel", inner), ("k.run", launch), ("C coop", c_coop), ("C plain", c_plain),
                 ("empty", empty), ("mm", mm), ("op", call)):
    host, total = per_call(fn)
    rows.append((name, host, total))
if mesh.rank == 0:
    print(f"gemm_rs M={M} N={N} K={K}: host us per call (300 back to back, median of 7) | with the GPU")
    for name, host, total in rows:
        print(f"  {name:8} {host:6.1f} | {total:6.1f}", flush=True)


def ctx():
    with common.refusal_reaches_peers(mesh, op._KERNELS):
        pass


plan = et.ops.DEFAULT_PLAN
steps = [
    ("op (launches)", call),
    ("kernel() (launches)", inner),
    ("is_compiling", torch.compiler.is_compiling),
    ("plan_config", lambda: common.plan_config("g", None)),
    ("check_operands", lambda: common.check_operands("g", "h", x, w, mesh)),
    ("kernel_plan", lambda: op.kernel_plan(M, K, N, x.dtype, 132, mesh.world_size, plan)),
    ("sm_count", lambda: op.sm_count(mesh.device.index)),
    ("cached_kernel", lambda: op.cached_kernel(op._KERNELS, plan, cfg, "static", build)),
    ("refusal ctx", ctx),
    ("torch.empty", empty),
    ("x.new_empty", lambda: x.new_empty(y.shape)),
    ("t.device != dev", lambda: x.device != mesh.device),
    ("is_contiguous", x.is_contiguous),
    ("data_ptr", x.data_ptr),
    ("getDevice", torch._C._cuda_getDevice),
    ("capturing", torch._C._cuda_isCurrentStreamCapturing),
    ("raw stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
    ("shape key", lambda: (x.shape, x.dtype) == (x.shape, x.dtype)),
]
best = [(name, min(per_call(f, runs=1)[0] for _ in range(7))) for name, f in steps]
everyone = [None] * mesh.world_size
dist.all_gather_object(everyone, best)
if mesh.rank == 0:
    print("host us per step alone (best of 7 x 300), rank 0 | rank 1")
    for (name, a), (_, b) in zip(everyone[0], everyone[-1]):
        print(f"  {name:20} {a:7.2f} | {b:7.2f}")
dist.barrier()
pr = cProfile.Profile()
for _ in range(5):
    pr.enable()
    for _ in range(300):
        call()
    pr.disable()
    torch.cuda.synchronize()
if mesh.rank == 0:
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
mesh.close()
