#!/usr/bin/env bash
# The main command under mpirun (Open MPI or MPICH); Hydra overrides pass through.
#   NPROC=2 bash launch/mpirun.sh workload=moe schedule=dynamic
set -euo pipefail
PYTHON=${PYTHON:-python3}   # the interpreter to run (e.g. a venv's, without activating it)
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NPROC=${NPROC:-$($PYTHON -c 'import torch; print(max(1, torch.cuda.device_count()))')}
MPIRUN=${MPIRUN:-$(command -v mpirun || command -v mpiexec)}
if "$MPIRUN" --version 2>&1 | grep -q "Open MPI"; then
  # Open MPI: run as root where needed, and forward the variables above to every rank
  exec "$MPIRUN" --allow-run-as-root -n "$NPROC" -x NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME -x NVSHMEM_DISABLE_NVLS \
    -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x PYTHONPATH $PYTHON -m etdist.bench "$@"
fi
exec "$MPIRUN" -n "$NPROC" $PYTHON -m etdist.bench "$@"  # MPICH forwards the environment
