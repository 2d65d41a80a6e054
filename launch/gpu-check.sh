#!/usr/bin/env bash
# On a GPU machine (2+ GPUs): every GPU test, then the benchmarks; the table is printed last.
#   bash launch/gpu-check.sh [results dir, default bench/results]
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
RESULTS=${1:-bench/results}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')

timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -n 30
tests=$?
timeout 900 python3 -m torch.distributed.run --nproc_per_node="$NGPU" -m etdist.bench_collectives --out "$RESULTS" \
  2>&1 | grep -v '^W[0-9]' | tee /tmp/etdist-bench.log
echo "gpu tests exit $tests"
grep -E '^(reduce_scatter|all_gather|all_reduce|\* = out)' /tmp/etdist-bench.log
