"""The error record a CudaKernel launch leaves in its arena, read, decoded and raised on the host."""
from __future__ import annotations

import numpy as np

from ..mesh.calls import describe_word
from ..mesh.control import ErrorKind, Event
from ..mesh.errors import CallMismatchError
from .codegen_triton import ERR_WORDS, decode_event_code
from .cuda_state import _MeshState, _sync
from .errors import RuntimeFault

# Error record kinds in a kernel's arena (mesh.control.ErrorKind): a wait timed out, or the ranks'
# calls differed at entry (recorded by each rank in its own arena: nothing ran)
ERR_CALL = int(ErrorKind.CALL)


class ErrorMixin:
    """CudaKernel's raising of its launches' errors (a mixin: uses self.ir and self.interpreted)."""

    def _raise_if_this_call_failed(self, mesh, st: _MeshState) -> None:
        """After the last launch has finished (synced): raise its error, if any."""
        self._raise_if_failed(mesh, st, st.arena[:ERR_WORDS].tolist())

    def _check_pending(self, mesh, st: _MeshState, now: bool = False) -> None:
        """Raise a finished launch's error. Per call only the pinned word is read: it changes only when
        a launch's last program stores it (the launch's end), so nonzero means a finished launch failed; `now`
        (after a sync) and the interpreter (CPU memory) read the record itself."""
        if st.arena is not None and (now or self.interpreted or st.error_np[0] != 0):
            _sync(mesh)
            self._raise_if_failed(mesh, st, st.arena[:ERR_WORDS].tolist())

    def _raise_if_failed(self, mesh, st: _MeshState, words) -> None:
        if int(words[0]) == 0:
            return
        kind, rank, code, observed, expected, peer, epoch = (int(w) for w in words[:7])
        if kind == ERR_CALL:   # the launch ran nothing: forget the record, the kernel stays usable
            _sync(mesh)
            st.arena[:ERR_WORDS].zero_()
            if st.error_np is not None:
                st.error_np[0] = 0
            calls = getattr(mesh, "calls", None)
            if calls is not None:
                raise calls.device_error(epoch, expected, observed, peer)
            raise CallMismatchError(f"graph {self.ir.name!r}: rank {peer} made another call than this one "
                                    f"({describe_word(expected) or expected}) as call {epoch}")
        what = f"event code {code}"
        dec = decode_event_code(code)
        if kind in (ErrorKind.NOTIFY, ErrorKind.OVER) and dec is not None and dec[0] < len(self.ir.events):
            ev = self.ir.events[dec[0]]
            if kind == ErrorKind.NOTIFY:
                raise RuntimeFault(f"graph {self.ir.name!r}: a task on rank {rank} notified {ev.name} at coordinate "
                                   f"{observed} of dimension {peer}, outside its {expected} elements (launch {epoch}; "
                                   "compiled with check_events=True): a notify map is wrong at these sizes")
            coord = (np.unravel_index(dec[1], st.shape.event_shapes[ev.name]) if st.shape is not None else (dec[1],))
            raise RuntimeFault(f"graph {self.ir.name!r}: {ev.name}{[int(c) for c in coord]} on rank {rank} was "
                               f"notified past its count: counter {observed}, at most {expected} after launch "
                               f"{epoch} (compiled with check_events=True): more notifies than the count says")
        alive = getattr(mesh, "_peer_alive", None)
        gone = [s for s in range(mesh.world_size) if alive is not None and not alive(s)]
        gone = f"Ranks {gone} have exited or died (their liveness locks are free)" if gone else None
        if Event.decode(code)[0] == Event.CALL:   # the launch's entry: a peer never made this call
            raise RuntimeFault(
                f"graph {self.ir.name!r}: rank {rank} waited at the launch's entry for rank {peer} to make call "
                f"{expected} (every rank makes the same calls in the same order; its last was {observed}); the "
                f"watchdog expired after ~{mesh.watchdog_s:g} s. "
                + (gone or f"Rank {peer} skipped a call, is stuck before it, or failed"))
        if dec is not None and st.shape is not None:
            e, linear = dec
            if e < len(self.ir.events):
                ev = self.ir.events[e]
                coord = np.unravel_index(linear, st.shape.event_shapes[ev.name])
                what = f"{ev.name}{[int(c) for c in coord]}"
            else:   # the one code past the events a megakernel waits on (there is no exit rendezvous)
                what = "its ready queue (a claimed entry never arrived)"
        raise RuntimeFault(f"graph {self.ir.name!r}: rank {rank} waited on {what} (launch {epoch}): counter "
                           f"{observed}, needed {expected}; the watchdog expired after ~{mesh.watchdog_s:g} s. "
                           + (gone or "A task that should notify it did not run (a peer failed, or the graph is wrong)"))
