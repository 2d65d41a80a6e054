"""The generated GPU megakernels, run by Triton's CPU interpreter over a cpu-backend mesh (one
process per rank, one program per rank), against the float64 references:

    TRITON_INTERPRET=1 torchrun --nproc_per_node=2 tests/interp/megakernel_worker.py [--dynamic] [--local-first] [graph ...]

--local-first compiles with et.compile's local_first (the local prefix during the call agreement).

Prints 'OK <graph> M=<M>' per graph and size (tests/test_megakernel_interpreted.py counts them).
"""
import sys

import torch

import etdist as et
from etdist.workloads import ag_gemm, gemm_rs, mlp

T = 16   # tile sizes: the smallest tl.dot takes


def cases():
    yield "gemm_rs", gemm_rs.gemm_reduce_scatter(T, T, torch.float32, T, group_m=2), \
        lambda R, M: gemm_rs.make_inputs(R, M, 24, 40, seed=M), gemm_rs.reference, ("x", "w")
    # split-K: K = 24 in slices of one 16-wide step, the third slice empty (it stores zeros)
    yield "gemm_rs_split", gemm_rs.gemm_reduce_scatter(T, T, torch.float32, T, group_m=2, splits=3), \
        lambda R, M: gemm_rs.make_inputs(R, M, 24, 40, seed=M), gemm_rs.reference, ("x", "w")
    # whole tiles in waves of 5 tasks, the tiles past the last whole wave in 3 slices of one step
    # (M=37 on 2 ranks: 2 x 2 x 3 tiles, 10 whole and 2 split; on 3 ranks, and M=5: 9 or 6 tiles)
    yield "gemm_rs_tail", gemm_rs.gemm_reduce_scatter(T, T, torch.float32, T, group_m=2, splits=3, wave=5), \
        lambda R, M: gemm_rs.make_inputs(R, M, 40, 40, seed=M), gemm_rs.reference, ("x", "w")
    yield "gemm_rs_skinny", gemm_rs.gemm_reduce_scatter_skinny(T, T, torch.float32, T, splits=2), \
        lambda R, M: gemm_rs.make_inputs(R, min(M, T), 40, 24, seed=M), gemm_rs.reference, ("x", "w")
    yield "ag_gemm", ag_gemm.all_gather_gemm(T, T, torch.float32, T, group_m=2), \
        lambda R, M: ag_gemm.make_inputs(R, M, 24, 40, seed=M), ag_gemm.reference, ("x", "w")
    yield "ag_gemm_whole", ag_gemm.all_gather_gemm_whole(T, T, torch.float32, T), \
        lambda R, M: ag_gemm.make_inputs(R, M, 24, 40, seed=M), ag_gemm.reference, ("x", "w")
    yield "mlp", mlp.tp_mlp(T, T, torch.float32, T, group_m=2), \
        lambda R, M: mlp.make_inputs(R, M, 24, 20 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down")
    # the last TAIL down tiles of each rank's order in 3 slices (M=37: 2 x 2 x 2 down tiles of 32 columns
    # on 2 ranks, 3 x 1 x 2 on 3; TAIL=2: one owner's whole share on 3 ranks)
    yield "mlp_tail", mlp.tp_mlp(T, T, torch.float32, T, group_m=2, down_n=2 * T, tail_splits=3), \
        lambda R, M: mlp.make_inputs(R, M, 40, 20 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down"), \
        {"TAIL": 2}
    # every down tile in slices (TAIL = all of a rank's: R owners x row tiles x 2 column tiles)
    yield "mlp_tail_every", mlp.tp_mlp(T, T, torch.float32, T, group_m=2, down_n=2 * T, tail_splits=3), \
        lambda R, M: mlp.make_inputs(R, M, 40, 20 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down"), \
        lambda R, M: {"TAIL": R * et.cdiv(et.cdiv(M, R), T) * 2}
    yield "mlp_whole", mlp.tp_mlp_whole(T, T, torch.float32, T, down_splits=2), \
        lambda R, M: mlp.make_inputs(R, M, 24, 20 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down")
    # sizes promised multiples of 16: the GEMM bodies load through TMA descriptors (zero-filled
    # past ragged edges: M, and N = 48 against 32-wide column tiles; the MLP's down tiles twice as
    # wide as its gate/up tiles, as the op runs them)
    yield "gemm_rs_tma", gemm_rs.gemm_reduce_scatter(T, 2 * T, torch.float32, T, align=16, group_m=2), \
        lambda R, M: gemm_rs.make_inputs(R, M, 32, 48, seed=M), gemm_rs.reference, ("x", "w")
    yield "gemm_rs_split_tma", gemm_rs.gemm_reduce_scatter(T, 2 * T, torch.float32, T, align=16, group_m=2, splits=2), \
        lambda R, M: gemm_rs.make_inputs(R, M, 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    yield "gemm_rs_tail_tma", gemm_rs.gemm_reduce_scatter(T, 2 * T, torch.float32, T, align=16, group_m=2, splits=2,
                                                          wave=3), \
        lambda R, M: gemm_rs.make_inputs(R, M, 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    yield "gemm_rs_skinny_tma", gemm_rs.gemm_reduce_scatter_skinny(T, 2 * T, torch.float32, T, splits=2, align=16), \
        lambda R, M: gemm_rs.make_inputs(R, min(M, T), 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    # the owner sums half-width column tiles (reduce_n), as the op's skinny classes do
    yield "gemm_rs_skinny_swap_tma", gemm_rs.gemm_reduce_scatter_skinny(T, 2 * T, torch.float32, T, splits=2,
                                                                        align=16, swap_ab=True, reduce_n=T), \
        lambda R, M: gemm_rs.make_inputs(R, min(M, T), 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    yield "gemm_rs_skinny_local_tma", gemm_rs.gemm_reduce_scatter_skinny(T, 2 * T, torch.float32, T, splits=3,
                                                                         align=16, swap_ab=True, reduce_n=T,
                                                                         local_sums=True), \
        lambda R, M: gemm_rs.make_inputs(R, min(M, T), 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    yield "mlp_tma", mlp.tp_mlp(T, T, torch.float32, T, align=16, group_m=2, down_n=2 * T, own_from_x=True), \
        lambda R, M: mlp.make_inputs(R, M, 32, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down")
    yield "mlp_tail_tma", mlp.tp_mlp(T, T, torch.float32, T, align=16, group_m=2, down_n=2 * T, tail_splits=2,
                                     own_from_x=True), \
        lambda R, M: mlp.make_inputs(R, M, 48, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down"), \
        {"TAIL": 1}
    yield "mlp_tail_every_tma", mlp.tp_mlp(T, T, torch.float32, T, align=16, group_m=2, down_n=2 * T, tail_splits=2,
                                           own_from_x=True), \
        lambda R, M: mlp.make_inputs(R, M, 48, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down"), \
        lambda R, M: {"TAIL": R * et.cdiv(et.cdiv(M, R), T) * 2}
    # own_from_x (the ops' default): a rank's own row tiles read x (their gather elements count 0), the
    # gather copies to the peers only
    yield "ag_gemm_tma", ag_gemm.all_gather_gemm(T, 2 * T, torch.float32, T, align=16, group_m=2, own_from_x=True), \
        lambda R, M: ag_gemm.make_inputs(R, M, 32, 48, seed=M), ag_gemm.reference, ("x", "w")
    yield "ag_gemm_whole_tma", ag_gemm.all_gather_gemm_whole(T, 2 * T, torch.float32, T, align=16), \
        lambda R, M: ag_gemm.make_inputs(R, M, 32, 48, seed=M), ag_gemm.reference, ("x", "w")
    # fp16, the partials crossing to the owners in fp16 (x_partials), summed in fp32
    yield "gemm_rs_skinny_x_partials_tma", gemm_rs.gemm_reduce_scatter_skinny(T, 2 * T, torch.float16, T, splits=3,
                                                                              align=16, swap_ab=True, reduce_n=T,
                                                                              local_sums=True, x_partials=True), \
        lambda R, M: gemm_rs.make_inputs(R, min(M, T), 48, 48, seed=M, dtype=torch.float16), gemm_rs.reference, \
        ("x", "w")
    # gemm_rs's skinny graph with every row in one matmul task per slice and column tile: a 2T-row
    # accumulator and a T-row tail
    yield "gemm_rs_skinny_tail_tma", gemm_rs.gemm_reduce_scatter_skinny(2 * T, 2 * T, torch.float32, T, splits=3,
                                                                        align=16, reduce_n=T, local_sums=True,
                                                                        tail_m=T), \
        lambda R, M: gemm_rs.make_inputs(R, M, 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    # the same, the first 2T rows through a descriptor (M=5: fewer than its box, zero-filled)
    yield "gemm_rs_skinny_tail_rows_desc_tma", gemm_rs.gemm_reduce_scatter_skinny(2 * T, 2 * T, torch.float32, T, splits=3,
                                                                              align=16, reduce_n=T, local_sums=True,
                                                                              tail_m=T, tail_row_tma=True), \
        lambda R, M: gemm_rs.make_inputs(R, M, 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    # every row in one task: a 2T-row accumulator and a T-row tail (M=37: 32 + 5; M=5: the tail empty)
    yield "ag_gemm_whole_tail_tma", ag_gemm.all_gather_gemm_whole(2 * T, 2 * T, torch.float32, T, align=16,
                                                                  tail_m=T), \
        lambda R, M: ag_gemm.make_inputs(R, M, 32, 48, seed=M), ag_gemm.reference, ("x", "w")
    yield "ag_gemm_whole_tail_rows_desc_tma", ag_gemm.all_gather_gemm_whole(2 * T, 2 * T, torch.float32, T, align=16,
                                                                            tail_m=T, tail_row_tma=True), \
        lambda R, M: ag_gemm.make_inputs(R, M, 32, 48, seed=M), ag_gemm.reference, ("x", "w")
    # the MLP with every row in each task: gate/up and down (2 slices, each waiting for its part of h)
    for name, desc in (("mlp_whole_tail_tma", False), ("mlp_whole_tail_rows_desc_tma", True)):
        yield name, mlp.tp_mlp_whole(2 * T, 2 * T, torch.float32, T, align=16, down_splits=2, up_n=T, tail_m=T,
                                     tail_row_tma=desc), \
            lambda R, M: mlp.make_inputs(R, M, 32, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down")
    # one contraction step in 3 slices: two down slices wait on h_ready elements of count 0
    yield "mlp_whole_tail_empty_slices_tma", mlp.tp_mlp_whole(2 * T, 2 * T, torch.float32, T, align=16, down_splits=3,
                                                              up_n=T, tail_m=T), \
        lambda R, M: mlp.make_inputs(R, M, 32, T * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down")
    # the last 3 whole-gather GEMM tiles in 2 contraction slices each, summed per tile (transposed tiles)
    yield "ag_gemm_whole_ragged_tma", ag_gemm.all_gather_gemm_whole(T, 2 * T, torch.float32, T, align=16, gemm_n=T,
                                                                    swap_ab=True, ragged_tiles=3, ragged_splits=2), \
        lambda R, M: ag_gemm.make_inputs(R, M, 32, 48, seed=M), ag_gemm.reference, ("x", "w")
    # the whole-gather GEMM tiles half as wide as the copy / down tiles (ops.ag_gemm.whole_width),
    # computed transposed (swap_ab: the weights on the MMA's M side), as the 32-row class runs them
    yield "ag_gemm_whole_narrow_tma", ag_gemm.all_gather_gemm_whole(T, 2 * T, torch.float32, T, align=16, gemm_n=T,
                                                                    swap_ab=True), \
        lambda R, M: ag_gemm.make_inputs(R, M, 32, 48, seed=M), ag_gemm.reference, ("x", "w")
    yield "mlp_whole_narrow_tma", mlp.tp_mlp_whole(T, 2 * T, torch.float32, T, align=16, down_splits=2, up_n=T,
                                                   swap_ab=True), \
        lambda R, M: mlp.make_inputs(R, M, 32, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down")
    # row_pointers (the plans' choice for tiles whose box runs far past the rows): the weights through
    # descriptors, the rows (x, gathered rows, h) through masked pointer loads; plain and swapped tiles
    yield "gemm_rs_tail_rows_tma", gemm_rs.gemm_reduce_scatter(T, 2 * T, torch.float32, T, align=16, group_m=2,
                                                               splits=2, wave=3, row_pointers=True), \
        lambda R, M: gemm_rs.make_inputs(R, M, 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    yield "ag_gemm_rows_tma", ag_gemm.all_gather_gemm(T, 2 * T, torch.float32, T, align=16, group_m=2, own_from_x=True,
                                                      row_pointers=True), \
        lambda R, M: ag_gemm.make_inputs(R, M, 32, 48, seed=M), ag_gemm.reference, ("x", "w")
    yield "mlp_tail_rows_tma", mlp.tp_mlp(T, T, torch.float32, T, align=16, group_m=2, down_n=2 * T, tail_splits=2,
                                          own_from_x=True, row_pointers=True), \
        lambda R, M: mlp.make_inputs(R, M, 48, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down"), \
        {"TAIL": 1}
    # padded (the MLP's plan above 128 rows): the gathered rows padded to whole row tiles, which the
    # gate/up tiles read through descriptors over whole tiles, h through pointers (where row_pointers
    # holds: own rows gathered too); or own rows from x, through a descriptor over x's rows
    yield "mlp_tail_padded_tma", mlp.tp_mlp(T, T, torch.float32, T, align=16, group_m=2, down_n=2 * T, tail_splits=2,
                                            row_pointers=True, padded=True), \
        lambda R, M: mlp.make_inputs(R, M, 48, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down"), \
        {"TAIL": 1}
    yield "mlp_padded_own_tma", mlp.tp_mlp(T, T, torch.float32, T, align=16, group_m=2, down_n=2 * T, tail_splits=2,
                                           own_from_x=True, padded=True), \
        lambda R, M: mlp.make_inputs(R, M, 48, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down"), \
        {"TAIL": 1}
    yield "mlp_whole_narrow_rows_tma", mlp.tp_mlp_whole(T, 2 * T, torch.float32, T, align=16, down_splits=2, up_n=T,
                                                        swap_ab=True, row_pointers=True), \
        lambda R, M: mlp.make_inputs(R, M, 32, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down")

    # the sources' tiles side by side (interleave: ops.plan_model.interleave_sources, where each source's
    # rows are one row tile), the MLP's down tiles owner by owner, every one in slices; gemm_rs's
    # owners' tiles side by side, those past the whole waves in slices
    yield "ag_gemm_interleaved_tma", ag_gemm.all_gather_gemm(T, 2 * T, torch.float32, T, align=16, group_m=2,
                                                             own_from_x=True, row_pointers=True, interleave=True), \
        lambda R, M: ag_gemm.make_inputs(R, M, 32, 48, seed=M), ag_gemm.reference, ("x", "w")
    yield "gemm_rs_interleaved_tma", gemm_rs.gemm_reduce_scatter(T, 2 * T, torch.float32, T, align=16, group_m=2,
                                                                 splits=2, wave=3, row_pointers=True,
                                                                 interleave=True), \
        lambda R, M: gemm_rs.make_inputs(R, M, 48, 48, seed=M), gemm_rs.reference, ("x", "w")
    yield "mlp_interleaved_tma", mlp.tp_mlp(T, T, torch.float32, T, align=16, group_m=2, down_n=2 * T, tail_splits=2,
                                            own_from_x=True, padded=True, interleave=True), \
        lambda R, M: mlp.make_inputs(R, M, 48, 48 * R, seed=M), mlp.reference, ("x", "w_gate_up", "w_down"), \
        lambda R, M: {"TAIL": R * et.cdiv(et.cdiv(M, R), T) * 2}

    # replicated in and out: every rank the whole x and y, the down tiles' partials pushed to every
    # rank, the last TAIL down tiles in 2 contraction slices (M=37: 2 of 6, M=5: 2 of 2; then
    # narrower gate/up tiles, computed transposed: 1 of 3 and 1 of 1)
    yield "mlp_replicated", mlp.tp_mlp_replicated(T, T, torch.float32, T, down_splits=2), \
        lambda R, M: mlp.make_inputs(R, M, 24, 20 * R, seed=M, replicated=True), _replicated, \
        ("x", "w_gate_up", "w_down"), {"TAIL": 2}
    yield "mlp_replicated_tma", mlp.tp_mlp_replicated(T, 2 * T, torch.float32, T, align=16, down_splits=2, up_n=T,
                                                      swap_ab=True), \
        lambda R, M: mlp.make_inputs(R, M, 32, 48 * R, seed=M, replicated=True), _replicated, \
        ("x", "w_gate_up", "w_down"), {"TAIL": 1}
    # each output tile summed on one owner rank (column tile j: rank j % R), who sends it to every rank
    yield "mlp_replicated_owners_tma", mlp.tp_mlp_replicated(T, 2 * T, torch.float32, T, align=16, down_splits=2,
                                                             up_n=T, swap_ab=True, owners=True), \
        lambda R, M: mlp.make_inputs(R, M, 32, 48 * R, seed=M, replicated=True), _replicated, \
        ("x", "w_gate_up", "w_down"), {"TAIL": 1}


def _replicated(xs, w_gate_up, w_down):
    """Every rank's y is the whole y."""
    return [mlp.reference_replicated(xs[0], w_gate_up, w_down)] * len(xs)


def main(args):
    schedule = "dynamic" if "--dynamic" in args else "static"
    local_first = "--local-first" in args
    only = [a for a in args if not a.startswith("--")]
    mesh = et.init_mesh(backend="cpu")
    R, r = mesh.world_size, mesh.rank
    for name, graph, make, reference, names, *extra in cases():
        if only and name not in only:
            continue
        kernel = et.compile(graph, schedule=schedule, target="cuda", local_first=local_first)
        for M in (37, 5):               # ragged: the last ranks own fewer rows (or none)
            # sizes no input names (the MLP's TAIL), or a function of (R, M) giving them
            sizes = (extra[0](R, M) if callable(extra[0]) else extra[0]) if extra else {}
            inputs = make(R, M)          # every rank builds every rank's inputs (same seed), keeps its own
            want = reference(*([i[n] for i in inputs] for n in names))[r]
            M_run = inputs[0]["x"].shape[0] if name.startswith("gemm_rs") else M
            for launch in range(2):      # the second launch re-arms the counters
                y = kernel(mesh, sizes={"M": M_run, **sizes}, **inputs[r])["y"]
                err = ((y.double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item() if want.numel() else 0.0
                tol = 1e-4 if y.dtype == torch.float32 else 1e-2   # fp16 graphs: its rounding
                assert y.shape == want.shape and err < tol, (name, M, launch, tuple(y.shape), err)
            print(f"OK {name} M={M} {schedule} rank {r}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main(sys.argv[1:])
