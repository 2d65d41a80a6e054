"""Launch the Triton exchange kernel (kernels/exchange.py) for a plan.

Runs on the nvshmem backend (inline-asm acquire polls), and on the cpu backend under
TRITON_INTERPRET=1 (atomic polls), which is how CI checks the kernel's protocol without a GPU.
"""
from __future__ import annotations

from typing import Dict

import torch
from triton import knobs as triton_knobs

from ..kernels.exchange import exchange_kernel
from ..kernels.interpret import patch_interpreter
from ..kernels.launch_hooks import hooks_active
from ..mesh.persistent import empty_persistent
from ..mesh import Mesh, MeshError
from ..mesh.control import signature_dtype
from .plan import Op, Plan
from .workspace import MAX_CHUNKS, Workspace

# Chosen by a sweep of these four on 2x H200 (the sweep and its knobs: 74255bb's parent)
BLOCK = 8192              # tl.arange's size
NUM_WARPS = 4
PROGRAMS_PER_SM = 4       # at most, where they fit
CHUNKS_PER_PROGRAM = 16   # so that pushes and combines pipeline


def choose_chunk(max_count: int, programs: int, align: int, block: int) -> int:
    """Chunk size in elements: about CHUNKS_PER_PROGRAM chunks per program so pushes and combines
    pipeline, never below one BLOCK (small messages: one program, one chunk), a multiple of
    `align`, and at most MAX_CHUNKS chunks."""
    chunk = max(-(-max_count // (CHUNKS_PER_PROGRAM * programs)), -(-max_count // MAX_CHUNKS), min(block, max_count), 1)
    step = block if chunk >= block else align
    return -(-chunk // step) * step


def plan_chunk(plan: Plan, slot_elems: int, programs: int, align: int, block: int) -> int:
    """choose_chunk for `plan`, from a count every rank shares: both ends of a segment must cut it
    into the same chunks (the receiver waits on the sender's chunk lanes). all_to_all ranks' largest
    segments differ, so its chunks are sized for the slot, the most any rank may send."""
    basis = slot_elems if plan.op is Op.ALL_TO_ALL else plan.max_count
    return choose_chunk(max(basis, 1), programs, align, block)


def _compiled(mesh: Mesh, args: dict, constexprs: dict, num_warps: int):
    """Compile (once per variant) and load the module now, before anything spins."""
    ptr_align = tuple(v.data_ptr() % 16 == 0 for v in args.values() if isinstance(v, torch.Tensor))
    key = (tuple(sorted(constexprs.items())), num_warps, args["x_ptr"].dtype, ptr_align, mesh.device.index)
    cache = _COMPILED
    k = cache.get(key)
    if k is None:
        k = exchange_kernel.warmup(**args, **constexprs, grid=(1,), num_warps=num_warps)
        k._init_handles()
        cache[key] = k
    return k


_COMPILED: Dict[tuple, object] = {}


def _resident_programs(mesh: Mesh, kernel, num_warps: int) -> int:
    """Programs that fit on the GPU at once (every waiter's producer must be running too)."""
    props = torch.cuda.get_device_properties(mesh.device)
    threads = 32 * num_warps
    per_sm = min(getattr(props, "max_threads_per_multi_processor", 2048) // threads,
                 getattr(props, "regs_per_multiprocessor", 65536) // max(1, kernel.n_regs * threads), 32)
    if kernel.metadata.shared:
        per_sm = min(per_sm, getattr(props, "shared_memory_per_multiprocessor", 228 << 10) // kernel.metadata.shared)
    return max(1, props.multi_processor_count * min(per_sm, PROGRAMS_PER_SM))


def prepare_gpu(mesh: Mesh, ws: Workspace, x: torch.Tensor, out: torch.Tensor, plan: Plan, rendezvous: bool,
                direct: bool = False, *, call_sig: int):
    """Everything a launch needs, resolved once: returns a no-argument callable that launches the
    compiled kernel on the current stream (a few microseconds of host time)."""
    if torch.cuda.is_current_stream_capturing():
        raise MeshError("a collective is being captured into a CUDA graph before it ran once with these "
                        "tensors: call it once outside the graph first (same tensors, check=False)")
    w, es = mesh.world_size, x.element_size()
    align = max(1, 16 // es)
    if not (plan.aligned(align) and x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
            and ws.slot_elems(x.dtype) % align == 0):
        align = 1
    block, num_warps = BLOCK, NUM_WARPS
    lay = mesh.layout
    packed = empty_persistent(4 * w + 3, torch.int64, mesh.device).zero_()   # kept by the launcher
    args = dict(x_ptr=x, out_ptr=out, plan_ptr=packed, scratch_ptr=ws.scratch.view(x.dtype),
                scratch_table=ws.scratch_table, sig_ptr=ws.signals, sig_table=ws.signals_table, ctrl_ptr=mesh.ctrl,
                ctrl_table=ws.ctrl_table, out_table=mesh.peer_ptrs(out) if direct else ws.scratch_table,
                call_error_ptr=mesh.call_error,
                meta_off=lay.meta, exit_off=lay.exit, grid_off=lay.grid, epoch_off=lay.epoch,
                entry_off=lay.entry, call_off=lay.call, seq_off=lay.call_seq, rank=mesh.rank, world=w,
                op_sig=plan.op_signature(signature_dtype(x.dtype)), call_sig=call_sig, nchunks=1,
                max_spins=mesh.watchdog_spins(), skip_notify=int(mesh.fault_skip_notify_rank == mesh.rank))
    constexprs = dict(REDUCE=plan.op.reduces, RENDEZVOUS=rendezvous, DIRECT=direct, USE_ASM=True, BLOCK=block, ALIGN=align,
                      PALIGN=align * es)
    kernel = _compiled(mesh, args, constexprs, num_warps)
    cap = _resident_programs(mesh, kernel, num_warps)
    chunk = plan_chunk(plan, ws.slot_elems(x.dtype), cap, align, block)
    nchunks = -(-plan.max_count // chunk)
    programs = max(1, min(nchunks, cap))
    vals = list(plan.send_off + plan.send_cnt + plan.recv_off + plan.recv_cnt) + [chunk, ws.slot_elems(x.dtype),
                                                                                plan.rest]
    packed.copy_(torch.tensor(vals, dtype=torch.int64))
    args["nchunks"] = nchunks
    # Pointers go to the launcher as plain ints (no per-call tensor attribute lookups).
    # x and out are not kept alive by the cache (its key holds their addresses, shapes and dtype).
    args["x_ptr"], args["out_ptr"] = x.data_ptr(), out.data_ptr()
    full = [args[n] if n in args else constexprs[n] for n in exchange_kernel.arg_names]  # keeps ours alive
    flat = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in full]
    run, function, meta = kernel.run, kernel.function, kernel.packed_metadata
    raw_stream, index = torch._C._cuda_getCurrentRawStream, mesh.device.index

    def launch():
        if hooks_active():  # profilers: pass their hooks and metadata, as Triton's own path does
            hooks = triton_knobs.runtime.launch_enter_hook, triton_knobs.runtime.launch_exit_hook
            stream = raw_stream(index)
            run(programs, 1, 1, stream, function, meta, kernel.launch_metadata((programs, 1, 1), stream, *full),
                *hooks, *flat)
            return
        run(programs, 1, 1, raw_stream(index), function, meta, None, None, None, *flat)

    launch.full = full
    launch.programs, launch.chunk = programs, chunk
    return launch


def exchange_interpreted(mesh: Mesh, ws: Workspace, x: torch.Tensor, out: torch.Tensor, plan: Plan,
                         rendezvous: bool = True, direct: bool = False, *, call_sig: int) -> None:
    """The same kernel under TRITON_INTERPRET=1 on the cpu backend (atomic polls, no inline asm)."""
    patch_interpreter()
    w, es = mesh.world_size, x.element_size()
    chunk = plan_chunk(plan, ws.slot_elems(x.dtype), 4, 1, BLOCK)
    nchunks = -(-plan.max_count // chunk)
    vals = list(plan.send_off + plan.send_cnt + plan.recv_off + plan.recv_cnt) + [chunk, ws.slot_elems(x.dtype),
                                                                                plan.rest]
    packed = torch.tensor(vals, dtype=torch.int64)
    lay = mesh.layout
    exchange_kernel[(max(1, min(nchunks, 4)),)](
        x, out, packed, ws.scratch.view(x.dtype), ws.scratch_table, ws.signals, ws.signals_table, mesh.ctrl,
        ws.ctrl_table, mesh.peer_ptrs(out) if direct else ws.scratch_table, mesh.call_error, lay.meta, lay.exit, lay.grid, lay.epoch, lay.entry, lay.call, lay.call_seq, mesh.rank, w,
        plan.op_signature(signature_dtype(x.dtype)), call_sig, nchunks, int(mesh.watchdog_s * 1000), int(mesh.fault_skip_notify_rank == mesh.rank),
        REDUCE=plan.op.reduces, RENDEZVOUS=rendezvous, DIRECT=direct, USE_ASM=False, BLOCK=BLOCK, ALIGN=1, PALIGN=es)
