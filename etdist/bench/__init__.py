"""The benchmark harness: the main command and the tools around it. It may import the whole
library; nothing in the library imports it (tests/test_layering.py).

    python -m etdist.bench [group=option ...]        the main command (main.py; Hydra configs in conf/)
    python -m etdist.bench.collectives               the standalone collectives against NCCL (torchrun)
    python -m etdist.bench.report                    tables and plots from result records

    main        the Hydra app: CPU-runtime cells, or the GPU cells of gpu.py
    gpu         the GPU cells: fused ops and layers against cuBLAS+NCCL and the torch layers
    config      the structured configs (schemas) behind conf/
    report      markdown tables and plots from records
    measure     the timing protocol, baselines, result records, model shapes
"""
