"""One kernel for every collective: push segments into peers, signal, wait, combine, rendezvous.

A collective is a per-peer plan (collectives/plan.py): send_off[d]/send_cnt[d] say which elements
of x go to rank d; recv_off[s]/recv_cnt[s] where rank s's elements land in out. The element range
of every segment is cut into chunks of CH elements; program p owns chunks p, p+P, ... and, for
each, (1) stores chunk c of every peer's segment into that peer's scratch slot for our rank,
(2) sets the peer's signal lane [c, rank] to the epoch (release, sys scope), then (3) waits for
lane [c, s] >= epoch from every source s (acquire), checks the sender's signature, and combines:
REDUCE sums our own segment and every slot in fp32 into out; otherwise it copies each source's
slot (our own segment straight from x) to its place in out. Chunk k+1 is pushed before chunk k is
combined, so NVLink traffic and HBM work overlap. Scratch slots alternate between two halves by
epoch parity; the exit rendezvous keeps any rank from starting call e+1 until all left call e.
The epoch lives on the device (control block), so launches replayed from a CUDA graph stay correct.

Scratch layout (elements of x's dtype): [(parity * W + src) * slot_elems + i].
Signal lanes (int32): [chunk * W + src].
DIRECT (all_gather into a symmetric `out`): chunks go straight into the peer's out, no scratch and no
copy on the receiver; writers first wait for the peer's entry lane (it has entered this call). Plan (int64): [send_off | send_cnt | recv_off | recv_cnt] (W each), chunk, slot_elems, rest
(elements later rounds move: signatures carry count + rest).
"""
import triton
import triton.language as tl

from ..mesh.control import SIG_COUNT_BITS
from .sync import (ERR_SHAPE, agree_call, finish_launch, hand_over_call_error, notify, peer_base, record_error,
                   rendezvous, wait)

EVENT_CHUNK = tl.constexpr(1 << 20)
EVENT_EXIT = tl.constexpr(2 << 20)
EVENT_ENTRY = tl.constexpr(4 << 20)
SIG_MASK = tl.constexpr((1 << SIG_COUNT_BITS) - 1)   # op_sig carries the op and dtype above


@triton.jit
def _copy(dst, src, start, end, BLOCK: tl.constexpr):
    """Alignment hints must be applied by the caller (Triton drops hints on function arguments)."""
    for b in range(start, end, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        m = offs < end
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


# Scalars are never specialised on their values, so one compiled kernel serves every rank, world
# size and message size (the host launches it directly, skipping Triton's per-call dispatch).
SCALAR_ARGS = ["meta_off", "exit_off", "grid_off", "epoch_off", "entry_off", "call_off", "seq_off", "rank", "world",
               "op_sig", "call_sig", "nchunks", "max_spins", "skip_notify"]


@triton.jit(do_not_specialize=SCALAR_ARGS)
def exchange_kernel(x_ptr, out_ptr, plan_ptr, scratch_ptr, scratch_table, sig_ptr, sig_table,
                    ctrl_ptr, ctrl_table, out_table, call_error_ptr, meta_off, exit_off, grid_off, epoch_off, entry_off,
                    call_off, seq_off, rank, world, op_sig, call_sig, nchunks, max_spins, skip_notify,
                    REDUCE: tl.constexpr, RENDEZVOUS: tl.constexpr, DIRECT: tl.constexpr, USE_ASM: tl.constexpr,
                    BLOCK: tl.constexpr, ALIGN: tl.constexpr, PALIGN: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(ctrl_ptr + epoch_off, volatile=True) + 1  # bumped by finish_launch
    parity = epoch % 2
    poisoned = tl.load(ctrl_ptr, volatile=True) != 0
    # every rank makes the same call (mesh/calls.py), checked before anything is sent
    seq, agreed = agree_call(ctrl_ptr, ctrl_table, call_off, seq_off, rank, world, call_sig, max_spins, ctrl_ptr,
                             ctrl_table, pid, USE_ASM)
    # Scalars from memory, not arguments: Triton drops alignment hints on scalar arguments.
    chunk = tl.multiple_of(tl.load(plan_ptr + 4 * world), ALIGN)
    slot_elems = tl.multiple_of(tl.load(plan_ptr + 4 * world + 1), ALIGN)
    my_off = tl.multiple_of(tl.load(plan_ptr + rank), ALIGN)
    my_cnt = tl.multiple_of(tl.load(plan_ptr + world + rank), ALIGN)
    my_out = tl.multiple_of(tl.load(plan_ptr + 2 * world + rank), ALIGN)
    rest = tl.load(plan_ptr + 4 * world + 2)
    if (poisoned == 0) & (agreed != 0):
        # Header for every peer: what we are about to send it (released by our chunk notifies).
        for d in range(world):
            if d != rank:
                meta = peer_base(ctrl_table, d, ctrl_ptr) + meta_off + rank * 4 + parity * 2
                tl.store(meta, epoch)
                tl.store(meta + 1, op_sig | ((tl.load(plan_ptr + world + d) + rest).to(tl.int32) & SIG_MASK))
        if DIRECT:  # we write into peers' `out` itself: only once they entered this call
            rendezvous(ctrl_ptr, ctrl_table, entry_off, epoch, rank, world, max_spins, EVENT_ENTRY, USE_ASM)
        nmine = tl.cdiv(nchunks - pid, nprog)
        for k in range(0, nmine + 1):
            if k < nmine:  # push chunk c to every peer
                c = pid + k * nprog
                start = c * chunk
                for d in range(world):
                    if d != rank:
                        cnt = tl.multiple_of(tl.load(plan_ptr + world + d), ALIGN)
                        if start < cnt:
                            dst = peer_base(scratch_table, d, scratch_ptr) + (parity * world + rank) * slot_elems
                            if DIRECT:  # straight to where our block lives in the peer's out
                                dst = peer_base(out_table, d, out_ptr) + my_out
                            src = x_ptr + tl.multiple_of(tl.load(plan_ptr + d), ALIGN)
                            _copy(tl.multiple_of(dst, PALIGN), tl.multiple_of(src, PALIGN),
                                  start, tl.multiple_of(tl.minimum(start + chunk, cnt), ALIGN), BLOCK)
                            if skip_notify == 0:
                                notify(peer_base(sig_table, d, sig_ptr) + c * world + rank, epoch, True, "sys")
            if k > 0:  # combine chunk c (pushed one turn ago)
                c = pid + (k - 1) * nprog
                start = c * chunk
                bad = 0
                for s in range(world):
                    cnt_s = tl.load(plan_ptr + 3 * world + s)
                    if (s != rank) & (start < cnt_s):
                        got = wait(sig_ptr + c * world + s, epoch, max_spins, ctrl_ptr, ctrl_table, rank, world,
                                   EVENT_CHUNK + c, s, epoch, "sys", USE_ASM)
                        if got != 0:
                            m = ctrl_ptr + meta_off + s * 4 + parity * 2
                            their = tl.load(m + 1, volatile=True)
                            mine = op_sig | ((cnt_s + rest).to(tl.int32) & SIG_MASK)
                            if REDUCE:
                                mine = op_sig | ((my_cnt + rest).to(tl.int32) & SIG_MASK)
                            if (tl.load(m, volatile=True) != epoch) | (their != mine):
                                record_error(ctrl_ptr, ctrl_table, rank, world, ERR_SHAPE, EVENT_CHUNK + c,
                                             their, mine, s, epoch)
                                got = 0
                        bad += 1 - got
                if bad == 0:
                    if REDUCE:
                        end = tl.minimum(start + chunk, my_cnt)
                        for b in range(start, end, BLOCK):
                            offs = b + tl.arange(0, BLOCK)
                            msk = offs < end
                            acc = tl.load(x_ptr + my_off + offs, mask=msk).to(tl.float32)
                            for s in range(world):
                                if s != rank:
                                    slot = scratch_ptr + (parity * world + s) * slot_elems
                                    acc += tl.load(slot + offs, mask=msk).to(tl.float32)
                            tl.store(out_ptr + my_out + offs, acc.to(out_ptr.dtype.element_ty), mask=msk)
                    else:
                        for s in range(world):
                            cnt_s = tl.multiple_of(tl.load(plan_ptr + 3 * world + s), ALIGN)
                            if DIRECT:
                                if s != rank:
                                    cnt_s = start  # already in place: nothing to copy
                            if start < cnt_s:
                                dst = tl.multiple_of(out_ptr + tl.multiple_of(tl.load(plan_ptr + 2 * world + s), ALIGN),
                                                     PALIGN)
                                end = tl.multiple_of(tl.minimum(start + chunk, cnt_s), ALIGN)
                                src = tl.multiple_of(scratch_ptr + (parity * world + s) * slot_elems, PALIGN)
                                if s == rank:
                                    src = tl.multiple_of(x_ptr + my_off, PALIGN)
                                _copy(dst, src, start, end, BLOCK)
    last = finish_launch(ctrl_ptr, ctrl_table, exit_off, grid_off, epoch_off, epoch, rank, world, 2 * max_spins,
                         agreed, RENDEZVOUS, EVENT_EXIT, USE_ASM)
    if last != 0:   # every program has read the call number: this call is this rank's last now
        tl.atomic_xchg(ctrl_ptr + seq_off, seq, sem="relaxed", scope="gpu")
        hand_over_call_error(ctrl_ptr, call_error_ptr)   # the host raises it at this rank's next call
