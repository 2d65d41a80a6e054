"""Plans: pure Python, no processes."""
from hypothesis import given, settings
from hypothesis import strategies as st

from etdist.collectives import plan as plans
from etdist.collectives.gpu_exchange import choose_chunk, plan_chunk
from etdist.collectives.workspace import MAX_CHUNKS


def test_reduce_scatter_plan():
    p = plans.reduce_scatter(4, 10)
    assert p.send_off == (0, 10, 20, 30) and p.send_cnt == (10,) * 4 and p.recv_off == (0,) * 4
    assert p.op.reduces and p.signature(10) == (1 << 28) | 10


def test_all_gather_round():
    p = plans.all_gather(2, 100, 40, 70)
    assert p.send_off == (40, 40) and p.send_cnt == (30, 30) and p.recv_off == (40, 140)


def test_all_to_all_prefixes():
    p = plans.all_to_all([2, 0, 3], [1, 4, 0])
    assert p.send_off == (0, 2, 2) and p.recv_off == (0, 1, 5) and p.max_count == 4


@settings(deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 10**5))
def test_rounds_cover_exactly(n, per):
    pieces = list(plans.rounds(n, per))
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(b - a <= per for a, b in pieces)
    assert all(pieces[i][1] == pieces[i + 1][0] for i in range(len(pieces) - 1))


@settings(deadline=None)
@given(st.integers(1, 1 << 27), st.sampled_from([1, 132, 528]), st.sampled_from([1, 2, 4, 8]))
def test_chunks_fit_the_signal_table(count, programs, align):
    chunk = choose_chunk(count, programs, align, 8192)
    assert chunk % align == 0 and -(-count // chunk) <= MAX_CHUNKS


@settings(deadline=None)
@given(st.lists(st.integers(0, 1 << 24), min_size=4, max_size=4), st.sampled_from([4, 132, 528]),
       st.sampled_from([1, 8]), st.sampled_from([1 << 13, 1 << 25]))
def test_all_to_all_ranks_cut_a_segment_alike(counts, programs, align, slot):
    """A segment's receiver waits on the chunk lanes its sender sets: both must cut it into the
    same chunks, though the two ranks' largest segments differ (sized by those, they did not)."""
    c = [counts[:2], counts[2:]]                       # c[src][dst] elements, two ranks
    c = [[min(v, slot) for v in row] for row in c]     # all_to_all refuses more than a slot
    ps = [plans.all_to_all(c[r], [c[s][r] for s in range(2)]) for r in range(2)]
    chunk = [plan_chunk(p, slot, programs, align, 8192) for p in ps]
    for s in range(2):
        for d in range(2):
            n = c[s][d]
            assert -(-n // chunk[s]) == -(-n // chunk[d]) and (n <= min(chunk) or chunk[s] == chunk[d]), (n, chunk)
    assert all(-(-p.max_count // k) <= MAX_CHUNKS for p, k in zip(ps, chunk))
