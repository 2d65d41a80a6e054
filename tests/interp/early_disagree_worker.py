"""The ranks disagree on early push (rank 1 compiles with early_push=0): the MoE graph's dynamic kernel
would walk `tiled` on one rank and not on the other. Every rank must refuse at the first call,
before anything launches, naming the difference (not hang until the watchdog): the call agreement
(mesh/calls.py) names the early-pushed tasks of each rank's kernel. Then they disagree on the tail
(rank 1's graph has its return and combine queued, TaskSpec.tail cleared): `returned` would be a
plain notify on one rank and walked on the other, and a queued combine never pushed: the kernels'
sources differ.

    TRITON_INTERPRET=1 torchrun --nproc_per_node=2 tests/interp/early_disagree_worker.py
        -> 'OK early disagree rank r', 'OK tail disagree rank r'
"""

import dataclasses

import etdist as et
from etdist.workloads import moe


def main():
    mesh = et.init_mesh(backend="cpu", watchdog_s=20)
    R, r = mesh.world_size, mesh.rank
    kernel = et.compile(moe.moe_layer(top_k=2, block_m=16, max_experts=16), schedule="dynamic", target="cuda",
                        early_push=0 if r == 1 else 1)
    ranks, _ = moe.make_inputs(R, 5, H=24, I=20, E=4 * R, seed=1)
    try:
        kernel(mesh, **ranks[r])
    except et.ShapeMismatchError as e:
        assert "early_push: ('gate_up',)" in str(e) and "early_push: ()" in str(e), e
        print(f"OK early disagree rank {r}", flush=True)
    ir = moe.moe_layer(top_k=2, block_m=16, max_experts=16).to_ir()
    if r == 1:   # the return and combine queued
        ir = dataclasses.replace(ir, tasks=tuple(dataclasses.replace(t, tail=False) for t in ir.tasks))
    kernel = et.compile(ir, schedule="dynamic", target="cuda")
    try:
        kernel(mesh, **ranks[r])
    except et.ShapeMismatchError as e:
        assert "the ranks disagree on call 2" in str(e) and "source: " in str(e), e
        print(f"OK tail disagree rank {r}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
