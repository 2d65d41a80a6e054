"""Every etdist launch on a mesh runs in the order its calls were made, whatever stream each is
issued on.

Why: a megakernel's programs spin on events that the peers' launches of the same call notify, and
they hold their SMs while they wait. Issued on two streams, two launches may run in either order or
side by side: launches of one kernel share its counters (one corrupts the other), and if one GPU
runs call B while its peer runs call A, each waits for a launch that cannot get the SMs it holds
(the watchdog fires). NCCL asks the same of its users; here it is kept for them.

How: while every launch goes to one stream, nothing but a compare per call. At the first launch
on another stream, that stream waits for all that is queued on the old one (one event). From then
on each launch records the event right after itself, so a switch waits for that launch only, not
for the work queued behind it (~2 us a call more), until SETTLED launches in a row went to one
stream (torch.compile's CUDA graphs warm up on a side stream once, then never again). Measured on one H200 (tests/gpu, `--case
streams`): a 4 GiB host-to-device copy queued behind a launch on s1 did not hold up the next call on
s2. A kernel queued there would have, whatever the order: while it runs it holds SM room that our
cooperative launch (a program on every SM) needs, so our launches overlap copies, not kernels.

CUDA graphs: launches captured in a graph are not ordered here (a capture cannot wait on an event
recorded outside it); a graph replays on the stream it is replayed on. Order replays and eager calls
on other streams yourself, as for any memory they share.
"""
from __future__ import annotations

import torch

# whether the current device's current stream is being captured (None on CPU-only torch)
capturing_current = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is being captured into a CUDA graph (asked every call)."""
    if device.type != "cuda":
        return False
    if torch._C._cuda_getDevice() == device.index:
        return capturing_current()
    with torch.cuda.device(device):   # the launch goes to `device`'s stream, so ask about that one
        return capturing_current()


class StreamOrder:
    """A mesh's launch order: `before(stream)` ahead of each launch, with the raw stream it goes to,
    and `after()` behind it (neither while capturing a CUDA graph). Both do nothing while one stream
    is used: a caller may skip `before` when `stream == order.last` and `after` when `order.event is
    None` (the host path of a decode call is tens of us)."""

    __slots__ = ("device", "last", "event", "run", "_streams")
    SETTLED = 16   # launches in a row on one stream after which a switch is rare again

    def __init__(self, device: torch.device):
        self.device = device
        self.last = None        # the raw stream of the last launch
        self.event = None       # after a switch, until SETTLED launches in a row: recorded after each
        self.run = 0            # launches in a row on `last` since the event was made
        self._streams = {}      # raw handle -> torch stream object (events record on those)

    def before(self, stream: int) -> None:
        last = self.last
        if last == stream:
            return
        if last is not None:
            if self.event is None:   # the first switch: everything queued on the old stream so far
                self.event = torch.cuda.Event()
                self.event.record(self._stream(last))
            self._stream(stream).wait_event(self.event)
        self.last, self.run = stream, 0

    def after(self) -> None:
        if self.event is not None:
            self.run += 1
            if self.run > self.SETTLED:   # one stream again: a later switch records at the switch
                self.event = None
            else:
                self.event.record(self._stream(self.last))

    def _stream(self, raw: int):
        s = self._streams.get(raw)
        if s is None:
            if len(self._streams) > 64:   # streams made and dropped in a loop: keep the map small
                self._streams.clear()
            s = self._streams[raw] = torch.cuda.ExternalStream(raw, device=self.device)
        return s
