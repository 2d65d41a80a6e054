"""The measurement protocol of docs/benchmarks.md ("How we measure") and docs/design.md's record schema as a library.

    timing     time_batched / time_single / time_alternated / slowest_rank: CUDA events on a GPU,
               perf_counter on CPU
    baselines  cuBLAS + NCCL (eager, CUDA graph), torch.ops.symm_mem, mm alone; floors and ceilings
    records    Record (one JSON line of bench/results/<workload>.jsonl), append/load/newest_per_cell
    shapes     the paper's MLP shapes and the token counts M we sweep
    threads    which threads of this process keep a core busy (/proc)

Submodules import torch lazily where they can, so `etdist.bench.report` reads records without a GPU.
"""
