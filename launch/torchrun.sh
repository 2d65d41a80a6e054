#!/usr/bin/env bash
# The main command under torchrun on this node; Hydra overrides pass through.
#   NPROC=2 bash launch/torchrun.sh workload=gemm_rs schedule=static [-m ...]
set -euo pipefail
PYTHON=${PYTHON:-python3}   # the interpreter to run (e.g. a venv's, without activating it)
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NPROC=${NPROC:-$($PYTHON -c 'import torch; print(max(1, torch.cuda.device_count()))')}
exec $PYTHON -m torch.distributed.run --nproc_per_node="$NPROC" -m etdist.bench "$@"
