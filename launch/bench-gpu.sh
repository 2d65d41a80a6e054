#!/usr/bin/env bash
# The GPU sweep through the Hydra main command: the 8 MLP shapes x bench=gpu's token counts, one
# process per GPU, records added to bench/results, then BENCHMARKS.md regenerated.
#   bash launch/bench-gpu.sh                       # gemm_rs, ag_gemm and mlp
#   WORKLOADS=mlp bash launch/bench-gpu.sh         # one workload; Hydra overrides pass through
#   RESULTS=/tmp/r MODELS_OVERRIDE=qwen3_8b SCHEDULE=both bash launch/bench-gpu.sh bench.symm_mem=false
#   MODELS_OVERRIDE=qwen3_30b_a3b,mixtral_8x7b WORKLOADS=moe SCHEDULE=both bash launch/bench-gpu.sh bench=gpu_moe
#     (add model.routing_skew=1.5 for skewed routing; the last bench= wins)
set -uo pipefail
PYTHON=${PYTHON:-python3}   # the interpreter to run (e.g. a venv's, without activating it)
cd "$(dirname "$0")/.."
MODELS=qwen3_8b,llama31_8b,gemma2_9b,gemma2_27b,qwen3_32b,llama31_70b,gpt3_175b,llama31_405b
NPROC=${NPROC:-$($PYTHON -c 'import torch; print(torch.cuda.device_count())')}
export NPROC
bash launch/torchrun.sh -m model=${MODELS_OVERRIDE:-$MODELS} workload=${WORKLOADS:-gemm_rs,ag_gemm,mlp} schedule=${SCHEDULE:-static} bench=gpu \
  bench.results_dir=${RESULTS:-bench/results} "$@" 2>&1 | grep -vE '^(W1|\[W|Setting OMP|\*{5})'
if [ "${RESULTS:-bench/results}" = bench/results ]; then $PYTHON -m etdist.bench.report > /dev/null && echo "BENCHMARKS.md regenerated"; fi
