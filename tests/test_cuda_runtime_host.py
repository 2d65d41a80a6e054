"""Host-side logic of the GPU runtime that needs no GPU: inputs refused on one rank make every
rank raise before anything launches (a fake mesh stands in for the ranks' host exchange)."""
import pytest
import torch

import etdist as et
from etdist.fusion.bind import MapTable
from etdist.fusion.cuda_runtime import CudaKernel
from etdist.workloads import gemm_rs


class FakeComm:
    def __init__(self, others):
        self.others = others  # what the other ranks contribute to the exchange

    def allgather(self, obj):
        return [obj, *self.others]


class FakeMesh:
    backend, rank, world_size, device = "nvshmem", 0, 2, torch.device("cpu")

    def __init__(self, others):
        self.comm, self.cache = FakeComm(others), {}


@pytest.fixture(scope="module")
def kernel():
    ir = gemm_rs.gemm_reduce_scatter(block_m=64, block_n=64, dtype=torch.bfloat16).to_ir()
    return CudaKernel(MapTable.build(ir), "static")


def test_peer_refusal_raises_here(kernel):
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    mesh = FakeMesh(["graph 'gemm_rs': input 'w' on rank 1 has shape [17, 32], expected [16, 32]"])
    with pytest.raises(et.InputError, match="rank 1 refused its inputs: .*input 'w' on rank 1 has shape"):
        kernel._agree(mesh, {"x": x, "w": w}, None)


def test_sizes_that_differ_across_ranks(kernel):
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    mesh = FakeMesh([[("K", 16), ("M", 9), ("N", 32), ("WORLD", 2)]])
    with pytest.raises(et.InputError, match="ranks disagree on sizes"):
        kernel._agree(mesh, {"x": x, "w": w}, None)


def test_own_refusal_is_shared_before_raising(kernel):
    seen = []

    class Recording(FakeComm):
        def allgather(self, obj):
            seen.append(obj)
            return super().allgather(obj)

    mesh = FakeMesh([[("K", 16), ("M", 8), ("N", 32), ("WORLD", 2)]])
    mesh.comm = Recording(mesh.comm.others)
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.float32)
    with pytest.raises(et.InputError, match="dtype torch.float32, expected torch.bfloat16"):
        kernel._agree(mesh, {"x": x, "w": w}, None)
    assert seen and isinstance(seen[0], str)  # the peers were told, so they raise too


def test_cpu_mesh_is_refused(kernel):
    mesh = FakeMesh([])
    mesh.backend = "cpu"
    with pytest.raises(et.InputError, match="needs a mesh with the 'nvshmem' backend"):
        kernel(mesh, x=torch.zeros(1), w=torch.zeros(1))


def test_op_operand_checks_before_launch():
    from etdist.ops.gemm_rs import check_operands
    mesh = FakeMesh([])
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    assert check_operands("op", "g", x, w, mesh) is mesh
    cases = [((x, torch.randn(17, 32, dtype=torch.bfloat16)), "contraction dims differ"),
             ((x, w.float()), "must share a dtype"),
             ((torch.randn(16, 8, dtype=torch.bfloat16).t(), w), "not contiguous"),
             ((x.to("meta"), w), "x is on meta"),
             ((x[0], w), "must be a 2-D tensor")]
    for (a, b), msg in cases:
        with pytest.raises(et.InputError, match=msg):
            check_operands("op", "g", a, b, mesh)
    mesh.backend = "cpu"
    with pytest.raises(et.InputError, match="et.ops.op runs on GPUs"):
        check_operands("op", "g", x, w, mesh)


def test_direct_launch_is_not_blocked_by_triton_default_hooks():
    """Triton 3.6 keeps an empty HookChain as its launch hooks: that must not count as a profiler
    (it did, and every call went through Triton's dispatch); a hook someone adds must."""
    from triton import knobs

    from etdist.kernels.launch_hooks import hooks_active
    assert not hooks_active()
    hook = lambda *a: None  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert hooks_active()
        finally:
            chain.remove(hook)
    assert not hooks_active()
