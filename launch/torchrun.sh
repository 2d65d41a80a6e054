#!/usr/bin/env bash
# The main command under torchrun on this node; Hydra overrides pass through.
#   NPROC=2 bash launch/torchrun.sh workload=gemm_rs schedule=static [-m ...]
set -euo pipefail
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NPROC=${NPROC:-$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')}
exec python3 -m torch.distributed.run --nproc_per_node="$NPROC" -m etdist.bench "$@"
