#!/usr/bin/env bash
# Re-check every GPU claim with one command, on a GPU machine (2+ GPUs for the cross-GPU timings;
# with one, the two-rank tests run with both ranks on it, init_mesh(share_gpu=True)):
#   bash launch/gpu-check.sh [results dir, default bench/results]
#   QUICK=1 bash launch/gpu-check.sh /tmp/r     # the tests + a few cells of each sweep
# PART=tests or PART=bench runs one half; PYTEST_K="<expr>" passes -k to pytest. Neither half fits one
# 10-minute device call whole: on one H100 at 33deb5e `pytest -m gpu` took
# ~13 min, its torch_compile and moe_layer_both tests ~4 of them. In 10-minute calls:
#   PART=tests PYTEST_K="not torch_compile and not moe_layer_both and not llama" bash launch/gpu-check.sh
#   PART=tests PYTEST_K="torch_compile or moe_layer_both or llama" bash launch/gpu-check.sh
#   QUICK=1 PART=bench bash launch/gpu-check.sh /tmp/r
# 1. every GPU test (pytest -m gpu; the Llama client test needs `pip install transformers`);
# 2. the collectives benchmark and the synchronisation latencies (etdist.bench.sync_latency);
# 3. the GEMM+RS, AG+GEMM and MLP (sequence-parallel and replicated) sweep, then the MoE sweep (both
# schedules), through the Hydra main command (launch/bench-gpu.sh).
# Records are appended under the results dir; a short table is printed last.
# Each record names the commit measured (git rev-parse, "+dirty" for uncommitted code). Where the
# tree was copied with a stale .git (a lent GPU machine may keep the first snapshot it was sent),
# name it in the command sent: ETDIST_COMMIT=<git rev-parse --short HEAD, read in the checkout> bash ...
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
RESULTS=${1:-bench/results}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)
if [ "${NGPU:-0}" -lt 1 ]; then
  echo "gpu-check.sh: no CUDA GPU here (python3 sees ${NGPU:-no torch}); it checks the GPU claims, so it needs one" >&2
  exit 1
fi
log=$(mktemp -d)

PART=${PART:-all}
case "$PART" in all|tests|bench) ;; *) echo "PART must be all, tests or bench, got '$PART'" >&2; exit 2 ;; esac
tests="not run (PART=bench)"
if [ "$PART" != bench ]; then
  timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -n 30
  tests=${PIPESTATUS[0]}
fi
if [ "$PART" = tests ]; then
  echo "== gpu tests exit $tests"
  exit "$tests"
fi
timeout 900 python3 -m torch.distributed.run --nproc_per_node="$NGPU" -m etdist.bench.collectives --out "$RESULTS" \
  2>&1 | grep -v '^W[0-9]' > "$log/collectives.log"
if [ "$NGPU" -ge 2 ]; then
  timeout 300 python3 -m torch.distributed.run --nproc_per_node=2 -m etdist.bench.sync_latency 2>&1 | grep -v '^W[0-9]' > "$log/sync.log"
fi
dense=() moe=() dense_models="" moe_models=qwen3_30b_a3b,mixtral_8x7b
if [ "${QUICK:-0}" = 1 ]; then
  dense=('bench.tokens=[128,8192]' bench.symm_mem=false) moe=('bench.tokens=[16,1024]')
  dense_models=llama31_70b,qwen3_32b moe_models=qwen3_30b_a3b
fi
RESULTS="$RESULTS" MODELS_OVERRIDE=$dense_models WORKLOADS=gemm_rs,ag_gemm,mlp,mlp_replicated \
  timeout 900 bash launch/bench-gpu.sh "${dense[@]}" > "$log/sweep.log" 2>&1
RESULTS="$RESULTS" MODELS_OVERRIDE=$moe_models WORKLOADS=moe SCHEDULE=both \
  timeout 900 bash launch/bench-gpu.sh bench=gpu_moe "${moe[@]}" model.routing_skew=0,1.5 >> "$log/sweep.log" 2>&1

echo "== gpu tests exit $tests"
echo "== collectives (us per call; see docs/benchmarks.md for the columns)"
grep -E '^(reduce_scatter|all_gather|all_reduce|\* = out)' "$log/collectives.log"
echo "== one dependent step (etdist.bench.sync_latency)"
grep -E '^(case|two|ready|OK)' "$log/sync.log" 2>/dev/null || echo "(needs 2 GPUs)"
echo "== fused layers (us per call; speedup > 1 means faster than the best baseline: cuBLAS+NCCL eager/graph, for MoE also loop and the fused MoE)"
grep -E '^\[[0-9]+/[0-9]+\]' "$log/sweep.log" | sed 's/ best baseline / best /' | sort -k2,2 -s
