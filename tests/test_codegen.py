"""The GPU backend's code generation, checked without a GPU: Triton compiles the generated
megakernel for sm_90 on the host, and the PTX carries the memory orderings we intend."""
import dataclasses
import functools
import re

import pytest
import torch
import triton
import triton.language as tl

import etdist as et
from etdist.fusion.codegen_triton import (compile_for, compile_ptx, decode_event_code, event_code, generate,
                                          kernel_params, local_prefix)
from etdist.kernels import moe_tiles
from etdist.workloads import ag_gemm, gemm_rs, mlp, moe


@pytest.fixture(scope="module")
def gemm_rs_ir():
    return gemm_rs.gemm_reduce_scatter(block_m=64, block_n=64, dtype=torch.bfloat16).to_ir()


@pytest.fixture(scope="module")
def gemm_rs_ptx(gemm_rs_ir):
    return compile_ptx(gemm_rs_ir)


def test_generated_source_is_the_static_schedule(gemm_rs_ir):
    src = generate(gemm_rs_ir)
    assert "for _et_gid in range(_et_pid, _et_end1, NUM_PROGRAMS):" in src  # program p runs p, p+P, ...
    assert "do_not_specialize=['K', 'M', 'N', 'RANK', 'WORLD'" in src      # align=1: nothing specialised
    assert src.count("_et_wait(") == 1 and src.count("_et_notify(") == 1
    call = src[src.index("_et_body_matmul("):].split("\n")[0]
    assert call.startswith("_et_body_matmul((k // ")                   # tile k's owner, then its (i, j)
    assert call.endswith(", s, x, w, partial, partial_peers, M, K, N, RANK, WORLD, 1, 1, 64, 64, 64, 0, USE_ASM)")
    assert "_et_body_reduce(i, j, 1, -1, partial, y, " in src           # one slice from every source


def test_event_checks_are_generated_only_when_asked(gemm_rs_ir):
    """check_events: each notify checks its coordinates, the end checks every counter; off (the
    default), the kernel has neither (their run is tests/interp/check_events_worker.py's)."""
    plain, checked = generate(gemm_rs_ir), generate(gemm_rs_ir, check_events=True)
    assert "_et_record" not in plain and "_et_bad" not in plain
    assert checked.count("_et_record(arena, arena_peers, RANK, WORLD, 6,") == checked.count("_et_notify(") == 1
    assert checked.count("_et_record(arena, arena_peers, RANK, WORLD, 7,") == len(gemm_rs_ir.events)


def test_local_prefix_is_what_no_peer_can_see():
    """local_prefix: the leading tasks with no waits, local notifies and bodies given neither an
    output nor a symmetric tensor: the skinny slices summed locally (matmul into `slices`), the MoE
    router's logits; not a matmul that stores into its owner's partials, nor a gather."""
    skinny = lambda **kw: gemm_rs.gemm_reduce_scatter_skinny(64, 64, torch.bfloat16, 64, **kw).to_ir()  # noqa: E731
    assert local_prefix(skinny(local_sums=True)) == 1 and local_prefix(skinny()) == 0
    assert local_prefix(moe.moe_layer(top_k=2, block_m=16, max_experts=16).to_ir()) == 1
    assert local_prefix(ag_gemm.all_gather_gemm(64, 64, torch.bfloat16, 64).to_ir()) == 0

    @triton.jit
    def body(i, x, s):
        pass

    def one_task(scratch: dict, reads: bool = False) -> int:   # a task without waits over x and a scratch `s`
        g = et.Graph("local")
        n = g.size("n")
        g.input("x", (n,))
        s = g.scratch("s", (n,), torch.int32, **scratch)
        done = g.event("done", (1,), count=n)
        when = (lambda i: s[i] > 0) if reads else None

        @g.task(grid=(n,), notify=lambda i: done[0], when=when, triton=body)
        def a(t, i):
            pass
        return local_prefix(g.to_ir())

    assert one_task({}) == 1
    assert one_task({"symmetric": True}) == 0 and one_task({"zeroed": True}) == 0   # a peer's, or kept zero
    assert one_task({}, reads=True) == 0                                             # a `when` that reads


def test_local_first_runs_the_local_bodies_before_the_agreement_and_their_notifies_after():
    """local_first: the call's word posted, the local tasks' bodies, the wait for the peers' words,
    then (agreed) the local tasks' notifies and the rest of the walk from the first id past the
    local ones that is this program's; without it one agreement comes first, as before."""
    ir = gemm_rs.gemm_reduce_scatter_skinny(64, 64, torch.bfloat16, 64, local_sums=True, align=16).to_ir()
    plain, src = generate(ir), generate(ir, local_first=True)
    assert "_et_agree_post(" not in plain and plain.count("_et_agree(") == 1
    at = [src.index(s) for s in ("_et_agree_post(", "_et_body_matmul(", "_et_agree_wait(", "if _et_agreed != 0:",
                                 "_et_notify(arena + ev_sliced_off", "_et_body_combine(")]
    assert at == sorted(at) and "_et_seq, _et_agreed = _et_agree(" not in src
    assert src.count("_et_body_matmul(") == 1 and src.count("ev_sliced_off + j, 1") == 1   # each once
    assert ("for _et_gid in range(_et_end0 + (_et_pid + NUM_PROGRAMS - _et_end0 % NUM_PROGRAMS) % NUM_PROGRAMS, "
            in src)
    assert "wgmma" in compile_ptx(ir, local_first=True)   # it builds for sm_90
    # the dynamic schedule: only pinned tasks walk the static formula (the MoE router's logits);
    # a graph without them has no local prefix to run early
    moe_ir = moe.moe_layer(top_k=2, block_m=16, max_experts=16).to_ir()
    dyn = generate(moe_ir, dynamic=True, local_first=True)
    at = [dyn.index(s) for s in ("_et_agree_post(", "_et_body_logits(", "_et_agree_wait(", "_et_body_route(")]
    assert at == sorted(at) and dyn.count("_et_body_logits(") == 1
    assert generate(ir, dynamic=True, local_first=True) == generate(ir, dynamic=True)


def test_ptx_orders_cross_gpu_signals(gemm_rs_ptx):
    ptx = gemm_rs_ptx
    assert re.search(r"ld\.acquire\.sys\.global\.b32", ptx), "waits on peer-notified events must be sys-scope acquires"
    assert re.search(r"atom\.global\.sys\.release\.add", ptx), "notifies to a peer must be sys-scope release adds"
    assert re.search(r"atom\.global\.sys\.release\.exch", ptx), "exit lanes are set with a sys-scope release"
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx), "the grid counter is a gpu-scope acq_rel add"
    assert "mma" in ptx and "bar.sync" in ptx  # tensor-core tiles; CTA barrier before each release


def test_aligned_sizes_vectorise_and_M_stays_unspecialised():
    """K, N promised multiples of 16 are specialised (vector loads, cp.async, vector peer stores);
    M is not, so every M runs the same binary."""
    ir = gemm_rs.gemm_reduce_scatter(block_m=128, block_n=128, dtype=torch.bfloat16, align=16).to_ir()
    src = generate(ir)
    assert "do_not_specialize=['M', 'RANK', 'WORLD'" in src
    ptx = compile_ptx(ir, num_warps=8)
    assert "cp.async.bulk.tensor" in ptx and "wgmma" in ptx    # aligned GEMM tiles load through TMA
    assert "st.global.b16" not in ptx, "a store of the GEMM or the reduce is not vectorised"


@pytest.mark.parametrize("build", ["ag_gemm", "mlp", "mlp_whole", "gemm_rs_skinny", "gemm_rs_skinny_local",
                                   "gemm_rs_tail"])
def test_aligned_gemm_tiles_load_through_tma(build):
    """Every GEMM body of an aligned graph loads its operands with TMA (no cp.async pointer loads
    left in its main loop), and a tile whose rows were written in the same launch fences the async
    proxy first (an event's release/acquire orders only generic-proxy accesses)."""
    ir = {"ag_gemm": lambda: ag_gemm.all_gather_gemm(128, 128, torch.bfloat16, 64, align=16),
          "mlp": lambda: mlp.tp_mlp(128, 128, torch.bfloat16, 64, align=16),
          "mlp_whole": lambda: mlp.tp_mlp_whole(64, 128, torch.bfloat16, 64, align=16),
          "gemm_rs_skinny": lambda: gemm_rs.gemm_reduce_scatter_skinny(dtype=torch.bfloat16, splits=4, align=16),
          "gemm_rs_skinny_local": lambda: gemm_rs.gemm_reduce_scatter_skinny(128, 128, torch.bfloat16, 128, 4, 16,
                                                                             swap_ab=True, reduce_n=32, local_sums=True),
          "gemm_rs_tail": lambda: gemm_rs.gemm_reduce_scatter(128, 256, torch.bfloat16, 64, align=16, splits=4,
                                                              wave=132)}[build]()
    ptx = compile_ptx(ir.to_ir(), num_warps=8)
    assert "cp.async.bulk.tensor" in ptx and "wgmma" in ptx
    assert "cp.async.cg" not in ptx and "cp.async.ca" not in ptx, "a GEMM operand still loads through pointers"
    if not build.startswith("gemm_rs"):   # its operands are the inputs, written before the launch
        assert "fence.proxy.async.global" in ptx


@pytest.mark.parametrize("build", ["ag_gemm", "mlp", "mlp_replicated_swap", "gemm_rs_tail"])
def test_row_pointer_tiles_load_weights_through_tma_and_rows_through_pointers(build):
    """row_pointers (the plans' choice where a row tile's box would run far past the rows: ops.plan_model.
    row_pointers): the weights still load through descriptors, the rows through masked cp.async (the
    swapped tile transposes the rows it loaded). test_op_megakernels_do_not_spill compiles the ops'
    row-pointer kernels too."""
    ir = {"ag_gemm": lambda: ag_gemm.all_gather_gemm(128, 128, torch.bfloat16, 64, align=16, row_pointers=True),
          "mlp": lambda: mlp.tp_mlp(128, 128, torch.bfloat16, 64, align=16, row_pointers=True),
          "mlp_replicated_swap": lambda: mlp.tp_mlp_replicated(32, 128, torch.bfloat16, 64, align=16, swap_ab=True,
                                                               row_pointers=True),
          "gemm_rs_tail": lambda: gemm_rs.gemm_reduce_scatter(128, 256, torch.bfloat16, 64, align=16, splits=4,
                                                              wave=132, row_pointers=True)}[build]()
    ptx = compile_ptx(ir.to_ir(), num_warps=8)
    assert "cp.async.bulk.tensor" in ptx and "wgmma" in ptx, "the weights no longer load through TMA"
    assert "cp.async.cg" in ptx or "cp.async.ca" in ptx, "the rows do not load through pointers"


def test_local_events_use_gpu_scope():
    g = et.Graph("local")
    n = g.size("n")
    g.input("x", (n,))
    done = g.event("done", (n,))

    @triton.jit
    def nop(i, x):
        tl.store(x + i, 1.0)

    @g.task(grid=(n,), notify=lambda i: done[i], triton=nop)
    def a(t, i):
        pass

    @g.task(grid=(n,), wait=lambda i: done[i], triton=nop)
    def b(t, i):
        pass

    ptx = compile_ptx(g.to_ir())
    assert re.search(r"ld\.acquire\.gpu\.global\.b32", ptx)
    assert re.search(r"atom\.global\.gpu\.release\.add", ptx)
    assert not re.search(r"atom\.global\.sys\.release\.add", ptx)


def test_body_parameters_are_bound_by_name():
    g = et.Graph("binding")
    n = g.size("n")
    g.input("x", (n,))

    @triton.jit
    def body(i, x, mystery):
        pass

    @g.task(grid=(n,), triton=body)
    def a(t, i):
        pass

    with pytest.raises(et.GraphError, match="takes 'mystery', which is no index name, tensor"):
        generate(g.to_ir())


def test_index_names_may_not_shadow_kernel_parameters():
    g = et.Graph("shadow")
    n = g.size("n")
    g.input("x", (n,))

    @triton.jit
    def body(n):
        pass

    @g.task(grid=(n,), triton=body)
    def a(t, n):  # the index is called like the size
        pass

    with pytest.raises(et.GraphError, match="index name 'n' collides"):
        generate(g.to_ir())


@triton.jit
def _nothing():
    pass


def _one_empty_task(g: et.Graph) -> et.Graph:
    """g with one task that does nothing: enough for generate() to look at g's names."""
    @g.task(grid=(1,), triton=_nothing)
    def a(t, i):
        pass
    return g


@pytest.mark.parametrize("name", ["error_host", "arena", "max_spins", "epoch", "NUM_PROGRAMS", "tl"])
def test_tensors_and_sizes_may_not_take_the_kernels_own_parameter_names(name):
    for as_size in (False, True):
        g = et.Graph("taken")
        n = g.size(name if as_size else "n")
        g.input("x" if as_size else name, (n,))
        with pytest.raises(et.GraphError, match="the megakernel's own parameters"):
            generate(_one_empty_task(g).to_ir())


def test_event_codes_round_trip():
    for e, lin in [(0, 0), (3, 12345), (7, (1 << 20) - 1)]:
        assert decode_event_code(event_code(e, lin)) == (e, lin)
    assert decode_event_code(2 << 20) is None  # the mesh's own codes are below ours


def test_skinny_variant_notifies_every_owner_in_a_loop():
    ir = gemm_rs.gemm_reduce_scatter_skinny(dtype=torch.bfloat16, splits=4, align=16).to_ir()
    src = generate(ir)
    assert "for _et_s0 in range(0, WORLD):" in src  # et.every(0, R) becomes a loop of notifies
    ptx = compile_ptx(ir)
    assert "wgmma" in ptx and "cp.async" in ptx
    assert re.search(r"atom\.global\.sys\.release\.add", ptx)


def test_mlp_graph_compiles_with_every_gpu_body():
    ir = mlp.tp_mlp(block_m=64, block_n=64, dtype=torch.bfloat16, align=16).to_ir()
    src = generate(ir)
    for body in ("_et_body_ag_out_send(", "_et_body_gate_up(", "_et_body_down(", "_et_body_reduce("):
        assert body in src
    ptx = compile_ptx(ir)
    assert "wgmma" in ptx and re.search(r"atom\.global\.sys\.release\.add", ptx)


@pytest.mark.parametrize("variant", ["ag_gemm_whole", "mlp_whole"])
def test_small_m_variants_compile_for_sm90(variant):
    build = {"ag_gemm_whole": ag_gemm.all_gather_gemm_whole, "mlp_whole": mlp.tp_mlp_whole}[variant]
    ir = build(64, 64, torch.bfloat16, 128, 16).to_ir()
    ptx = compile_ptx(ir)
    assert "wgmma" in ptx and re.search(r"ld\.acquire\.sys", ptx) and re.search(r"atom\.global\.sys\.release\.add", ptx)


def test_all_gather_gemm_graph_compiles():
    ptx = compile_ptx(ag_gemm.all_gather_gemm(128, 128, torch.bfloat16, 64, 16).to_ir(), num_warps=8)
    assert "wgmma" in ptx and "cp.async" in ptx and re.search(r"ld\.acquire\.sys", ptx)


def test_dynamic_schedule_pops_a_ready_queue_and_releases_consumers():
    """Without early push's chains (early_push 0 or 1, the default: gemm_rs waits on no
    pinned work) the matmul tiles' notifies release the reduce tiles; with them (2) the reduce
    tiles are seeded behind the matmul tiles and spin, and nothing is released."""
    from etdist.fusion.ir import early_pushed
    ir = gemm_rs.gemm_reduce_scatter(block_m=64, block_n=64, dtype=torch.bfloat16, align=16).to_ir()
    chained = generate(ir, dynamic=True, early=early_pushed(ir, chains=True))
    assert chained.count("_et_release(") == 0 and chained.count("_et_notify(") == 1
    src = generate(ir, dynamic=True)
    assert src == generate(ir, dynamic=True, early=frozenset())
    assert "while _et_more != 0:" in src and "_et_take(rq, _et_claimed, rq_q, _et_limit" in src
    assert "for _et_gid in range(" not in src                        # no static formula
    assert src.count("_et_release(") == 1 and "_et_notify(" not in src
    assert "ev_epoch * (WORLD)" in src                                # arrived's count, for the release
    assert "epoch" not in kernel_params(ir, dynamic=True)              # the kernel's own (arena words)
    assert "ev_epoch = tl.load(arena + " in src and "_et_last != 0" in src
    ptx = compile_ptx(ir, dynamic=True)
    assert "wgmma" in ptx and "atom.global.gpu.relaxed.add.u64" in ptx         # claims: fetch-and-add on the head
    assert "cas.b64" not in ptx                                                # no retry loop on the head
    assert "atom.global.gpu.relaxed.exch.b64" in ptx and "_et_rewind(rq, _et_limit)" in src  # head rewound
    assert "atom.global.sys.acq_rel.add.u32" in ptx                           # notify that sees completion
    assert "atom.global.sys.release.exch.b64" in ptx                          # a slot published (push)
    assert "ld.global.sys.acquire.b64" in ptx                                 # a claimed slot polled


def test_dynamic_tasks_claim_their_next_index_between_body_and_notifies():
    """A queued task whose notifies are all plain claims the next index after its body, before
    them; one whose notify may walk consumers into the queue claims after it (the claimed task
    would wait behind the walk). One claim per task either way: tasks that did not claim (or run)
    claim after the dispatch."""
    from etdist.fusion.ir import early_pushed
    ir = gemm_rs.gemm_reduce_scatter(block_m=64, block_n=64, dtype=torch.bfloat16, align=16).to_ir()
    claim = "_et_claimed = _et_claim(rq)"
    loop = generate(ir, dynamic=True).split("while _et_more != 0:")[1]       # matmul releases reduce tiles
    matmul, reduce = loop.split("_et_body_reduce(")
    assert "_et_release(" in matmul and claim not in matmul.split("_et_body_matmul(")[1]
    assert reduce.count(claim) == 2                                          # in reduce, and after the dispatch
    chained = generate(ir, dynamic=True, early=early_pushed(ir, chains=True)).split("while _et_more != 0:")[1]
    body = chained.index("_et_body_matmul(")                                 # reduce tiles seeded: plain notifies
    assert body < chained.index(claim) < chained.index("_et_notify(") < chained.index("_et_body_reduce(")
    assert chained.count(claim) == len(ir.tasks) + 1


def test_dynamic_on_gpus_refuses_counts_that_depend_on_rank():
    from etdist.fusion.bind import MapTable
    from etdist.fusion.cuda_runtime import CudaKernel
    g = et.Graph("rank_count")
    g.input("x", (4,), torch.float32)
    e = g.event("e", (1,), count=g.rank + 1)

    @g.task(grid=(1,), notify=lambda i: e[0])
    def a(t, i):
        pass

    @g.task(grid=(1,), wait=lambda i: e[0])
    def b(t, i):
        pass
    with pytest.raises(et.GraphError, match="do not depend on RANK"):
        CudaKernel(MapTable.build(g.to_ir()), "dynamic")


def test_distributed_counts_read_from_tensors_are_refused_on_gpus():
    from etdist.fusion.bind import MapTable
    from etdist.fusion.cuda_runtime import CudaKernel
    g = et.Graph("dd_remote")
    n = g.input("n", (1,), torch.int64)
    e = g.event("e", (g.world,), count=lambda r: n[0], distributed=True)
    ready = g.event("ready", (1,))

    @g.task(grid=(1,), notify=lambda i: ready[0])
    def a(t, i):
        pass

    @g.task(grid=(1,), wait=lambda i: [ready[0], e[g.rank]])
    def b(t, i):
        pass
    with pytest.raises(et.GraphError, match="local events only"):
        CudaKernel(MapTable.build(g.to_ir()), "static")


@pytest.mark.slow   # the default set compiles nn.MoE's kernel in test_op_megakernels_do_not_spill[moe]
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_graph_compiles_for_sm90(dtype):
    from etdist.workloads import moe
    ir = moe.moe_layer(top_k=8, block_m=64, dtype=dtype, block=64, block_n=128, align=16).to_ir()  # as nn.MoE
    for dynamic in (False, True):
        ptx = compile_ptx(ir, dynamic=dynamic, num_warps=8)
        assert re.search(r"atom\.global\.sys\.(release|acq_rel)", ptx)
        # aligned sizes vectorise the loads, so Triton pipelines the expert GEMM loops (without
        # them no cp.async at all: every operand went through plain loads, measured ~70 TF/s)
        assert re.search(r"cp\.async\.wait_group\s+[1-9]", ptx)
        assert "cp.async.bulk.tensor" in ptx   # the expert weights load through TMA


def _spill_bytes(ptx: str) -> int:
    """Bytes a thread spills to local memory, by the ptxas that ships with Triton (sm_90a)."""
    import os
    import subprocess
    import tempfile
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\d+) bytes spill stores", info).group(1))


def _op_kernels():
    """(name, graph, warps, stages) of the kernels the fused ops and nn.MoE compile, bf16, aligned."""
    from etdist.ops import ag_gemm as ag_op, gemm_rs as rs_op, mlp as mlp_op
    from etdist.ops.config import DEFAULT_PLAN as P
    from etdist.workloads import moe
    bf = torch.bfloat16
    # every size class (256: large tiles in contraction slices; 129: rows through pointers)
    for M in (16, 64, 128, 129, 256, 8192):
        cfg, _, _, build = rs_op.kernel_plan(M, 6144, 4096, bf, 132, 2, P)
        yield f"gemm_rs M={M}", build, cfg.num_warps, cfg.num_stages
    # the 128-row class with each rank's slices summed before they cross the links (local_sums_min_m)
    cfg, _, _, build = rs_op.kernel_plan(128, 6144, 4096, bf, 132, 2, dataclasses.replace(P, local_sums_min_m=0))
    assert "local_sums" not in build.keywords
    yield "gemm_rs M=128 slices to the owners", build, cfg.num_warps, cfg.num_stages
    # gemm_rs just past the skinny classes: a 128-row accumulator and a 32-row tail (an option), bf16 and fp32
    for dt in (bf, torch.float32):
        cfg, _, _, build = rs_op.kernel_plan(129, 6144, 4096, dt, 132, 2, P.override("skinny_tail_m=32"))
        assert build.keywords["tail_m"] == 32
        yield f"gemm_rs skinny tail M=129 {dt}", build, cfg.num_warps, cfg.num_stages
    # the skinny classes' partials in bf16 (an option), with and without local sums
    for M in (16, 128):
        cfg, _, _, build = rs_op.kernel_plan(M, 6144, 4096, bf, 132, 2, P.override("skinny_x_partials=1"))
        assert build.keywords["x_partials"]
        yield f"gemm_rs skinny bf16 partials M={M}", build, cfg.num_warps, cfg.num_stages
    # the whole classes' ragged last wave in slices (an option), at 16 (transposed tiles) and 128 rows
    for M in (16, 128):
        cfg, build = ag_op.kernel_plan(M, 4608, 36864, bf, 132, 2, P.override("whole_ragged_splits=8"))
        assert build.keywords["ragged_splits"] == 5
        yield f"ag_gemm_whole ragged M={M}", build, cfg.num_warps, cfg.num_stages
    # all_gather_gemm just past the whole class: a 128-row accumulator and a 32-row tail
    cfg, build = ag_op.kernel_plan(129, 8192, 28672, bf, 132, 2, P)
    assert build.keywords["tail_m"] == 32
    yield "ag_gemm tail M=129", build, cfg.num_warps, cfg.num_stages
    # both tails with their first 128 rows through a descriptor (an option)
    cfg, build = ag_op.kernel_plan(129, 8192, 28672, bf, 132, 2, P.override("tail_row_tma=1"))
    assert build.keywords["tail_row_tma"]
    yield "ag_gemm tail rows by descriptor M=129", build, cfg.num_warps, cfg.num_stages
    cfg, _, _, build = rs_op.kernel_plan(129, 6144, 4096, bf, 132, 2, P.override("skinny_tail_m=32+tail_row_tma=1"))
    assert build.keywords["tail_row_tma"]
    yield "gemm_rs skinny tail rows by descriptor M=129", build, cfg.num_warps, cfg.num_stages
    # the MLP just past the whole class with every row in each task (an option), bf16 and fp32
    for dt, extra in ((bf, "+tail_row_tma=1"), (torch.float32, "")):
        cfg, build, _ = mlp_op.kernel_plan(160, 8192, 14336, dt, 132, 2, P.override("mlp_tail_m=32" + extra))
        assert build.keywords["tail_m"] == 32
        yield f"mlp tail M=160 {dt}", build, cfg.num_warps, cfg.num_stages
    # the replicated MLP's 128-row class with each output tile summed on its owner
    cfg, build, _ = mlp_op.replicated_plan(128, 4096, 6144, bf, 132, 2, P)
    assert build.keywords["owners"]
    yield "mlp_replicated owners M=128", build, cfg.num_warps, cfg.num_stages
    # a decode candidate (a 16-row skinny class, swapped)
    yield "gemm_rs skinny swap 16x128x128", \
        lambda: gemm_rs.gemm_reduce_scatter_skinny(16, 128, bf, 128, 4, 16, swap_ab=True), 4, 6
    L, T = P.large, P.mlp_tiles
    # the tail plan's graph: two matmul bodies (whole tiles, slices) in one kernel
    yield "gemm_rs tail", lambda: gemm_rs.gemm_reduce_scatter(L.block_m, L.block_n, bf, L.block_k, 16, splits=4, wave=132), \
        L.num_warps, L.num_stages
    for M in (16, 64, 128):   # every whole-gather class of each op, as the ops build them
        A, W = ag_op.whole_tile("all_gather_gemm", M, P), ag_op.whole_tile("tensor_parallel_mlp", M, P)
        yield f"ag_gemm_whole M={M}", functools.partial(ag_gemm.all_gather_gemm_whole, A.block_m, A.block_n, bf,
                                                        A.block_k, 16, swap_ab=A.swap_ab), A.num_warps, A.num_stages
        yield f"mlp_whole M={M}", functools.partial(mlp.tp_mlp_whole, W.block_m, W.block_n, bf, W.block_k, 16,
                                                    swap_ab=W.swap_ab), W.num_warps, W.num_stages
        # a ragged M in the class: the rows through pointers (ops.gemm_rs.row_pointers)
        yield f"ag_gemm_whole M={M - 1} rows", functools.partial(ag_gemm.all_gather_gemm_whole, A.block_m, A.block_n,
                                                                 bf, A.block_k, 16, swap_ab=A.swap_ab,
                                                                 row_pointers=True), A.num_warps, A.num_stages
        yield f"mlp_whole M={M - 1} rows", functools.partial(mlp.tp_mlp_whole, W.block_m, W.block_n, bf, W.block_k, 16,
                                                             swap_ab=W.swap_ab, row_pointers=True), \
            W.num_warps, W.num_stages
        # the plans' narrowest GEMM tiles (ops.ag_gemm.whole_width), the down tiles in slices
        yield f"ag_gemm_whole M={M} narrow", functools.partial(ag_gemm.all_gather_gemm_whole, A.block_m, A.block_n, bf,
                                                               A.block_k, 16, gemm_n=ag_op.WHOLE_MIN_N,
                                                               swap_ab=A.swap_ab), A.num_warps, A.num_stages
        yield f"mlp_whole M={M} narrow", functools.partial(mlp.tp_mlp_whole, W.block_m, W.block_n, bf, W.block_k, 16,
                                                           down_splits=4, up_n=ag_op.WHOLE_MIN_N, swap_ab=W.swap_ab), \
            W.num_warps, W.num_stages
    own = dict(own_from_x=True)   # above 128 rows, as the ops build them
    yield "ag_gemm", lambda: ag_gemm.all_gather_gemm(L.block_m, L.block_n, bf, L.block_k, 16, **own), L.num_warps, \
        L.num_stages
    A = P.large_narrow   # above 128 rows where the large tiles leave a ragged last wave
    yield "ag_gemm narrow", lambda: ag_gemm.all_gather_gemm(A.block_m, A.block_n, bf, A.block_k, 16, **own), \
        A.num_warps, A.num_stages
    yield "mlp", lambda: mlp.tp_mlp(T.block_m, T.block_n, bf, T.block_k, 16, down_n=P.mlp_down_n, **own), T.num_warps, \
        T.num_stages
    yield "mlp tail", lambda: mlp.tp_mlp(T.block_m, T.block_n, bf, T.block_k, 16, down_n=P.mlp_down_n, tail_splits=3,
                                         **own), T.num_warps, T.num_stages
    yield "mlp rows", lambda: mlp.tp_mlp(T.block_m, T.block_n, bf, T.block_k, 16, down_n=P.mlp_down_n, tail_splits=3,
                                         row_pointers=True, padded=True), T.num_warps, T.num_stages
    yield "mlp padded own", lambda: mlp.tp_mlp(T.block_m, T.block_n, bf, T.block_k, 16, down_n=P.mlp_down_n,
                                               tail_splits=3, padded=True, **own), T.num_warps, T.num_stages
    yield "ag_gemm narrow rows", lambda: ag_gemm.all_gather_gemm(A.block_m, A.block_n, bf, A.block_k, 16,
                                                                 row_pointers=True, **own), A.num_warps, A.num_stages
    # all_gather_gemm past 256 rows where the large tiles fill their waves: the whole-gather graph
    cfg, build = ag_op.kernel_plan(384, 8192, 28672, bf, 132, 2, P)
    assert build.func.__name__ == "all_gather_gemm_whole" and cfg is P.large
    yield "ag_gemm whole large M=384", build, cfg.num_warps, cfg.num_stages
    # the plans at M = 129 (ag_gemm: 161, past its tail) on two ranks: the sources' (owners') tiles
    # side by side (ops.plan_model.interleave_sources); gemm_rs in 2 slices (llama31_70b) and whole (gpt3_175b)
    for name, (cfg, build) in (("ag_gemm interleaved", ag_op.kernel_plan(161, 8192, 28672, bf, 132, 2, P)),
                               ("mlp interleaved", mlp_op.kernel_plan(129, 8192, 14336, bf, 132, 2, P)[:2]),
                               ("gemm_rs interleaved", rs_op.kernel_plan(129, 14336, 8192, bf, 132, 2, P)[::3]),
                               ("gemm_rs interleaved whole", rs_op.kernel_plan(129, 24576, 12288, bf, 132, 2, P)[::3])):
        assert build.keywords["interleave"], name
        yield name, build, cfg.num_warps, cfg.num_stages
    # nn.MoE's decode-size class (Qwen3-30B-A3B's top-8 of 128). Its combine's [64, 256]
    # accumulator over 8 unrolled expert loads once spilled 1.8 KB per thread, and as the
    # megakernel has one register allocation, the expert GEMM loops spilled too.
    # The tiles and blocks are a layer's (nn.moe.layer_tiles, graph_blocks): qwen3's (I = 768:
    # 256-wide down tiles; top-8: small routing and combine blocks), mixtral's (I = 14336) at top-2;
    # w_gate_up interleaved as nn.MoE stores it (one 256-wide gate/up dot)
    from etdist.nn.moe import GATE_UP_BLOCK, graph_blocks, layer_tiles
    for name, top_k, I, large, one in (("moe", 8, 768, False, False), ("moe large", 2, 14336, True, False),
                                       ("moe large top-8", 8, 768, True, False),
                                       ("moe one rank top-8", 8, 768, False, True),
                                       ("moe large one rank top-8", 8, 768, True, True)):
        t = layer_tiles(I, 128 if top_k == 8 else 8, large, world=1 if one else 2)
        yield name, functools.partial(moe.moe_layer, top_k=top_k, block_m=t.block_m, dtype=bf, max_experts=128,
                                      block=t.block, block_n=t.block_n, down_block_n=t.down_n,
                                      half_tails=t.half_tails, small_rows=t.small_rows, align=16, one_rank=one,
                                      gate_up_interleave=GATE_UP_BLOCK, **graph_blocks(top_k, large)), \
            t.num_warps, t.num_stages


# one kernel of each family in the default set (a cold compile takes 3-15 s); every one in the slow set
DEFAULT_KERNELS = {"gemm_rs M=16", "gemm_rs M=129", "gemm_rs M=8192", "gemm_rs tail", "ag_gemm_whole M=16",
                   "mlp_whole M=16", "mlp_whole M=127 rows", "ag_gemm", "mlp", "mlp tail", "gemm_rs interleaved", "moe",
                   "ag_gemm tail M=129"}


@pytest.mark.parametrize("name,build,warps,stages", [k if k[0] in DEFAULT_KERNELS else
                                                     pytest.param(*k, marks=pytest.mark.slow) for k in _op_kernels()],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_op_megakernels_do_not_spill(name, build, warps, stages):
    """...and fit in one SM's shared memory (Triton compiles an oversized kernel; the launch fails)."""
    kernel = compile_for(build().to_ir(), num_warps=warps, num_stages=stages)
    assert kernel.metadata.shared <= 232448, (name, kernel.metadata.shared)   # sm_90: 227 KiB per block
    assert _spill_bytes(kernel.asm["ptx"]) <= 64, name


@pytest.mark.slow   # ~10-20 s each, cold
@pytest.mark.parametrize("top_k,I,large,one", [(8, 768, False, False), (8, 768, False, True), (2, 14336, True, False),
                                               (8, 768, True, False), (8, 14336, True, False)],
                         ids=["small", "small-one-rank", "large", "large-top8", "large-top8-long"])
def test_dynamic_moe_megakernel_does_not_spill(top_k, I, large, one):
    """The ready queue's release walk (1024 consumers a block) is a call of its own: inlined, it
    made nn.MoE's dynamic kernels spill (found by review: 340 bytes per thread with 128-row tiles).
    nn.MoE's own tiles for the expert size I (nn.moe.layer_tiles). The large class, at 4 stages
    and with the tail's second static walk, spills 20-44 bytes a thread; its 256-wide down tiles
    (I <= 2048) 88 at top-8: a bound of 96 there, as they won 12-15% spilled (records
    moe_tiles_ab); else the bound of the ops' kernels, 64."""
    from etdist.nn.moe import GATE_UP_BLOCK, graph_blocks, layer_tiles
    from etdist.workloads import moe
    t = layer_tiles(I, 128 if top_k == 8 else 8, large)
    ir = moe.moe_layer(top_k=top_k, block_m=t.block_m, dtype=torch.bfloat16, max_experts=128, block=t.block,
                       block_n=t.block_n, down_block_n=t.down_n, half_tails=t.half_tails, align=16,
                       gate_up_interleave=GATE_UP_BLOCK, small_rows=t.small_rows, fuse_router=t.fused_router,
                       router_width=t.router_width, one_rank=one, **graph_blocks(top_k, large)).to_ir()
    # the early push nn.MoE compiles each class with (down tiles seeded behind gate/up: chains)
    from etdist.fusion.ir import early_at
    from etdist.nn.moe import EARLY_PUSH
    early = early_at(ir, EARLY_PUSH)
    kernel = compile_for(ir, num_warps=t.num_warps, num_stages=t.num_stages, dynamic=True, early=early)
    bound = 96 if large and t.down_n == 256 else 64
    assert kernel.metadata.shared <= 232448 and _spill_bytes(kernel.asm["ptx"]) <= bound


@pytest.mark.slow   # ~15 s, cold
def test_moe_small_body_stages_fit_in_shared_memory():
    """moe_layer(small_stages=6): the 16-row bodies' loops in 6 stages (34 KB each) where the
    kernel's 5 are set by the 64-row body's 40 KB: the one-rank small class still fits an SM, unspilled."""
    from etdist.nn.moe import GATE_UP_BLOCK, graph_blocks, layer_tiles
    from etdist.workloads import moe
    t = layer_tiles(768, 128)
    ir = moe.moe_layer(top_k=8, block_m=t.block_m, dtype=torch.bfloat16, max_experts=128, block=t.block,
                       block_n=t.block_n, down_block_n=t.down_n, align=16, small_rows=t.small_rows, small_stages=6,
                       one_rank=True, gate_up_interleave=GATE_UP_BLOCK, fuse_router=t.fused_router,
                       router_width=t.router_width, **graph_blocks(8)).to_ir()
    kernel = compile_for(ir, num_warps=t.num_warps, num_stages=t.num_stages)
    assert kernel.metadata.shared <= 232448 and _spill_bytes(kernel.asm["ptx"]) <= 64


@pytest.mark.slow   # ~15-45 s each, cold
@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_float32_moe_tiles_fit_in_shared_memory(large):
    """nn.MoE's float32 tiles drop to nn.moe.FLOAT32_STAGES: at the bf16 stages they would need
    246-328 KB of shared memory a program, and the launch would fail."""
    from etdist.nn.moe import layer_tiles
    from etdist.workloads import moe
    t = layer_tiles(768, 128, large, torch.float32)   # short experts: no 256-wide down tiles in float32
    ir = moe.moe_layer(top_k=2, block_m=t.block_m, dtype=torch.float32, max_experts=128, block=t.block,
                       block_n=t.block_n, down_block_n=t.down_n, half_tails=t.half_tails, align=16).to_ir()
    assert compile_for(ir, num_warps=t.num_warps, num_stages=t.num_stages).metadata.shared <= 232448


@pytest.mark.slow   # ~15-30 s each, cold
@pytest.mark.parametrize("dtype,experts", [(torch.bfloat16, 512), (torch.float32, 256)])
def test_many_experts_router_slices_fit_in_shared_memory(dtype, experts):
    """A decode logits task loads its whole router slice only where it takes at most
    workloads.moe.WHOLE_SLICE_BYTES (a dot stages it in shared memory): 512 experts in bf16, 256 in
    float32, step through theirs (found by review: the whole slice needed 264-272 KB)."""
    from etdist.nn.moe import layer_tiles
    from etdist.workloads import moe
    t = layer_tiles(768, experts, dtype=dtype)
    ir = moe.moe_layer(top_k=8, block_m=t.block_m, dtype=dtype, max_experts=experts, block=t.block, block_n=t.block_n,
                       down_block_n=t.down_n, small_rows=t.small_rows, align=16, one_rank=True).to_ir()
    assert compile_for(ir, num_warps=t.num_warps, num_stages=t.num_stages, dynamic=True).metadata.shared <= 232448


def test_swap_ab_skinny_tile_multiplies_transposed():
    """The weights on the wgmma's M side (64 rows) and 16 token rows on its N side, the weight
    tile read transposed from shared memory; the plain tile pads the rows to a 64-row M side."""
    swap = compile_ptx(gemm_rs.gemm_reduce_scatter_skinny(16, 128, torch.bfloat16, 128, 4, 16, swap_ab=True).to_ir(),
                       num_warps=4, num_stages=6)
    plain = compile_ptx(gemm_rs.gemm_reduce_scatter_skinny(64, 128, torch.bfloat16, 128, 4, 16).to_ir(),
                        num_warps=4, num_stages=4)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16", swap)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16", plain)
    assert "cp.async.bulk.tensor" in swap


@triton.jit
def _moe_dispatch_alone(x, topk_ids, recv, recv_peers, recv_expert, recv_expert_peers, T, H, E_local, RANK, WORLD):
    moe_tiles.moe_dispatch(tl.program_id(0), tl.program_id(1), tl.program_id(2), x, topk_ids, recv, recv_peers,
                           recv_expert, recv_expert_peers, T, H, E_local, RANK, WORLD, TOP_K=8, BS=64, BH=128, WH=512)


@triton.jit
def _moe_send_back_alone(d, recv_expert, expert_out, back, back_peers, T, H, RANK, WORLD):
    moe_tiles.moe_send_back(d, tl.program_id(0), tl.program_id(1), recv_expert, expert_out, back, back_peers, T, H,
                            RANK, WORLD, TOP_K=8, BS=64, BH=128, WH=512)


@pytest.mark.parametrize("fn,sig", [
    (_moe_dispatch_alone, dict(x="*bf16", topk_ids="*i64", recv="*bf16", recv_peers="*i64", recv_expert="*i64",
                               recv_expert_peers="*i64", T="i32", H="i32", E_local="i32", RANK="i32", WORLD="i32")),
    (_moe_send_back_alone, dict(d="i32", recv_expert="*i64", expert_out="*bf16", back="*bf16", back_peers="*i64",
                                T="i32", H="i32", RANK="i32", WORLD="i32"))])
def test_moe_copies_store_to_peers_16_bytes_at_a_time(fn, sig):
    """The tokens' rows travel to the peer in 16-byte stores, as the megakernel compiles them (pointers
    16-byte aligned, H a multiple of 16). A peer address made from a loaded integer compiled to one
    2-byte store per element (st.global.b16: an NVLink write each; dispatch ran at ~1/3 of NVLink)."""
    from triton.backends.compiler import GPUTarget
    attrs = {(k,): [["tt.divisibility", 16]] for k, (n, t) in enumerate(sig.items()) if t.startswith("*") or n == "H"}
    src = triton.compiler.ASTSource(fn, sig, constexprs={}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    assert "st.global.v4.b32" in ptx and "st.global.b16" not in ptx


def test_a_tensor_named_like_a_symmetric_tensors_peer_table_is_refused():
    g = et.Graph("twice")
    n = g.size("n")
    g.scratch("x", (n,), torch.float32, symmetric=True)
    g.input("x_peers", (n,))
    with pytest.raises(et.GraphError, match="two kernel parameters"):
        generate(_one_empty_task(g).to_ir())
