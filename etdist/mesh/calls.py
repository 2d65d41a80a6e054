"""Agreement before launch: every op and collective on a mesh checks, before anything that could
hang or mix up data, that every rank makes the same call.

A call is described by a `Signature` (op, dtypes, full shapes, out= given or not, plan key), which
hashes to a 31-bit word, and numbered per mesh (the control block's call number, ControlLayout).
Call n of rank r stores its word, then n, into lane (r, n % 2) of every peer's control block,
then waits (watchdog) until each peer's lane (s, n % 2) holds n and compares the words. Lanes
alternate by parity: a rank reaches call n + 2 only after every peer published n + 1, so after
every peer is done reading call n.

On any difference every rank raises CallMismatchError before anything ran for call n, naming each
rank's call (each rank's board, a small symmetric buffer, carries the text behind its word); the
mesh stays usable, its next call being n + 1 on every rank. A rank that refuses its own arguments publishes REFUSED,
with the reason on its board, so its peers raise at once instead of waiting out the watchdog. A
peer that never makes call n (it skipped a call, exited or died) makes the others raise
PeerTimeoutError naming it, and a rank one call behind is caught at the first call that differs.

Who runs it: on the cpu backend the host, per call (a few stores and loads of shared memory). On
GPUs the kernels themselves at entry (kernels/sync.py: `agree_call`), so a call at a prepared
shape costs a cross-GPU round trip and no host work; the host runs the same protocol only where it
talks to the peers anyway (a new shape) or refuses a call. Both bump the same call number.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional

import numpy as np
import torch

from .control import ErrorKind, Event
from .errors import CallMismatchError, MeshError, PeerTimeoutError
from .stream_order import capturing as stream_capturing

REFUSED = 1          # the word of a call its rank refused (its reason is on its board)
_RESERVED = 1        # words 0 (never written) and 1 are no signature
BOARD_BYTES = 512    # per parity: 4 bytes word, 4 bytes length, then the text (utf-8, truncated);
                     # written word last (a reader that sees the word sees the rest)
_TEXTS: dict = {}    # word -> text of every signature this process made (names a peer's word)
_WORDS: dict = {}    # (op, args) -> word: a signature seen before costs a dict lookup


def tensor_arg(t) -> Optional[tuple]:
    """What a signature records of a tensor argument: (dtype, shape), or None where absent."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return (type(t).__name__,)
    return (str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _fmt(v) -> str:
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], tuple):
        return f"{v[0]}{list(v[1])}"   # a tensor_arg
    if isinstance(v, tuple) and v and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in v):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v) + "}"   # named values
    return repr(v)


@dataclass(frozen=True)
class Signature:
    """What every rank's call must share: `op` and its (name, value) `args` (plain, hashable values:
    tensor_arg(t) for tensors, the plan key, flags)."""

    op: str
    args: tuple

    @cached_property
    def word(self) -> int:
        key = (self.op, self.args)
        w = _WORDS.get(key)
        if w is None:
            digest = hashlib.blake2b(repr(key).encode(), digest_size=4).digest()
            w = int.from_bytes(digest, "little") & 0x7FFFFFFF
            w = w if w > _RESERVED else w + _RESERVED + 1
            if len(_TEXTS) > 4096:
                _TEXTS.clear()
                _WORDS.clear()
            _TEXTS.setdefault(w, self)
            _WORDS[key] = w
        return w

    @property
    def text(self) -> str:
        return f"{self.op}({', '.join(f'{k}={_fmt(v)}' for k, v in self.args)})"


def describe_word(word: int) -> Optional[str]:
    """The text of a signature word this process has made (None where unknown)."""
    if word == REFUSED:
        return "a call it refused"
    sig = _TEXTS.get(word)
    return None if sig is None else sig.text


class _HostWords:
    """The cpu backend's control blocks as numpy views: stores are seen by the peers in order."""

    def __init__(self, mesh):
        self.mesh = mesh

    def read(self, rank: int, index: int) -> int:
        return int(self.mesh._ctrl_peers_np[rank][index])

    def write(self, rank: int, index: int, value: int) -> None:
        self.mesh._ctrl_peers_np[rank][index] = value

    def board_read(self, rank: int, parity: int) -> bytes:
        return self.mesh._board_np[rank][parity].tobytes()

    def board_write(self, parity: int, data: bytes) -> None:
        own = self.mesh._board_np[self.mesh.rank][parity]
        own[4:len(data)] = np.frombuffer(data[4:], dtype=np.uint8)
        own[:4] = np.frombuffer(data[:4], dtype=np.uint8)   # the word last: who sees it sees the text

    def sync(self) -> None:
        pass


class _DeviceWords:
    """GPU control blocks through peer views: each store a copy that completes (synchronised)
    before the next, so a peer's kernel that sees the call number sees the word stored before it.
    Host slow paths only (a new shape, a refusal, an error being named)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def read(self, rank: int, index: int) -> int:
        return int(self.mesh.peer(self.mesh.ctrl, rank)[index].item())

    def write(self, rank: int, index: int, value: int) -> None:
        self.mesh.peer(self.mesh.ctrl, rank)[index].fill_(value)
        self.sync()

    def board_read(self, rank: int, parity: int) -> bytes:
        return bytes(self.mesh.peer(self.mesh.board, rank)[parity].cpu().tolist())

    def board_write(self, parity: int, data: bytes) -> None:
        own = self.mesh.board[parity]
        own[4:len(data)].copy_(torch.frombuffer(bytearray(data[4:]), dtype=torch.uint8))
        self.sync()
        own[:4].copy_(torch.frombuffer(bytearray(data[:4]), dtype=torch.uint8))
        self.sync()

    def sync(self) -> None:
        self.mesh.impl.synchronize()


def _board_bytes(word: int, text: str) -> bytes:
    body = text.encode()[:BOARD_BYTES - 8]
    return word.to_bytes(4, "little") + len(body).to_bytes(4, "little") + body


class CallAgreement:
    """The host side of a mesh's call agreement (the module docstring says the protocol)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.words = _HostWords(mesh) if mesh.backend == "cpu" else _DeviceWords(mesh)
        lay = mesh.layout
        self.call_off, self.seq_off = lay.call, lay.call_seq   # offsets, once: agree is per call
        self.others = [s for s in range(mesh.world_size) if s != mesh.rank]
        self._board_word = [0, 0]   # what our board holds per parity (cpu backend: written on change)
        self.owed: List[str] = []   # refusals made while a CUDA graph captured (publishing synchronises)

    # -- the protocol -------------------------------------------------------------------------
    def last(self) -> int:
        """The call number of this rank's last call on the mesh (the control block's word)."""
        m = self.mesh
        self.words.sync()   # kernels bump it: read it once they are done
        return self.words.read(m.rank, m.layout.call_seq)

    def agree(self, sig: Signature) -> int:
        """Publish `sig` as this rank's next call and check every peer's; returns the call number.
        Raises CallMismatchError (the mesh stays usable) or PeerTimeoutError (a peer never came)."""
        m = self.mesh
        if self.owed:
            self.pay_owed()
        if m.world_size == 1:
            return self._bump(self.last() + 1)
        if m.backend == "cpu":
            return self._agree_host(sig)
        seq = self.last() + 1
        self._publish(seq, sig.word, lambda: sig.text)
        words = self._collect(seq)
        self._bump(seq)
        if any(w != sig.word for w in words):
            raise self._mismatch(seq, words)
        return seq

    def _agree_host(self, sig: Signature) -> int:
        """agree on the cpu backend, per call: a few stores and loads of shared memory (the same
        protocol as _publish / _collect, unrolled for its cost: ~25 us a call in those)."""
        m, peers, word = self.mesh, self.mesh._ctrl_peers_np, sig.word
        own = peers[m.rank]
        seq = int(own[self.seq_off]) + 1
        parity = seq & 1
        if self._board_word[parity] != word:
            self.words.board_write(parity, _board_bytes(word, sig.text))
            self._board_word[parity] = word
        mine = self.call_off + 4 * m.rank + 2 * parity
        for d in self.others:
            peers[d][mine + 1] = word
        for d in self.others:
            peers[d][mine] = seq
        differ = False
        for s in self.others:
            lane = self.call_off + 4 * s + 2 * parity
            if own[lane] < seq:
                m.wait_word(lambda: int(own[lane]), seq, s, Event.encode(Event.CALL, seq % (1 << 20)), seq)
            differ = differ or int(own[lane + 1]) != word
        own[self.seq_off] = seq
        if differ:
            raise self._mismatch(seq, [word if s == m.rank else int(own[self.call_off + 4 * s + 2 * parity + 1])
                                       for s in range(m.world_size)])
        return seq

    def refuse(self, reason: str) -> Optional[int]:
        """This rank refused its own call's arguments (`reason`): publish REFUSED as its next call,
        so the peers raise at once naming it. Returns the call number; the caller raises its error.
        While a CUDA graph captures (publishing synchronises) it is owed: published at this rank's
        next call outside a capture (pay_owed), where the peers' launch of the refused call waits."""
        m = self.mesh
        if m._closed or m._failed is not None:
            return None
        if stream_capturing(m.device):
            self.owed.append(reason)
            return None
        seq = self.last() + 1
        if m.world_size > 1:
            self._publish(seq, REFUSED, lambda: reason)
        return self._bump(seq)

    def pay_owed(self) -> None:
        """Publish the refusals made while capturing (outside a capture: the caller checks)."""
        owed, self.owed = self.owed, []
        for reason in owed:
            self.refuse(reason)

    def _bump(self, seq: int) -> int:
        m = self.mesh
        self.words.write(m.rank, m.layout.call_seq, seq)
        return seq

    def _publish(self, seq: int, word: int, text) -> None:
        m, lay, parity = self.mesh, self.mesh.layout, seq % 2
        if self._board_word[parity] != word or m.backend != "cpu":
            self.words.board_write(parity, _board_bytes(word, text()))
            self._board_word[parity] = word
        lane = lay.call_lane(m.rank, seq)
        for d in range(m.world_size):
            if d != m.rank:
                self.words.write(d, lane + 1, word)
        for d in range(m.world_size):
            if d != m.rank:
                self.words.write(d, lane, seq)

    def _collect(self, seq: int) -> List[int]:
        """Every rank's word for call `seq` (ours included), once each peer has published it."""
        m, lay = self.mesh, self.mesh.layout
        out = []
        for s in range(m.world_size):
            lane = lay.call_lane(s, seq)
            if s != m.rank:
                m.wait_word(lambda: self.words.read(m.rank, lane), seq, s, Event.encode(Event.CALL, seq % (1 << 20)),
                            seq)
            out.append(self.words.read(m.rank, lane + 1) if s != m.rank else None)
        own = self.words.board_read(m.rank, seq % 2)
        out[m.rank] = int.from_bytes(own[:4], "little")
        return out

    # -- naming what differs ------------------------------------------------------------------
    def text_of(self, rank: int, seq: int, word: int, wait_s: float = 0.0) -> str:
        """What rank `rank` called as call `seq` (its word `word`): its board's text where the board
        holds that word (waiting up to wait_s for it), else this process's record, else the word."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                data = self.words.board_read(rank, seq % 2)
            except Exception:   # noqa: BLE001 (a closed mesh's views): fall back to the record
                data = b""
            if len(data) >= 8 and int.from_bytes(data[:4], "little") == word:
                n = int.from_bytes(data[4:8], "little")
                text = data[8:8 + n].decode(errors="replace")
                return f"refused its arguments ({text})" if word == REFUSED else f"called {text}"
            if time.monotonic() >= deadline:
                break
            time.sleep(1e-3)
        known = describe_word(word)
        if word == REFUSED:
            return "refused its arguments (its own error says why)"
        return f"called {known}" if known else f"made another call (signature {word:#010x}; its own error names it)"

    def _mismatch(self, seq: int, words: List[int]) -> CallMismatchError:
        return CallMismatchError(mismatch_message(seq, [self.text_of(r, seq, w, wait_s=2.0)
                                                        for r, w in enumerate(words)]))

    def raise_pending(self) -> None:
        """Raise the call a kernel found the ranks disagreeing on (its record in mesh.call_error), if
        any: nothing ran for it, so the mesh stays usable. ~0.1 us when there is none."""
        words = self.mesh._call_error_np
        if words is None or words[0] == 0:
            return
        self.mesh.impl.synchronize()   # the launch's stores of the rest of the record are in
        rec = [int(w) for w in words]
        words[:] = 0
        raise self.device_error(rec[6], rec[4], rec[3], rec[5])

    def device_error(self, seq: int, mine: int, theirs: int, peer: int) -> CallMismatchError:
        """The error for a mismatch a kernel found at entry (ErrorKind.CALL in its record)."""
        texts = {self.mesh.rank: self.text_of(self.mesh.rank, seq, mine), peer: self.text_of(peer, seq, theirs)}
        return CallMismatchError(mismatch_message(seq, texts))


class refusing:
    """Around a call's own argument checks: an error raised there is this rank refusing the call, so
    the peers are told (CallAgreement.refuse) and raise at once, naming it, instead of waiting for a
    call that never comes; the error goes on. A class, not a generator: it wraps every call."""

    __slots__ = ("mesh",)

    def __init__(self, mesh):
        self.mesh = mesh

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, (MeshError, TypeError, ValueError)) \
                and not issubclass(kind, (PeerTimeoutError, CallMismatchError)):
            calls = getattr(self.mesh, "calls", None)
            if calls is not None:
                calls.refuse(f"{type(exc).__name__}: {exc}")
        return False


def mismatch_message(seq: int, texts) -> str:
    """One message for every rank: which rank made which call `seq` (texts: a list by rank, or a
    dict of the ranks known), ranks that made the same call grouped."""
    items = list(enumerate(texts)) if isinstance(texts, list) else sorted(texts.items())
    groups: dict = {}
    for r, t in items:
        groups.setdefault(t, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {t}" for t, rs in groups.items()]
    return (f"the ranks disagree on call {seq} on this mesh: {'; '.join(parts)}. Every rank must make the same "
            f"calls in the same order, with the same shapes, dtypes and out=; nothing ran for this call and the "
            f"mesh stays usable")


# ErrorKind.CALL is what a kernel records for a mismatch it finds at entry
CALL_KIND = int(ErrorKind.CALL)
