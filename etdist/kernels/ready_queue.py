"""The on-GPU ready queue of the dynamic schedule (one per rank, in symmetric memory).

Layout of the int64 buffer `rq` (offsets are kernel arguments, the same on every rank):

    [0] head (claims) | [1] tail (pushes) | [2, 2+Q) slots | pending[task] | rowptr[arena word] |
    cols | seeded tasks

A launch's queue starts with its seeded tasks: those that wait on nothing, then the early-pushed
ones (ir.early_pushed: they wait only on pinned tasks' events, or with its chains also on seeded
tasks ahead of them, and spin when popped). Their ids sit
in a table the host writes once per shape, and a claim of one of the launch's first NINIT indices
reads it directly (take; or computes it, where the seeded ids are consecutive): seeding costs no
atomics and keeps id order (pushed one by one at the start, each program paid a chain of
sys-scope atomics before its first task).

A finished task that brings an event element to its count walks that element's consumers
(rowptr/cols: the inverse map, built on the host per shape; each entry waits << 32 | task, its
number of waits with it) on the rank that owns the element, bumps the pending count of each one
that waits on more than this element, and pushes the ones whose every wait is now complete: one
sys-scope atomic on that rank's tail per block of them, then each slot stored with release. A
consumer with one wait is pushed at once: no other notifier shares its count, so the bump (a
dependent sys-scope atomic on the release's path) would decide nothing. Push number i's slot
holds (i + 1) << 32 | task, so a program that claimed it knows when its entry has landed (the stamp
is compared in 32 bits: (i + 1) << 32 wraps once a mesh has pushed 2^31 tasks, and a slot is never
more than one lap stale). Head and tail only grow (each launch claims every queued task once and
pushes every one it does not seed), so counters re-arm by launch epoch as the events do; claims
overshoot by one per program at the end of a launch, and the last program to finish rewinds the head.
Pushed tasks have all their waits complete: no program spins inside one, which is what makes the
schedule deadlock-free for any valid graph. The programs that do spin are in pinned tasks
(TaskSpec.pinned: never queued; every program runs its static share of them first, as under the
static schedule, deadlock-free as long as they wait only on each other, graph._check_pinned), in
early-pushed ones, which wait only on pinned work or on tasks seeded ahead of them (each held
by a running program, so the earliest unfinished one always progresses), and in the tail (TaskSpec.tail: every program
walks its static share of it once it claims past the launch's last queued index; by then every
queued task is held by a program that runs it, and no queued task waits on the tail,
graph._check_tail).
"""
import triton
import triton.language as tl

from .sync import ERR_TIMEOUT, peer_base, record_error


@triton.jit
def push(q, task, QSIZE, ready):
    """Queue `task` (a scalar, or a block of tasks, one per lane) where `ready`: claim a tail index,
    then publish the slot with release. Sys scope always: peers push into the same tail, and
    atomics of different scopes on one word are not atomic with each other in the PTX memory model."""
    task = task.to(tl.int64)
    t = tl.atomic_add(q + 1 + 0 * task, 1 + 0 * task, mask=ready, sem="relaxed", scope="sys")
    tl.atomic_xchg(q + 2 + t % QSIZE, ((t + 1) << 32) | task, mask=ready, sem="release", scope="sys")


@triton.jit
def push_block(q, tasks, QSIZE, ready):
    """push for a block of tasks, one per lane: a single tail claim for all the ready lanes, each
    lane's slot at its rank among them (one sys-scope atomic per block, not one per lane; traced,
    that alone did not shorten a release walk: the wider blocks of _release_walk did)."""
    r = ready.to(tl.int32)
    n = tl.sum(r, axis=0)
    if n > 0:
        first = tl.atomic_add(q + 1, n.to(tl.int64), sem="relaxed", scope="sys")
        t = first + (tl.cumsum(r, axis=0) - r).to(tl.int64)
        tl.atomic_xchg(q + 2 + t % QSIZE, ((t + 1) << 32) | tasks.to(tl.int64), mask=ready, sem="release",
                       scope="sys")


@triton.jit
def claim(q):
    """Claim the next queue index (one fetch-and-add: a compare-and-swap loop made the programs
    retry against each other, records moe_trace). The dynamic loop
    claims its next index after a task's body, before plain notifies (the claim's round trip, one
    thread's atomic broadcast through shared memory, runs while the body's stores drain, which
    the notify's release fence waits for), and reads the task at it with `take`."""
    return tl.atomic_add(q, 1, sem="relaxed", scope="gpu")


@triton.jit
def take(q, claimed, QSIZE, limit, INIT, NINIT, SEED_BASE, TOTAL, ev_epoch, max_spins, ctrl_ptr, ctrl_table, rank,
         world, event, epoch):
    """The task at queue index `claimed`: its id, or -1 when every queued task of the launch is
    claimed (or the watchdog fired: recorded, as in sync.wait).
    A launch's first NINIT indices are its seeded tasks, the same every launch: SEED_BASE + k where
    they are consecutive ids from SEED_BASE (the host checks; no load after the claim), else read
    from the table at INIT. No program pushes them, and the first claims cost no wait for a slot.
    Past them, index i is the launch's push number i - ev_epoch * NINIT (pushes count only their
    own), and the program waits for that slot's stamp.
    A program stops at its first index >= limit, so the head ends past the launch's last task;
    `rewind_head` puts it back when every program of the launch is done."""
    got = tl.where(claimed < limit, claimed, claimed * 0 - 1)
    task = (got * 0 - 1).to(tl.int32)
    if got >= 0:
        k = got - (limit - TOTAL)                     # the index within this launch
        if k < NINIT:
            if SEED_BASE >= 0:
                task = (SEED_BASE + k).to(tl.int32)
            else:
                task = tl.load(q + INIT + k).to(tl.int32)
        else:
            pushed = got - (got * 0 + ev_epoch) * NINIT   # in int64: epochs x seeded tasks pass 2**31
            slot = q + 2 + pushed % QSIZE
            stamp = (pushed + 1) & 0xFFFFFFFF
            v = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
            spins = 0
            failed = tl.load(ctrl_ptr, volatile=True) != 0
            while (((v >> 32) & 0xFFFFFFFF) != stamp) & (spins < max_spins) & (failed == 0):
                v = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
                spins += 1
                if spins % 1024 == 0:
                    failed = tl.load(ctrl_ptr, volatile=True) != 0
            if ((v >> 32) & 0xFFFFFFFF) == stamp:
                task = (v & 0xFFFFFFFF).to(tl.int32)
            elif failed == 0:
                record_error(ctrl_ptr, ctrl_table, rank, world, ERR_TIMEOUT, event, (v >> 32).to(tl.int32),
                             (pushed + 1).to(tl.int32), -1, epoch)
    tl.debug_barrier()
    return task


@triton.jit
def next_task(q, QSIZE, limit, INIT, NINIT, TOTAL, ev_epoch, max_spins, ctrl_ptr, ctrl_table, rank, world, event,
              epoch):
    """`claim`, then `take` at once (seeded tasks read from the table): for kernels that have
    nothing to do between the two (tests, etdist.bench.sync_latency)."""
    return take(q, claim(q), QSIZE, limit, INIT, NINIT, -1, TOTAL, ev_epoch, max_spins, ctrl_ptr, ctrl_table, rank,
                world, event, epoch)


@triton.jit
def rewind_head(q, limit):
    """After the launch (every program of this GPU has stopped claiming): the head back to the
    number of tasks pushed so far, as the next launch's indices expect. Only this GPU claims."""
    tl.atomic_xchg(q, limit, sem="relaxed", scope="gpu")


@triton.jit
def notify_release(counter, target, index, owner, rq, rq_peers, QSIZE, PENDING, ROWPTR, COLS,
                   ev_epoch, RANK, SCOPE: tl.constexpr, BLOCK: tl.constexpr = 1024):
    """Notify an event element (release, as sync.notify) and, if this brought it to `target`,
    release its consumers on rank `owner`: `index` is the element's word in the owner's arena."""
    tl.debug_barrier()
    old = tl.atomic_add(counter, 1, sem="acq_rel", scope=SCOPE)
    if old + 1 == target:
        q = rq
        if owner != RANK:
            q = peer_base(rq_peers, owner, rq)
        _release_walk(q, index, QSIZE, PENDING, ROWPTR, COLS, ev_epoch, BLOCK)


@triton.jit(noinline=True)
def _release_walk(q, index, QSIZE, PENDING, ROWPTR, COLS, ev_epoch, BLOCK: tl.constexpr):
    """The element's consumers, BLOCK at a time, a few per thread: an element such as "the routing
    is planned" can release thousands of tasks, and each block costs a chain of dependent
    sys-scope atomics (pending counts, the tail claim, the slots): wide blocks walk them in fewer
    (records moe_trace).
    Not inlined: inlined into the megakernel, the 1024-wide walk made the expert GEMMs' kernel
    spill (340 bytes per thread with 128-row tiles); a call keeps its registers to itself."""
    start = tl.load(q + ROWPTR + index)
    stop = tl.load(q + ROWPTR + index + 1)
    lanes = tl.arange(0, BLOCK)
    for c0 in range(start, stop, BLOCK):
        ok = c0 + lanes < stop
        entry = tl.load(q + COLS + c0 + lanes, mask=ok, other=0)
        g, waits = (entry & 0xFFFFFFFF).to(tl.int32), (entry >> 32).to(tl.int32)
        shared = ok & (waits > 1)
        p = tl.atomic_add(q + PENDING + g, 1 + 0 * entry, mask=shared, sem="acq_rel", scope="sys")   # peers bump it too
        push_block(q, g, QSIZE, (ok & (waits == 1)) | (shared & (p + 1 == ev_epoch * waits)))
