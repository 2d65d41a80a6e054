#!/usr/bin/env bash
# The decode A/B in one device call (2 GPUs, ~5 minutes): where the skinny gemm_rs loses bandwidth,
# then the candidate tile configs inside the megakernel, each checked against float32 first.
#   bash launch/decode-ab.sh
#   1. launch/decode_ladder.py on GPU 0 at qwen3_8b's and llama31_70b's gemm_rs shapes (M=16):
#      today's tile, 64x128x128, swap-AB with a deep weight ring, flattened, pre-packed, torch.mm;
#   2. launch/tune_decode.py on both GPUs: today's default against 64x128x128 at one task per SM
#      (the last A/B's winner, whose correctness the first pass checks) and swap-AB 16-row classes.
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
echo "== decode ladder, qwen3_8b gemm_rs (x [16, 6144] @ w [6144, 4096])"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 launch/decode_ladder.py --M 16 --K 6144 --N 4096
echo "== decode ladder, llama31_70b gemm_rs (x [16, 14336] @ w [14336, 8192])"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 launch/decode_ladder.py --M 16 --K 14336 --N 8192
echo "== megakernel A/B (us per call; gemm_rs rows only where M <= the config's block_m)"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
timeout 400 python3 -m torch.distributed.run --nproc_per_node="$NGPU" launch/tune_decode.py \
  ${CONFIGS:-64,64,128,4,4,2 64,128,128,4,4,1 16,128,128,4,6,1,swap 16,64,128,4,10,2,swap 32,128,128,4,5,1,swap} \
  2>&1 | grep -vE '^(W1|\[W|Setting OMP|\*{5})'
