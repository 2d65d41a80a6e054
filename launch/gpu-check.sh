#!/usr/bin/env bash
# Re-check every GPU claim with one command, on a GPU machine (2+ GPUs for the cross-GPU parts):
#   bash launch/gpu-check.sh [results dir, default bench/results]
# 1. every GPU test (pytest -m gpu); 2. the collectives benchmark; 3. the GEMM+RS sweep.
# Records are appended under the results dir; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
RESULTS=${1:-bench/results}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
log=$(mktemp -d)

timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -n 30
tests=${PIPESTATUS[0]}
timeout 900 python3 -m torch.distributed.run --nproc_per_node="$NGPU" -m etdist.bench_collectives --out "$RESULTS" \
  2>&1 | grep -v '^W[0-9]' > "$log/collectives.log"
timeout 900 bash launch/bench-gemm-rs.sh "$RESULTS/gemm_rs.jsonl" > "$log/gemm_rs.log" 2>&1

echo "== gpu tests exit $tests"
echo "== collectives (us per call; see BENCHMARKS.md for the columns)"
grep -E '^(reduce_scatter|all_gather|all_reduce|\* = out)' "$log/collectives.log"
echo "== GEMM+reduce-scatter (us per call; best/ours > 1 means faster than cuBLAS+NCCL)"
grep -E '^ +(model|[a-z0-9_]+ +[0-9]+ )' "$log/gemm_rs.log" | tail -n 41
