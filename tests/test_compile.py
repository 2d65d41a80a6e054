"""torch.compile keeps each etdist op whole (collectives/compiled.py, ops/compiled.py): traced with
fullgraph=True (a graph break is an error) and dynamic sizes, the ops are single custom-op nodes
whose fake implementations give the output shapes, and one graph serves every M.

No GPU here: CPU kernels registered for the custom ops stand in for the megakernels (what rank 1 of
2 computes when both ranks hold the same data), so Dynamo, the fake tensors and AOT autograd run for
real and only the kernels are stand-ins. tests/gpu/compile_worker.py runs the real ops compiled."""
import pytest
import torch
import torch.nn.functional as F

import etdist as et
from etdist.mesh.mesh import remember


class FakeMesh:
    backend, rank, world_size, device = "nvshmem", 1, 2, torch.device("cpu")
    token = torch.zeros(1, dtype=torch.int32)


def _mine(t, M):   # rank 1 of 2: rows [C, 2C) of M, C = cdiv(M, 2)
    C = -(-M // 2)
    return t[min(M, C):min(M, 2 * C)]


def _gathered(x, M):   # both ranks hold x: the gathered rows, cut to M
    return torch.cat([x, x])[:M]


STAND_INS = {
    "gemm_reduce_scatter": lambda x, w, schedule, mesh, token: _mine(x @ w, x.shape[0]).clone(),
    "all_gather_gemm": lambda x, w, total_rows, schedule, mesh, token: _gathered(x, total_rows or 2 * x.shape[0]) @ w,
    "tensor_parallel_mlp": lambda x, wgu, wd, total_rows, schedule, seq, mesh, token: (
        F.silu(x @ wgu[:, :wd.shape[0]]) * (x @ wgu[:, wd.shape[0]:])) @ wd,
    "all_gather": lambda x, check, mesh, token: torch.cat([x, x]),
    "reduce_scatter": lambda x, check, mesh, token: 2 * x[x.shape[0] // 2:],   # both ranks' x alike
    "all_reduce": lambda x, check, mesh, token: 2 * x,
}


_LIB = None


@pytest.fixture(scope="module")
def mesh():
    global _LIB
    if _LIB is None:   # for this process: only compiled calls reach these kernels
        _LIB = torch.library.Library("etdist", "FRAGMENT")
        for name, fn in STAND_INS.items():
            _LIB.impl(name, fn, "CPU")
    m = FakeMesh()
    remember(m)
    return m


def test_the_mesh_key_names_rank_and_world(mesh):
    """The ops' output shapes depend on rank and world, and inductor's FX graph cache (on disk, across
    runs) keys a compiled graph on its constants, the mesh key among them: a key that named neither
    let a world-1 run's graph serve a later world-2 run (found on one H100)."""
    assert mesh.key.endswith("-rank1-of2"), mesh.key


def test_ops_are_single_nodes_of_one_graph_for_every_m(mesh):
    K, N, H, I = 16, 8, 16, 4
    w, w_ag = torch.randn(K, N), torch.randn(H, N)
    wgu, wd = torch.randn(H, 2 * I), torch.randn(I, H)

    def layer(h, x, M):
        y = torch.relu(et.ops.gemm_reduce_scatter(h, w, mesh=mesh)) + 1
        z = et.ops.all_gather_gemm(x, w_ag, mesh=mesh, total_rows=M) * 0.5
        m = et.ops.tensor_parallel_mlp(x, wgu, wd, mesh=mesh, total_rows=M) + x
        return y, z, m, et.all_gather(m, mesh=mesh), et.reduce_scatter(torch.cat([m, m]), mesh=mesh), \
            et.all_reduce(m, mesh=mesh) - 1

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for M in (5, 6, 37, 100, 9):   # no size 0 or 1 (torch specialises those: another graph)
        h, x = torch.randn(M, K), torch.randn(-(-M // 2), H)
        y, z, m, g, rs, ar = compiled(h, x, M)
        C = -(-M // 2)
        want_m = STAND_INS["tensor_parallel_mlp"](x, wgu, wd, M, None, True, None, None) + x
        assert y.shape == (min(M, 2 * C) - min(M, C), N)
        assert torch.allclose(y, torch.relu(_mine(h @ w, M)) + 1)
        assert torch.allclose(z, _gathered(x, M) @ w_ag * 0.5)
        assert torch.allclose(m, want_m) and torch.allclose(g, torch.cat([want_m, want_m]))
        assert torch.allclose(rs, 2 * want_m) and torch.allclose(ar, 2 * want_m - 1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_out_is_filled_under_compile(mesh):
    w = torch.randn(16, 8)

    def f(h, out):
        return et.ops.gemm_reduce_scatter(h, w, mesh=mesh, out=out)

    torch._dynamo.reset()
    h, out = torch.randn(6, 16), torch.empty(3, 8)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(h, out)
    assert torch.allclose(out, _mine(h @ w, 6)) and torch.allclose(got, out)


def test_export_names_the_ops_and_their_shapes(mesh):
    class Layer(torch.nn.Module):
        def forward(self, h, w):
            return et.ops.gemm_reduce_scatter(h, w, mesh=mesh)

    ep = torch.export.export(Layer(), (torch.randn(5, 16), torch.randn(16, 8)), strict=True)
    nodes = [n for n in ep.graph.nodes if "etdist" in str(n.target)]
    assert [str(n.target) for n in nodes] == ["etdist.gemm_reduce_scatter.default"]
    assert nodes[0].meta["val"].shape == (2, 8)    # rank 1 of 2 owns rows [3, 5)


def test_a_call_whose_result_goes_unused_still_runs(mesh):
    """A pure op whose result is unused is dropped by torch.compile; dropped on some ranks only, its
    peers wait for it (the watchdog fires). Each op declares it writes the mesh's token, so it stays."""
    calls = []
    lib = torch.library.Library("etdist", "FRAGMENT")
    lib.impl("all_gather", lambda x, check, m, token: calls.append(1) or torch.cat([x, x]), "CPU")
    try:
        def f(x):
            et.all_gather(x, mesh=mesh)   # as on a rank that does not use it
            return x * 2

        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            calls.clear()
            torch.compile(f, fullgraph=True, backend=backend)(torch.randn(4, 3))
            assert len(calls) == 1, backend
    finally:
        lib._destroy()   # the module's stand-in is the kernel again



def test_another_plan_config_is_refused_under_compile(mesh):
    """A compiled node carries no PlanConfig: an op traced with another config is refused, naming
    it, before it runs (Dynamo breaks the graph there and the refusal reaches the caller; with
    fullgraph=True, where a graph break is an error, Dynamo's). The default itself, or none, compiles."""
    w = torch.randn(16, 8)
    wide = et.ops.DEFAULT_PLAN.override("whole_max_m=256")

    def f(h, config):
        return et.ops.gemm_reduce_scatter(h, w, mesh=mesh, config=config) * 2

    for config in (None, et.ops.DEFAULT_PLAN):
        torch._dynamo.reset()
        assert torch.compile(f, fullgraph=True, backend="aot_eager")(torch.randn(6, 16), config).shape == (3, 8)
    torch._dynamo.reset()
    with pytest.raises(et.InputError, match="et.ops.gemm_reduce_scatter under torch.compile runs the default plan "
                                            "only; got config with whole_max_m=256"):
        torch.compile(f, backend="aot_eager")(torch.randn(6, 16), wide)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(f, fullgraph=True, backend="aot_eager")(torch.randn(6, 16), wide)
