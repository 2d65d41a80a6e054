"""The call agreement's host protocol (mesh/calls.py) on ranks simulated by threads over shared
numpy control blocks: the same code the cpu backend runs per call, and GPUs on their slow paths."""
import threading
import time

import numpy as np
import pytest
import torch

from etdist.mesh import calls as calls_mod
from etdist.mesh.calls import REFUSED, CallAgreement, Signature, mismatch_message, tensor_arg
from etdist.mesh.control import ControlLayout
from etdist.mesh.errors import CallMismatchError, PeerTimeoutError


class ThreadMesh:
    """What CallAgreement reads of a cpu-backend mesh, for one of `world` ranks sharing `blocks`."""

    backend, device, _closed, _failed = "cpu", torch.device("cpu"), False, None

    def __init__(self, rank, world, blocks, boards, watchdog_s=2.0):
        self.rank, self.world_size, self.watchdog_s = rank, world, watchdog_s
        self.layout = ControlLayout(world)
        self._ctrl_peers_np, self._board_np = blocks, boards
        self.calls = CallAgreement(self)

    def wait_word(self, read, target, peer, event, epoch):
        deadline = time.monotonic() + self.watchdog_s
        while read() < target:
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"rank {self.rank}: rank {peer} never made call {epoch}")
            time.sleep(1e-4)


def meshes(world=2, **kw):
    blocks = [np.zeros(ControlLayout(world).size, dtype=np.int32) for _ in range(world)]
    boards = [np.zeros((2, calls_mod.BOARD_BYTES), dtype=np.uint8) for _ in range(world)]
    return [ThreadMesh(r, world, blocks, boards, **kw) for r in range(world)]


def run_ranks(ms, fn):
    """fn(mesh) on every rank at once; each rank's return value or exception."""
    out = [None] * len(ms)

    def body(r):
        try:
            out[r] = fn(ms[r])
        except Exception as e:   # noqa: BLE001
            out[r] = e
    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(ms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def sig(n=16, dtype=torch.float32, op="all_reduce", out=False):
    return Signature(op, (("x", tensor_arg(torch.empty(n, dtype=dtype))), ("out", out)))


def test_signature_words_name_full_shapes_and_dtypes():
    """Counts 2**24 apart and dtypes of one size differ (the exchange's own check compared counts mod 2**24)."""
    words = {sig(16).word, sig(16 + (1 << 24)).word, sig(16, torch.bfloat16).word, sig(16, torch.float16).word,
             sig(16, out=True).word, sig(16, op="all_gather").word}
    assert len(words) == 6 and all(w > 1 for w in words)
    assert sig(16).word == sig(16).word
    assert sig(16 + (1 << 24)).text == "all_reduce(x=float32[16777232], out=False)"


def test_ranks_that_agree_get_consecutive_call_numbers():
    ms = meshes(3)
    for k in range(1, 6):   # both parities, several times
        assert run_ranks(ms, lambda m: m.calls.agree(sig(k))) == [k, k, k]


def test_a_difference_raises_the_same_message_on_every_rank_and_the_next_call_works():
    ms = meshes(3)
    out = run_ranks(ms, lambda m: m.calls.agree(sig(16, torch.bfloat16 if m.rank == 1 else torch.float16)))
    assert all(isinstance(e, CallMismatchError) for e in out), out
    assert len({str(e) for e in out}) == 1
    msg = str(out[0])
    assert "call 1" in msg and "ranks 0, 2 called all_reduce(x=float16[16], out=False)" in msg
    assert "rank 1 called all_reduce(x=bfloat16[16], out=False)" in msg
    assert run_ranks(ms, lambda m: m.calls.agree(sig(4))) == [2, 2, 2]


def test_a_refusal_is_named_by_its_reason_on_the_peers():
    ms = meshes(2)

    def call(m):
        if m.rank == 1:
            m.calls.refuse("MeshError: out must be (4,)")
            return "refused"
        return m.calls.agree(sig(4))
    out = run_ranks(ms, call)
    assert out[1] == "refused" and isinstance(out[0], CallMismatchError)
    assert "rank 1 refused its arguments (MeshError: out must be (4,))" in str(out[0])
    assert run_ranks(ms, lambda m: m.calls.agree(sig(4))) == [2, 2]


def test_a_refusal_while_capturing_is_owed_until_the_next_call(monkeypatch):
    """Publishing synchronises, which a CUDA graph capture forbids: owed, then published ahead of this
    rank's next call, as the call the peers' captured launch waits on."""
    ms = meshes(2)
    capturing = [True]
    monkeypatch.setattr(calls_mod, "stream_capturing", lambda device: capturing[0])
    assert ms[1].calls.refuse("InputError: x is not contiguous") is None and ms[1].calls.owed
    capturing[0] = False

    def call(m):
        if m.rank == 0:   # the peer's refused call, then the next one
            try:
                m.calls.agree(sig(4))
            except CallMismatchError as e:
                assert "rank 1 refused its arguments (InputError: x is not contiguous)" in str(e)
        return m.calls.agree(sig(8))
    assert run_ranks(ms, call) == [2, 2] and not ms[1].calls.owed


def test_a_rank_one_call_behind_is_caught_at_the_first_call_that_differs():
    ms = meshes(2, watchdog_s=0.5)

    def calls(m):
        seen = []
        for n in ([16, 8, 4] if m.rank == 0 else [8, 4]):
            try:
                seen.append(m.calls.agree(sig(n)))
            except CallMismatchError as e:
                seen.append(f"call {str(e).split('call ')[1].split()[0]} differs")
            except PeerTimeoutError:
                seen.append("timeout")
        return seen
    out = run_ranks(ms, calls)
    assert out == [["call 1 differs", "call 2 differs", "timeout"], ["call 1 differs", "call 2 differs"]], out


def test_a_peer_that_never_calls_times_out_naming_it():
    ms = meshes(2, watchdog_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="rank 1"):
        ms[0].calls.agree(sig(4))
    assert time.monotonic() - t0 < 2


def test_the_message_groups_ranks_by_call():
    msg = mismatch_message(7, ["called a", "called b", "called a", "refused its arguments (why)"])
    assert msg.startswith("the ranks disagree on call 7 on this mesh: ranks 0, 2 called a; rank 1 called b; "
                          "rank 3 refused its arguments (why)")
    assert REFUSED == 1
