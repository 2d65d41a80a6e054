"""The three workload graphs against float64 references: every world size, ragged sizes, both
schedules, many interleavings."""
import pytest
import torch

import etdist as et
from etdist.fusion.bind import MapTable, bind
from etdist.workloads import ag_gemm, gemm_rs, mlp, moe
from etdist.workloads.gather import gather_rows

from conftest import rel_err

WORLDS = (1, 2, 4, pytest.param(8, marks=pytest.mark.slow))   # 8 simulated ranks: the slow set
FEW_WORLDS = (1, 2, pytest.param(4, marks=pytest.mark.slow))   # variants of a graph tested at every world above
SEEDS = range(20)
TOL = 1e-5


@pytest.fixture(scope="module", params=["static", "dynamic"])
def schedule(request):
    return request.param


def _check_gemm_rs(kernel, world, M, K, N, input_seed, seeds, dtype=torch.float32, tol=TOL):
    """The gemm_rs kernel on fresh random inputs against the float64 reference, one run per
    interleaving seed: every rank's rows, shape and values. Returns the last run's outputs."""
    inputs = gemm_rs.make_inputs(world, M, K, N, seed=input_seed, dtype=dtype)
    want = gemm_rs.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
    for seed in seeds:
        got = kernel.run(inputs, interleave="random", seed=seed)
        for r in range(world):
            assert got[r]["y"].shape == want[r].shape
            assert rel_err(got[r]["y"], want[r]) < tol, (r, seed)
    return got


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 3])  # ragged: not a multiple of the tile nor of the world
def test_gemm_reduce_scatter(schedule, world, M):
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=8, block_n=8), schedule=schedule, programs=3)
    K, N = 12, 19
    _check_gemm_rs(kernel, world, M, K, N, world * 100 + M, SEEDS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 3])
@pytest.mark.parametrize("wave", [4, 7])
def test_gemm_reduce_scatter_splits_only_the_tiles_past_the_last_whole_wave(schedule, world, M, wave):
    """wave=: the head's tiles whole, the rest in 3 contraction slices (K=12 in 6 steps of 2): each
    tile's reduce sums exactly the partials its slices wrote (the scratch starts as NaN), and its
    event waits for that many. M=37 on 2 ranks: 2 x 3 x 3 = 18 tiles, 16 or 14 whole; M=3 on 2
    ranks: 6 tiles, 4 or none whole."""
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=8, block_n=8, block_k=2, splits=3, wave=wave),
                        schedule=schedule, programs=3)
    _check_gemm_rs(kernel, world, M, 12, 19, world * 100 + M, range(8))
    with pytest.raises(et.GraphError, match="wave must be a non-negative int"):
        gemm_rs.gemm_reduce_scatter(splits=2, wave=-1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 3])
@pytest.mark.parametrize("splits,wave", [(1, 0), (3, 0), (3, 4), (3, 7)])
def test_gemm_reduce_scatter_with_the_owners_tiles_side_by_side(schedule, world, M, splits, wave):
    """interleave: every owner's tile q, then every owner's tile q + 1 (u = q x R + owner), whole,
    in 3 slices, or sliced past the whole waves (whose tiles are then no single owner's): each
    owner's reduce still waits for and sums exactly the slices its tiles were cut in."""
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=8, block_n=8, block_k=2, splits=splits, wave=wave,
                                                    interleave=True), schedule=schedule, programs=3)
    _check_gemm_rs(kernel, world, M, 12, 19, world * 100 + M + splits, range(6))
    b = bind(MapTable.build(kernel.ir), {"M": M, "K": 12, "N": 19, "WORLD": world})
    mn = -(-(-(-M // world)) // 8) * 3        # row tiles of an owner's cdiv(M, R) rows x 3 column tiles
    for r in range(world):                    # the owners of a rank's tiles in id order (slice 0 of each)
        owners = [dst for f in b.functions if f.maps.spec.name.startswith("matmul") for k in range(f.size)
                  if f.unravel(k)[-1] == 0 or f.maps.spec.name == "matmul_whole"
                  for _, (dst, _, _) in f.maps.notify_elements(f.unravel(k), {**b.sizes, "RANK": r})]
        assert owners == [d for _ in range(mn) for d in range(world)], (r, owners)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [16, 5, 1])
@pytest.mark.parametrize("reduce_n", [None, 2])
@pytest.mark.parametrize("local_sums", [False, True])
def test_gemm_reduce_scatter_skinny(schedule, world, M, reduce_n, local_sums):
    """The decode variant: every row in one tile, split-K, each tile notifying every owner; the
    owner sums whole column tiles or quarter-width ones (reduce_n=2: N=19 leaves a ragged last one,
    and one past N). local_sums: each rank sums its slices per owner first (M=1 on 2+ ranks: an
    owner without rows still gets its notifies)."""
    kernel = et.compile(gemm_rs.gemm_reduce_scatter_skinny(block_m=16, block_n=8, block_k=4, splits=3,
                                                           reduce_n=reduce_n, local_sums=local_sums),
                        schedule=schedule, programs=3)
    inputs = gemm_rs.make_inputs(world, M, 21, 19, seed=world * 10 + M)
    want = gemm_rs.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
    for seed in SEEDS:
        got = kernel.run(inputs, interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)
    with pytest.raises(et.InputError, match="M must be <= 16"):
        kernel.run(gemm_rs.make_inputs(world, 17, 21, 19))
    with pytest.raises(et.GraphError, match="reduce_n must divide block_n=8"):
        gemm_rs.gemm_reduce_scatter_skinny(block_m=16, block_n=8, reduce_n=3)


@pytest.mark.parametrize("world", FEW_WORLDS)
@pytest.mark.parametrize("M", [37, 5])
@pytest.mark.parametrize("tiles,splits", [(2, 3), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_all_gather_gemm_whole_slices_its_ragged_last_tiles(schedule, world, M, tiles, splits):
    """ragged_tiles, ragged_splits: the last tiles of the order in contraction slices (K = 21 in
    steps of 4 over 3 slices: the last one shorter), summed per tile into y; fewer GEMM tiles than
    that is refused before the launch; bad arguments are named."""
    kernel = et.compile(ag_gemm.all_gather_gemm_whole(block_m=8, block_n=8, block_k=4, ragged_tiles=tiles,
                                                      ragged_splits=splits), schedule=schedule, programs=3)
    inputs = ag_gemm.make_inputs(world, M, 21, 19, seed=world * 100 + M)
    want = ag_gemm.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
    for seed in range(0, 20, 2):
        got = kernel.run(inputs, sizes={"M": M}, interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)
    with pytest.raises(et.InputError, match=f"slices the last {tiles} GEMM tiles"):
        kernel.run(ag_gemm.make_inputs(world, 5, 21, 8, seed=1), sizes={"M": 5})
    for bad in (dict(ragged_tiles=2, ragged_splits=1), dict(ragged_tiles=-1, ragged_splits=2),
                dict(ragged_tiles=2, ragged_splits=2, tail_m=16, align=16)):
        with pytest.raises(et.GraphError, match="ragged_tiles must be an int >= 0"):
            ag_gemm.all_gather_gemm_whole(block_m=8, block_n=8, block_k=4, **bad)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("M", [48, 40, 33, 5])
def test_gemm_rs_skinny_with_a_tail_takes_every_row_in_one_task(schedule, world, M):
    """tail_m (local sums): up to block_m + tail_m rows in one matmul task per slice and column tile
    (32 + 16 here; 5 leaves the tail empty); more rows, or an owner's rows past one tile (one rank),
    are refused before the launch; tail_m wants local sums and a power of two >= 16."""
    kernel = et.compile(gemm_rs.gemm_reduce_scatter_skinny(block_m=32, block_n=16, block_k=16, splits=3, align=16,
                                                           local_sums=True, tail_m=16),
                        schedule=schedule, programs=3)
    _check_gemm_rs(kernel, world, M, 64, 48, world * 10 + M, range(0, 20, 2))
    with pytest.raises(et.InputError, match="M must be <= 48"):
        kernel.run(gemm_rs.make_inputs(world, 49, 64, 48))
    with pytest.raises(et.InputError, match="an owner's rows must fit one 32-row tile"):
        kernel.run(gemm_rs.make_inputs(1, 40, 64, 48))
    for bad in (dict(tail_m=24, local_sums=True, align=16), dict(tail_m=16, local_sums=False, align=16),
                dict(tail_m=16, local_sums=True, align=1)):
        with pytest.raises(et.GraphError, match="tail_m must be 0 or a power of two >= 16"):
            gemm_rs.gemm_reduce_scatter_skinny(block_m=32, block_n=16, block_k=16, **bad)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("local_sums", [False, True])
def test_gemm_rs_skinny_partials_in_x_dtype(schedule, world, local_sums):
    """x_partials: the partials that cross to the owners are bf16 (x's dtype), summed in fp32: within
    bf16's rounding of the float64 reference, with and without local sums; fp32 graphs keep fp32."""
    graph = gemm_rs.gemm_reduce_scatter_skinny(block_m=16, block_n=8, block_k=4, splits=3, dtype=torch.bfloat16,
                                               local_sums=local_sums, x_partials=True)
    assert graph.to_ir().tensor("partial").dtype == torch.bfloat16
    assert gemm_rs.gemm_reduce_scatter_skinny(block_m=16, block_n=8, block_k=4, x_partials=True).to_ir().tensor(
        "partial").dtype == torch.float32
    kernel = et.compile(graph, schedule=schedule, programs=3)
    got = _check_gemm_rs(kernel, world, 13, 21, 19, world, range(0, 20, 4), dtype=torch.bfloat16, tol=2e-2)
    assert all(got[r]["y"].dtype == torch.bfloat16 for r in range(world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 3])
@pytest.mark.parametrize("own_from_x", [False, True])
def test_all_gather_gemm(schedule, world, M, own_from_x):
    """own_from_x: a rank's own row tiles read x (their gather elements count 0, nothing waits),
    the gather copies to the peers only."""
    kernel = et.compile(ag_gemm.all_gather_gemm(block_m=8, block_n=8, own_from_x=own_from_x), schedule=schedule,
                        programs=3)
    K, N = 12, 19
    inputs = ag_gemm.make_inputs(world, M, K, N, seed=world * 100 + M)
    want = ag_gemm.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
    for seed in SEEDS:
        got = kernel.run(inputs, sizes={"M": M}, interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)


@pytest.mark.parametrize("world", FEW_WORLDS)
@pytest.mark.parametrize("M", [48, 37, 17, 3])
def test_all_gather_gemm_with_a_tail_takes_every_row_in_one_task(schedule, world, M):
    """tail_m: up to block_m + tail_m rows in one task per column tile (32 + 16 here): past the
    row tile (37, 48), within it (17, 3: an empty tail); more rows are refused before the launch."""
    kernel = et.compile(ag_gemm.all_gather_gemm_whole(32, 16, block_k=16, align=16, tail_m=16), schedule=schedule,
                        programs=3)
    inputs = ag_gemm.make_inputs(world, M, 32, 48, seed=world * 100 + M)
    want = ag_gemm.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
    for seed in SEEDS:
        got = kernel.run(inputs, sizes={"M": M}, interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)
    with pytest.raises(et.InputError, match="at most block_m \\+ tail_m = 48 rows"):
        kernel.run(ag_gemm.make_inputs(world, 49, 32, 48, seed=1), sizes={"M": 49})
    with pytest.raises(et.GraphError, match="tail_m must be 0 or a power of two >= 16"):
        ag_gemm.all_gather_gemm_whole(32, 16, align=16, tail_m=24)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 1])
@pytest.mark.parametrize("own_from_x", [False, True])
def test_tensor_parallel_mlp(schedule, world, M, own_from_x):
    """All-gather -> gate/up + SwiGLU -> down -> reduce-scatter, as one graph (own_from_x: a rank's
    own gate/up tiles read x)."""
    kernel = et.compile(mlp.tp_mlp(block_m=8, block_n=8, own_from_x=own_from_x), schedule=schedule, programs=3)
    inputs = mlp.make_inputs(world, M, H=12, I=6 * world, seed=world * 10 + M)
    want = mlp.reference([i["x"] for i in inputs], [i["w_gate_up"] for i in inputs], [i["w_down"] for i in inputs])
    for seed in SEEDS:
        got = kernel.run(inputs, sizes={"M": M}, interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 1])
def test_tensor_parallel_mlp_slices_the_last_down_tiles(schedule, world, M):
    """tail_splits=3: the last TAIL down tiles of each rank's order in 3 contraction slices (I = 12
    per rank in 6 steps of 2), TAIL from none to one owner's every tile; each owner sums 3 slices
    from the source whose order ends on its tile and one from the others. Or all of them (TAIL =
    world x one owner's): each owner sums 3 slices from every source. A TAIL between those, or
    past them, is refused before the launch."""
    kernel = et.compile(mlp.tp_mlp(block_m=8, block_n=8, block_k=2, down_n=4, tail_splits=3, own_from_x=True),
                        schedule=schedule, programs=3)
    inputs = mlp.make_inputs(world, M, H=12, I=12 * world, seed=world * 10 + M)
    want = mlp.reference([i["x"] for i in inputs], [i["w_gate_up"] for i in inputs], [i["w_down"] for i in inputs])
    rows = -(-M // world)
    mn = -(-rows // 8) * 3                          # one owner's down tiles: row tiles x 3 column tiles
    for tail in sorted({0, 1, mn, world * mn}):
        for seed in range(4):
            got = kernel.run(inputs, sizes={"M": M, "TAIL": tail}, interleave="random", seed=seed)
            for r in range(world):
                assert rel_err(got[r]["y"], want[r]) < TOL, (tail, r, seed)
    for tail in sorted({mn + 1, world * mn + 1} - {world * mn}):
        with pytest.raises(et.InputError, match="at most one owner's down tiles, or all of them"):
            kernel.run(inputs, sizes={"M": M, "TAIL": tail})


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 13, 1])
def test_interleaved_sources_give_the_same_result(schedule, world, M):
    """interleave=True: each source's tile q beside the other sources' tile q (gather.source_order),
    ag_gemm's and the MLP's gate/up tiles, and the MLP's down tiles owner by owner, whole or every
    one in 3 slices (TAIL = all of them); a TAIL of some tiles is refused, as the last tiles of an
    interleaved order are no single owner's."""
    ag = et.compile(ag_gemm.all_gather_gemm(block_m=8, block_n=8, own_from_x=True, interleave=True),
                    schedule=schedule, programs=3)
    inputs = ag_gemm.make_inputs(world, M, 12, 19, seed=world * 100 + M)
    want = ag_gemm.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
    whole = et.compile(mlp.tp_mlp(block_m=8, block_n=8, own_from_x=True, interleave=True), schedule=schedule,
                       programs=3)
    sliced = et.compile(mlp.tp_mlp(block_m=8, block_n=8, block_k=2, down_n=4, tail_splits=3, interleave=True),
                        schedule=schedule, programs=3)
    m_inputs = mlp.make_inputs(world, M, H=12, I=12 * world, seed=world * 10 + M)
    m_want = mlp.reference(*([i[k] for i in m_inputs] for k in ("x", "w_gate_up", "w_down")))
    every = world * -(-(-(-M // world)) // 8) * 3   # every down tile: owners x row tiles x 3 column tiles
    for seed in range(0, 12, 3):
        got = ag.run(inputs, sizes={"M": M}, interleave="random", seed=seed)
        m_got = whole.run(m_inputs, sizes={"M": M}, interleave="random", seed=seed + 1)
        s_got = [sliced.run(m_inputs, sizes={"M": M, "TAIL": tail}, interleave="random", seed=seed + 2)
                 for tail in (0, every)]
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)
            assert rel_err(m_got[r]["y"], m_want[r]) < TOL, (r, seed)
            assert all(rel_err(o[r]["y"], m_want[r]) < TOL for o in s_got), (r, seed)
    if every > 1:
        with pytest.raises(et.InputError, match="0 or every down tile with interleaved owners"):
            sliced.run(m_inputs, sizes={"M": M, "TAIL": 1})


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 16, 1])
@pytest.mark.parametrize("owners", [False, True])
def test_replicated_mlp_ends_in_an_all_reduce(schedule, world, M, owners):
    """tp_mlp_replicated: every rank holds the whole x and gets the whole y; each down tile pushes
    its partial to every rank, or (owners) to its column tile's owner, who sends the sum to every
    rank (2 column tiles: at 4 ranks two own none). Whole down tiles; then the last TAIL of them
    (none, one, all) in 3 contraction slices, under gate/up tiles half as wide (I = 6 x world in
    steps of 4: on one rank the third slice is empty). Too large a TAIL is refused before the launch."""
    inputs = mlp.make_inputs(world, M, H=12, I=6 * world, seed=world * 10 + M, replicated=True)
    want = mlp.reference_replicated(inputs[0]["x"], [i["w_gate_up"] for i in inputs], [i["w_down"] for i in inputs])
    mh = -(-M // 8) * 2                             # down tiles: row tiles x 2 column tiles
    whole = et.compile(mlp.tp_mlp_replicated(block_m=8, block_n=8, block_k=4, owners=owners), schedule=schedule,
                       programs=3)
    sliced = et.compile(mlp.tp_mlp_replicated(block_m=8, block_n=8, block_k=4, down_splits=3, up_n=4, owners=owners),
                        schedule=schedule, programs=3)
    runs = [(whole, {"M": M})] + [(sliced, {"M": M, "TAIL": tail}) for tail in sorted({0, 1, mh})]
    for kernel, sizes in runs:
        for seed in range(0, 12, 3):
            got = kernel.run(inputs, sizes=sizes, interleave="random", seed=seed)
            for r in range(world):
                assert got[r]["y"].shape == want.shape and rel_err(got[r]["y"], want) < TOL, (sizes, r, seed)
    with pytest.raises(et.InputError, match="at most the down tiles"):
        sliced.run(inputs, sizes={"M": M, "TAIL": mh + 1})
    with pytest.raises(et.GraphError, match="down_splits must be a positive int"):
        mlp.tp_mlp_replicated(down_splits=0)


@pytest.mark.parametrize("world", FEW_WORLDS)
@pytest.mark.parametrize("M", [pytest.param(48, marks=pytest.mark.slow), 37, pytest.param(17, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("splits", [3, pytest.param(1, marks=pytest.mark.slow)])
def test_mlp_with_a_tail_takes_every_row_in_one_task(schedule, world, M, splits):
    """tail_m: up to block_m + tail_m rows in one gate/up task per column tile and one down task per
    column tile and slice (32 + 16 here): past the row tile (37, 48), within it (17, 3: an empty
    tail); down slice s waits for its columns of h only (I = 80 in steps of 16 over 3 slices: the
    last one shorter); more rows are refused before the launch; bad arguments are named."""
    kernel = et.compile(mlp.tp_mlp_whole(32, 16, block_k=16, align=16, tail_m=16, up_n=8, down_splits=splits),
                        schedule=schedule, programs=3)
    inputs = mlp.make_inputs(world, M, H=32, I=80 * world, seed=world * 100 + M)
    want = mlp.reference(*([i[k] for i in inputs] for k in ("x", "w_gate_up", "w_down")))
    for seed in SEEDS:
        got = kernel.run(inputs, sizes={"M": M}, interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)
    if splits > 1:   # I = 16: one contraction step, the other slices empty (no gate/up tile to wait for)
        inputs = mlp.make_inputs(world, M, H=32, I=16 * world, seed=world * 100 + M)
        want = mlp.reference(*([i[k] for i in inputs] for k in ("x", "w_gate_up", "w_down")))
        got = kernel.run(inputs, sizes={"M": M}, interleave="random", seed=1)
        assert all(rel_err(got[r]["y"], want[r]) < TOL for r in range(world))
    with pytest.raises(et.InputError, match="at most block_m \\+ tail_m = 48 rows"):
        kernel.run(mlp.make_inputs(world, 49, H=32, I=80 * world, seed=1), sizes={"M": 49})
    for bad in (dict(tail_m=24), dict(tail_m=16, align=1), dict(tail_m=16, up_n=24)):
        with pytest.raises(et.GraphError, match="tail_m must be 0 or a power of two >= 16"):
            mlp.tp_mlp_whole(32, 16, block_k=16, **{"align": 16, **bad})


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("M", [37, 16, 1])
def test_small_m_variants_read_the_whole_gather(schedule, world, M):
    """ag_gemm_whole and mlp_whole: tiles over all M rows after the whole gather; row tiles span
    several owners (the down tiles scatter their rows to each owner's partial)."""
    ag = et.compile(ag_gemm.all_gather_gemm_whole(block_m=8, block_n=8, block_k=4), schedule=schedule, programs=3)
    inputs = ag_gemm.make_inputs(world, M, 12, 19, seed=world * 100 + M)
    want = ag_gemm.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
    whole = et.compile(mlp.tp_mlp_whole(block_m=8, block_n=8, block_k=4), schedule=schedule, programs=3)
    m_inputs = mlp.make_inputs(world, M, H=12, I=6 * world, seed=world * 10 + M)
    m_want = mlp.reference(*([i[k] for i in m_inputs] for k in ("x", "w_gate_up", "w_down")))
    # the down tiles' contraction in 3 slices too (I = 6 x world in steps of 4: on one rank 2 steps,
    # so the third slice is empty)
    sliced = et.compile(mlp.tp_mlp_whole(block_m=8, block_n=8, block_k=4, down_splits=3), schedule=schedule,
                        programs=3)
    # GEMM (gate/up) tiles narrower than the gather's copy tiles and the down tiles, ragged against
    # N = 19 and I = 6 x world, as the ops narrow them at decode sizes (ops.ag_gemm.whole_width)
    ag_narrow = et.compile(ag_gemm.all_gather_gemm_whole(block_m=8, block_n=8, block_k=4, gemm_n=4),
                           schedule=schedule, programs=3)
    narrow = et.compile(mlp.tp_mlp_whole(block_m=8, block_n=8, block_k=4, down_splits=2, up_n=4),
                        schedule=schedule, programs=3)
    for seed in range(0, 20, 2):
        got = ag.run(inputs, sizes={"M": M}, interleave="random", seed=seed)
        n_got = ag_narrow.run(inputs, sizes={"M": M}, interleave="random", seed=seed + 1)
        m_got = whole.run(m_inputs, sizes={"M": M}, interleave="random", seed=seed)
        s_got = sliced.run(m_inputs, sizes={"M": M}, interleave="random", seed=seed + 1)
        u_got = narrow.run(m_inputs, sizes={"M": M}, interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)
            assert rel_err(n_got[r]["y"], want[r]) < TOL, (r, seed)
            assert rel_err(m_got[r]["y"], m_want[r]) < TOL, (r, seed)
            assert rel_err(s_got[r]["y"], m_want[r]) < TOL, (r, seed)
            assert rel_err(u_got[r]["y"], m_want[r]) < TOL, (r, seed)
    with pytest.raises(et.GraphError, match="down_splits must be a positive int"):
        mlp.tp_mlp_whole(down_splits=0)
    with pytest.raises(et.GraphError, match="up_n must be a positive int"):
        mlp.tp_mlp_whole(up_n=0)
    with pytest.raises(et.GraphError, match="gemm_n must be a positive int"):
        ag_gemm.all_gather_gemm_whole(gemm_n=True)
    g = et.Graph("peers_only_whole")
    with pytest.raises(et.GraphError, match="peers_only is for per-source readiness"):
        gather_rows(g, g.input("x", (4, 4), torch.float32), 4, lambda r: 4, 4, 4, "gathered", whole=True,
                    peers_only=True)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("skew", [0.0, 4.0])
def test_moe(schedule, world, skew):
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=4), schedule=schedule, programs=3)
    T, H, I = 11, 8, 6
    inputs, (wg, w1, w2) = moe.make_inputs(world, T, H, I, E=2 * world, seed=world, skew=skew)
    want = moe.reference([i["x"] for i in inputs], wg, w1, w2, top_k=2)
    for seed in SEEDS:
        got = kernel.run(inputs, interleave="random", seed=seed)
        for r in range(world):
            assert rel_err(got[r]["y"], want[r]) < TOL, (r, seed)
    if world > 1:  # the routing decided that some expert tiles do not exist
        assert kernel.last_stats.tasks_skipped > 0


def test_moe_tasks_follow_routing():
    """Under the dynamic schedule only the down tiles the routing asked for run (block 16, so every
    expert GEMM is one column block here); the rest of the grid is skipped."""
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=4), schedule="dynamic")
    T, H, I, E, world = 16, 8, 6, 4, 2
    inputs, _ = moe.make_inputs(world, T, H, I, E, seed=3, skew=8.0)
    kernel.run(inputs)
    routed = [torch.softmax(i["x"] @ i["wg"], -1).topk(2, -1).indices.flatten() for i in inputs]
    counts = torch.bincount(torch.cat(routed), minlength=E)
    tiles = int(sum(-(-c // 4) for c in counts.tolist()))
    S, EL = 2 * T, E // world
    max_tiles = -(-world * S // 4) + min(EL, world * S)
    slot_blocks, slabs, slices = -(-S // 16), -(-H // 128), -(-H // 64)   # block 16: slabs 8x, slices 4x
    # logits, route, dispatch, plan, tile_table, gate_up (all: past ntiles as no-ops), send_back, combine
    token_blocks = -(-T // 16)
    fixed = world * (token_blocks * slices + token_blocks + world * slot_blocks * slabs + EL + 1 + max_tiles
                     + world * slot_blocks * slabs + -(-T // 4) * slabs)
    assert kernel.last_stats.tasks_run == fixed + tiles
    assert kernel.last_stats.tasks_skipped == world * max_tiles - tiles


def test_moe_degenerate_sizes_are_refused_before_running(schedule):
    """I = 0 leaves no gate/up tiles, which are what order the down tiles after the routing: it
    deadlocked (a hang until the watchdog on GPUs); H = 0 and top_k = 0 failed inside tile bodies.
    All are refused before anything runs, and the next good call is right."""
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=4), schedule=schedule)
    for H, I in ((8, 0), (0, 4)):
        bad, _ = moe.make_inputs(2, 5, H, I, E=4)
        with pytest.raises(et.InputError, match=r"H \(the hidden size.* must be >= 1"):
            kernel.run(bad)
    inputs, (wg, w1, w2) = moe.make_inputs(2, 5, 8, 4, E=4)
    want = moe.reference([i["x"] for i in inputs], wg, w1, w2, top_k=2)
    assert all(rel_err(g["y"], w) < TOL for g, w in zip(kernel.run(inputs), want))
    with pytest.raises(et.GraphError, match="top_k must be a positive int, got 0"):
        moe.moe_layer(top_k=0)
    for bad in (24, 8, 0, True):     # a Triton block: a power of two, >= 16
        with pytest.raises(et.GraphError, match=f"route_block must be a power of two >= 16 .*got {bad!r}"):
            moe.moe_layer(route_block=bad)
    with pytest.raises(et.GraphError, match="plan_block must be a power of two >= 16"):
        moe.moe_layer(plan_block=1000)
    with pytest.raises(et.GraphError, match="down_block_n must be a power of two >= 16 .*got 24"):
        moe.moe_layer(down_block_n=24)
    with pytest.raises(et.GraphError, match="half_tails needs block_m >= 32 .*got block_m=16"):
        moe.moe_layer(block_m=16, half_tails=True)
    for name in ("topk_block", "combine_block", "combine_width"):
        with pytest.raises(et.GraphError, match=f"{name} must be a power of two >= 16 .*got 48"):
            moe.moe_layer(**{name: 48})
    for bad in (0, 2.0, True, 2 ** 31):
        with pytest.raises(et.GraphError, match=rf"combine_tasks must be a positive int \(below 2\*\*31\), got {bad!r}"):
            moe.moe_layer(combine_tasks=bad)
    with pytest.raises(et.GraphError, match=r"topk_block \(64\) must not exceed route_block \(32\)"):
        moe.moe_layer(route_block=32, topk_block=64)
    for bad in (0, 24, True):
        with pytest.raises(et.GraphError, match=rf"gate_up_interleave must be a positive multiple of block_n \(16.*got {bad!r}"):
            moe.moe_layer(gate_up_interleave=bad)
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=4, gate_up_interleave=32), schedule=schedule)
    inputs, _ = moe.make_inputs(2, 5, 24, 48, E=4, seed=1)                 # I = 48: not whole blocks of 32
    with pytest.raises(et.InputError, match="interleaved blocks .32 columns.* need I, the expert intermediate size, to be a multiple"):
        kernel.run(inputs)
    w = torch.randn(3, 8, 96)
    assert torch.equal(moe.deinterleave_gate_up(moe.interleave_gate_up(w, 16), 16), w)
    assert torch.equal(moe.interleave_gate_up(w, 48), w)                    # one block each: the same layout
    for f in (moe.interleave_gate_up, moe.deinterleave_gate_up):
        with pytest.raises(ValueError, match="last dimension .96"):
            f(w, 32)


def test_moe_routing_and_combine_have_their_own_blocks(schedule):
    """topk_block (routing tasks smaller than the logits' blocks: several wait on one) and the
    combine's own rows and columns per task (nn.MoE's combine covers the SMs): their grids, the
    count `routed` expects; T and H ragged against every block."""
    from etdist.fusion.expr import evaluate
    for tasks, rows, width in ((None, 3, 16), (4, 2, 16), (1, 1, 32)):   # tasks 4 -> 2 rows (cdiv(4, 3 slabs))
        graph = moe.moe_layer(top_k=2, block_m=4, block=16, route_block=32, topk_block=16, combine_block=16,
                              combine_width=width, combine_tasks=tasks)
        kernel = et.compile(graph, schedule=schedule, programs=3)
        for T, H in ((45, 40), (7, 72)):
            inputs, (wg, w1, w2) = moe.make_inputs(2, T, H, 20, E=4, seed=T, skew=1.0)
            want = moe.reference([i["x"] for i in inputs], wg, w1, w2, top_k=2)
            assert all(rel_err(g["y"], w) < TOL for g, w in zip(kernel.run(inputs), want)), (tasks, T, H)
        grids = {t.name: t.grid for t in graph.to_ir().tasks}
        sizes = dict(T=45, H=40)
        assert [evaluate(n, sizes) for n in grids["route"]] == [3]          # 45 tokens in blocks of 16
        assert [evaluate(n, sizes) for n in grids["logits"]] == [2, 1]      # blocks of 32, slices of 64
        # 3 blocks of 16 tokens x 3 slabs of 16 columns (2 of 32); capped, a task row takes every
        # rows-th block
        assert [evaluate(n, sizes) for n in grids["combine"]] == [rows, -(-40 // width)], tasks
        routed = next(e for e in graph.to_ir().events if e.name == "routed")
        assert evaluate(routed.count, sizes) == 3                            # one notify per routing task


def test_moe_fused_router(schedule):
    """fuse_router: one router task kind (token block x hidden slice) whose last slice to arrive
    routes its block; the last block routed (one rank) or the last plan task (more) builds the
    tile table: at one rank and more, several blocks and slices (router_width 16 of H 40/72:
    ragged), one token at three ranks (a rank whose experts receive nothing expects no down tile),
    random interleavings (any task may arrive last), each launch leaving the arrival counts zero
    (the runtime checks)."""
    for one, world in ((True, 1), (False, 2), (False, 3)):
        graph = moe.moe_layer(top_k=2, block_m=4, block=32, router_width=16, one_rank=one, fuse_router=True)
        names = [t.name for t in graph.to_ir().tasks]
        assert "router" in names and not {"logits", "route"} & set(names)
        assert "tile_table" not in names and ("plan" in names) == (not one)
        kernel = et.compile(graph, schedule=schedule, programs=3)
        for T, H in ((37, 40), (1, 72)):
            inputs, (wg, w1, w2) = moe.make_inputs(world, T, H, 20, E=2 * world, seed=T, skew=1.0)
            want = moe.reference([i["x"] for i in inputs], wg, w1, w2, top_k=2)
            for seed in SEEDS:
                got = kernel.run(inputs, interleave="random", seed=seed)
                assert all(rel_err(g["y"], w) < TOL for g, w in zip(got, want)), (world, T, seed)
    one = et.compile(moe.moe_layer(top_k=2, block_m=4, one_rank=True, fuse_router=True), schedule=schedule)
    inputs, _ = moe.make_inputs(1, 0, 8, 6, E=4)
    with pytest.raises(et.InputError, match="fused router's one-rank graph .* needs at least one token"):
        one.run(inputs)
    with pytest.raises(et.GraphError, match="fuse_router routes whole logits blocks: topk_block must be None or "
                                            "route_block .32., got 16"):
        moe.moe_layer(route_block=32, topk_block=16, fuse_router=True)
    with pytest.raises(et.GraphError, match="router_width must be a power of two >= 16 .*got 24"):
        moe.moe_layer(router_width=24)
    for bad in (dict(small_stages=-1, small_rows=16, block_m=32), dict(small_stages=6)):   # the latter: no small_rows
        with pytest.raises(et.GraphError, match="small_stages must be an int >= 0, and 0 without small_rows"):
            moe.moe_layer(**bad)


def test_moe_down_tiles_have_their_own_width(schedule):
    """down_block_n (nn.MoE: 256 where the experts' intermediate size is short) sets the down tiles'
    columns apart from the gate/up tiles': their grid, the columns each writes and the count `done`
    expects; H ragged against both."""
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=4, block=16, block_n=16, down_block_n=32), schedule=schedule)
    for T, H in ((5, 40), (9, 72)):
        inputs, (wg, w1, w2) = moe.make_inputs(2, T, H, 20, E=4, seed=T, skew=1.0)
        want = moe.reference([i["x"] for i in inputs], wg, w1, w2, top_k=2)
        assert all(rel_err(g["y"], w) < TOL for g, w in zip(kernel.run(inputs), want))


def test_moe_graph_built_for_one_rank_is_refused_on_two(schedule):
    """one_rank=True (nn.MoE on one GPU: the bodies move no rows) runs one rank and refuses more."""
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=4, one_rank=True), schedule=schedule)
    two, _ = moe.make_inputs(2, 5, 8, 4, E=4)
    with pytest.raises(et.InputError, match=r"built for one rank \(moe_layer\(one_rank=True\)\)"):
        kernel.run(two)
    one, (wg, w1, w2) = moe.make_inputs(1, 5, 8, 4, E=4)
    assert rel_err(kernel.run(one)[0]["y"], moe.reference([one[0]["x"]], wg, w1, w2, top_k=2)[0]) < TOL
    # its sample sizes (what validation runs on) hold top_k experts on the one rank: qwen3's top-8
    # of 128 once found none ("no sample sizes satisfy its checks")
    for top_k in (1, 8, 16):
        et.compile(moe.moe_layer(top_k=top_k, block_m=4, one_rank=True), schedule=schedule)


def test_one_compile_serves_every_size():
    kernel = et.compile(gemm_rs.gemm_reduce_scatter(block_m=8, block_n=8))
    for M in (1, 2, 9, 64, 65):
        inputs = gemm_rs.make_inputs(2, M, 4, 5, seed=M)
        want = gemm_rs.reference([i["x"] for i in inputs], [i["w"] for i in inputs])
        got = kernel.run(inputs)
        assert all(rel_err(g["y"], w) < TOL for g, w in zip(got, want))


def test_moe_aligned_sizes(schedule):
    """align=16 (what nn.MoE asks for when H and I allow it, so the GPU loads vectorise): the same
    results at aligned sizes, and a size that breaks the promise is refused before any task runs."""
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=4, align=16), schedule=schedule, programs=3)
    inputs, (wg, w1, w2) = moe.make_inputs(2, 9, 32, 16, E=4, seed=5, skew=2.0)
    want = moe.reference([i["x"] for i in inputs], wg, w1, w2, top_k=2)
    got = kernel.run(inputs, interleave="random", seed=1)
    assert all(rel_err(g["y"], w) < TOL for g, w in zip(got, want))
    bad, _ = moe.make_inputs(2, 9, 24, 16, E=4, seed=5)
    with pytest.raises(et.InputError, match=r"H=24 is not a multiple of 16"):
        kernel.run(bad)


def test_moe_expert_tiles_walk_groups_of_row_tiles_per_weight_block():
    """The expert GEMM tasks ran row tile after row tile: mixtral at 4096 tokens has 16 row tiles
    per expert and 112 gate/up column blocks, so a wave of programs never shared a weight block and
    every row tile re-read its expert's weights from HBM. Now a wave walks 8 row tiles (numbered
    expert after expert) per column block: consecutive tasks share one weight block, and the order
    is still every (row tile, column block) once."""
    ir = moe.moe_layer(top_k=2, block_m=128, block=64, block_n=128).to_ir()
    env = dict(T=4096, H=4096, I=14336, E=8, E_local=4, WORLD=2, RANK=0)
    for name, cols in (("gate_up", 14336 // 128), ("down", 4096 // 128)):
        task = next(t for t in ir.tasks if t.name == name)
        bind = dict(task.bind)
        n_name = "n" if name == "gate_up" else "h"
        total = task.grid[0].evaluate(env)
        pairs = [(bind["j"].evaluate({**env, "q": q}), bind[n_name].evaluate({**env, "q": q})) for q in range(total)]
        max_tiles = total // cols
        assert sorted(pairs) == [(j, n) for j in range(max_tiles) for n in range(cols)]
        assert pairs[:8] == [(j, 0) for j in range(8)]            # 8 row tiles on one weight block
        assert pairs[8:16] == [(j, 1) for j in range(8)]
