"""Host-side logic of the GPU runtime that needs no GPU: inputs refused on one rank make every
rank raise before anything launches (a fake mesh stands in for the ranks' host exchange)."""
import dataclasses
import math

import pytest
import torch

import etdist as et
from etdist.fusion.bind import MapTable
from etdist.fusion.cuda_runtime import CudaKernel
from etdist.mesh.stream_order import StreamOrder
from etdist.ops.common import RepeatedCall
from etdist.ops.config import DEFAULT_PLAN
from etdist.workloads import gemm_rs

P = DEFAULT_PLAN   # the plans' config, as the ops take it by default


class FakeComm:
    def __init__(self, others):
        self.others = others  # what the other ranks contribute to the exchange

    def allgather(self, obj):
        return [obj, *self.others]


class RecordingComm(FakeComm):
    """A FakeComm that keeps what this rank contributed to each exchange, in `seen`."""

    def __init__(self, others):
        super().__init__(others)
        self.seen = []

    def allgather(self, obj):
        self.seen.append(obj)
        return super().allgather(obj)


def peer_sizes(sizes):
    """What a peer that accepted its inputs sends in the agreement (CudaKernel._agree)."""
    return {"sizes": sizes, "captured": []}


class FakeCalls:
    """mesh.calls (mesh/calls.py) as a recorder: the signatures this rank agreed on, the refusals it
    published; the peers agree with everything."""

    def __init__(self):
        self.agreed, self.refused, self.owed = [], [], []

    def agree(self, sig):
        self.agreed.append(sig)
        return len(self.agreed)

    def refuse(self, reason):
        self.refused.append(reason)

    def raise_pending(self):
        pass


class FakeMesh:
    backend, rank, world_size, device = "nvshmem", 0, 2, torch.device("cpu")

    def __init__(self, others):
        self.comm, self.cache = FakeComm(others), {}
        self.stream_order = StreamOrder(self.device)
        self.calls = FakeCalls()


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
    mesh = FakeMesh([peer_sizes([("K", 16), ("M", 9), ("N", 32), ("WORLD", 2)])])
    with pytest.raises(et.InputError, match="ranks disagree on sizes"):
        kernel._agree(mesh, {"x": x, "w": w}, None)


def test_own_refusal_is_shared_before_raising(kernel):
    mesh = FakeMesh([peer_sizes([("K", 16), ("M", 8), ("N", 32), ("WORLD", 2)])])
    mesh.comm = RecordingComm(mesh.comm.others)
    seen = mesh.comm.seen
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.float32)
    with pytest.raises(et.InputError, match="dtype torch.float32, expected torch.bfloat16"):
        kernel._agree(mesh, {"x": x, "w": w}, None)
    assert seen and isinstance(seen[0], str)  # the peers were told, so they raise too


def test_wrong_out_is_refused_on_every_rank_before_launch(kernel, monkeypatch):
    """A wrong out= on one rank is part of what the ranks agree on, like a wrong input: refused after
    the agreement, the peers launched anyway and their launch waited for (and took) this rank's next
    call's data (seen under TRITON_INTERPRET=1 with 2 ranks)."""
    from etdist.fusion.cuda_runtime import _MeshState
    mesh = FakeMesh([peer_sizes([("K", 16), ("M", 8), ("N", 32), ("WORLD", 2)])])
    mesh.comm = RecordingComm(mesh.comm.others)
    seen = mesh.comm.seen
    monkeypatch.setattr(kernel, "_new_state", lambda m: _MeshState(programs=1, device=m.device))
    monkeypatch.setattr(kernel, "_prepare", lambda *a: pytest.fail("prepared a launch for a refused call"))
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    with pytest.raises(et.InputError, match=r"out\['y'\]: need a contiguous torch.bfloat16 tensor of shape "
                                            r"\[4, 32\] on cpu, got \[3, 3\] torch.bfloat16"):
        kernel(mesh, x=x, w=w, out={"y": torch.empty(3, 3, dtype=torch.bfloat16)})
    assert not seen and "out['y']" in mesh.calls.refused[0]   # the peers were told, before any exchange
    with pytest.raises(et.InputError, match="out= takes a dict of output tensors by name"):
        kernel(mesh, x=x, w=w, out=torch.empty(4, 32, dtype=torch.bfloat16))


def test_cpu_mesh_is_refused(kernel):
    mesh = FakeMesh([])
    mesh.backend = "cpu"
    with pytest.raises(et.InputError, match="needs a mesh with the 'nvshmem' backend"):
        kernel(mesh, x=torch.zeros(1), w=torch.zeros(1))


def test_op_operand_checks_before_launch():
    from etdist.ops.common import check_operands
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
    mesh.backend = "cpu"   # the CPU runtime runs the graph (ops/cpu_path.py): the same checks
    assert check_operands("op", "g", x, w, mesh) is mesh


def test_no_rows_at_all_launches_nothing(monkeypatch):
    """M = 0 (an empty batch): each op returns its empty result without a kernel. It raised
    MeshError (a zero-size view is not in symmetric memory) or ZeroDivisionError before (one H200)."""
    import etdist.ops.ag_gemm as ag_op
    import etdist.ops.gemm_rs as rs_op
    import etdist.ops.mlp as mlp_op
    for mod in (rs_op, ag_op, mlp_op):
        monkeypatch.setattr(mod, "cached_kernel", lambda *a: pytest.fail("built a kernel for no rows"))
    mesh, bf = FakeMesh([]), torch.bfloat16
    none, w, wd = torch.randn(0, 16, dtype=bf), torch.randn(16, 64, dtype=bf), torch.randn(32, 16, dtype=bf)
    assert et.ops.gemm_reduce_scatter(none, w, mesh=mesh).shape == (0, 64)
    assert et.ops.all_gather_gemm(none, w, mesh=mesh, total_rows=0).shape == (0, 64)
    one = FakeMesh([])
    one.world_size = 1
    assert et.ops.all_gather_gemm(none, w, mesh=one).shape == (0, 64)           # one rank: M = 0 x 1

    class Planned(Exception):
        pass

    def planned(*a):
        raise Planned
    monkeypatch.setattr(ag_op, "kernel_plan", planned)
    monkeypatch.setattr(ag_op, "sm_count", lambda index: 132)
    with pytest.raises(Planned):   # 2 ranks, no total_rows: 0 rows here may be a ragged M < 2, the kernel's agreement decides
        et.ops.all_gather_gemm(none, w, mesh=mesh)
    y = et.ops.tensor_parallel_mlp(none, w, wd, mesh=mesh, total_rows=0)
    assert y.shape == (0, 16) and y.dtype == bf
    out = torch.empty(0, 64, dtype=bf)
    assert et.ops.gemm_reduce_scatter(none, w, mesh=mesh, out=out) is out
    with pytest.raises(et.InputError, match=r"out must be an empty torch.bfloat16 tensor \[0, 64\]"):
        et.ops.gemm_reduce_scatter(none, w, mesh=mesh, out=torch.empty(1, 64, dtype=bf))
    with pytest.raises(et.InputError, match="total_rows is 0 but x has 8 rows"):
        et.ops.all_gather_gemm(torch.randn(8, 16, dtype=bf), w, mesh=mesh, total_rows=0)


def test_op_arguments_beyond_x_and_w_are_checked_before_launch(monkeypatch):
    """w_down, total_rows and mesh of the wrong kind: AttributeError / IndexError / TypeError from
    inside the ops before; now an InputError naming the argument, before any kernel is built."""
    import etdist.ops.ag_gemm as ag_op
    import etdist.ops.mlp as mlp_op
    for mod in (ag_op, mlp_op):
        monkeypatch.setattr(mod, "cached_kernel", lambda *a: pytest.fail("built a kernel for a refused call"))
    mesh = FakeMesh([])
    bf = torch.bfloat16
    x, w_gate_up = torch.randn(8, 16, dtype=bf), torch.randn(16, 64, dtype=bf)
    for w_down, got in (([[1.0]], "got list"), (torch.randn(32, dtype=bf), r"got torch.Size\(\[32\]\)")):
        with pytest.raises(et.InputError, match=rf"w_down must be a 2-D tensor \[I, 16\], {got}"):
            et.ops.tensor_parallel_mlp(x, w_gate_up, w_down, mesh=mesh)
    with pytest.raises(et.InputError, match=r"w_down must be a contiguous torch.bfloat16 tensor on cpu, got torch.float32"):
        et.ops.tensor_parallel_mlp(x, w_gate_up, torch.randn(32, 16), mesh=mesh)
    for bad in (-1, "15", 15.0, True):
        with pytest.raises(et.InputError, match="total_rows must be a non-negative int"):
            et.ops.all_gather_gemm(x, w_gate_up, mesh=mesh, total_rows=bad)
        with pytest.raises(et.InputError, match="total_rows must be a non-negative int"):
            et.ops.tensor_parallel_mlp(x, w_gate_up, torch.randn(32, 16, dtype=bf), mesh=mesh, total_rows=bad)
    with pytest.raises(et.InputError, match="mesh must be the Mesh from et.init_mesh"):
        et.ops.all_gather_gemm(x, w_gate_up, mesh="nvshmem")
    w_down = torch.randn(32, 16, dtype=bf)
    with pytest.raises(et.InputError, match="sequence_parallel must be True or False, got 0"):
        et.ops.tensor_parallel_mlp(x, w_gate_up, w_down, mesh=mesh, sequence_parallel=0)
    with pytest.raises(et.InputError, match=r"total_rows=16 but sequence_parallel=False: every rank passes the whole x"):
        et.ops.tensor_parallel_mlp(x, w_gate_up, w_down, mesh=mesh, total_rows=16, sequence_parallel=False)


def test_replicated_mlp_without_rows_or_with_many(monkeypatch):
    """sequence_parallel=False: M = 0 returns the empty y without a launch (every rank holds the
    same x, so all agree); an x longer than one launch's partials allow (replicated_rows) runs in
    launches of that many rows into slices of one y, and a wrong `out` is refused before any."""
    import etdist.ops.mlp as mlp_op
    monkeypatch.setattr(mlp_op, "cached_kernel", lambda *a: pytest.fail("built a kernel"))
    monkeypatch.setattr(mlp_op, "sm_count", lambda index: 132)
    mesh, bf = FakeMesh([]), torch.bfloat16
    w_gate_up, w_down = torch.randn(16, 64, dtype=bf), torch.randn(32, 16, dtype=bf)
    y = et.ops.tensor_parallel_mlp(torch.randn(0, 16, dtype=bf), w_gate_up, w_down, mesh=mesh, sequence_parallel=False)
    assert y.shape == (0, 16)
    launches = []

    def launch(config, plan, schedule, mesh, x, w_gate_up, w_down, out):
        launches.append((plan[2]["M"], x.shape[0], out.shape[0], out.data_ptr()))
        return out
    monkeypatch.setattr(mlp_op, "_launch", launch)
    monkeypatch.setattr(mlp_op, "SCRATCH_BYTES", 2 * 128 * 16 * 2)   # 128 rows a launch, at 2 ranks
    x = torch.randn(300, 16, dtype=bf)
    y = et.ops.tensor_parallel_mlp(x, w_gate_up, w_down, mesh=mesh, sequence_parallel=False)
    assert y.shape == (300, 16)
    assert [a[:3] for a in launches] == [(128, 128, 128), (128, 128, 128), (44, 44, 44)]
    assert [a[3] for a in launches] == [y[lo:].data_ptr() for lo in (0, 128, 256)]
    launches.clear()
    with pytest.raises(et.InputError, match=r"out must be a contiguous torch.bfloat16 tensor \[300, 16\]"):
        et.ops.tensor_parallel_mlp(x, w_gate_up, w_down, mesh=mesh, sequence_parallel=False,
                                   out=torch.empty(300, 8, dtype=bf))
    assert not launches


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


class LaunchRecorder:
    """Stands in for Triton's compiled kernel (direct launches) and its JIT (the fallback)."""

    function, packed_metadata = 0, None

    def __init__(self):
        self.direct, self.jit = [], []
        self.megakernel = self

    def run(self, *args):
        self.direct.append(list(args[9:-2]))          # the kernel's own arguments

    def __getitem__(self, grid):
        return lambda *args, **kw: self.jit.append(list(args))


class PreparingMesh(FakeMesh):
    """Enough of a mesh for CudaKernel.__call__ on the CPU: one rank, buffers in host memory."""

    def __init__(self):
        super().__init__([])
        self.world_size = 1

    def empty(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    def peer_ptrs(self, t):
        return torch.tensor([t.data_ptr()], dtype=torch.int64)

    watchdog_s = 1.0

    def watchdog_spins(self):
        return 1 << 20

    def barrier(self):
        pass


def _recorded_gemm_rs(monkeypatch):
    """An aligned gemm_rs CudaKernel whose launches a LaunchRecorder takes (no GPU): (kernel, recorder)."""
    from etdist.fusion import cuda_runtime as cr
    ir = gemm_rs.gemm_reduce_scatter(block_m=64, block_n=64, dtype=torch.bfloat16, align=16).to_ir()
    kernel = CudaKernel(MapTable.build(ir), "static")
    rec = LaunchRecorder()
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 0, raising=False)
    monkeypatch.setattr(cr, "hooks_active", lambda: False)
    monkeypatch.setattr(kernel, "module", rec)
    word = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(kernel, "_new_state", lambda mesh: cr._MeshState(
        programs=4, error_word=word, error_np=word.numpy(), compiled=rec))
    return kernel, rec


def test_argument_layout_is_built_once_per_shape(monkeypatch):
    """The launch arguments come from a per-shape layout (fixed addresses taken once): each call
    passes exactly what the kernel's parameters name, its own inputs and outputs included, and
    nothing else that changes (the epochs are the kernel's own: a CUDA graph replays the launch);
    a misaligned input is copied (the kernels assume 16-byte aligned rows) and a misaligned output
    falls back to Triton's launcher with the same arguments."""
    kernel, rec = _recorded_gemm_rs(monkeypatch)
    mesh = PreparingMesh()
    for call in range(3):
        x, w = torch.randn(24, 32, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16)
        y = kernel(mesh, x=x, w=w)["y"]
        st = kernel.state(mesh)
        # no epochs (the kernel keeps its own); the call's signature word (mesh/calls.py)
        values = {**st.shape.fixed, "x": x, "w": w, "y": y, "call_sig": st.word}
        want = [values[p].data_ptr() if isinstance(values[p], torch.Tensor) else values[p] for p in kernel.params]
        assert rec.direct[-1] == want
    assert len(rec.direct) == 3 and not rec.jit
    kernel(mesh, x=x, w=w, out={"y": y})
    kernel(mesh, x=x, w=w, out={"y": y})
    sig = kernel.params.index("call_sig")   # out= given: another signature word (mesh/calls.py)
    assert rec.direct[-1] == rec.direct[-2]   # the same tensors: the very same launch
    assert rec.direct[-1][:sig] + rec.direct[-1][sig + 1:] == rec.direct[2][:sig] + rec.direct[2][sig + 1:]
    odd = torch.empty(24 * 32 + 1, dtype=torch.bfloat16)[1:].view(24, 32)   # contiguous, 2 bytes off
    odd.copy_(x)
    kernel(mesh, x=odd, w=w)
    sent = rec.direct[-1][kernel.params.index("x")]
    assert len(rec.direct) == 6 and not rec.jit and sent != odd.data_ptr() and sent % 16 == 0  # an aligned copy
    y_odd = torch.empty(24 * 48 + 1, dtype=torch.bfloat16)[1:].view(24, 48)
    y = kernel(mesh, x=x, w=w, out={"y": y_odd})["y"]
    assert y is y_odd and len(rec.direct) == 6 and len(rec.jit) == 1
    values = {**st.shape.fixed, "x": x, "w": w, "y": y_odd, "call_sig": kernel._word(st, {"y": y_odd})}
    assert len(rec.jit[0]) == len(kernel.params)
    for p, got in zip(kernel.params, rec.jit[0]):
        assert got is values[p] if isinstance(values[p], torch.Tensor) else got == values[p], p
    kernel(mesh, x=x, w=w, out={"y": y_odd})
    assert all(a is b or a == b for a, b in zip(rec.jit[-1], rec.jit[-2]))   # the same arguments again


class HotRecorder(LaunchRecorder):
    """A LaunchRecorder whose `run` is Triton's CudaLauncher as the repeat launch uses it: the C
    launcher (`launch`, recorded in `hot`) and the attributes the runtime reads."""

    def __init__(self):
        super().__init__()
        self.hot, owner = [], self

        class Run:
            global_scratch_size = profile_scratch_size = 0
            global_scratch_align, launch_cooperative_grid, launch_pdl, num_ctas = 1, True, False, 1

            def __call__(self, *args):
                owner.direct.append(list(args[9:-2]))

            def launch(self, *args):
                owner.hot.append(list(args[13:-2]))   # past grid, stream, function, scratch, metadata, hooks

        self.run = Run()


def _hot_gemm_rs(monkeypatch):
    """_recorded_gemm_rs with a HotRecorder, on a stand-in for GPU -1 (a CPU tensor's get_device())
    that never captures: (kernel, recorder, mesh)."""
    from etdist.fusion import cuda_runtime as cr
    kernel, _ = _recorded_gemm_rs(monkeypatch)
    rec = HotRecorder()
    monkeypatch.setattr(kernel, "module", rec)
    word = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(kernel, "_new_state", lambda mesh: cr._MeshState(
        programs=4, error_word=word, error_np=word.numpy(), compiled=rec))
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(cr, "capturing_current", lambda: False)
    mesh = PreparingMesh()
    mesh.cache[kernel._key] = cr._KernelStates(gpu=-1)
    return kernel, rec, mesh


def test_a_repeated_call_launches_what_the_general_path_would(monkeypatch):
    """A decode step's repeat (same shapes and dtypes as the kernel's last call, no out=) goes
    straight to Triton's C launcher with the arguments the general path passes (fresh outputs, this
    call's inputs); anything else takes the general path: another shape, out=, a capture, an error
    word set, a profiler hook, another stream, a non-contiguous or misaligned input."""
    from etdist.fusion import cuda_runtime as cr
    kernel, rec, mesh = _hot_gemm_rs(monkeypatch)
    w = torch.randn(32, 48, dtype=torch.bfloat16)
    kernel(mesh, x=torch.randn(24, 32, dtype=torch.bfloat16), w=w)
    assert len(rec.direct) == 1 and not rec.hot
    st = kernel.state(mesh)
    for call in range(3):
        x = torch.randn(24, 32, dtype=torch.bfloat16)
        y = kernel(mesh, x=x, w=w)["y"]
        assert y.shape == (24, 48) and y.dtype == torch.bfloat16   # one rank: every row
        values = {**st.shape.fixed, "x": x, "w": w, "y": y, "call_sig": st.word}
        assert rec.hot[-1] == [values[p].data_ptr() if isinstance(values[p], torch.Tensor) else values[p]
                               for p in kernel.params]
    assert len(rec.hot) == 3 and len(rec.direct) == 1
    general = len(rec.direct)

    def declines(**call):
        nonlocal general
        hot = len(rec.hot)
        kernel(mesh, **{"x": x, "w": w, **call})
        general += 1
        return len(rec.direct) == general and len(rec.hot) == hot

    assert declines(out={"y": y})
    assert declines(x=torch.randn(40, 32, dtype=torch.bfloat16))   # another shape (a new state)
    assert declines()                                              # back: the last call was another state's
    kernel(mesh, x=x, w=w)
    assert len(rec.hot) == 4
    st.error_np[0] = 1   # a finished launch failed: the general path reads (and raises) it
    assert declines()
    st.error_np[0] = 0
    monkeypatch.setattr(cr, "capturing_current", lambda: True)
    assert declines()
    monkeypatch.setattr(cr, "capturing_current", lambda: False)
    monkeypatch.setattr(cr, "hooks_active", lambda: True)
    assert kernel._launch_hot(mesh, None, {"x": x, "w": w}) is None
    monkeypatch.setattr(cr, "hooks_active", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 7, raising=False)
    assert kernel._launch_hot(mesh, None, {"x": x, "w": w}) is None
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 0, raising=False)
    # made on a side stream (a warm-up before a CUDA graph capture), then called on the main one: laid
    # out again there (it stayed on the side stream's, and every call took the general path: 2x H200)
    st.hot.stream = 7
    assert declines() and st.hot.stream == 0
    kernel(mesh, x=x, w=w)
    assert len(rec.hot) == 5
    odd = torch.empty(24 * 32 + 1, dtype=torch.bfloat16)[1:].view(24, 32)
    assert kernel._launch_hot(mesh, None, {"x": odd, "w": w}) is None
    assert kernel._launch_hot(mesh, None, {"x": x, "w": w.float()}) is None
    assert kernel._launch_hot(mesh, None, {"w": w, "x": x}) is None   # not the order it was made with
    with pytest.raises(et.InputError, match="not contiguous"):
        kernel(mesh, x=torch.randn(32, 24, dtype=torch.bfloat16).t(), w=w)
    assert kernel._launch_hot(mesh, None, {"x": x, "w": w}) is not None and len(rec.hot) == 6


def test_a_state_kept_under_another_key_makes_its_repeat_again(monkeypatch):
    """The least recently used state is kept without re-laying where a new call binds the same
    sizes under another key (sizes given, not given): its repeat record went with it, and a call
    under the old key (no longer prepared) launched through it without the new shape's agreement
    (found in review). The record is now made again, under the key the state holds."""
    kernel, rec, mesh = _hot_gemm_rs(monkeypatch)
    agreed = []
    real = kernel._agree
    monkeypatch.setattr(kernel, "_agree", lambda *a, **k: agreed.append(1) or real(*a, **k))
    w, x = torch.randn(32, 48, dtype=torch.bfloat16), torch.randn(24, 32, dtype=torch.bfloat16)
    kernel(mesh, x=x, w=w)
    kernel(mesh, x=torch.randn(40, 32, dtype=torch.bfloat16), w=w)
    kernel(mesh, sizes={"M": 24}, x=x, w=w)        # the 24-row state again, under another key
    assert len(agreed) == 3
    hot = len(rec.hot)
    kernel(mesh, sizes={"M": 24}, x=x, w=w)
    assert len(rec.hot) == hot + 1                  # its repeat, under the key it now holds
    kernel(mesh, x=x, w=w)                          # the old key: a new shape to the runtime, agreed
    assert len(agreed) == 4 and len(rec.hot) == hot + 1


def _ops_on_a_stand_in_gpu(monkeypatch) -> HotRecorder:
    """Every CudaKernel's launches go to one HotRecorder, on the stand-in GPU -1 of _hot_gemm_rs
    (no capture, no profiler hook, stream 0): the ops' own paths run on the CPU. Returns the recorder."""
    from etdist.fusion import cuda_runtime as cr
    rec = HotRecorder()
    word = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(cr.CudaKernel, "_new_state", lambda self, mesh: cr._MeshState(
        programs=4, error_word=word, error_np=word.numpy(), compiled=rec))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(cr, "capturing_current", lambda: False)
    monkeypatch.setattr(cr, "hooks_active", lambda: False)
    return rec


def on_the_stand_in_gpu(mesh) -> None:
    """The kernels' states on `mesh` as the stand-in GPU's from here on (made on a CPU mesh, they
    have none, and the repeat launch is for GPUs)."""
    from etdist.fusion import cuda_runtime as cr
    for states in mesh.cache.values():
        if isinstance(states, cr._KernelStates):
            states.gpu = -1


def test_an_op_repeat_skips_its_checks_and_plan_only_for_the_last_calls_shapes(monkeypatch):
    """et.ops.* hand a repeat (same mesh, schedule, config, M and operand shapes) to the kernel's repeat
    launch without their checks and plan; other operands go through both (and their errors)."""
    import etdist.ops.gemm_rs as rs_op
    rec = _ops_on_a_stand_in_gpu(monkeypatch)
    monkeypatch.setattr(rs_op, "sm_count", lambda index: 132)
    monkeypatch.setattr(rs_op, "_REPEAT", RepeatedCall())
    mesh = PreparingMesh()
    mesh.world_size = 2
    x, w = torch.randn(16, 64, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
    on_the_stand_in_gpu(mesh)
    checks = []
    real = rs_op.check_operands
    monkeypatch.setattr(rs_op, "check_operands", lambda *a: checks.append(a) or real(*a))
    y = et.ops.gemm_reduce_scatter(x, w, mesh=mesh)
    assert y.shape == (8, 128) and len(rec.hot) == 1 and not checks
    et.ops.gemm_reduce_scatter(x, w, mesh=mesh, schedule="dynamic")   # another key: its own path
    assert len(checks) == 1
    with pytest.raises(et.InputError, match="must share a dtype"):
        et.ops.gemm_reduce_scatter(x, w.float(), mesh=mesh)
    other = PreparingMesh()
    other.world_size = 2
    assert rs_op._REPEAT.launch(("static", None), other, None, {"x": x, "w": w}) is None   # another mesh
    assert rs_op._REPEAT.launch(("static", None), mesh, 5, {"x": x, "w": w}) is None       # another M
    assert rs_op._REPEAT.launch(("static", None), mesh, None, {"x": x[:8], "w": w}) is None  # another shape
    assert rs_op._REPEAT.launch(("static", None), mesh, None, {"x": x, "w": w}) is not None
    import gc
    import weakref
    gone = weakref.ref(other)
    rs_op._REPEAT.remember(("static", "other"), other, None, None, None)
    del other
    gc.collect()
    assert gone() is None   # the repeat does not keep a mesh alive


def test_all_gather_gemm_and_mlp_repeats_take_the_repeat_launch(monkeypatch):
    """The same for all_gather_gemm and both MLP forms: a repeat (same total_rows too) launches with
    no checks; total_rows given where it was not, or of another type, goes through them."""
    import etdist.ops.ag_gemm as ag_op
    import etdist.ops.mlp as mlp_op
    rec = _ops_on_a_stand_in_gpu(monkeypatch)
    mesh = PreparingMesh()
    bf = torch.bfloat16
    x, w, wd = torch.randn(8, 64, dtype=bf), torch.randn(64, 128, dtype=bf), torch.randn(64, 64, dtype=bf)
    calls = [(ag_op, lambda **kw: et.ops.all_gather_gemm(x, w, mesh=mesh, **kw)),
             (mlp_op, lambda **kw: et.ops.tensor_parallel_mlp(x, w, wd, mesh=mesh, **kw)),
             (mlp_op, lambda **kw: et.ops.tensor_parallel_mlp(x, w, wd, mesh=mesh, sequence_parallel=False, **kw))]
    for mod, call in calls:
        monkeypatch.setattr(mod, "sm_count", lambda index: 132)
        monkeypatch.setattr(mod, "_REPEAT", RepeatedCall())
        checks = []
        monkeypatch.setattr(mod, "check_operands",
                            lambda *a, seen=checks, real=mod.check_operands: seen.append(a) or real(*a))
        call()
        on_the_stand_in_gpu(mesh)
        hot = len(rec.hot)
        assert call().shape[0] == 8 and len(rec.hot) == hot + 1 and len(checks) == 1
        call(total_rows=8)   # M the same, but given: the op's checks, then the kernel's repeat launch
        assert len(checks) == 2 and len(rec.hot) == hot + 2
        call(total_rows=8)   # remembered with it
        assert len(rec.hot) == hot + 3 and len(checks) == 2
        with pytest.raises(et.InputError, match="total_rows must be a non-negative int"):
            call(total_rows=8.0)
    with pytest.raises(et.InputError, match="sequence_parallel must be True or False, got 1"):
        et.ops.tensor_parallel_mlp(x, w, wd, mesh=mesh, sequence_parallel=1)   # equal to True, still refused


def test_a_shape_captured_in_a_cuda_graph_keeps_its_state(monkeypatch):
    """Graphs captured at several M of one kernel (a server's per-batch-size decode graphs), or one
    graph and then calls at other M: sharing one state, each new shape re-laid the counters and grew
    (freed) the buffers the earlier graphs launch with, so their replays read garbage or hung (one
    H200). Each shape now has its own state; the captured ones are pinned at
    the next new shape (agreed by the ranks) and never re-laid, and calls at them launch the same."""
    from etdist.fusion import cuda_runtime as cr
    kernel, rec = _recorded_gemm_rs(monkeypatch)

    class Mesh(PreparingMesh):
        freed = []

        def free(self, t):
            self.freed.append(t.data_ptr())

    mesh, capturing = Mesh(), [False]
    mesh.comm = RecordingComm([])
    monkeypatch.setattr(cr, "stream_capturing", lambda device: capturing[0])
    w = torch.randn(32, 48, dtype=torch.bfloat16)
    xs = {M: torch.randn(M, 32, dtype=torch.bfloat16) for M in (8, 16, 24, 512, 600, 700)}
    captured = {}
    for M in (8, 16):
        kernel(mesh, x=xs[M], w=w)                     # warm-up: prepares the shape
        capturing[0] = True
        y = kernel(mesh, x=xs[M], w=w)["y"]            # "captured"
        capturing[0] = False
        captured[M] = (rec.direct[-1], y, kernel.state(mesh))
    assert captured[16][2].pinned is False             # pinned at the next agreement, not during the capture
    for M in (24, 512, 600, 700, 512):                 # more shapes than STATES_KEPT: unpinned ones re-laid
        kernel(mesh, x=xs[M], w=w)
    assert mesh.comm.seen[-1]["captured"] == [] and any(e["captured"] for e in mesh.comm.seen[1:])
    pinned = [st for st in kernel._states(mesh) if st.pinned]
    assert {id(st) for st in pinned} == {id(captured[M][2]) for M in (8, 16)}
    assert len(kernel._states(mesh)) == 2 + cr.STATES_KEPT
    held = {t.data_ptr() for st in pinned for t in (*st.buffers.values(), st.arena)}
    assert not held & set(mesh.freed)
    sig = kernel.params.index("call_sig")   # out= given: another signature word (mesh/calls.py), else the same
    for M in (8, 16):                                  # eager at a captured shape: its state, the same launch
        kernel(mesh, x=xs[M], w=w, out={"y": captured[M][1]})
        assert kernel.state(mesh) is captured[M][2]
        assert rec.direct[-1][:sig] + rec.direct[-1][sig + 1:] == captured[M][0][:sig] + captured[M][0][sig + 1:]
    capturing[0] = True
    with pytest.raises(et.InputError, match="call it once at this shape outside the capture first, just before"):
        kernel(mesh, x=torch.randn(40, 32, dtype=torch.bfloat16), w=w)
    capturing[0] = False


def test_a_kernel_called_at_two_shapes_in_turn_prepares_each_once(monkeypatch):
    """A layer's o_proj and down projection can share one gemm_rs kernel (same size class, other K):
    with one state they re-agreed and re-laid every call (a host collective and a barrier each)."""
    kernel, rec = _recorded_gemm_rs(monkeypatch)
    mesh = PreparingMesh()
    mesh.comm = RecordingComm([])
    a, b = (torch.randn(24, k, dtype=torch.bfloat16) for k in (32, 64))
    wa, wb = (torch.randn(k, 48, dtype=torch.bfloat16) for k in (32, 64))
    for _ in range(5):
        kernel(mesh, x=a, w=wa)
        kernel(mesh, x=b, w=wb)
    assert len(mesh.comm.seen) == 2 and len(rec.direct) == 10


def test_skinny_split_k_aims_at_one_task_per_sm():
    """slices x column tiles <= SMs, at least 1 slice and at most 8; the op's plan takes the size
    class by M."""
    from etdist.ops.config import fp32_config
    from etdist.ops.gemm_rs import kernel_plan, skinny_splits
    assert skinny_splits(4096, 132, 64) == 2              # 64 column tiles x 2 = 128 tasks on 132 SMs
    assert skinny_splits(4096, 132, 128) == 4             # 32 x 4 = 128 tasks: one per SM
    assert skinny_splits(8192, 132, 128) == 2
    assert skinny_splits(4608, 132, 128) == 3             # 36 x 3 = 108: 4 would make 144, two waves
    assert skinny_splits(128, 132, 64) == 8 and skinny_splits(1 << 20, 132, 64) == 1
    for M, want in ((1, P.skinny_32), (32, P.skinny_32), (33, P.skinny_64), (64, P.skinny_64), (65, P.skinny_128),
                    (128, P.skinny_128)):
        cfg, splits, align, _ = kernel_plan(M, 6144, 4096, torch.bfloat16, 132, 2, P)
        assert cfg is want and align == 16
        assert splits == skinny_splits(4096, 132, want.block_n)
    # fp32 halves the contraction step but keeps its class's slices
    cfg, splits, _, build = kernel_plan(16, 6144, 4096, torch.float32, 132, 2, P)
    assert cfg == fp32_config(P.skinny_32) and cfg.swap_ab and splits == skinny_splits(4096, 132, 128)
    assert build().name.startswith("gemm_rs")
    cfg, splits, align, build = kernel_plan(8192, 6000, 4095, torch.float32, 132, 2, P)
    assert cfg == fp32_config(P.large) and splits == 1 and align == 1 and build().name == "gemm_rs"


def test_large_graph_plans_split_k_by_waves_and_weight_traffic():
    """Above 128 rows LARGE tiles go in as many contraction slices as plan_cost rates best. gemma2_27b's
    down projection (K=18432, N=4608) at M=1024 makes 144 tiles on 132 SMs: two waves for 1.09 waves
    of work; in 4 slices, 576 tasks in 5 waves of a quarter each, each task TASK_US more than its
    steps, and a wave of reduce tasks per 132 tiles. At M=256 on gpt3_175b's shape the weights, read
    once per owner, take longer than the whole tiles' single wave: slicing only adds partials (the
    owners' tiles side by side read them once: 4 slices). Many waves (M=8192) or full ones
    (llama31_70b at 1024: 256 tiles): whole tiles."""
    from etdist.ops.plan_model import SM_TFLOPS
    from etdist.ops.gemm_rs import HBM_TBS, REDUCE_WAVE_US, TASK_US, kernel_plan, large_plan, plan_cost
    LARGE = P.large
    tile_us = 2 * 128 * 256 * 18432 / (SM_TFLOPS * 1e6)
    assert plan_cost(1024, 18432, 4608, 2, 132, LARGE) == 2 * (tile_us + TASK_US)  # compute-bound: 2 waves
    assert plan_cost(1024, 18432, 4608, 2, 132, LARGE, 4) == 5 * (tile_us / 4 + TASK_US) + 2 * REDUCE_WAVE_US
    assert plan_cost(1024, 18432, 4608, 4, 144, LARGE) == tile_us + TASK_US         # 4 x 2 x 18: one wave on 144 SMs
    weights_us = 2 * 2 * 24576 * 12288 / (HBM_TBS * 1e6)                             # once per destination
    assert plan_cost(256, 24576, 12288, 2, 132, LARGE) > weights_us                  # memory-bound (and a bit more)
    # with the owners' tiles side by side (one row tile each: M <= 256 on two ranks) the weights are
    # read once, and the single wave of whole tiles (and its reduce) is the longer: 4 slices
    assert plan_cost(256, 24576, 12288, 2, 132, LARGE, interleave=True) == \
        tile_us * 24576 / 18432 + TASK_US + REDUCE_WAVE_US
    for M, K, N, want, interleaved in ((1024, 18432, 4608, 4, 4), (1000, 12800, 5120, 4, 4), (256, 14336, 8192, 2, 2),
                                       (256, 24576, 12288, 1, 4), (1024, 6144, 4096, 1, 1), (1024, 14336, 8192, 1, 1),
                                       (8192, 18432, 4608, 1, 1)):
        assert large_plan(M, K, N, 2, 132, P) == want, (M, K, N)
        assert large_plan(M, K, N, 2, 132, P, interleave=True) == interleaved, (M, K, N)
        cfg, splits, _, build = kernel_plan(M, K, N, torch.bfloat16, 132, 2, P)   # interleaved at M <= 256
        want = interleaved if M <= 256 else want
        g = build()
        assert (cfg, splits, g.name) == (LARGE, want, "gemm_rs")
        assert dict(next(t for t in g.to_ir().tasks if t.name == "matmul").constexprs)["SPLITS"] == want


def test_max_splits_reaches_the_plan():
    """PlanConfig.max_splits=1 keeps every large tile whole; the plan caches key on the config, so
    both plans stand side by side."""
    from etdist.ops import gemm_rs as op

    def plans(config):
        return [(M, op.kernel_plan(M, K, N, torch.bfloat16, 132, 2, config)[0].block_n,
                 op.kernel_plan(M, K, N, torch.bfloat16, 132, 2, config)[1])
                for M, K, N in ((256, 6144, 4096), (1024, 18432, 4608), (1024, 6144, 4096))]
    assert plans(P) == [(256, 256, 4), (1024, 256, 4), (1024, 256, 1)]
    assert plans(P.override("max_splits=1")) == [(256, 256, 1), (1024, 256, 1), (1024, 256, 1)]
    assert plans(P) == [(256, 256, 4), (1024, 256, 4), (1024, 256, 1)]


def test_tail_plan_splits_only_the_last_waves_tiles():
    """The tail plan: the tiles that fill whole waves run whole and the rest in slices.
    gemma2_27b at M=1024: 144 tiles on 132 SMs, 12 left, 4 slices (48 tasks); qwen3_32b: 160, 28 left,
    4 slices (112). gpt3_175b at M=4096: 1536 tiles, 84 left: 3 slices, two waves of thirds (2 slices
    make two waves of halves). 100 left: whole (no slicing shortens that last wave). Fewer tiles
    than SMs: large_plan's roofline (gpt3_175b at M=256 stays whole: the weights bound it)."""
    from etdist.ops.gemm_rs import large_plan, tail_plan
    assert tail_plan(1024, 18432, 4608, 2, 132, P) == 4 and tail_plan(1000, 12800, 5120, 2, 132, P) == 4
    assert tail_plan(8192, 6144, 4096, 2, 132, P) == 1                    # 1024 tiles: 100 left of 132
    assert tail_plan(4096, 24576, 12288, 2, 132, P) == 3                  # 1536 tiles: 84 left, 3 slices
    assert tail_plan(2048, 18432, 4608, 2, 132, P) == 4                   # 288 tiles: 24 left
    assert tail_plan(2048, 18432, 4608, 2, 144, P) == 1                   # 288 tiles: two whole waves
    for M, K, N in ((256, 24576, 12288), (256, 6144, 4096), (129, 18432, 4608)):
        assert tail_plan(M, K, N, 2, 132, P) == large_plan(M, K, N, 2, 132, P)
    # the partials [2 x slices, M / 2, N] stay within 1 GiB (NVSHMEM's heap is 4 GiB by default) and
    # int32 offsets (found by review: llama31_405b's shape at M=32800 took 4.3 GB in 4 slices)
    from etdist.ops.plan_model import slices_that_fit
    assert slices_that_fit(8192, 16384, 2, 2, 4) == 4 and slices_that_fit(16384, 16384, 2, 2, 4) == 2
    assert slices_that_fit(32800, 16384, 2, 2, 4) == 1 and slices_that_fit(32800, 16384, 2, 4, 4) == 1
    assert tail_plan(8192, 26624, 16384, 2, 132, P) == 4 and tail_plan(32800, 26624, 16384, 2, 132, P) == 1


def test_chosen_plan_weighs_each_tasks_fixed_cost_and_the_reduce():
    """A task costs TASK_US over its steps and a plan with a reduce task a wave of them, so short
    slices lose where they cut few tiles: qwen3_8b's shard at M=768 (96 tiles on 132 SMs) runs whole
    tiles (4 slices took 1.24x their time on one H100), and so does gemma2_9b's at M=2048 (224
    tiles: 92 left in 4 slices took 1.09x). A short tail still goes in slices where that saves most
    of a wave: qwen3_8b at M=2560 (56 of 320 left, 2 slices, 0.92x), llama31_405b at M=6144 (36 of
    3072 left, 3 slices, 0.95x); gemma2_27b at M=1024 keeps its 4 (0.68x the whole tiles' time)."""
    from etdist.ops.gemm_rs import chosen_plan, kernel_plan
    assert chosen_plan(768, 6144, 4096, 1, 132, P) == (1, 0) and chosen_plan(768, 6144, 4096, 2, 132, P) == (1, 0)
    assert chosen_plan(2048, 7168, 3584, 2, 132, P) == (1, 0)
    assert chosen_plan(2560, 6144, 4096, 2, 132, P) == (2, 132)
    assert chosen_plan(6144, 26624, 16384, 2, 132, P) == (3, 132)
    assert chosen_plan(1024, 18432, 4608, 2, 132, P) == (4, 132)
    assert chosen_plan(512, 6144, 4096, 2, 132, P)[0] > 1                 # 64 tiles: slices still pay
    _, splits, _, build = kernel_plan(768, 6144, 4096, torch.bfloat16, 132, 2, P)
    assert splits == 1 and build.keywords["wave"] == 0


def test_tail_plan_builds_the_wave_graph():
    """Where large_plan slices every tile but the tiles fill a wave (gemma2_27b at M=1024: 144
    tiles), the graph gets the SM count as its wave and slices only the tail; whole plans (M=8192)
    and fewer tiles than SMs (M=256: 32 tiles) keep large_plan's graph."""
    from etdist.ops import gemm_rs as op
    got = []
    for M, K, N in ((1024, 18432, 4608), (8192, 6144, 4096), (256, 6144, 4096)):
        _, s, _, b = op.kernel_plan(M, K, N, torch.bfloat16, 132, 2, P)
        got.append((M, s, b.keywords.get("wave", 0), len(b().to_ir().tasks)))
    assert got == [(1024, 4, 132, 3), (8192, 1, 0, 2), (256, 4, 0, 2)]


def test_skinny_classes_sum_narrow_column_tiles():
    """gemm_rs at M <= 128: the owner sums column tiles as narrow as 32 (SKINNY_REDUCE_N) while the
    reduce tasks stay within one per SM: qwen3_8b's 32 column tiles of 128 in 4 parts, gemma2_27b's
    36 in 2 (144 > 132), gpt3_175b's 96 whole; from 65 rows (local sums) the combine tasks, one per
    owner and part, within one wave too (qwen3_8b: 2 parts of 64); a block_n that no power of two
    cuts to 32 or more stays whole."""
    from etdist.ops import gemm_rs as op
    widths = {}
    for N in (4096, 4608, 12288):
        for M in (1, 16, 64, 128):
            cfg, _, _, build = op.kernel_plan(M, 6144, N, torch.bfloat16, 132, 2, P)
            reduce = next(t for t in build().to_ir().tasks if t.name == "reduce")
            assert build.keywords["reduce_n"] == dict(reduce.constexprs)["BLOCK_N"] and cfg.block_n == 128
            widths.setdefault(N, set()).add(build.keywords["reduce_n"])
    assert widths == {4096: {32, 64}, 4608: {64, 128}, 12288: {128}}   # {M <= 64, M = 128}
    assert op.skinny_reduce_n(48, 2, 132) == 48 and op.skinny_reduce_n(64, 1, 132) == 32


def test_whole_tile_plans_keep_a_reduce_task():
    """Whole-tile plans (qwen3_8b's shard at M=1024 and 8192) store every partial, the rank's own
    too, and sum them in a reduce task: own tiles last with the reduce in their epilogue took 1.6x
    the time at M=1000/1024 on 2x H200 (records gemm_rs.jsonl, variant FUSE_OWN=0 against base at
    ce26af2), so that plan is gone."""
    from etdist.ops import gemm_rs as op
    for M in (1024, 8192):
        _, splits, _, build = op.kernel_plan(M, 6144, 4096, torch.bfloat16, 132, 2, P)
        names = [t.name for t in build().to_ir().tasks]
        assert splits == 1 and names == ["matmul", "reduce"] and "own_last" not in build.keywords


def test_mlp_tail_plan_slices_where_down_tiles_leave_a_ragged_wave():
    """The fused MLP's tail plan (mlp_tail_splits=3): gemma2_27b at M=1024 deals 144 copies (to the peer only: own_from_x),
    1152 gate/up tiles and 144 down tiles (each ~4x a gate/up tile's work) round-robin over 132
    programs, so 12 programs get a second down tile: its last 12 down tiles go in slices. qwen3_32b:
    160 down tiles, 36 sliced. Where the busiest program would gain less than MIN_GAIN (qwen3_8b,
    llama31_70b at M=1024): none; nor where every down tile fits in one wave (llama31_8b, gemma2_9b:
    128 and 112 down tiles; the model had sliced 48 and 32, which lost 3-10% on one H200). At most one
    owner's tiles; none with one slice."""
    from etdist.ops.mlp import tail_plan
    assert tail_plan(1024, 4608, 18432, 2, 132, 3, P, own_from_x=True) == 12
    assert tail_plan(1024, 4096, 7168, 2, 132, 3, P, own_from_x=True) == 0
    assert tail_plan(1000, 3584, 7168, 2, 132, 3, P, own_from_x=True) == 0
    assert tail_plan(1000, 5120, 12800, 2, 132, 3, P, own_from_x=True) == 36
    assert tail_plan(1024, 4096, 6144, 2, 132, 3, P, own_from_x=True) == 0
    assert tail_plan(1024, 8192, 14336, 2, 132, 3, P, own_from_x=True) == 0
    assert tail_plan(1024, 4608, 18432, 2, 132, 1, P, own_from_x=True) == 0
    for M in (129, 300, 1000, 4096):
        rows = -(-M // 2)
        assert 0 <= tail_plan(M, 4608, 18432, 2, 132, 3, P, own_from_x=True) <= -(-rows // 128) * 18
    # the copies move the dealing: qwen3_8b's shape at M=2600 slices its last 88 down tiles only
    # with the own rows' copies gone, at M=6700 its last 24 only with them (own rows gathered too)
    assert [tail_plan(M, 4096, 6144, 2, 132, 3, P, own_from_x=own) for M in (2600, 6700) for own in (True, False)] == \
        [88, 0, 0, 24]


def test_mlp_slices_every_down_tile_where_they_fit_one_wave():
    """Above 128 rows, where a rank's down tiles are no more than the SMs (132), all of them run in
    the slices that make their one wave shortest, 3% dearer per extra slice (gemm_rs.wave_splits):
    32 tiles 4 slices, 36 or 72 tiles 3 (two waves of thirds), 48 or 64 tiles 2, 96 tiles 4 (three
    waves of quarters), 112 or 128 tiles none; with more tiles than SMs, the tail plan's (a few of
    them in mlp_tail_splits slices). Both MLP plans; the sequence-parallel graph counts every owner's
    tiles (world 2, M=512 on llama31_8b's shape: 2 owners x 2 row tiles x 16 column tiles = 64)."""
    from etdist.ops import mlp as mlp_op
    assert [mlp_op.few_down_splits(t, 132, 4, P) for t in (32, 36, 48, 64, 72, 96, 112, 128, 133)] == \
        [4, 3, 2, 2, 3, 4, 1, 1, 1]
    assert mlp_op.few_down_splits(32, 132, 2, P) == 2
    bf16 = torch.bfloat16
    _, build, sizes = mlp_op.kernel_plan(512, 4096, 7168, bf16, 132, 2, P)
    assert build.keywords["tail_splits"] == 2 and sizes == {"M": 512, "TAIL": 64}
    _, build, sizes = mlp_op.kernel_plan(256, 4608, 18432, bf16, 132, 2, P)   # gemma2_27b: 2 x 18 tiles
    assert build.keywords["tail_splits"] == 3 and sizes == {"M": 256, "TAIL": 36}
    _, build, sizes = mlp_op.kernel_plan(1024, 4608, 18432, bf16, 132, 2, P)  # 144 tiles: the tail plan's
    assert build.keywords["tail_splits"] == 3 and sizes == {"M": 1024, "TAIL": 12}
    _, build, sizes = mlp_op.kernel_plan(1024, 4096, 7168, bf16, 132, 2, P)   # 128 tiles: whole
    assert build.keywords["tail_splits"] == 1 and sizes == {"M": 1024}
    whole = P.override("mlp_tail_splits=1")   # every down tile whole, these too
    _, build, sizes = mlp_op.kernel_plan(512, 4096, 7168, bf16, 132, 2, whole)
    assert build.keywords["tail_splits"] == 1 and sizes == {"M": 512}
    _, build, sizes = mlp_op.kernel_plan(1024, 4608, 18432, bf16, 132, 2, whole)
    assert build.keywords["tail_splits"] == 1 and sizes == {"M": 1024}


def test_mlp_plans_pass_their_graphs_checks():
    """Every size a plan gives (TAIL: none, the last few, every tile) passes the checks of the graph
    it builds, ragged M and world sizes that do not divide it included, on both MLP graphs."""
    from etdist.fusion.expr import RANK_NAME, WORLD_NAME
    from etdist.ops import mlp as mlp_op
    bf16, seen = torch.bfloat16, set()
    for H, I in ((4096, 7168), (4608, 18432)):
        for world in (1, 2, 3, 4, 8):
            for M in (129, 300, 500, 1000, 2000, 4100):
                for plan in (mlp_op.kernel_plan(M, H, I, bf16, 132, world, P),
                             mlp_op.replicated_plan(M, H, I, bf16, 132, world, P)):
                    _, build, sizes = plan
                    env = {**sizes, "H": H, "I": I, WORLD_NAME: world, RANK_NAME: 0}
                    failed = [c.message for c in build().to_ir().checks if not c.cond.evaluate(env)]
                    assert not failed, (build.func.__name__, world, M, sizes, failed)
                    seen.add((build.func.__name__, sizes.get("TAIL", 0) > 0))
    assert seen == {(g, t) for g in ("tp_mlp", "tp_mlp_replicated") for t in (False, True)}


def test_whole_mlp_slices_its_few_down_tiles():
    """At or below 128 rows the fused MLP's down tiles (one per block_n columns of H and row tile)
    run in contraction slices up to one task per SM: qwen3_8b's H=4096 at M=16 makes 32 tiles, 4
    slices, and as many at M=128 (one 128-row tile); at M=64 with 64-row tiles of 64 columns, 64
    tiles, 2 slices; llama31_70b's 8192 at M=16, 2; gpt3_175b's 12288 (96 tiles), whole. At most
    WHOLE_DOWN_SPLITS."""
    from etdist.ops import ag_gemm as ag_op
    from etdist.ops import mlp as mlp_op
    small, rest = ag_op.whole_tile("tensor_parallel_mlp", 16, P), ag_op.whole_tile("tensor_parallel_mlp", 128, P)
    narrow = dataclasses.replace(ag_op.whole_tile("tensor_parallel_mlp", 64, P), block_n=64)
    assert [mlp_op.whole_down_splits(16, 4096, small, 132), mlp_op.whole_down_splits(128, 4096, rest, 132),
            mlp_op.whole_down_splits(64, 4096, narrow, 132), mlp_op.whole_down_splits(16, 8192, small, 132),
            mlp_op.whole_down_splits(16, 12288, small, 132)] == [4, 4, 2, 2, 1]
    assert mlp_op.whole_down_splits(1, 512, small, 132) == mlp_op.WHOLE_DOWN_SPLITS


def _skinny_plans(config):
    """{M: (block_m, block_n, swap, splits)} of gemm_rs's plans with `config`."""
    from etdist.ops import gemm_rs as op
    plans = {}
    for M in (16, 32, 64, 128):
        cfg, splits, _, _ = op.kernel_plan(M, 6144, 4096, torch.bfloat16, 132, 2, config)
        plans[M] = (cfg.block_m, cfg.block_n, int(cfg.swap_ab), splits)
    return plans


def test_a_class_config_changes_only_its_own_class():
    """Giving the 128-row class the 64-row class's tile leaves M <= 64 as it was (a review once found
    a class's plan keyed by its tile), and a class out of size order still gives each M the smallest
    class that holds it."""
    default = _skinny_plans(P)
    assert default == {16: (32, 128, 1, 4), 32: (32, 128, 1, 4), 64: (64, 128, 0, 4), 128: (128, 128, 1, 4)}
    same_tile = _skinny_plans(P.override("skinny_128=64,128,128,4,4"))
    assert same_tile[64] == default[64]                 # the first class's one task per SM
    assert same_tile[128][:3] == (128, 256, 0)          # no class holds 128 rows now: the large graph's
    assert same_tile[128][3] > 1                        # tiles, in slices (32 whole ones fill a quarter of the SMs)
    out_of_order = _skinny_plans(P.override("skinny_64=16,128,128,4,6,swap"))
    assert out_of_order[16][:3] == (16, 128, 1) and out_of_order[32] == default[32]
    assert out_of_order[64] == default[128]      # no 64-row class left: the 128-row one serves M=64


def test_whole_gather_ops_take_their_tile_class_by_m(monkeypatch):
    """all_gather_gemm and tensor_parallel_mlp at M <= 128 (whole gather): the 32-row tile up to 32
    rows, then each op's own tile (the MLP's two weight tiles keep it at 64 deep); all_gather_gemm's
    128-row tile with a tail up to 160 rows; the large tiles above. What the ops hand to the compile,
    caught before it."""
    import types
    from etdist.ops import ag_gemm as ag_op, mlp as mlp_op

    asked = []

    def caught(cache, config, cfg, schedule, build):
        asked.append((cfg, build().name))
        raise LookupError("caught before the compile")

    monkeypatch.setattr(ag_op, "cached_kernel", caught)
    monkeypatch.setattr(mlp_op, "cached_kernel", caught)
    monkeypatch.setattr(mlp_op, "sm_count", lambda index: 132)   # the tail plan asks above 128 rows
    monkeypatch.setattr(ag_op, "sm_count", lambda index: 132)    # whole_width asks at or below
    mesh = types.SimpleNamespace(backend="nvshmem", device=torch.device("cpu"), world_size=2)
    H, I = 256, 128
    x = torch.randn(4, H, dtype=torch.bfloat16)
    w, wgu, wd = (torch.randn(*s, dtype=torch.bfloat16) for s in ((H, I), (H, 2 * I), (I, H)))
    for M in (1, 32, 33, 64, 65, 128, 129, 161):
        with pytest.raises(LookupError):
            ag_op.all_gather_gemm(x, w, mesh=mesh, total_rows=M)
        with pytest.raises(LookupError):
            mlp_op.tensor_parallel_mlp(x, wgu, wd, mesh=mesh, total_rows=M)
    small, ag, mlp_tile, big = P.whole_32, P.whole_ag, P.whole_mlp, P.whole_128
    assert (small.block_m, small.swap_ab, ag.block_k, mlp_tile.block_k, big.block_m) == (32, True, 128, 64, 128)
    assert [cfg for cfg, _ in asked] == [small, small, small, small, ag, mlp_tile, ag, mlp_tile,
                                         big, big, big, big, big, P.mlp_tiles, P.large, P.mlp_tiles]
    assert [name for _, name in asked[:2]] == ["ag_gemm_whole", "mlp_whole"]
    assert [name for _, name in asked[-4:]] == ["ag_gemm_whole", "mlp", "ag_gemm", "mlp"]


def test_ag_gemm_takes_narrower_large_tiles_where_they_fill_the_last_wave():
    """Above 128 rows, all_gather_gemm's tiles are LARGE (128x256) unless 128x128 ones, at
    NARROW_RATE of their speed, keep the SMs busier over the waves: a rank of two's shapes on 132
    SMs at M=1000, llama31_8b's N=14336 (448 LARGE tiles: 3.4 waves) and qwen3_32b's 25600 (800:
    6.06), not qwen3_8b's 12288 (384: 2.9) nor any shape at M=8192 (full waves)."""
    from etdist.ops import ag_gemm as ag_op
    pick = lambda M, N, world=1: ag_op.large_tile(M, N, world, 132, P).block_n   # noqa: E731
    assert [pick(1000, 14336), pick(1000, 25600), pick(1000, 12288), pick(8192, 14336), pick(2048, 14336)] == \
        [128, 128, 256, 256, 256]
    assert pick(1000, 14336, world=2) == 128   # two sources of 500 rows: 2 x 4 row tiles, the same 448
    assert ag_op.large_tile(129, 128, 2, 132, P) == P.large


def test_own_rows_from_x_in_both_per_source_graphs():
    """Above 128 rows, all_gather_gemm's and the MLP's own row tiles read x: the plans build the
    graphs with own_from_x, whose gather copies to the peers only ((R - 1) x row tiles x column
    tiles copy tasks). At or below 128 rows (the whole-gather graphs) there is no such choice."""
    from etdist.fusion.expr import evaluate
    from etdist.ops import ag_gemm, mlp
    got = {}
    for M in (100, 1000):
        _, b = ag_gemm.kernel_plan(M, 256, 512, torch.bfloat16, 132, 2, P)
        _, m, _ = mlp.kernel_plan(M, 256, 512, torch.bfloat16, 132, 2, P)
        sends = [[t for t in f().to_ir().tasks if t.name.endswith("_send")][0] for f in (b, m)]
        got[M] = (b.keywords.get("own_from_x"), m.keywords.get("own_from_x"),
                  *(evaluate(t.grid[0], {"WORLD": 2, "RANK": 0, "M": M}) for t in sends))
    assert got[1000] == (True, True, 1, 1)                  # to R - 1 ranks
    assert got[100][:2] == (None, None)


def test_whole_width_narrows_tiles_fewer_than_the_sms(monkeypatch):
    """The whole-gather GEMM tiles halve while twice as many still fit in one wave (132 SMs, a rank
    of two's shapes): qwen3_8b's gate/up at M=16, 48 tiles of 128, to 96 of 64; its ag_gemm's 96
    tiles stay (192 would make a second wave), as do qwen3_32b's 100 gate/up tiles and, at M=128
    (two row tiles of 64), qwen3_8b's 96; one tile of 128 goes down to WHOLE_MIN_N (64), and no
    further. WHOLE_MIN_N=128 keeps every tile whole."""
    from etdist.ops import ag_gemm as ag_op
    from etdist.ops.config import TileConfig
    small, rest = TileConfig(32, 128, 64, 4, 6, swap_ab=True), TileConfig(64, 128, 128, 4, 4)
    assert ag_op.whole_width(16, 6144, small, 132) == 64
    assert ag_op.whole_width(16, 12288, small, 132) == 128
    assert ag_op.whole_width(16, 12800, small, 132) == 128
    assert ag_op.whole_width(128, 6144, rest, 132) == 128
    assert ag_op.whole_width(1, 128, small, 132) == 64
    monkeypatch.setattr(ag_op, "WHOLE_MIN_N", 32)
    assert ag_op.whole_width(1, 128, small, 132) == 32
    assert ag_op.whole_width(16, 6144, small, 132) == 64      # 192 of 32 would not fit one wave
    monkeypatch.setattr(ag_op, "WHOLE_MIN_N", 128)
    assert ag_op.whole_width(16, 6144, small, 132) == 128


def _whole_tiles(config):
    """{(op, M): (block_m, block_n, block_k, warps, stages, swap)} of the whole-gather classes."""
    from etdist.ops import ag_gemm as op
    return {(name, M): (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, int(c.swap_ab))
            for name in ("all_gather_gemm", "tensor_parallel_mlp") for M in (16, 64, 128)
            for c in [op.whole_tile(name, M, config)]}


def test_whole_gather_tile_classes():
    """whole_32 / whole_ag / whole_mlp / whole_128 set one class each, shared where both ops use it."""
    default = _whole_tiles(P)
    assert default == {("all_gather_gemm", 16): (32, 128, 64, 4, 6, 1), ("all_gather_gemm", 64): (64, 128, 128, 4, 4, 0),
                       ("all_gather_gemm", 128): (128, 128, 64, 8, 4, 0),
                       ("tensor_parallel_mlp", 16): (32, 128, 64, 4, 6, 1),
                       ("tensor_parallel_mlp", 64): (64, 128, 64, 4, 4, 0),
                       ("tensor_parallel_mlp", 128): (128, 128, 64, 8, 4, 0)}
    one = _whole_tiles(P.override("whole_ag=64,64,128,4,3"))
    assert one == {**default, ("all_gather_gemm", 64): (64, 64, 128, 4, 3, 0)}
    big = _whole_tiles(P.override("whole_128=128,64,64,8,3,swap"))
    assert big == {**default, ("all_gather_gemm", 128): (128, 64, 64, 8, 3, 1),
                   ("tensor_parallel_mlp", 128): (128, 64, 64, 8, 3, 1)}
    small = _whole_tiles(P.override("whole_32=16,128,64,4,6"))
    assert small[("all_gather_gemm", 16)] == small[("tensor_parallel_mlp", 16)] == (16, 128, 64, 4, 6, 0)


def test_a_new_kernel_never_finds_a_freed_kernels_state():
    """Kernels keep their per-mesh state in mesh.cache. Keyed by id(kernel), a kernel freed and
    replaced by a new one at the same address handed the new one its state on some ranks only
    (the ranks' collective allocations then desynchronised: CI saw it as a flaky interpreted test)."""
    import gc

    table = MapTable.build(gemm_rs.gemm_reduce_scatter(block_m=64, block_n=64, dtype=torch.bfloat16).to_ir())
    cache, stale = {}, 0
    for _ in range(30):
        k = CudaKernel(table, "static")
        stale += k._key in cache
        cache[k._key] = "state of a kernel that is about to be freed"
        del k
        gc.collect()
    assert stale == 0


def test_tile_config_format():
    from etdist.ops.config import TileConfig, fp32_config
    assert TileConfig.parse("16,128,128,4,6,swap") == TileConfig(16, 128, 128, 4, 6, swap_ab=True)
    assert TileConfig.parse("64, 64, 128, 4, 4") == TileConfig(64, 64, 128, 4, 4)
    assert fp32_config(TileConfig(16, 128, 128, 4, 6, True)) == TileConfig(16, 128, 64, 4, 3, True)
    for bad in ("64,64,128", "64,64,128,4,4,fast", "64,64,x,4,4", "64,64,128,4,4,swap,swap", "0,0,0,0,0",
                "48,64,64,4,4", "8,64,64,4,4", "64,64,64,3,4", "64,64,64,32,4", "64,64,64,4,0"):
        with pytest.raises(ValueError, match="block_m,block_n,block_k,warps,stages"):
            TileConfig.parse(bad)


def test_a_failed_growth_leaves_no_layout_over_freed_buffers(monkeypatch):
    """A new shape grows the symmetric scratch: free the old buffer, then allocate (collective). When
    the allocation fails (symmetric heap exhausted, on every rank alike) and the caller carries on at
    the old shape, the kernel launched with the freed buffer still in its arguments (NVSHMEM hands
    that memory to the next allocation)."""
    kernel, rec = _recorded_gemm_rs(monkeypatch)

    class Exhausting(PreparingMesh):
        limit, freed = None, []

        def empty(self, shape, dtype):
            if self.limit is not None and math.prod(shape) > self.limit:
                raise RuntimeError("symmetric heap exhausted")
            return super().empty(shape, dtype)

        def free(self, t):   # keeps t alive: its address is not handed out again here
            self.freed.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t))

    mesh = Exhausting()
    w = torch.randn(32, 48, dtype=torch.bfloat16)
    small, mid, big = (torch.randn(m, 32, dtype=torch.bfloat16) for m in (24, 16, 512))
    kernel(mesh, x=small, w=w)
    kernel(mesh, x=mid, w=w)      # STATES_KEPT states held: the next new shape re-lays small's
    mesh.limit = 24 * 48 + 1     # room for the small shape's partial buffer, not for the big one's
    with pytest.raises(RuntimeError, match="exhausted"):
        kernel(mesh, x=big, w=w)
    assert mesh.freed             # the small shape's buffer went back before the allocation failed
    for _ in range(2):            # back at the old shape, then again
        kernel(mesh, x=small, w=w)
        args = [a for a in rec.direct[-1] if isinstance(a, int) and a > 1 << 16]
        assert not [a for a in args for lo, hi, _ in mesh.freed if lo <= a < hi], "a freed buffer was launched"


def test_symmetric_scratch_sized_by_rank_is_refused():
    """Symmetric buffers are allocated and grown collectively. One sized by RANK (here the rows a
    rank owns) passed the first call where every rank owned as many rows (M=4 on 2 ranks), then at
    M=5 grew on rank 0 only: rank 0 sat in mesh.empty's allgather, rank 1 in the barrier."""
    g = et.Graph("rank_sized")
    M = g.size("M")
    C, owned = et.row_chunks(M, g.world)
    g.input("x", (M,), torch.float32)
    g.output("y", (M,), torch.float32)
    g.scratch("mine", (owned(g.rank),), torch.float32, symmetric=True)
    g.scratch("local", (owned(g.rank),), torch.float32)          # not symmetric: each rank its own
    g.scratch("chunk", (C,), torch.float32, symmetric=True)      # the same everywhere

    @g.task(grid=(1,))
    def copy(t, _):
        t.y[:] = t.x

    with pytest.raises(et.GraphError, match="symmetric tensor 'mine': .* depends on RANK"):
        CudaKernel(MapTable.build(g.to_ir()), "static")


def test_an_op_refused_on_one_rank_is_published_as_its_call():
    """et.ops checks their operands before choosing a kernel. Refused on one rank at a shape every
    rank has prepared, the peers launched without asking and took that rank's next call as this
    one's: the refusal is now published as this rank's call (mesh/calls.py), whose entry check
    stops the peers' launch; accepted operands publish nothing."""
    from etdist.ops import common as op

    mesh = FakeMesh([])
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.float32)
    with pytest.raises(et.InputError, match="must share a dtype"):
        with op.refusal_reaches_peers(mesh, {}):
            op.check_operands("gemm_reduce_scatter", "g", x, w, mesh)
    assert len(mesh.calls.refused) == 1 and "must share a dtype" in mesh.calls.refused[0]
    with op.refusal_reaches_peers(mesh, {}):   # accepted operands publish nothing
        op.check_operands("gemm_reduce_scatter", "g", x, w.bfloat16(), mesh)
    assert len(mesh.calls.refused) == 1


def test_launches_on_another_stream_wait_for_the_last_launch(monkeypatch):
    """Launches of one mesh on two streams ran unordered: two launches of a kernel share its
    counters, and two ranks running two calls in opposite orders wait on each other (each holds the
    SMs). One stream costs nothing; the first switch waits for the old stream's queue; from then on
    each launch records an event behind itself, so a switch waits for that launch, not for later work."""
    from etdist.mesh import stream_order

    log = []

    class Stream:
        def __init__(self, raw, device=None):
            self.raw = raw

        def wait_event(self, ev):
            log.append(("wait", self.raw, ev.at))

    class Event:
        at = None

        def record(self, s):
            self.at = s.raw
            log.append(("record", s.raw))

    monkeypatch.setattr(torch.cuda, "ExternalStream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    order = stream_order.StreamOrder(torch.device("cuda", 0))

    def launch(stream):
        order.before(stream)
        log.append(("launch", stream))
        order.after()

    for _ in range(3):
        launch(7)
    assert log == [("launch", 7)] * 3            # one stream: no events at all
    log.clear()
    launch(9)                                    # first switch: 9 waits for everything queued on 7
    assert log == [("record", 7), ("wait", 9, 7), ("launch", 9), ("record", 9)]
    log.clear()
    launch(9)
    launch(7)                                    # 7 waits for the event recorded just after 9's launch
    assert log == [("launch", 9), ("record", 9), ("wait", 7, 9), ("launch", 7), ("record", 7)]
    for _ in range(order.SETTLED + 5):           # one stream again: no events after SETTLED launches
        launch(7)
    log.clear()
    launch(7)
    assert log == [("launch", 7)]
    launch(9)                                    # a switch again records at the switch
    assert log == [("launch", 7), ("record", 7), ("wait", 9, 7), ("launch", 9), ("record", 9)]


def test_kernel_launches_go_through_the_mesh_stream_order(monkeypatch):
    """Eager launches are ordered on the stream they go to; launches captured in a CUDA graph are not
    (a capture cannot wait on an event recorded outside it)."""
    from etdist.fusion import cuda_runtime as cr
    kernel, rec = _recorded_gemm_rs(monkeypatch)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 5, raising=False)
    capturing = [False]
    monkeypatch.setattr(cr, "stream_capturing", lambda device: capturing[0])
    mesh = PreparingMesh()
    x, w = torch.randn(24, 32, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16)
    kernel(mesh, x=x, w=w)
    assert mesh.stream_order.last == 5 and len(rec.direct) == 1
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 6, raising=False)
    capturing[0] = True
    kernel(mesh, x=x, w=w)                       # captured on stream 6: not ordered, not the last
    assert mesh.stream_order.last == 5 and len(rec.direct) == 2


def test_a_call_refused_while_capturing_is_published_not_launched(monkeypatch):
    """A refusal inside a CUDA graph capture raises the InputError and launches nothing; publishing
    it to the peers (mesh/calls.py, which owes it while capturing: tests/test_calls.py) is the mesh's
    business. The next call launches as usual: the refused call left the kernel usable."""
    from etdist.fusion import cuda_runtime as cr
    kernel, rec = _recorded_gemm_rs(monkeypatch)
    capturing = [False]
    monkeypatch.setattr(cr, "stream_capturing", lambda device: capturing[0])
    mesh = PreparingMesh()
    x, w = torch.randn(24, 32, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16)
    kernel(mesh, x=x, w=w)
    capturing[0] = True
    with pytest.raises(et.InputError, match=r"out\['y'\]"):
        kernel(mesh, x=x, w=w, out={"y": torch.empty(3, 3, dtype=torch.bfloat16)})
    assert len(rec.direct) == 1 and not kernel.state(mesh).captured
    assert len(mesh.calls.refused) == 1 and "out['y']" in mesh.calls.refused[0]
    capturing[0] = False
    kernel(mesh, x=x, w=w)
    assert len(rec.direct) == 2


def test_a_failed_graph_replay_is_raised_at_calls_at_other_shapes(monkeypatch):
    """A launch replayed from a CUDA graph leaves its error word in its own state: eager calls at
    other shapes read only theirs, so the failure showed only at check(). The captured states'
    words are now read every call."""
    from etdist.fusion import cuda_runtime as cr
    kernel, rec = _recorded_gemm_rs(monkeypatch)

    def new_state(mesh):
        word = torch.zeros(1, dtype=torch.int32)
        return cr._MeshState(programs=4, error_word=word, error_np=word.numpy(), compiled=rec)
    monkeypatch.setattr(kernel, "_new_state", new_state)
    capturing = [False]
    monkeypatch.setattr(cr, "stream_capturing", lambda device: capturing[0])
    mesh = PreparingMesh()
    w = torch.randn(32, 48, dtype=torch.bfloat16)
    small, big = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(600, 32, dtype=torch.bfloat16)
    kernel(mesh, x=small, w=w)
    capturing[0] = True
    kernel(mesh, x=small, w=w)                       # "captured"
    capturing[0] = False
    graphed = kernel.state(mesh)
    kernel(mesh, x=big, w=w)
    kernel(mesh, x=big, w=w)                         # fine: nothing failed
    # a replay timed out: the kernel's record in the arena, its word in the pinned copy
    graphed.arena[:8] = torch.tensor([1, 0, 0, 3, 4, -1, 2, 0], dtype=torch.int32)
    graphed.error_np[0] = 1
    with pytest.raises(et.RuntimeFault, match="counter 3, needed 4"):
        kernel(mesh, x=big, w=w)


def test_replicated_plan_slices_ragged_down_waves_and_bounds_its_partials():
    """The replicated MLP's plan (one H200's 132 SMs, a rank of 2): at decode sizes every down tile
    in slices; above, the last down tiles in 3 slices where the last wave is ragged (gemma2_27b at
    M=1024: 144 tiles, 12 past the first wave); where all fit one wave, all of them in as many
    slices as make it shortest (llama31_8b at M=256: 32 tiles, 4 slices; at M=1024, 128 tiles:
    none); none where mlp_tail_splits is 1. One launch's partials [2, rows, H] stay within SCRATCH_BYTES and
    int32 offsets: longer x runs in launches of replicated_rows rows (found by review: llama31_405b
    at world 8 and M=16512 would have wrapped the offsets)."""
    from etdist.ops import mlp as mlp_op
    from etdist.ops.plan_model import SCRATCH_BYTES
    bf16 = torch.bfloat16
    _, build, sizes = mlp_op.replicated_plan(16, 4096, 7168, bf16, 132, 2, P)
    assert build.keywords["down_splits"] == 4 and sizes == {"M": 16, "TAIL": 32}
    _, build, sizes = mlp_op.replicated_plan(1024, 4608, 18432, bf16, 132, 2, P)
    assert build.keywords["down_splits"] == 3 and sizes == {"M": 1024, "TAIL": 12}
    _, build, sizes = mlp_op.replicated_plan(256, 4096, 7168, bf16, 132, 2, P)
    assert build.keywords["down_splits"] == 4 and sizes == {"M": 256, "TAIL": 32}
    _, build, sizes = mlp_op.replicated_plan(1024, 4096, 7168, bf16, 132, 2, P)
    assert build.keywords["down_splits"] == 1 and sizes == {"M": 1024}
    whole = P.override("mlp_tail_splits=1")
    _, build, sizes = mlp_op.replicated_plan(1024, 4608, 18432, bf16, 132, 2, whole)
    assert build.keywords["down_splits"] == 1 and sizes == {"M": 1024}
    _, build, sizes = mlp_op.replicated_plan(256, 4096, 7168, bf16, 132, 2, whole)
    assert build.keywords["down_splits"] == 1 and sizes == {"M": 256}
    for H, world in ((16384, 8), (8192, 2), (4096, 1)):
        rows = mlp_op.replicated_rows(H, world, 2)
        assert rows % 128 == 0 and world * rows * H * 2 <= SCRATCH_BYTES and world * rows * H < 2 ** 31
    assert mlp_op.replicated_rows(16384, 8, 2) == 4096



def test_plans_load_rows_through_pointers_where_a_tile_runs_far_past_them():
    """plan_model.row_pointers: a ragged last row tile that is the only one or less than half full
    loads its rows through pointers (a descriptor's box zero-fills the rows past its tensor slowly);
    full tiles and nearly full last tiles keep descriptors; gemm_rs's skinny classes keep them
    always."""
    from etdist.ops import ag_gemm as ag_op
    from etdist.ops import gemm_rs as rs_op
    from etdist.ops import mlp as mlp_op
    from etdist.ops.plan_model import row_pointers
    rule = {(16, 32): True, (32, 32): False, (100, 128): True, (128, 128): False, (129, 128): True,
            (191, 128): True, (192, 128): False, (500, 128): False, (1000, 128): False, (1024, 128): False}
    assert {k: row_pointers(*k) for k in rule} == rule
    bf = torch.bfloat16

    def chosen():
        return {"gemm_rs 129 w1": rs_op.kernel_plan(129, 7168, 4096, bf, 132, 1, P)[3].keywords["row_pointers"],
                "gemm_rs 258 w2": rs_op.kernel_plan(258, 7168, 4096, bf, 132, 2, P)[3].keywords["row_pointers"],
                "gemm_rs 256 w2": rs_op.kernel_plan(256, 7168, 4096, bf, 132, 2, P)[3].keywords["row_pointers"],
                "gemm_rs 100 skinny": "row_pointers" in rs_op.kernel_plan(100, 7168, 4096, bf, 132, 2, P)[3].keywords,
                "ag_gemm 100 whole": ag_op.kernel_plan(100, 4096, 7168, bf, 132, 2, P)[1].keywords["row_pointers"],
                "ag_gemm 1000 w2": ag_op.kernel_plan(1000, 4096, 7168, bf, 132, 2, P)[1].keywords["row_pointers"],
                "mlp 16 whole": mlp_op.kernel_plan(16, 4096, 7168, bf, 132, 2, P)[1].keywords["row_pointers"],
                "mlp 129 w1": mlp_op.kernel_plan(129, 4096, 7168, bf, 132, 1, P)[1].keywords["row_pointers"],
                "mlp 1024 w2": mlp_op.kernel_plan(1024, 4096, 7168, bf, 132, 2, P)[1].keywords["row_pointers"],
                "replicated 129": mlp_op.replicated_plan(129, 4096, 7168, bf, 132, 2, P)[1].keywords["row_pointers"],
                "replicated 1024": mlp_op.replicated_plan(1024, 4096, 7168, bf, 132, 2, P)[1].keywords["row_pointers"]}
    assert chosen() == {"gemm_rs 129 w1": True, "gemm_rs 258 w2": True, "gemm_rs 256 w2": False,
                        "gemm_rs 100 skinny": False, "ag_gemm 100 whole": True, "ag_gemm 1000 w2": False,
                        "mlp 16 whole": True, "mlp 129 w1": True, "mlp 1024 w2": False, "replicated 129": True,
                        "replicated 1024": False}


def test_mlp_plans_pad_the_gathered_rows_above_the_whole_gather_sizes():
    """Above 128 rows the sequence-parallel MLP pads its gathered rows (gate/up tiles read them
    through descriptors over whole row tiles) and, where row_pointers holds for a rank's rows,
    gathers its own rows too instead of reading x (the caller's, which cannot be padded); the
    whole-gather sizes do not pad. The graph pads the gathered rows by one row tile and hands the
    gate/up tiles TMA 3."""
    from etdist.ops import mlp as mlp_op
    bf = torch.bfloat16

    def plan(M, world):
        kw = mlp_op.kernel_plan(M, 4096, 7168, bf, 132, world, P)[1].keywords
        return kw.get("padded", False), kw.get("own_from_x", False)
    cells = {(16, 2): (False, False), (129, 1): (True, False), (258, 2): (True, False), (192, 1): (True, True),
             (1024, 2): (True, True)}
    assert {c: plan(*c) for c in cells} == cells

    from etdist.fusion.expr import evaluate
    from etdist.workloads import mlp as mlp_graph
    ir = mlp_graph.tp_mlp(128, 128, bf, 64, align=16, padded=True, row_pointers=True).to_ir()
    env = {"M": 129, "H": 256, "I": 256, "WORLD": 2, "RANK": 0}
    assert [evaluate(d, env) for d in ir.tensor("ag_out").shape] == [2 * 65 + 128, 256]
    assert [evaluate(d, env) for d in ir.tensor("h").shape] == [2 * 65, 256]
    assert {t.name: dict(t.constexprs).get("TMA") for t in ir.tasks if "TMA" in dict(t.constexprs)} == \
        {"gate_up": 3, "down": 2}


def test_interleaved_sources_only_where_each_source_is_one_row_tile():
    """plan_model.interleave_sources: the per-source graphs of ag_gemm and the MLP, and gemm_rs's
    per-owner graph, put the sources' (owners') tiles side by side at two or more ranks where each
    rank's rows are one row tile (M <= 256 at world 2, <= 512 at world 4), the MLP only with its
    down tiles all whole or all in slices, gemm_rs in place of its own tiles last (whole tiles:
    llama31_405b's shape at M <= 256); nowhere at one rank or at the skinny / whole-gather sizes
    (all_gather_gemm's 128-row tile with a tail included: M 129-160)."""
    from etdist.ops import ag_gemm as ag_op
    from etdist.ops import gemm_rs as rs_op
    from etdist.ops import mlp as mlp_op
    bf = torch.bfloat16

    def plans(M, world):
        ag = ag_op.kernel_plan(M, 8192, 28672, bf, 132, world, P)[1].keywords
        mlp = mlp_op.kernel_plan(M, 8192, 14336, bf, 132, world, P)[1].keywords
        rs = rs_op.kernel_plan(M, 24576, 12288, bf, 132, world, P)[3].keywords
        return ag.get("interleave", False), mlp.get("interleave", False), rs.get("interleave", False)

    want = {(128, 2): (False, False, False), (129, 2): (False, True, True), (161, 2): (True, True, True),
            (256, 2): (True, True, True),
            (257, 2): (False, False, False), (129, 1): (False, False, False), (512, 4): (True, True, True),
            (1000, 2): (False, False, False)}
    assert {c: plans(*c) for c in want} == want
    whole = rs_op.kernel_plan(256, 26624, 16384, bf, 132, 2, P)   # whole tiles, owners side by side
    assert whole[1] == 1 and whole[3].keywords["interleave"]


def test_all_gather_gemm_reads_half_full_row_tiles_through_pointers():
    """all_gather_gemm's per-source tiles load the rows through pointers where a source's last row
    tile is half full too (192 rows a source at M=384 on 2 ranks), not only where it is less; a
    nearly full one (500 rows at M=1000) keeps descriptors, and gemm_rs keeps the former rule."""
    from etdist.ops import ag_gemm as ag_op
    from etdist.ops import gemm_rs as rs_op
    from etdist.ops.plan_model import row_pointers
    bf = torch.bfloat16
    assert ag_op.kernel_plan(384, 4096, 14336, bf, 132, 2, P)[1].keywords["row_pointers"]
    assert not ag_op.kernel_plan(1000, 8192, 28672, bf, 132, 2, P)[1].keywords["row_pointers"]
    assert not rs_op.kernel_plan(384, 14336, 8192, bf, 132, 2, P)[3].keywords["row_pointers"]
    assert row_pointers(192, 128, at_half=True) and not row_pointers(192, 128)


def test_whole_gather_reaches_256_rows_with_one_row_tile():
    """With whole_max_m at 256, M = 129-256 takes the whole-gather graph with one 256-row tile per
    column (every weight read once), in both ops; at the default 128 those sizes keep the
    per-source graphs."""
    from etdist.ops import ag_gemm as ag_op
    from etdist.ops import mlp as mlp_op
    bf = torch.bfloat16
    assert ag_op.kernel_plan(200, 8192, 28672, bf, 132, 2, P)[1].func.__name__ == "all_gather_gemm"
    wide = P.override("whole_max_m=256")
    for M in (129, 200, 256):
        cfg, build = ag_op.kernel_plan(M, 8192, 28672, bf, 132, 2, wide)
        assert cfg == P.whole_256 and build.func.__name__ == "all_gather_gemm_whole"
        cfg, build, _ = mlp_op.kernel_plan(M, 8192, 14336, bf, 132, 2, wide)
        assert cfg == P.whole_256_mlp and build.func.__name__ == "tp_mlp_whole"
    assert ag_op.kernel_plan(128, 8192, 28672, bf, 132, 2, wide)[0] == P.whole_128
    assert ag_op.kernel_plan(200, 8192, 28672, bf, 132, 2, P)[1].func.__name__ == "all_gather_gemm"


def test_zero_sized_dims_are_refused_before_any_plan_code():
    """N = 0 or K = 0 (H = 0 in the MLP) ended in a ZeroDivisionError inside the plans."""
    from etdist.ops.common import check_operands
    mesh = FakeMesh([])
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    with pytest.raises(et.InputError, match=r"zero-sized output width \(N = 0\)"):
        check_operands("gemm_reduce_scatter", "g", x, w[:, :0], mesh)
    with pytest.raises(et.InputError, match=r"zero-sized contraction \(K = 0\)"):
        check_operands("all_gather_gemm", "g", x[:, :0], w[:0], mesh)
    for op, args in (("gemm_reduce_scatter", (x, w[:, :0])), ("all_gather_gemm", (x, w[:, :0])),
                     ("tensor_parallel_mlp", (x[:, :0], torch.zeros(0, 8, dtype=torch.bfloat16),
                                              torch.zeros(4, 0, dtype=torch.bfloat16)))):
        with pytest.raises(et.InputError, match="zero-sized"):
            getattr(et.ops, op)(*args, mesh=mesh)
    assert len(mesh.calls.refused) == 3   # published: the peers raise too


def test_sizes_past_32_bit_offsets_are_refused_before_allocation(kernel, monkeypatch):
    """A call whose tensors pass 2**31 elements asked for 4-64 GiB symmetric allocations (their
    offsets overflow in the kernels): refused before any, the refusal published."""
    mesh = FakeMesh([])
    monkeypatch.setattr(kernel, "_prepare", lambda *a: pytest.fail("prepared a launch for a refused call"))
    x = torch.empty(2**16, 2**15 + 16, dtype=torch.bfloat16, device="meta")
    w = torch.empty(2**15 + 16, 64, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(mesh, "device", torch.device("meta"), raising=False)
    with pytest.raises(et.InputError, match=r"tensor 'x' would hold 2,148,532,224 elements .* 32-bit element offsets"):
        kernel._agree_call(mesh, {"x": x, "w": w}, None, None)
    assert mesh.calls.refused and not mesh.calls.agreed


def test_graph_checks_run_at_the_sizes_calls_use():
    """compile() enumerates small sample sizes; a map out of bounds only past them (here from the
    fifth tile on) was not caught before it ran. Now each new size class is checked before launch."""
    g = et.Graph("late_bug")
    M = g.size("M")
    x = g.input("x", (M,), torch.float32)
    g.output("y", (M,), torch.float32)
    tiles = et.cdiv(M, 4)
    done = g.event("done", (tiles,))

    @g.task(grid=(tiles,), notify=lambda i: done[et.where(i < 8, i, i + 1)])   # wrong from tile 8 on
    def a(t, i):
        t.y[4 * i:4 * i + 4] = t.x[4 * i:4 * i + 4]

    @g.task(grid=(tiles,), wait=lambda i: done[i])
    def b(t, i):
        pass

    g.sample(M=8)
    g.sample(M=16)
    k = et.compile(g, target="cpu")
    k.run([{"x": torch.ones(16)}])   # checked at M = 31 too (the class of 16): 8 tiles, none wrong
    k.run([{"x": torch.ones(12)}])
    with pytest.raises(et.GraphError, match=r"notifies done\[16\], outside the event's shape \[16\] \(sizes \{'WORLD': 1, 'M': 63"):
        k.run([{"x": torch.ones(40)}])   # its class's top, M = 63: 16 tiles


def test_a_launch_held_at_its_entry_names_the_rank_and_the_call(kernel):
    """A watchdog in the call agreement (a peer never made the call) says which rank and which call,
    not an event code; a wait on a graph event names the event."""
    from etdist.mesh.control import ErrorKind, Event
    mesh = FakeMesh([])
    mesh.watchdog_s = 3
    st = type("State", (), {"shape": None})()
    words = [int(ErrorKind.TIMEOUT), 0, Event.encode(Event.CALL, 3), 2, 3, 1, 3, 0]
    with pytest.raises(et.RuntimeFault, match=r"rank 0 waited at the launch's entry for rank 1 to make call 3 "
                                              r".*its last was 2.*watchdog expired after ~3 s"):
        kernel._raise_if_failed(mesh, st, words)
    words[2] = (16 << 20) | 5   # the graph's first event, element 5
    with pytest.raises(et.RuntimeFault, match=r"waited on event code"):
        kernel._raise_if_failed(mesh, st, words)
