"""GPU checks of the fused GEMM+RS megakernel, one process per GPU:

    torchrun --nproc_per_node=N tests/gpu/gemm_rs_worker.py [--case ok|trace|dynamic|graph|streams|peer-skips|
                                                              refusal|capture-refusal]

Prints 'OK <check>' lines that tests/gpu/test_megakernel_gpu.py counts.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import etdist as et
from etdist.ops import gemm_rs as op_module
from etdist.ops.common import kernel_key
from etdist.ops.config import DEFAULT_PLAN


def host_all_gather(t):
    """Every rank's t, as float32 on this rank's GPU, gathered through the CPU (gloo): NCCL refuses
    ranks that share a GPU (init_mesh(share_gpu=True))."""
    parts = [torch.empty(t.shape, dtype=torch.float32) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.float().cpu())
    return [p.to(t.device) for p in parts]


def host_all_reduce(t):
    """t summed over the ranks in place, through the CPU (as host_all_gather)."""
    c = t.cpu()
    dist.all_reduce(c)
    t.copy_(c)


def gathered(x, M, mesh):
    """float32 [M, K]: every rank's rows x (chunks of cdiv(M, world), ragged at the end)."""
    C = -(-M // mesh.world_size)
    pad = torch.zeros(C, x.shape[1], device=mesh.device, dtype=x.dtype)
    pad[:x.shape[0]] = x
    return torch.cat(host_all_gather(pad))[:M]


def reference(x, w, mesh):
    """float32 reference: all ranks' x and w gathered, summed, this rank's rows."""
    xs, ws = host_all_gather(x), host_all_gather(w)
    total = sum(a @ b for a, b in zip(xs, ws))
    C = -(-x.shape[0] // mesh.world_size)
    return total[mesh.rank * C:(mesh.rank + 1) * C]


def check_ok(mesh):
    torch.manual_seed(1234 + mesh.rank)
    K, N = 1536, 1024
    # every size class, ragged ones included (K=1536, N=1024: large tiles in 4, 3 and 2 contraction
    # slices from 129 to 2048 rows, whole at 4096; at 4608, 144 tiles: a wave of 132 whole tiles,
    # then 12 in 4 slices)
    for M in (1, 5, 16, 64, 65, 100, 128, 129, 1000, 1024, 2048, 4096, 4608):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(M, K, device=mesh.device, dtype=dtype)
            w = torch.randn(K, N, device=mesh.device, dtype=dtype) / K ** 0.5
            y = et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
            ref = reference(x, w, mesh)
            for k in op_module._KERNELS.values():
                k.check(mesh)
            assert y.shape == ref.shape, (y.shape, ref.shape)
            err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item() if ref.numel() else 0.0
            tol = 1e-2 if dtype == torch.bfloat16 else 5e-3  # fp32 tl.dot uses tf32
            assert err < tol, f"M={M} {dtype}: rel err {err:.2e}"
            # the same call again: counters re-armed, no recompilation, same answer
            y2 = et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
            assert torch.equal(y, y2), f"M={M}: second launch differs"
            # a repeat with new operands (the repeat launch, ops/common.RepeatedCall): their own answer
            x3, w3 = torch.randn_like(x), torch.randn_like(w) / K ** 0.5
            y3, ref3 = et.ops.gemm_reduce_scatter(x3, w3, mesh=mesh), reference(x3, w3, mesh)
            err = ((y3.float() - ref3).abs().max() / ref3.abs().max().clamp_min(1e-6)).item() if ref3.numel() else 0.0
            assert err < tol, f"M={M} {dtype}, a repeat with new operands: rel err {err:.2e}"
    print(f"OK correctness rank {mesh.rank}", flush=True)
    # another PlanConfig: its own plans and kernels beside the default's (whole large tiles; the
    # 128-row class's slices sent to their owners unsummed), the same answers
    other = DEFAULT_PLAN.override("max_splits=1+local_sums_min_m=0")
    for M in (16, 100, 1000, 4608):
        x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
        w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5
        y, ref = et.ops.gemm_reduce_scatter(x, w, mesh=mesh, config=other), reference(x, w, mesh)
        err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item() if ref.numel() else 0.0
        assert y.shape == ref.shape and err < 1e-2, f"config {other.changes()} M={M}: rel err {err:.2e}"
    print(f"OK config rank {mesh.rank}", flush=True)
    # unseen sizes: whole LARGE tiles, in slices, rows through pointers or descriptors, the skinny classes
    unseen = [*range(3000, 3100, 7), *range(130, 1100, 97), *range(2, 64, 5), *range(66, 128, 9)]
    sms = torch.cuda.get_device_properties(mesh.device).multi_processor_count
    binaries = {}   # the op's kernel key -> the first M that needs it: one binary serves every later M
    for M in unseen:
        cfg, _, _, build = op_module.kernel_plan(M, K, N, torch.bfloat16, sms, mesh.world_size, DEFAULT_PLAN)
        binaries.setdefault(kernel_key(DEFAULT_PLAN, cfg, "static", build), M)
    for M in binaries.values():
        et.ops.gemm_reduce_scatter(torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16),
                                   torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16), mesh=mesh)
    before = op_module.compiled_variants()
    for M in unseen:
        x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
        w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16)
        et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
    torch.cuda.synchronize()
    assert op_module.compiled_variants() == before, (before, op_module.compiled_variants())
    print(f"OK no-recompile rank {mesh.rank} ({before} binaries, {len(binaries)} plans over {len(unseen)} sizes)",
          flush=True)
    bad = [(torch.randn(8, K, device=mesh.device, dtype=torch.bfloat16),
            torch.randn(K + 1, N, device=mesh.device, dtype=torch.bfloat16), "contraction dims differ"),
           (torch.randn(8, K, device=mesh.device, dtype=torch.bfloat16),
            torch.randn(K, N, device=mesh.device, dtype=torch.float32), "must share a dtype"),
           (torch.randn(K, 8, device=mesh.device, dtype=torch.bfloat16).t(),
            torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16), "not contiguous"),
           (torch.randn(8, K, dtype=torch.bfloat16), torch.randn(K, N, dtype=torch.bfloat16), "is on cpu")]
    for x, w, msg in bad:
        try:
            et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
        except et.InputError as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(f"no error for {msg}")
    print(f"OK bad-input rank {mesh.rank}", flush=True)
    check_idle_threads(mesh)


def check_idle_threads(mesh):
    """Idle, no thread of the process keeps a core busy (NVSHMEM's proxy thread spun one whole core
    and doubled the host time of an eager call where it shared the main thread's core)."""
    from etdist.bench.measure.threads import busy_threads
    torch.cuda.synchronize()
    busy = busy_threads(1.0)
    spinning = {tid: f"{b:.0%}" for tid, (_, b) in busy.items() if b > 0.5}
    assert not spinning, f"threads busy while idle (share of a core): {spinning}"
    print(f"OK idle-threads rank {mesh.rank} ({len(busy)} threads)", flush=True)


def check_peer_skips(mesh):
    """Rank 1 skips a call: rank 0's launch waits at its entry for rank 1's call (the call
    agreement); the watchdog must raise, naming the call and the rank, no hang."""
    K, N, M = 256, 256, 64
    x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
    w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16)
    et.ops.gemm_reduce_scatter(x, w, mesh=mesh)  # first call at this shape: prepares on every rank
    kernel = next(iter(op_module._KERNELS.values()))
    kernel.check(mesh)
    if mesh.rank == 0:
        et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
        # The launch ends (watchdog) and its last program stores the error word in pinned host
        # memory: the next call must raise from that word alone, before it launches
        torch.cuda.synchronize(mesh.device)
        try:
            et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
        except et.RuntimeFault as e:
            assert "watchdog" in str(e), str(e)
            print("OK error-word rank 0", flush=True)
        else:
            raise AssertionError("the next call did not see the failed launch's error word")
        try:
            kernel.check(mesh)
        except et.RuntimeFault as e:   # held at the launch's entry: rank 1 never made the call
            assert "rank 1 to make call" in str(e) and "watchdog" in str(e), str(e)
            print(f"OK watchdog rank 0: {e}", flush=True)
        else:
            raise AssertionError("rank 0 did not notice the missing peer")
    else:  # stay alive (peers write into our memory) and learn of the failure from rank 0's record
        import time
        time.sleep(mesh.watchdog_s + 3)
        try:
            kernel.check(mesh)
        except et.RuntimeFault as e:
            print(f"OK watchdog rank {mesh.rank}: skipped the call, then saw: {e}", flush=True)
        else:
            raise AssertionError("rank 1 never learned that rank 0 failed")


def close(y, ref, tol):
    """max |y - ref| <= tol x max |ref|; a rank that owns no rows (M < world x chunk) has nothing to compare."""
    return y.numel() == ref.numel() == 0 or (y.float() - ref).abs().max() <= tol * ref.abs().max()


def check_dynamic(mesh):
    """schedule='dynamic' (the on-GPU ready queue) for all three fused ops, ragged sizes, against
    float32 references; every size twice (queue and counters re-armed)."""
    R, r = mesh.world_size, mesh.rank
    torch.manual_seed(99)   # the same full tensors on every rank
    H, I = 1024, 2048 * R
    for M in (5, 16, 100, 1000, 2048):
        C = -(-M // R)
        lo, hi = min(M, r * C), min(M, (r + 1) * C)
        x_full = torch.randn(M, H, device=mesh.device, dtype=torch.bfloat16)
        w_gu = torch.randn(H, 2 * I // R, device=mesh.device, dtype=torch.bfloat16) / H ** 0.5
        w_dn = torch.randn(I // R, H, device=mesh.device, dtype=torch.bfloat16) / (I // R) ** 0.5
        h = torch.randn(M, I // R, device=mesh.device, dtype=torch.bfloat16)
        for _ in range(2):
            y = et.ops.gemm_reduce_scatter(h, w_dn, mesh=mesh, schedule="dynamic")
            ref = reference(h, w_dn, mesh)
            assert close(y, ref, 1e-2), ("gemm_rs", M)
            y = et.ops.all_gather_gemm(x_full[lo:hi].contiguous(), w_gu, mesh=mesh, total_rows=M, schedule="dynamic")
            ref = x_full.float() @ w_gu.float()
            assert close(y, ref, 1e-2), ("ag_gemm", M)
            y = et.ops.tensor_parallel_mlp(x_full[lo:hi].contiguous(), w_gu, w_dn, mesh=mesh, total_rows=M,
                                           schedule="dynamic")
            gu = x_full.float() @ w_gu.float()
            part = (torch.nn.functional.silu(gu[:, :I // R]) * gu[:, I // R:]) @ w_dn.float()
            host_all_reduce(part)
            ref = part[lo:hi]
            assert close(y, ref, 2e-2), ("mlp", M)
    print(f"OK dynamic rank {r}", flush=True)


def check_trace(mesh):
    """trace=True: every task of the launch on some SM, ends after starts, waits inside the task,
    the same result as without tracing; a Chrome trace file that loads as JSON."""
    import json
    import tempfile

    from etdist.workloads import gemm_rs
    torch.manual_seed(7 + mesh.rank)
    M, K, N = 1000, 1536, 1024
    x = torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16)
    w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(128, 128, torch.bfloat16, 64, 16), target="cuda", trace=True)
    y = kernel(mesh, x=x, w=w)["y"]
    everything = kernel.trace(mesh)
    names = {name for name, _, _ in et.fusion.trace.PHASES}
    is_phase = [r[2].split("@")[0] in names for r in everything]
    phases = [r for r, p in zip(everything, is_phase) if p]
    rows = [r for r, p in zip(everything, is_phase) if not p]
    R, C = mesh.world_size, -(-M // mesh.world_size)
    tasks = R * (R * -(-C // 128) * -(-N // 128) + -(-C // 128) * -(-N // 128))   # matmul + reduce, all ranks
    assert len(rows) == tasks, (len(rows), tasks)
    sms = torch.cuda.get_device_properties(mesh.device).multi_processor_count
    assert len(phases) == 2 * R * sms, (len(phases), R, sms)   # every program's agree and finish, every rank
    assert all(0 <= sm < sms and 0 <= start <= end for _, sm, _, start, end in everything)
    assert {r for r, *_ in rows} == set(range(R))
    # every rank's timer on the host clock (fusion/trace.py: measured offsets), from the first entry of any
    assert min(r[3] for r in everything) == 0.0
    # no task starts before its program agreed on the call (the ranks' launch skew is in `agree`)
    agreed = {(r, label.split()[-1]): end for r, _, label, _, end in phases if label.startswith("agree@")}
    assert all(start >= agreed[(r, label.split(" program ")[1].split(",")[0])] - 1e-3
               for r, _, label, start, _ in rows), "a task started before its program's call agreement"
    span = max(r[4] for r in rows) - min(r[3] for r in rows)
    # ranks sharing a GPU take turns on it (time slices of milliseconds): a launch may span several
    assert span < 1e5 or mesh.shares_gpu, \
        f"a launch of {len(rows)} tasks spans {span:.0f} us: clocks not aligned per rank?"
    assert torch.allclose(y.float(), reference(x, w, mesh), atol=5e-2, rtol=2e-2)
    path = et.fusion.trace.write_chrome(rows, tempfile.mktemp(suffix=".json"), track="SM")
    events = json.loads(path.read_text())["traceEvents"]
    print(f"OK trace rank {mesh.rank}: {len(rows)} tasks on {len({(r, sm) for r, sm, *_ in rows})} SM tracks, "
          f"{span:.0f} us, {len(events)} Chrome events", flush=True)


def check_graph(mesh):
    """Each fused op captured in a CUDA graph, replayed with fresh inputs copied into the captured
    ones: every replay matches the float32 reference (the kernel's epochs are its own, so replays
    re-arm the counters), and eager calls in between stay correct. Both schedules, decode and
    ragged prefill sizes."""
    R, r = mesh.world_size, mesh.rank
    H, I = 1024, 2048 * R
    for schedule in ("static", "dynamic"):
        for M in (16, 1000):
            C = -(-M // R)
            lo, hi = min(M, r * C), min(M, (r + 1) * C)
            w_gu = torch.randn(H, 2 * I // R, device=mesh.device, dtype=torch.bfloat16) / H ** 0.5
            w_dn = torch.randn(I // R, H, device=mesh.device, dtype=torch.bfloat16) / (I // R) ** 0.5
            h = torch.randn(M, I // R, device=mesh.device, dtype=torch.bfloat16)
            x = torch.randn(hi - lo, H, device=mesh.device, dtype=torch.bfloat16)
            ops = {"gemm_rs": lambda: et.ops.gemm_reduce_scatter(h, w_dn, mesh=mesh, schedule=schedule),
                   "ag_gemm": lambda: et.ops.all_gather_gemm(x, w_gu, mesh=mesh, total_rows=M, schedule=schedule),
                   "mlp": lambda: et.ops.tensor_parallel_mlp(x, w_gu, w_dn, mesh=mesh, total_rows=M,
                                                             schedule=schedule)}

            def ref(name):
                if name == "gemm_rs":
                    return reference(h, w_dn, mesh)
                full = gathered(x, M, mesh)
                if name == "ag_gemm":
                    return full @ w_gu.float()
                gu = full @ w_gu.float()
                part = (torch.nn.functional.silu(gu[:, :I // R]) * gu[:, I // R:]) @ w_dn.float()
                host_all_reduce(part)
                return part[lo:hi]

            for name, op in ops.items():
                op()                                  # compile and prepare the shape outside the capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = op()
                for rep in range(3):
                    h.copy_(torch.randn_like(h))
                    x.copy_(torch.randn_like(x))
                    g.replay()
                    want = ref(name)
                    err = ((y.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item() if want.numel() else 0
                    assert err < 2e-2, (schedule, M, name, rep, err)
                    eager = op()                      # an eager call between replays: epochs stay in step
                    err = ((eager.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item() if want.numel() else 0
                    assert err < 2e-2, (schedule, M, name, rep, "eager", err)
    check_graphs_per_size(mesh)
    print(f"OK graph rank {r}", flush=True)


def check_graphs_per_size(mesh):
    """A server's CUDA graphs, one per batch size: gemm_rs and ag_gemm captured at several M of one
    size class, replayed interleaved, then again after an eager call at a larger M of the class.
    Sharing one state per kernel, the earlier graphs replayed garbage (rel err ~1.5) or hung."""
    R, r = mesh.world_size, mesh.rank
    K, N = 1536, 1024
    w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5
    for Ms, big in (((8, 16, 24), 32), ((200, 300), 4000)):
        for name in ("gemm_rs", "ag_gemm"):
            def call(x, M):
                if name == "gemm_rs":
                    return et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
                return et.ops.all_gather_gemm(x, w, mesh=mesh, total_rows=M)

            def rows(M):   # gemm_rs: every row, partial sums; ag_gemm: this rank's chunk
                C = -(-M // R)
                return M if name == "gemm_rs" else min(M, (r + 1) * C) - min(M, r * C)

            def check(x, y, M, what):
                want = reference(x, w, mesh) if name == "gemm_rs" else gathered(x, M, mesh) @ w.float()
                err = ((y.float() - want).abs().max() / want.abs().max()).item()
                assert err < 2e-2, (name, M, what, err)

            graphs = {}
            for M in Ms:
                x = torch.randn(rows(M), K, device=mesh.device, dtype=torch.bfloat16)
                call(x, M)                                 # warm-up at this shape, outside the capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = call(x, M)
                graphs[M] = (g, x, y)
            for what in ("interleaved", "after an eager call at a larger M"):
                if what != "interleaved":
                    xb = torch.randn(rows(big), K, device=mesh.device, dtype=torch.bfloat16)
                    check(xb, call(xb, big), big, "eager")
                for M in (*Ms, *Ms):
                    g, x, y = graphs[M]
                    x.copy_(torch.randn_like(x))
                    g.replay()
                    check(x, y, M, what)
    print(f"OK graphs-per-size rank {r}", flush=True)


def prepared_gemm_rs(mesh):
    """x [16, 1536], w [1536, 1024] bf16, after one call that prepared their shape on every rank."""
    x = torch.randn(16, 1536, device=mesh.device, dtype=torch.bfloat16)
    w = torch.randn(1536, 1024, device=mesh.device, dtype=torch.bfloat16)
    et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
    torch.cuda.synchronize()
    return x, w


def raised(kind, call, what: str) -> Exception:
    """The `kind` error that call() raises; AssertionError("`what`") if it returns."""
    try:
        call()
    except kind as e:
        return e
    raise AssertionError(what)


def checked_everything(mesh):
    for k in op_module._KERNELS.values():
        k.check(mesh)


def check_refusal(mesh):
    """At a prepared shape rank 1 refuses its call (x fp16, w bf16): published as its call
    (mesh/calls.py), rank 0's launch of it runs nothing and rank 0 raises CallMismatchError naming
    the refusal (at check()); then both ranks' next call runs and is right: the mesh stays usable."""
    x, w = prepared_gemm_rs(mesh)
    if mesh.rank == 1:
        raised(et.InputError, lambda: et.ops.gemm_reduce_scatter(x.half(), w, mesh=mesh), "rank 1's call was accepted")
    else:
        et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
        e = raised(et.ShapeMismatchError, lambda: checked_everything(mesh), "rank 0's launch finished without rank 1")
        assert "rank 1 refused its arguments" in str(e), e
    y = et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
    want = reference(x, w, mesh)
    assert ((y.float() - want).abs().max() / want.abs().max()).item() < 2e-2
    print(f"OK refusal rank {mesh.rank}", flush=True)


def check_dtype_mismatch(mesh):
    """bf16 on one rank, fp16 on the other, at a shape both dtypes' kernels had prepared (issue 45: rank
    0 returned a wrong result without an error, rank 1 timed out): every launch checks the ranks' calls
    at entry, runs nothing, and each rank raises CallMismatchError naming both calls at its next call
    (here check()); the next calls that agree run right."""
    x, w = prepared_gemm_rs(mesh)
    et.ops.gemm_reduce_scatter(x.half(), w.half(), mesh=mesh)      # the fp16 kernel prepared too
    torch.cuda.synchronize()
    dtype = torch.bfloat16 if mesh.rank == 0 else torch.float16
    et.ops.gemm_reduce_scatter(x.to(dtype), w.to(dtype), mesh=mesh)
    e = raised(et.ShapeMismatchError, lambda: checked_everything(mesh), "the disagreeing calls ran")
    assert "bfloat16" in str(e) and "float16" in str(e) and "the ranks disagree on call" in str(e), e
    y = et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
    want = reference(x, w, mesh)
    assert ((y.float() - want).abs().max() / want.abs().max()).item() < 2e-2
    print(f"OK dtype-mismatch rank {mesh.rank}", flush=True)


def check_streams(mesh):
    """Launches on two streams run in call order (mesh/stream_order.py). The first switch: a call on
    s2 waits for s1's queue (a long copy, then a call). After it, a call on s2 waits only for the
    last launch, not for work queued behind it on s1. Every output matches the reference. The work
    on s1 is a host-to-device copy (the copy engines, no SM): a kernel there would hold SM room
    that our cooperative launch needs, delaying it whatever the order."""
    K, N, M = 1536, 1024, 64
    w = torch.randn(K, N, device=mesh.device, dtype=torch.bfloat16) / K ** 0.5
    xs = [torch.randn(M, K, device=mesh.device, dtype=torch.bfloat16) for _ in range(4)]
    op = lambda x: et.ops.gemm_reduce_scatter(x, w, mesh=mesh)   # noqa: E731
    host = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=mesh.device)
    op(xs[0])
    torch.cuda.synchronize()
    t0 = time.time()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.time() - t0
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        dev.copy_(host, non_blocking=True)
        y1 = op(xs[1])
    with torch.cuda.stream(s2):
        y2 = op(xs[2])
        done2 = torch.cuda.Event()
        done2.record()
    time.sleep(copy_s / 4)
    assert not done2.query(), "the call on s2 ran before the call on s1 issued ahead of it"
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        y3 = op(xs[3])
        dev.copy_(host, non_blocking=True)   # queued behind the launch: s2 need not wait for it
        copied = torch.cuda.Event()
        copied.record()
    with torch.cuda.stream(s2):
        y4 = op(xs[1])
        done4 = torch.cuda.Event()
        done4.record()
    t0 = time.time()
    while not done4.query() and time.time() - t0 < 2 * copy_s:
        time.sleep(0.0002)
    assert done4.query() and not copied.query(), "the call on s2 waited for work queued behind s1's launch"
    torch.cuda.synchronize()
    for x, y in ((xs[1], y1), (xs[2], y2), (xs[3], y3), (xs[1], y4)):
        want = reference(x, w, mesh)
        err = ((y.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, err
    checked_everything(mesh)
    print(f"OK streams rank {mesh.rank} (a 4 GiB copy took {copy_s * 1e3:.0f} ms)", flush=True)


def check_capture_refusal(mesh):
    """A call refused while a CUDA graph captures it (x fp16, w bf16; rank 1, or the only rank)
    raises its InputError, not a CUDA error from a synchronise inside the capture; that rank's next
    call publishes the refusal first (mesh/calls.py), then runs; a peer's replay of its own captured
    call sees the refusal at entry, runs nothing, and its check() raises CallMismatchError naming the
    refusing rank; the next calls of both run right."""
    x, w = prepared_gemm_rs(mesh)
    refuser = mesh.world_size - 1
    g = torch.cuda.CUDAGraph()
    if mesh.rank == refuser:
        def capture_refused():
            with torch.cuda.graph(g):
                et.ops.gemm_reduce_scatter(x.half(), w, mesh=mesh)
        raised(et.InputError, capture_refused, "the call was accepted")
    else:
        with torch.cuda.graph(g):
            et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
        g.replay()
        e = raised(et.ShapeMismatchError, lambda: checked_everything(mesh), "the replay ran without the refusing rank")
        assert f"rank {refuser} refused its arguments" in str(e), e
    y = et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
    want = reference(x, w, mesh)
    assert ((y.float() - want).abs().max() / want.abs().max()).item() < 2e-2
    print(f"OK capture-refusal rank {mesh.rank}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="ok")
    args = ap.parse_args()
    dist.init_process_group("cpu:gloo,cuda:nccl")  # the mesh reuses the group; references go through gloo
    mesh = et.init_mesh(watchdog_s=3 if args.case == "peer-skips" else None)
    if args.case in ("ok", "trace", "dynamic", "graph", "streams"):
        {"ok": check_ok, "trace": check_trace, "dynamic": check_dynamic, "graph": check_graph,
         "streams": check_streams}[args.case](mesh)
        mesh.close()
    elif args.case in ("refusal", "capture-refusal", "dtype-mismatch"):   # the mesh stays usable: closed as usual
        {"refusal": check_refusal, "capture-refusal": check_capture_refusal,
         "dtype-mismatch": check_dtype_mismatch}[args.case](mesh)
        mesh.close()
    else:  # the mesh is broken on purpose: leave without the collective teardown
        {"peer-skips": check_peer_skips}[args.case](mesh)
        sys.stdout.flush()
        os._exit(0)
