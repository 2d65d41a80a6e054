"""Trace mode: off costs nothing in the generated kernel; on, every task's times and SM are stored
and decode back to task coordinates; the CPU runtime writes the same Chrome format."""
import json

import pytest
import torch

import etdist as et
from etdist.fusion.codegen_triton import PHASE_WORDS, TRACE_WORDS, compile_ptx, generate, kernel_params
from etdist.fusion.trace import chrome_events, clock_offset, earliest, first_start, gpu_rows, summary, write_chrome
from etdist.workloads import gemm_rs


def ir():
    return gemm_rs.gemm_reduce_scatter(block_m=64, block_n=64, dtype=torch.bfloat16).to_ir()


def test_trace_is_a_compile_time_switch():
    g = ir()
    off, on = generate(g), generate(g, trace=True)
    assert "trace_buf" not in off and "_et_clock" not in off and "trace_buf" not in kernel_params(g)
    assert kernel_params(g, trace=True)[-1] == "trace_buf"
    # start, waits done, end per task; entry, call agreed, tasks done, end per program
    assert on.count("_et_clock(") == 3 * len(g.tasks) + 4
    ptx_on = compile_ptx(g, trace=True)
    assert "%globaltimer" in ptx_on and "%smid" in ptx_on
    assert "%globaltimer" not in compile_ptx(g)


def test_gpu_rows_decode_task_coordinates():
    g = ir()
    sizes = {"M": 200, "K": 64, "N": 100, "RANK": 1, "WORLD": 2}   # C=100: 2 row tiles, 2 column tiles
    n_matmul, n_reduce = 2 * 2 * 2, 2 * 2
    buf = [0] * ((n_matmul + n_reduce) * TRACE_WORDS)
    def put(gid, start, waited, end, sm, program):
        buf[gid * TRACE_WORDS:(gid + 1) * TRACE_WORDS] = [start, waited, end, sm << 32 | program]
    put(5, 1000, 1500, 4000, 17, 3)            # matmul task (tile 5: dst=1, q=1; contraction slice 0)
    put(n_matmul + 3, 9000, 12000, 13000, 2, 0)  # reduce task (i=1, j=1)
    rows = gpu_rows(g, sizes, buf, rank=1)
    assert rows == [(1, 17, "matmul@(5, 0) program 3, waited 0.5 us", 0.0, 3.0),
                    (1, 2, "reduce@(1, 1) program 0, waited 3.0 us", 8.0, 12.0)]
    big = 1_763_000_000_000_000_000          # a wall-clock %globaltimer: exact to the nanosecond
    buf2 = [w + big if k % TRACE_WORDS < 3 and w else w for k, w in enumerate(buf)]
    buf2[5 * TRACE_WORDS + 2] += 1           # one more ns: visible after the shift
    assert [r[4] for r in gpu_rows(g, sizes, buf2, rank=1)] == [3.001, 12.0]
    events = chrome_events(rows, track="SM")
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"SM 17", "SM 2"}
    assert [e["dur"] for e in events if e["ph"] == "X"] == [3.0, 4.0]


def test_the_launch_phases_of_each_program_decode_after_the_tasks():
    """Each program's entry, call agreed, tasks done and end follow the task records: rows `agree`
    (entry to agreed) and `finish` (tasks done to end), the times from the earliest entry; a program
    that recorded nothing shows none."""
    g = ir()
    sizes = {"M": 200, "K": 64, "N": 100, "RANK": 0, "WORLD": 2}
    tasks, programs = 2 * 2 * 2 + 2 * 2, 3
    buf = [0] * (tasks * TRACE_WORDS + programs * PHASE_WORDS)
    buf[0:TRACE_WORDS] = [5000, 5000, 9000, 4 << 32]               # matmul task 0 on program 0
    at = tasks * TRACE_WORDS
    buf[at:at + PHASE_WORDS] = [1000, 4000, 9500, 10500, 4 << 32]    # program 0 on SM 4
    at += 2 * PHASE_WORDS
    buf[at:at + PHASE_WORDS] = [1200, 4100, 4200, 10000, 7 << 32 | 2]   # program 2 on SM 7; program 1: nothing
    assert earliest(buf, tasks) == 1000 and first_start(buf, tasks) == 5000
    rows = gpu_rows(g, sizes, buf, rank=0)
    assert rows == [(0, 4, "matmul@(0, 0) program 0, waited 0.0 us", 4.0, 8.0),
                    (0, 4, "agree@program 0", 0.0, 3.0), (0, 4, "finish@program 0", 8.5, 9.5),
                    (0, 7, "agree@program 2", 0.2, 3.1), (0, 7, "finish@program 2", 3.2, 9.0)]
    text = summary(rows, 0)
    assert "agree" in text and "finish" in text and "span 9.5 us" in text


def test_cpu_trace_by_default_when_compiled_with_trace(tmp_path):
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=8, block_n=8), trace=True)
    kernel.run(gemm_rs.make_inputs(2, 12, 5, 9))
    trace = kernel.last_stats.trace
    assert len(trace) == kernel.last_stats.tasks_run > 0
    path = write_chrome(trace, tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"]
    kernel.run(gemm_rs.make_inputs(2, 12, 5, 9), trace=False)
    assert kernel.last_stats.trace == []


def test_summary_of_one_rank():
    """span, busy share, per-kind stats and gaps from (rank, SM, label, start, end) rows."""
    from etdist.fusion.trace import summary
    rows = [(0, 1, "matmul@(0, 0) program 1, waited 0.5 us", 0.0, 10.0),
            (0, 1, "reduce@(0,) program 1, waited 2.0 us", 12.0, 20.0),
            (0, 2, "matmul@(0, 1) program 2, waited 1.5 us", 0.0, 10.0),
            (1, 3, "matmul@(1, 0) program 3, waited 9.0 us", 0.0, 99.0)]     # another rank: ignored
    text = summary(rows, rank=0)
    assert "span 20.0 us over 2 programs, busy in tasks 70%" in text           # 28 us busy of 2 x 20
    matmul = next(l for l in text.splitlines() if l.strip().startswith("matmul"))
    assert matmul.split()[1:] == ["2", "0.0", "10.0", "10.0", "10.0", "1.0", "nan"]   # first on their programs
    reduce = next(l for l in text.splitlines() if l.strip().startswith("reduce"))
    assert reduce.split()[-1] == "2.00"                                 # 12.0 - 10.0 on program 1
    assert "median 2.00 us" in text and "sum 0.00 ms" in text
    assert summary(rows, rank=5) == "rank 5: no tasks"


def test_median_tile_body_and_a_queued_trace():
    """median_body_us: one rank's tasks of a kind, each less its wait; queued_trace: warm launches,
    a barrier, then launches back to back, and the last one's rows."""
    from etdist.fusion.trace import median_body_us, queued_trace
    rows = [(0, 1, "matmul@(0, 0) program 1, waited 2.0 us", 0.0, 10.0),
            (0, 2, "matmul@(0, 1) program 2, waited 1.0 us", 0.0, 20.0),
            (0, 3, "matmul@(1, 0) program 3", 0.0, 6.0),
            (0, 4, "matmul_tail@(0,) program 4", 0.0, 50.0),          # another kind
            (1, 1, "matmul@(1, 1) program 1", 0.0, 1.0)]              # another rank
    assert median_body_us(rows, 0, "matmul") == 8.0                   # of 8, 19, 6
    assert median_body_us(rows, 0, "reduce") is None
    calls = []

    class Kernel:
        def __call__(self, mesh, **args):
            calls.append(("launch", args))

        def trace(self, mesh):
            return [("rows after", len(calls))]

    class Mesh:
        def barrier(self):
            calls.append(("barrier", None))

    assert queued_trace(Kernel(), Mesh(), warm=2, queued=3, x=1) == [("rows after", 6)]
    assert [c[0] for c in calls] == ["launch", "launch", "barrier", "launch", "launch", "launch"]
    assert all(a == {"x": 1} for k, a in calls if k == "launch")


def test_clock_offset_takes_the_tightest_bracket():
    """A device timer read lies somewhere in its host bracket [before, after]: the tightest one's
    midpoint is the estimate (launch and sync latency differ from sample to sample)."""
    host_to_device = 240_000_000_123                     # the device timer is this far ahead
    samples = [(1000, 1000 + host_to_device + 9000, 21000),   # wide: the read landed late
               (50_000, 50_000 + host_to_device + 3000, 56_000),
               (90_000, 90_000 + host_to_device + 2500, 95_000)]   # tightest, 5 us
    offset, err = clock_offset(samples)
    assert (offset, err) == (host_to_device, 2500)
    with pytest.raises(ValueError):
        clock_offset([])


def test_ranks_rows_are_aligned_by_their_measured_offsets():
    """Two ranks whose timers are 0.24 s apart, the second rank's launch starting 7 us after the
    first's on the host clock: on one timeline, from the first task of either, 7 us apart (each rank's
    own earliest start used to be its 0, hiding the skew or, where a rank's clock was off, showing a
    launch spanning 0.1 s)."""
    g = ir()
    sizes = {"M": 200, "K": 64, "N": 100, "RANK": 1, "WORLD": 2}
    n = 2 * 2 * 2 + 2 * 2
    offsets = {0: 1_000_000_000, 1: 1_240_000_000}       # device - host, per rank
    host_start = {0: 5_000_000, 1: 5_007_000}
    bufs = {}
    for rank in (0, 1):
        buf = [0] * (n * TRACE_WORDS)
        s = host_start[rank] + offsets[rank]
        buf[0:TRACE_WORDS] = [s, s + 500, s + 3000, 1 << 32]
        bufs[rank] = buf
    starts = [first_start(bufs[r]) - offsets[r] for r in (0, 1)]   # what trace() gathers
    rows = [row for r in (0, 1) for row in gpu_rows(g, {**sizes, "RANK": r}, bufs[r], r,
                                                         origin_ns=min(starts) + offsets[r])]
    assert [(r[0], r[3], r[4]) for r in rows] == [(0, 0.0, 3.0), (1, 7.0, 10.0)]


def test_the_clock_kernel_reads_the_global_timer():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from etdist.kernels.sync import store_clock
    ptx = triton.compile(ASTSource(store_clock, {"out_ptr": "*i64"}, {}), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "%globaltimer" in ptx
