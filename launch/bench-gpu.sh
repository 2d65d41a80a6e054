#!/usr/bin/env bash
# The GPU sweep through the Hydra main command: the 8 MLP shapes x bench=gpu's token counts, one
# process per GPU, records added to bench/results, then docs/benchmarks.md regenerated. Without CUDA GPUs,
# or when the sweep fails, it says so in one line and exits non-zero.
#   bash launch/bench-gpu.sh                       # gemm_rs, ag_gemm and mlp
#   WORKLOADS=mlp bash launch/bench-gpu.sh         # one workload; Hydra overrides pass through
#   RESULTS=/tmp/r MODELS_OVERRIDE=qwen3_8b SCHEDULE=both bash launch/bench-gpu.sh bench.symm_mem=false
#   MODELS_OVERRIDE=qwen3_30b_a3b,mixtral_8x7b WORKLOADS=moe SCHEDULE=both bash launch/bench-gpu.sh bench=gpu_moe
#     (add model.routing_skew=1.5 for skewed routing; the last bench= wins)
set -uo pipefail
PYTHON=${PYTHON:-python3}   # the interpreter to run (e.g. a venv's, without activating it)
cd "$(dirname "$0")/.."
MODELS=qwen3_8b,llama31_8b,gemma2_9b,gemma2_27b,qwen3_32b,llama31_70b,gpt3_175b,llama31_405b
NGPU=$($PYTHON -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)
if [ "${NGPU:-0}" -lt 1 ]; then
  echo "bench-gpu.sh: no CUDA GPU here ($PYTHON sees ${NGPU:-no torch}); the GPU sweep needs one (python -m etdist.bench runs the CPU runtime)" >&2
  exit 1
fi
NPROC=${NPROC:-$NGPU}
export NPROC
bash launch/torchrun.sh -m model=${MODELS_OVERRIDE:-$MODELS} workload=${WORKLOADS:-gemm_rs,ag_gemm,mlp} schedule=${SCHEDULE:-static} bench=gpu \
  bench.results_dir=${RESULTS:-bench/results} "$@" 2>&1 | grep -vE '^(W1|\[W|Setting OMP|\*{5})'
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  echo "bench-gpu.sh: the sweep failed (exit $rc); docs/benchmarks.md left as it was" >&2
  exit "$rc"
fi
if [ "${RESULTS:-bench/results}" = bench/results ]; then
  $PYTHON -m etdist.bench.report --repo > /dev/null || { echo "bench-gpu.sh: the report failed" >&2; exit 1; }
  echo "docs/benchmarks.md regenerated"
fi
