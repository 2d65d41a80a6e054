"""Python host time per call of the fused ops on the CPU, no GPU needed: what the op wrapper and
CudaKernel.__call__ cost before any CUDA API call (the launch is stubbed; a one-rank fake mesh keeps
the buffers in host memory). Decode-sized calls are host-bound, so this is worth watching.

    python experiments/host_path_cpu.py [M] [--profile]      (qwen3_8b-sized operands, default M=16)
"""
import cProfile
import pstats
import sys
import time
import types

import torch
import etdist as et
from etdist.fusion import cuda_runtime as cr
from etdist.mesh.stream_order import StreamOrder
from etdist.ops import ag_gemm as ag_op
from etdist.ops import gemm_rs as rs_op
from etdist.ops import mlp as mlp_op

class FakeMesh:
    backend, rank, world_size = "nvshmem", 0, 1
    device = torch.device("cpu")
    def __init__(self):   # a real StreamOrder: one stream, as a real call's host path
        self.cache, self.comm = {}, types.SimpleNamespace(allgather=lambda x: [x])
        self.stream_order = StreamOrder(self.device)
    def empty(self, shape, dtype): return torch.zeros(shape, dtype=dtype)
    def free(self, t): pass
    def peer_ptrs(self, t): return torch.tensor([t.data_ptr()], dtype=torch.int64)
    def watchdog_spins(self): return 1 << 30
    def barrier(self): pass

class FakeLauncher:   # Triton's CudaLauncher: the Python wrapper and the C launch, both stubbed
    global_scratch_size = profile_scratch_size = 0
    global_scratch_align, launch_cooperative_grid, launch_pdl = 1, True, False
    def __call__(self, *args): pass
    def launch(self, *args): pass

class FakeCompiled:
    function, packed_metadata = 0, None
    run = FakeLauncher()

torch._C._cuda_getCurrentRawStream = lambda i: 0
# the kernels' states as a GPU's: "device" -1 (a CPU tensor's get_device()), never capturing
torch._C._cuda_getDevice = lambda: -1
cr.capturing_current = lambda: False
mesh = FakeMesh()
rs_op.sm_count = mlp_op.sm_count = ag_op.sm_count = lambda i: 132   # the plans ask for the SM count
def new_state(self, mesh):
    word = torch.zeros(1, dtype=torch.int32)
    return cr._MeshState(programs=132, error_word=word, error_np=word.numpy(), compiled=FakeCompiled())
cr.CudaKernel._new_state = new_state
cr.hooks_active = lambda: False
M = int(sys.argv[1]) if len(sys.argv) > 1 else 16
x = torch.randn(M, 1536, dtype=torch.bfloat16); w = torch.randn(1536, 4096, dtype=torch.bfloat16)
xa = torch.randn(M, 4096, dtype=torch.bfloat16); wa = torch.randn(4096, 2 * 1536, dtype=torch.bfloat16)
calls = {"gemm_rs": lambda: et.ops.gemm_reduce_scatter(x, w, mesh=mesh),
         "ag_gemm": lambda: et.ops.all_gather_gemm(xa, wa, mesh=mesh),
         "mlp": lambda: et.ops.tensor_parallel_mlp(xa, wa, w, mesh=mesh)}
for name, f in calls.items():
    f()
    for states in mesh.cache.values():
        if isinstance(states, cr._KernelStates):
            states.gpu = -1
    f(); f()
    best = 1e9   # the best of 7 runs of 1000: this machine's other work only adds
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(1000): f()
        best = min(best, (time.perf_counter() - t0) / 1000 * 1e6)
    print(f"{name:8} M={M}: {best:6.1f} us per call (Python host path, launch stubbed; best of 7 x 1000)")
if "--profile" in sys.argv:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(2000): calls["mlp"]()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
