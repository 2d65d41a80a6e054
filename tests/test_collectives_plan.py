"""Plans: pure Python, no processes."""
from hypothesis import given, settings
from hypothesis import strategies as st

from etdist.collectives import plan as plans
from etdist.collectives.gpu_exchange import choose_chunk
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
