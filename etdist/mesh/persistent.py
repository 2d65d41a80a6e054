"""Device buffers that outlive the call that makes them, allocated outside any CUDA graph pool.

torch.compile(mode="reduce-overhead") warms a graph up and records it with every allocation of
the calling thread routed to the graph's private pool. A kernel's scratch made there (at a shape's
first call) stays alive in our kernel state after the call; the pool counts it as its own and
cudagraph trees refuse ("tensors in the cudagraph pool not tracked as outputs"). The routing is per thread, so these buffers are allocated by a short-lived thread
of their own (tens of us, only when a buffer is made or grown), on the caller's device and current
stream (the caching allocator ties a block to the stream it was allocated on).
"""
from __future__ import annotations

import threading

import torch


def empty_persistent(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(shape) on `device`, from the default pool whatever pool this thread allocates to."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(device)
    made: list = []

    def allocate():
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                made.append(torch.empty(shape, dtype=dtype, device=device))
        except BaseException as e:   # e.g. out of memory: raised in the caller's thread
            made.append(e)

    thread = threading.Thread(target=allocate, name="etdist-alloc")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]
