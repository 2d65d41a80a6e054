"""The control block: one small symmetric int32 array per rank that kernels and host share.

One definition of the layout, used by the host (to read errors) and passed to kernels as offsets.

    [0, 8)            error record: kind, rank, event, observed, expected, peer, epoch, spare
    [8, 8+W)          barrier lanes: lane s holds the last barrier epoch rank s reached
    [8+W, 8+2W)       exit lanes: lane s holds the last collective epoch rank s finished
    [8+2W, 8+6W)      meta: 4 words per source rank s: (epoch, signature) for even and odd epochs;
                      signature = op << 28 | dtype << 24 | count mod 2**24 (what the sender sent
                      us; in a call of several rounds, the count of this round and the later ones;
                      dtype: an index into SIG_DTYPES, so ranks that pass different dtypes with
                      the same element count raise instead of reading each other's bytes)
    [8+6W]            grid counter (local): programs of one launch that have finished
    [8+6W+1]          device epoch (local): the last collective epoch this GPU ran; kernels read it
                      and bump it themselves, so a launch replayed from a CUDA graph stays correct
    [8+6W+2, 8+7W+2)  entry lanes: lane s holds the last epoch rank s entered (writers into our
                      user buffers wait for it: we no longer use what they overwrite)
    [8+7W+2, 8+11W+2) call lanes: 4 words per source rank s: (call number, signature word) of
                      its even and odd calls on this mesh (mesh/calls.py: every op and collective
                      checks them against its own before anything that could hang)
    [8+11W+2]         call number (local): the last call this rank made on the mesh; host or
                      kernel bumps it, so a launch replayed from a CUDA graph counts too

A lane has a single writer (the rank it is named after), so the same protocol works with plain
stores on CPU and release atomics on GPU: notify sets the lane to the epoch, wait spins until
lane >= epoch. Epochs increase by one per call and are never reset.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

ERR_WORDS = 8
META_WORDS = 4
CALL_WORDS = 4
SIG_COUNT_BITS = 24   # signature = op << 28 | dtype << SIG_COUNT_BITS | count mod 2**SIG_COUNT_BITS
SIG_DTYPES = ("", "float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8",
              "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "another dtype")


def signature_dtype(dtype) -> int:
    """The 4-bit dtype field of a signature for a torch dtype (named, so this layer needs no torch)."""
    name = str(dtype).removeprefix("torch.")
    return SIG_DTYPES.index(name) if name in SIG_DTYPES[1:] else len(SIG_DTYPES) - 1


def _describe_signature(sig: int, op_names) -> str:
    dtype = SIG_DTYPES[(sig >> SIG_COUNT_BITS) & 15]
    return (f"{op_names.get(sig >> 28, 'op')}{' of ' + dtype if dtype else ''} "
            f"with count {sig & ((1 << SIG_COUNT_BITS) - 1)}")


class ErrorKind(enum.IntEnum):
    NONE = 0
    TIMEOUT = 1  # a wait ran past the watchdog
    SHAPE = 2  # a peer's op/count differs from ours
    REFUSED = 3  # (kernel arenas) a rank refused its inputs at a shape every rank had prepared
    CALL = 4  # a peer's call signature differs from ours (mesh/calls.py): recorded on this rank only,
              # nothing ran, and the mesh stays usable
    GONE = 5  # a peer exited, died or closed its mesh (mesh/liveness.py), seen while waiting on it
    NOTIFY = 6  # (check_events) a task notified an element outside its event's shape
    OVER = 7  # (check_events) an element's counter went past its count at the end of a launch


class Event(enum.IntEnum):
    """What a recorded wait was waiting for (the error record's `event` word is event*2**20 + index)."""

    CHUNK = 1  # a data chunk of a collective, index = chunk
    EXIT = 2  # the exit rendezvous of a collective
    BARRIER = 3  # mesh.barrier
    ENTRY = 4  # a peer entering the call (before writing into its user buffers)
    CALL = 5  # a peer's signature of the call (mesh/calls.py), index = call number mod 2**20

    @staticmethod
    def encode(kind: "Event", index: int) -> int:
        return int(kind) << 20 | index

    @staticmethod
    def decode(word: int):
        return Event(word >> 20) if (word >> 20) in Event._value2member_map_ else None, word & ((1 << 20) - 1)


@dataclass(frozen=True)
class ControlLayout:
    world: int

    @property
    def err(self) -> int:
        return 0

    @property
    def barrier(self) -> int:
        return ERR_WORDS

    @property
    def exit(self) -> int:
        return ERR_WORDS + self.world

    @property
    def meta(self) -> int:
        return ERR_WORDS + 2 * self.world

    @property
    def grid(self) -> int:
        return ERR_WORDS + (2 + META_WORDS) * self.world

    @property
    def epoch(self) -> int:
        return self.grid + 1

    @property
    def entry(self) -> int:
        return self.grid + 2

    @property
    def call(self) -> int:
        return self.entry + self.world

    @property
    def call_seq(self) -> int:
        return self.call + CALL_WORDS * self.world

    @staticmethod
    def in_kernel(name: str, world: str = "WORLD") -> str:
        """The offset `name` as generated code writes it, `world` naming the kernel's world size
        (every offset is linear in it)."""
        a = getattr(ControlLayout(0), name)
        return f"({a} + {getattr(ControlLayout(1), name) - a} * {world})"

    def call_lane(self, source: int, seq: int) -> int:
        """Where rank `source`'s (call number, signature) of call `seq` lands (its parity's pair)."""
        return self.call + CALL_WORDS * source + 2 * (seq % 2)

    @property
    def size(self) -> int:
        return self.call_seq + 1


@dataclass(frozen=True)
class ErrorRecord:
    kind: ErrorKind
    rank: int  # the rank whose wait stalled (or that saw the mismatch)
    event: int
    observed: int
    expected: int
    peer: int  # the rank it waited on
    epoch: int

    @staticmethod
    def from_words(words) -> "ErrorRecord":
        w = [int(x) for x in words[:ERR_WORDS]]
        return ErrorRecord(ErrorKind(w[0]) if w[0] in ErrorKind._value2member_map_ else ErrorKind.TIMEOUT,
                           w[1], w[2], w[3], w[4], w[5], w[6])

    def describe(self, watchdog_s: float, op_names=None) -> str:
        ev, idx = Event.decode(self.event)
        what = {Event.CHUNK: f"data chunk {idx}", Event.EXIT: "the exit rendezvous",
                Event.BARRIER: "a barrier", Event.ENTRY: "the peer to enter the call",
                Event.CALL: "the peer to make the same call"}.get(ev, f"event {self.event}")
        if self.kind is ErrorKind.GONE:
            return (f"rank {self.peer} has exited, died or closed its mesh: rank {self.rank} saw it while waiting "
                    f"for {what} (call {self.epoch}). Every rank must make the same calls until all close the mesh")
        if self.kind is ErrorKind.SHAPE:
            names = op_names or {}
            return (f"ranks disagree on a collective: rank {self.rank} expected "
                    f"{_describe_signature(self.expected, names)}, but rank {self.peer} sent "
                    f"{_describe_signature(self.observed, names)} (call {self.epoch}): "
                    f"every rank must call the same collective with the same shapes and dtype")
        return (f"rank {self.rank} waited for {what} from rank {self.peer} (call {self.epoch}): lane "
                f"holds {self.observed}, expected >= {self.expected}; watchdog expired after ~{watchdog_s:g} s. "
                f"Rank {self.peer} never notified: it skipped a collective, called a different one, or died")
