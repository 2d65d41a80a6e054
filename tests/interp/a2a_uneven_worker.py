"""all_to_all with uneven counts whose largest segments differ between ranks, by the GPU exchange
kernel under Triton's interpreter (one process per rank):

    TRITON_INTERPRET=1 torchrun --nproc_per_node=2 tests/interp/a2a_uneven_worker.py

Rank 0 keeps 1.1M elements and swaps 100k with rank 1: sized by its own largest segment, rank 0
cut the shared segments into 24576-element chunks and rank 1 into 8192 (rank 1 then waited on
chunk lanes rank 0 never sets). Prints 'OK a2a uneven rank <r>'.
"""
import torch

import etdist as et
from etdist.collectives import all_to_all, ops

ops.CPU_EXCHANGE = "triton"   # the GPU exchange kernel on the cpu backend (interpreted)

COUNTS = [[1_100_000, 100_000], [100_000, 0]]   # COUNTS[src][dst], elements (rows of one)

mesh = et.init_mesh(backend="cpu")
r, w = mesh.rank, mesh.world_size
x = torch.cat([torch.arange(c, dtype=torch.float32) + 1e7 * (r * w + d) for d, c in enumerate(COUNTS[r])])
want = torch.cat([torch.arange(COUNTS[s][r], dtype=torch.float32) + 1e7 * (s * w + r) for s in range(w)])
got = all_to_all(x.view(-1, 1), COUNTS[r], recv_counts=[COUNTS[s][r] for s in range(w)])
assert torch.equal(got.view(-1), want), f"rank {r}: {(got.view(-1) != want).sum().item()} wrong elements"
print(f"OK a2a uneven rank {r}", flush=True)
mesh.close()
