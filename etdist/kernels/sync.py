"""Cross-program and cross-GPU synchronisation primitives for Triton kernels.

Ordering (PTX memory model):
- `notify` is a release: every store the program made before it (all threads: it starts with a
  CTA barrier) is visible to whoever acquires the same word afterwards. SCOPE "gpu" for events
  consumed on this GPU, "sys" for a word on (or read by) another GPU.
- `wait` is an acquire poll: loads after it see what the notifier stored before its release.
  SCOPE as above: "sys" for lanes a peer notifies. It ends with a CTA barrier.
- Every wait is bounded: after `max_spins` turns it records (kind, rank, event, observed,
  expected, peer, epoch) into the error slot of this rank and of every peer, and returns False.
  Callers skip the work that depended on it and carry on to `finish_launch`, so a missing notify
  ends every rank's kernel and the host raises (Mesh.check) instead of hanging.

USE_ASM selects an inline-asm `ld.acquire.<scope>.global.b32` poll (GPU; lighter than an atomic
poll, which Triton broadcasts through shared memory); without it the poll is an acquire atomic,
which also runs under TRITON_INTERPRET=1 on CPU tensors (where inline asm cannot).
"""
import triton
import triton.language as tl

ERR_TIMEOUT = tl.constexpr(1)
ERR_SHAPE = tl.constexpr(2)
ERR_CALL = tl.constexpr(4)        # mesh.control.ErrorKind.CALL
ERR_NOTIFY = tl.constexpr(6)      # mesh.control.ErrorKind.NOTIFY
ERR_OVER = tl.constexpr(7)        # mesh.control.ErrorKind.OVER
EVENT_CALL = tl.constexpr(5 << 20)   # mesh.control.Event.CALL


@triton.jit
def peer_base(table_ptr, rank, like_ptr):
    """Rank `rank`'s copy of a symmetric buffer, typed like `like_ptr`, from a Mesh.peer_ptrs table."""
    return tl.load(table_ptr + rank).to(tl.pointer_type(like_ptr.dtype.element_ty))


@triton.jit
def ld_acquire(ptr, SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
    if USE_ASM:
        if SCOPE == "sys":
            v = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr],
                                          dtype=tl.int32, is_pure=False, pack=1)
        else:
            v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                          dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    return v


@triton.jit
def notify(ptr, value, SET: tl.constexpr, SCOPE: tl.constexpr):
    """Release `value` into the int32 word at ptr: SET stores it (single-writer lanes stamped with an
    epoch), otherwise adds it (counters shared by several notifiers)."""
    tl.debug_barrier()
    if SET:
        tl.atomic_xchg(ptr, value, sem="release", scope=SCOPE)
    else:
        tl.atomic_add(ptr, value, sem="release", scope=SCOPE)


@triton.jit
def record_error(ctrl_ptr, ctrl_table, rank, world, kind, event, observed, expected, peer, epoch):
    """First error wins, on this rank and on every peer (sys-scope CAS on word 0, then the fields)."""
    for r in range(world):
        slot = ctrl_ptr
        if r != rank:
            slot = peer_base(ctrl_table, r, ctrl_ptr)
        prev = tl.atomic_cas(slot, 0, -1, sem="relaxed", scope="sys")
        if prev == 0:
            tl.store(slot + 1, rank)
            tl.store(slot + 2, event)
            tl.store(slot + 3, observed)
            tl.store(slot + 4, expected)
            tl.store(slot + 5, peer)
            tl.store(slot + 6, epoch)
            tl.atomic_xchg(slot, kind, sem="release", scope="sys")


@triton.jit
def record_local(err_ptr, rank, kind, event, observed, expected, peer, epoch):
    """An error record on this rank only (first error wins): for what every rank finds by itself."""
    prev = tl.atomic_cas(err_ptr, 0, -1, sem="relaxed", scope="gpu")
    if prev == 0:
        tl.store(err_ptr + 1, rank)
        tl.store(err_ptr + 2, event)
        tl.store(err_ptr + 3, observed)
        tl.store(err_ptr + 4, expected)
        tl.store(err_ptr + 5, peer)
        tl.store(err_ptr + 6, epoch)
        tl.atomic_xchg(err_ptr, kind, sem="release", scope="gpu")


@triton.jit
def wait(ptr, target, max_spins, ctrl_ptr, ctrl_table, rank, world, event, peer, epoch,
         SCOPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Spin until the int32 at ptr >= target (acquire). Returns 1, or 0 after recording a timeout
    (also 0 soon after an error is recorded on this rank, e.g. propagated by a peer).
    Compared as `v - target >= 0` in int32: counters and targets that grow past 2**31 wrap
    together, so the comparison stays right (a plain `v < target` would pass at once)."""
    v = ld_acquire(ptr, SCOPE, USE_ASM)
    spins = 0
    failed = tl.load(ctrl_ptr, volatile=True) != 0
    while (v - target < 0) & (spins < max_spins) & (failed == 0):
        v = ld_acquire(ptr, SCOPE, USE_ASM)
        spins += 1
        if spins % 1024 == 0:
            failed = tl.load(ctrl_ptr, volatile=True) != 0
    ok = (v - target >= 0).to(tl.int32)
    if ok == 0:
        if failed == 0:
            record_error(ctrl_ptr, ctrl_table, rank, world, ERR_TIMEOUT, event, v, target, peer, epoch)
    tl.debug_barrier()
    return ok


@triton.jit
def rendezvous(ctrl_ptr, ctrl_table, lanes_off, epoch, rank, world, max_spins, EVENT: tl.constexpr,
               USE_ASM: tl.constexpr):
    """Tell every peer 'rank reached epoch' (its lane lanes_off + rank, sys-scope release), then wait
    until every peer said the same in our lanes (watchdog'd; EVENT names it in the error record)."""
    for d in range(world):
        if d != rank:
            notify(peer_base(ctrl_table, d, ctrl_ptr) + lanes_off + rank, epoch, True, "sys")
    for s in range(world):
        if s != rank:
            wait(ctrl_ptr + lanes_off + s, epoch, max_spins, ctrl_ptr, ctrl_table, rank, world,
                 EVENT, s, epoch, "sys", USE_ASM)


@triton.jit
def agree_call(lanes_ptr, lanes_table, call_off, seq_off, rank, world, sig, max_spins, err_ptr, err_table, pid,
               USE_ASM: tl.constexpr):
    """Entry of a launch (mesh/calls.py's protocol): the call number is this rank's last plus one
    (the mesh control block `lanes_ptr`, word seq_off, which the caller's last program sets to it
    at the end); program 0 stores `sig`, then the number (release), into our lane of every peer's
    block; every program waits (watchdog) for every peer's lane of this call and compares the words.
    Returns (call number, agreed): agreed is 0 where a word differs (recorded in this rank's own
    err record as ERR_CALL: every rank finds it by itself, nothing runs and the mesh stays usable)
    or a peer never came (a timeout, recorded on every rank as wait's). agree_post then agree_wait."""
    seq = agree_post(lanes_ptr, lanes_table, call_off, seq_off, rank, world, sig, pid)
    return seq, agree_wait(lanes_ptr, call_off, seq, rank, world, sig, max_spins, err_ptr, err_table, USE_ASM)


@triton.jit
def agree_post(lanes_ptr, lanes_table, call_off, seq_off, rank, world, sig, pid):
    """agree_call's first half, which waits for nothing: the call number; program 0 posts our
    word and number into every peer's lane."""
    seq = tl.load(lanes_ptr + seq_off, volatile=True) + 1
    lane = call_off + 2 * (seq % 2)
    if pid == 0:
        for d in range(world):
            if d != rank:
                dst = peer_base(lanes_table, d, lanes_ptr) + lane + 4 * rank
                tl.store(dst + 1, sig)
                notify(dst, seq, True, "sys")   # released: who sees the number sees the word
    return seq


@triton.jit
def agree_wait(lanes_ptr, call_off, seq, rank, world, sig, max_spins, err_ptr, err_table, USE_ASM: tl.constexpr):
    """agree_call's second half: wait for every peer's lane of call `seq` and compare the words;
    agreed (1) or not (0)."""
    lane = call_off + 2 * (seq % 2)
    agreed = 1
    for s in range(world):
        if s != rank:
            got = wait(lanes_ptr + lane + 4 * s, seq, max_spins, err_ptr, err_table, rank, world,
                       EVENT_CALL + (seq & 0xFFFFF), s, seq, "sys", USE_ASM)
            if got != 0:
                theirs = tl.load(lanes_ptr + lane + 4 * s + 1, volatile=True)
                if theirs != sig:
                    record_local(err_ptr, rank, ERR_CALL, EVENT_CALL + (seq & 0xFFFFF), theirs, sig, s, seq)
                    got = 0
            agreed = agreed * got
    return agreed


@triton.jit
def hand_over_call_error(err_ptr, host_ptr):
    """The last program of a launch whose call the ranks disagreed on (err_ptr's record of kind
    ERR_CALL): the record to the mesh's pinned host words (the host raises it at this rank's next
    call of any op, mesh/calls.py), and err_ptr's cleared (nothing ran: the kernel stays usable)."""
    if tl.load(err_ptr, volatile=True) == ERR_CALL:
        for k in range(1, 8):
            tl.store(host_ptr + k, tl.load(err_ptr + k, volatile=True))
            tl.store(err_ptr + k, 0)
        tl.store(host_ptr, ERR_CALL)
        tl.atomic_xchg(err_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def finish_launch(ctrl_ptr, ctrl_table, exit_off, grid_off, epoch_off, epoch, rank, world, max_spins, agreed,
                  RENDEZVOUS: tl.constexpr, EVENT_EXIT: tl.constexpr, USE_ASM: tl.constexpr):
    """End of a launch: the last program to arrive (grid counter, gpu scope) re-arms the counter,
    records `epoch` as this GPU's device epoch for the next launch and, with RENDEZVOUS, runs the exit
    rendezvous: tells every peer 'rank done with epoch' and waits until every peer said the same to
    us, so no rank starts writing into a peer's buffers for the next call before that peer is done
    with this one (or a watchdog fired). A launch whose call the ranks did not agree on (agreed 0:
    it ran nothing) leaves the epoch and skips the rendezvous. Returns 1 in the last program to
    arrive (every other program of this GPU is done with the launch), else 0."""
    tl.debug_barrier()
    arrived = tl.atomic_add(ctrl_ptr + grid_off, 1, sem="acq_rel", scope="gpu")
    last = (arrived == tl.num_programs(0) - 1).to(tl.int32)
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(ctrl_ptr + grid_off, 0, sem="relaxed", scope="gpu")
        if agreed != 0:
            tl.atomic_xchg(ctrl_ptr + epoch_off, epoch, sem="relaxed", scope="gpu")
            if RENDEZVOUS:
                rendezvous(ctrl_ptr, ctrl_table, exit_off, epoch, rank, world, max_spins, EVENT_EXIT, USE_ASM)
    return last


@triton.jit
def trace_clock(anchor):
    """(global nanosecond timer, SM id) for trace mode; `anchor` (any scalar) only gives the asm an
    operand. Only generated when a graph is compiled with trace=True."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=tl.int64,
                                  is_pure=False, pack=1)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [anchor], dtype=tl.int32,
                                   is_pure=False, pack=1)
    return t, sm


@triton.jit
def store_clock(out_ptr):
    """One program: store %globaltimer (ns) into out_ptr[0] (fusion/trace.py's measure_offset)."""
    t, sm = trace_clock(tl.program_id(0))
    tl.store(out_ptr, t)


@triton.jit
def async_proxy_fence(USE_ASM: tl.constexpr):
    """Order the generic-proxy writes this thread has acquired (peer stores, other programs' tiles)
    before the TMA loads (async proxy) that follow: the release/acquire of an event orders the
    generic proxy only (PTX memory model, proxies). A no-op under the interpreter."""
    if USE_ASM:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
