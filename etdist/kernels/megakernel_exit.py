"""The end of a megakernel launch that peers write into: the exit rendezvous.

The last program of this rank to finish (a gpu-scope grid counter) tells every peer "rank done
with launch `epoch`" by setting its exit lane there (sys-scope release), then waits until every
peer did the same here. No rank leaves, and so no rank's next launch starts writing into a peer's
buffers, before all ranks are done with this one. Bounded by the watchdog like every wait.
"""
import triton
import triton.language as tl

from .sync import notify, peer_base, wait


@triton.jit
def exit_rendezvous(arena, arena_peers, exit_off, grid_off, epoch, rank, world, max_spins,
                    EVENT_EXIT: tl.constexpr, USE_ASM: tl.constexpr):
    tl.debug_barrier()
    arrived = tl.atomic_add(arena + grid_off, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(arena + grid_off, 0, sem="relaxed", scope="gpu")  # re-arm for the next launch
        for d in range(world):
            if d != rank:
                notify(peer_base(arena_peers, d, arena) + exit_off + rank, epoch, True, "sys")
        for s in range(world):
            if s != rank:
                wait(arena + exit_off + s, epoch, max_spins, arena, arena_peers, rank, world,
                     EVENT_EXIT, s, epoch, "sys", USE_ASM)
