"""The ready queue's push / claim under Triton's interpreter, with the queue indices started just
below 2**31 and 2**32: a slot's stamp ((index + 1) << 32) wraps there, and a claim must still
find its entry (it once compared the stamp in 64 bits and spun until the watchdog).

    TRITON_INTERPRET=1 python tests/interp/ready_queue_worker.py   -> 'OK ready queue <start>'
"""
import torch
import triton
import triton.language as tl

from etdist.kernels.interpret import patch_interpreter
from etdist.kernels.ready_queue import next_task, push, rewind_head

patch_interpreter()


@triton.jit
def round_trip(q, ctrl, out, QSIZE, limit, N: tl.constexpr):
    for i in tl.static_range(N):
        push(q, tl.full((), 100 + i, tl.int32), QSIZE, QSIZE > 0)
    for i in tl.static_range(N + 2):     # two claims past the launch's tasks: -1, the head overshoots
        tl.store(out + i, next_task(q, QSIZE, limit, 1000, ctrl, ctrl, 0, 1, 0, 1))
    tl.store(out + N + 2, (tl.load(q) - limit).to(tl.int32))
    rewind_head(q, limit)


def main():
    n, qsize = 6, 8
    for start in (2 ** 31 - 3, 2 ** 32 - 3):
        q = torch.zeros(2 + qsize, dtype=torch.int64)
        q[0] = q[1] = start                  # head (claims) and tail (pushes)
        ctrl, out = torch.zeros(8, dtype=torch.int32), torch.full((n + 3,), -7, dtype=torch.int32)
        round_trip[(1,)](q, ctrl, out, qsize, start + n, N=n)
        assert out.tolist() == [*range(100, 100 + n), -1, -1, 2], (start, out.tolist())
        assert int(ctrl[0]) == 0 and int(q[0]) == int(q[1]) == start + n
        print(f"OK ready queue {start}", flush=True)


if __name__ == "__main__":
    main()
