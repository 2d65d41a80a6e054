"""The generated GPU megakernels (codegen, Triton tile bodies, waits/notifies, call agreement) run
without a GPU: Triton's interpreter over a cpu-backend mesh, one process per rank, checked against
the float64 references at ragged sizes, twice per size (counters re-armed), under both schedules."""
import os
import pathlib
import subprocess
import sys

import pytest

INTERP = pathlib.Path(__file__).parent / "interp"
GRAPHS = ("gemm_rs", "gemm_rs_tail", "gemm_rs_tail_tma", "gemm_rs_skinny", "ag_gemm", "ag_gemm_whole", "mlp", "mlp_tail",
          "mlp_tail_tma", "mlp_whole",
          "gemm_rs_tma", "gemm_rs_skinny_tma", "gemm_rs_skinny_swap_tma", "mlp_tma", "ag_gemm_whole_tma",
          "ag_gemm_whole_narrow_tma", "mlp_whole_narrow_tma",
          "ag_gemm_tma", "mlp_replicated", "mlp_replicated_tma", "mlp_tail_every", "mlp_tail_every_tma",
          "gemm_rs_tail_rows_tma", "ag_gemm_rows_tma", "mlp_tail_rows_tma", "mlp_whole_narrow_rows_tma",
          "mlp_tail_padded_tma", "mlp_padded_own_tma", "ag_gemm_interleaved_tma", "mlp_interleaved_tma",
          "gemm_rs_interleaved_tma", "gemm_rs_skinny_local_tma", "mlp_replicated_owners_tma",
          "ag_gemm_whole_tail_tma", "gemm_rs_skinny_tail_tma", "ag_gemm_whole_tail_rows_desc_tma",
          "gemm_rs_skinny_tail_rows_desc_tma", "mlp_whole_tail_tma", "mlp_whole_tail_rows_desc_tma",
          "mlp_whole_tail_empty_slices_tma",
          "gemm_rs_skinny_x_partials_tma",
          "ag_gemm_whole_ragged_tma")


def interpreted(worker: str, world: int, schedule: str, timeout: int = 600, *names: str, **env_vars: str):
    """Run tests/interp/<worker> [names] on `world` processes under TRITON_INTERPRET=1; (exit code, output)."""
    env = dict(os.environ, TRITON_INTERPRET="1", ETDIST_WATCHDOG_S="60", **env_vars)
    args = ["--dynamic"] if schedule == "dynamic" else []
    args += list(names)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                        str(INTERP / worker), *args], capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr


# A few graphs (one of each op) at two ranks static and three ranks dynamic in the default set;
# every graph at every world and schedule in the slow set (`pytest -m slow`).
FEW = ("gemm_rs_tail_tma", "ag_gemm_interleaved_tma", "mlp_tail_padded_tma", "mlp_replicated_tma")
FEW_STATIC = FEW + ("mlp_whole_tail_rows_desc_tma",)   # and the tail options' bodies, at two ranks
FEW_DYNAMIC = ("gemm_rs_tail_tma", "mlp_tail_padded_tma")   # the ready queue across three ranks: two of them
slow = pytest.mark.slow


@pytest.mark.parametrize("world,schedule,graphs", [
    (2, "static", FEW_STATIC), (3, "dynamic", FEW_DYNAMIC), pytest.param(2, "static", GRAPHS, marks=slow),
    pytest.param(3, "static", GRAPHS, marks=slow), pytest.param(2, "dynamic", GRAPHS, marks=slow),
    pytest.param(3, "dynamic", GRAPHS, marks=slow)],
    ids=lambda v: "all" if v == GRAPHS else "few" if v in (FEW_DYNAMIC, FEW_STATIC) else str(v))
def test_generated_megakernels_match_references(world, schedule, graphs):
    """dynamic: the ready queue (claims, pushes across ranks, the inverse map) with one program
    per rank; races between programs of one GPU are not exercised here."""
    rc, out = interpreted("megakernel_worker.py", world, schedule, 900, *([] if graphs == GRAPHS else graphs))
    assert rc == 0, out[-5000:]
    for g in graphs:
        for M in (37, 5):
            assert out.count(f"OK {g} M={M} {schedule} ") == world, (g, M, out[-3000:])


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_counts_read_from_tensors_rearm_every_launch(schedule):
    """A data-dependent count (how many tiles exist, decided in-kernel) that changes from launch to
    launch, 0 included: the GPU kernel zeroes such counters at its end instead of re-arming by epoch."""
    rc, out = interpreted("data_dependent_worker.py", 2, schedule)
    assert rc == 0 and out.count(f"OK data-dependent {schedule}") == 2, out[-5000:]


@pytest.mark.parametrize("world,schedule,early", [
    # nn.MoE's settings at EP=2 first; every case in the slow set (~60 s each)
    *(pytest.param(*case, marks=slow) for case in [(2, "dynamic", "2"), (2, "static", "2"), (1, "static", "2"),
                                                   (1, "dynamic", "2"), (3, "dynamic", "2"), (2, "dynamic", "1"),
                                                   (2, "dynamic", "0")])])
def test_moe_kernel_with_in_kernel_routing(world, schedule, early):
    """The EP MoE graph's GPU bodies: routing (softmax top-k) in the kernel decides which expert
    tiles exist; dispatch and combine by peer stores (one rank: no rows move, gate/up reads x and
    the combine expert_out); uniform and skewed routing. Dynamic: the
    gate/up and down tiles seeded at launch (early 2, nn.MoE's), the gate/up tiles
    alone (early 1, et.compile's default: act_ready releases the down tiles) or neither (early 0:
    the tile table releases gate/up)."""
    rc, out = interpreted("moe_worker.py", world, schedule, 600, f"--early-push={early}")
    assert rc == 0 and out.count(f"OK moe {schedule}") == world, out[-5000:]


@pytest.mark.parametrize("world,schedule", [pytest.param(*case, marks=slow) for case in
                                             [(1, "dynamic"), (1, "static"), (2, "dynamic"), (3, "static")]])
def test_moe_router_chain_fused(world, schedule):
    """moe_layer(fuse_router=True): the router's logits, routing and (one rank) tile table in one
    task kind, each step run by the last task to arrive at an acq_rel count (no event between)."""
    rc, out = interpreted("moe_worker.py", world, schedule, 600, "--early-push=2", "--fused")
    assert rc == 0 and out.count(f"OK moe {schedule}") == world, out[-5000:]


def test_ranks_that_disagree_on_early_push_or_the_tail_refuse_before_launching():
    rc, out = interpreted("early_disagree_worker.py", 2, "dynamic", timeout=300)
    assert rc == 0 and out.count("OK early disagree") == 2 and out.count("OK tail disagree") == 2, out[-5000:]


def test_ready_queue_stamps_wrap_and_seeded_claims():
    """Queue indices past 2**31 and 2**32 (a long-lived mesh): claims still find their entries. A
    launch's seeded tasks come first, read from the table (or, consecutive ids, from their first:
    the table then is not read), then its pushes, in a later epoch."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, str(INTERP / "ready_queue_worker.py")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0 and p.stdout.count("OK ready queue") == 2 and p.stdout.count("OK seeded") == 4 \
        and p.stdout.count("from a base") == 2, \
        (p.stdout + p.stderr)[-3000:]


def test_a_call_refused_on_one_rank_at_a_prepared_shape_stops_every_rank():
    """At a prepared shape ranks launch without a host exchange: refused on one rank alone (an input
    not contiguous), the others' launch took that rank's next call as this one's, silently. Now the
    refusing rank stops their launch: it raises InputError, the others RuntimeFault, quickly."""
    rc, out = interpreted("refusal_worker.py", 2, "static")
    assert rc == 0 and out.count("OK refusal") == 2, out[-5000:]


@slow
@pytest.mark.parametrize("world,schedule", [(2, "static"), (3, "dynamic")])
def test_local_tasks_run_during_the_call_agreement(world, schedule):
    """et.compile(local_first=True): the skinny slices summed locally (their matmuls, the local
    prefix, run before the peers' words arrive, their notifies after), ragged, twice per size."""
    graphs = ("gemm_rs_skinny_local_tma", "gemm_rs_skinny_tail_tma")
    rc, out = interpreted("megakernel_worker.py", world, schedule, 900, "--local-first", *graphs)
    assert rc == 0, out[-5000:]
    for g in graphs:
        for M in (37, 5):
            assert out.count(f"OK {g} M={M} {schedule} ") == world, (g, M, out[-3000:])


@slow
def test_a_refused_call_leaves_the_local_tasks_notifies_undone():
    """local_first and a call refused on one rank: the peer's local matmuls ran during the
    agreement, but none notified, so the next call finds its counters where they were."""
    rc, out = interpreted("refusal_worker.py", 2, "static", 600, "--local-first")
    assert rc == 0 and out.count("OK refusal") == 2, out[-5000:]


@slow
def test_moe_router_logits_run_during_the_call_agreement():
    """local_first on the EP MoE graph at two ranks (dynamic, early push 2): the router's logits,
    pinned, are its local prefix."""
    rc, out = interpreted("moe_worker.py", 2, "dynamic", 900, "--early-push=2", "--local-first")
    assert rc == 0 and out.count("OK moe dynamic") == 2, out[-5000:]


def test_check_events_names_an_out_of_bounds_notify_and_an_over_notified_element():
    """compile(check_events=True): maps validation was told to skip, wrong on the GPU codegen, raise
    on every rank naming the event and coordinate, instead of a watchdog on another element or
    nothing at all; a correct graph runs launch after launch."""
    rc, out = interpreted("check_events_worker.py", 2, "static", 300)
    assert rc == 0, out[-5000:]
    assert out.count("OK check-events oob") == 2 and out.count("OK check-events over") == 2, out[-5000:]
