#!/usr/bin/env bash
# GEMM+RS sweep on a GPU machine: A/B the large-tile config on two models, then every model x M
# with the faster one; records to bench/results/gemm_rs.jsonl (or $1), the table printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${1:-bench/results/gemm_rs.jsonl}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
run() { timeout 600 python3 -m torch.distributed.run --nproc_per_node="$NGPU" -m etdist.bench_gemm_rs "$@" 2>&1 | grep -vE '^(W1|\[W|\*|Setting OMP)'; }
tmp=$(mktemp -d)
for cfg in 128,128,64,8,3 128,256,64,8,4; do
  ETDIST_GEMM_RS_LARGE=$cfg run --models qwen3_8b llama31_70b --M 8192 --out "$tmp/$cfg.jsonl" | tail -2
done
best=$(python3 launch/pick_tiles.py 128,128,64,8,3="$tmp/128,128,64,8,3.jsonl" 128,256,64,8,4="$tmp/128,256,64,8,4.jsonl")
echo "large tiles: $best"
ETDIST_GEMM_RS_LARGE=$best run --startup --out "$OUT"
