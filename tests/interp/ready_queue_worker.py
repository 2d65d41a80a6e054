"""The ready queue's push / claim under Triton's interpreter:
- with the queue indices started just below 2**31 and 2**32: a slot's stamp ((index + 1) << 32)
  wraps there, and a claim must still find its entry (it once compared the stamp in 64 bits and
  spun until the watchdog);
- a launch whose first claims are seeded tasks (read from the table, not pushed), in a later
  epoch: the claims past them find the pushes, which count only themselves;
- the same with consecutive seeded ids given by their first (SEED_BASE): the table is not read.

    TRITON_INTERPRET=1 python tests/interp/ready_queue_worker.py   -> 'OK ready queue <start>', 'OK seeded <epoch>'
"""
import torch
import triton
import triton.language as tl

from etdist.kernels.interpret import patch_interpreter
from etdist.kernels.ready_queue import claim, next_task, push, rewind_head, take

patch_interpreter()


@triton.jit
def round_trip(q, ctrl, out, QSIZE, limit, INIT, NINIT, SEED_BASE, TOTAL, ev_epoch, N: tl.constexpr,
               SEEDED: tl.constexpr):
    for i in tl.static_range(N):
        push(q, tl.full((), 100 + i, tl.int32), QSIZE, QSIZE > 0)
    for i in tl.static_range(SEEDED + N + 2):     # two claims past the launch's tasks: -1, the head overshoots
        if SEED_BASE < 0 and i % 2 == 0:          # both ways of claiming: at once, or claim then take
            got = next_task(q, QSIZE, limit, INIT, NINIT, TOTAL, ev_epoch, 1000, ctrl, ctrl, 0, 1, 0, 1)
        else:
            got = take(q, claim(q), QSIZE, limit, INIT, NINIT, SEED_BASE, TOTAL, ev_epoch, 1000, ctrl, ctrl, 0, 1, 0, 1)
        tl.store(out + i, got)
    tl.store(out + SEEDED + N + 2, (tl.load(q) - limit).to(tl.int32))
    rewind_head(q, limit)


def main():
    n, qsize = 6, 8
    for start in (2 ** 31 - 3, 2 ** 32 - 3):
        q = torch.zeros(2 + qsize, dtype=torch.int64)
        q[0] = q[1] = start                  # head (claims) and tail (pushes)
        ctrl, out = torch.zeros(8, dtype=torch.int32), torch.full((n + 3,), -7, dtype=torch.int32)
        round_trip[(1,)](q, ctrl, out, qsize, start + n, 0, 0, -1, start + n, 1, N=n, SEEDED=0)
        assert out.tolist() == [*range(100, 100 + n), -1, -1, 2], (start, out.tolist())
        assert int(ctrl[0]) == 0 and int(q[0]) == int(q[1]) == start + n
        print(f"OK ready queue {start}", flush=True)
    # a launch of 2 seeded tasks (ids 40, 41) and 4 pushed ones, in epoch 3 and in one whose queue
    # indices pass 2**32 (stamps wrap): its claims start at (epoch - 1) * 6, its pushes at (epoch - 1) * 4
    seeded, pushed = 2, 4
    total = seeded + pushed
    for epoch, base in ((3, -1), (2 ** 30 + 1, -1), (3, 40), (2 ** 30 + 1, 40)):
        q = torch.zeros(2 + qsize + seeded, dtype=torch.int64)
        q[2 + qsize:] = torch.tensor([40, 41] if base < 0 else [-5, -5])   # given a base, the table is not read
        q[0], q[1] = (epoch - 1) * total, (epoch - 1) * pushed
        ctrl, out = torch.zeros(8, dtype=torch.int32), torch.full((total + 3,), -7, dtype=torch.int32)
        round_trip[(1,)](q, ctrl, out, qsize, epoch * total, 2 + qsize, seeded, base, total, epoch, N=pushed,
                         SEEDED=seeded)
        assert out.tolist() == [40, 41, *range(100, 100 + pushed), -1, -1, 2], (epoch, base, out.tolist())
        assert int(ctrl[0]) == 0 and int(q[0]) == epoch * total and int(q[1]) == epoch * pushed
        print(f"OK seeded {epoch}{' from a base' if base >= 0 else ''}", flush=True)

if __name__ == "__main__":
    main()
