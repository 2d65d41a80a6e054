#!/usr/bin/env bash
# The decode-size A/Bs, each step time-bounded so that two or three fit in one 10-minute device call
# (2 GPUs). Name the steps to run (default: all, ~15 minutes: more than one call); records go to $RESULTS (default a
# scratch folder), never to bench/results unless asked.
#   bash experiments/decode-ab.sh sync trace whole      # ~5 minutes
#   bash experiments/decode-ab.sh moe                    # ~4 minutes
# Steps:
#   sync   experiments/sync_latency.py: one dependent step's cost (local and cross-GPU notify/wait, the
#          ready queue), the unit of the decode kernels' overheads;
#   trace  experiments/trace_gemm_rs.py at M=16 on qwen3_8b's shape: where the ~30 us that gemm_rs spends
#          beyond torch.mm + NCCL goes (tasks, reduce, start, exit rendezvous);
#   whole  ag_gemm and the MLP at M=16 and 128 on the 8 shapes, the former single whole-gather tile
#          (ETDIST_WHOLE_TILES=64,128,64,4,4) against today's size classes, alternated, in one call;
#   moe    nn.MoE's small-class tiles at 1, 16 and 128 tokens (experiments/tune-moe.sh): today's
#          64,64,128,8,3 against narrower column tiles (more gate/up tasks per expert at one token)
#          and 16-row tiles; all compile for sm_90a without spills (checked on the CPU);
#   moegroup  nn.MoE at 1024 and 4096 tokens (static, EP=2), its expert GEMMs walked row tile after
#          row tile (ETDIST_MOE_GROUP_M=1, the order before the grouping) against groups of 8 row
#          tiles per weight block (the default), alternated twice (not decode: it rides along, ~4 min).
#   moepin  nn.MoE under the dynamic schedule at 1/128/1024 tokens, zipf-skewed routing (EP=2), the
#          router's chain queued (ETDIST_MOE_PIN_ROUTER=0, as before) against pinned (the default;
#          with the static schedule beside it), alternated twice (~4 min);
#   early  nn.MoE under the dynamic schedule at 1/128/1024 tokens, zipf-skewed routing (EP=2): the
#          gate/up tiles released by the tile table's notify (ETDIST_EARLY_PUSH=0, as before) against
#          pushed early (the default: queued at launch, spinning on "tiled"), alternated twice; then
#          the static schedule once beside them (~5 min);
#   chain  nn.MoE under the dynamic schedule at 1/16/128/1024 tokens, Zipf 1.5 routing (EP=2): the down
#          tiles released by act_ready's walk (ETDIST_EARLY_PUSH=1) against seeded behind the gate/up
#          tiles (2: the default, measured on one GPU only), alternated twice, then static once (~5 min);
#   moetail nn.MoE under the dynamic schedule at 1/128/1024 tokens, zipf-skewed routing (EP=2): the
#          return and combine queued (ETDIST_MOE_TAIL=0, as before) against walked as the tail (the
#          default, measured on one GPU only), alternated twice (~4 min);
#   moelarge nn.MoE (static) at 128/512/1024 tokens, uniform routing (EP=2): the large tile class
#          from 512 rows per expert (ETDIST_MOE_LARGE_ROWS=512, as before) against from 64 (the
#          default, measured on one GPU only), alternated twice (~4 min);
#   moedown nn.MoE under the dynamic schedule at 16/1024/4096 tokens, Zipf 1.5 (EP=2): qwen3's down tiles
#          128 wide (ETDIST_MOE_DOWN_N=128, as before) against 256 (the default for experts of at most
#          2048 intermediate, measured on one GPU only), alternated twice,
#          then static once (~5 min);
#   moehalf the same for half-height last row tiles: off (ETDIST_MOE_HALF_TAILS=0, as before) against on
#          (the large class's default with >= 32 experts a rank, one GPU only so far) (~5 min);
#   moefine nn.MoE at 1/128/1024/4096 tokens, Zipf 1.5 (EP=2): top-k >= 4 routing and combine in the
#          class's blocks (ETDIST_MOE_FINE_BLOCKS=0, the blocks as before; the routing's slice sums stay
#          unrolled) against small ones (the default, one GPU only so far),
#          alternated twice, then static once (~6 min);
#   rstail gemm_rs at M=1000/1024/8192 on the five shapes whose plan it changes, the tiles past the
#          last whole wave alone in slices (ETDIST_GEMM_RS_SPLIT_TAIL=1, the default,
#          one GPU only so far) against every tile in slices (0), alternated
#          twice (prefill: it rides along, ~4 min);
#   rsown  gemm_rs at M=1000/1024/8192 on the same five shapes, each rank's own tiles last
#          (ETDIST_GEMM_RS_OWN_LAST=1) against owner 0's first on every rank (the default), alternated
#          twice, under the tail plan (RSOWN_TAIL=0: under today's plan) (~4 min);
#   rsfuse gemm_rs at M=1024/4096/8192 on four shapes whose plans keep tiles whole, own tiles last with
#          their reduce in their epilogue (ETDIST_GEMM_RS_FUSE_OWN=1, the default,
#          one GPU only so far) against owner 0's tiles first and a reduce task (0) (~4 min);
#   mlptail the fused MLP at M=1000/1024 on the shapes whose plan it changes, its last down tiles
#          in 3 slices (ETDIST_MLP_TAIL_SPLITS=3, the default, one GPU
#          only so far) against whole (1), alternated twice (~4 min);
#   ownx   ag_gemm and the fused MLP at M=1000/8192 on three shapes, own row tiles read from x
#          (ETDIST_AG_GEMM_OWN_FROM_X=1, the default, one GPU only so
#          far) against waiting for the copy of x into the gathered buffer (0) (~5 min);
#   mid    gemm_rs, ag_gemm and the fused MLP at M=129/160/256 on two shapes (each rank's rows one
#          row tile): the sources' (gemm_rs: owners') tiles in source order (ETDIST_INTERLEAVE_SOURCES=0,
#          as before) against side by side (1, the default: each weight tile read once, not once per source; on one GPU only the same
#          two orders of two row tiles were measured), alternated twice (~7 min);
#   midwhole the same cells, the per-source graphs above 128 rows (ETDIST_WHOLE_MAX_M=128, the default)
#          against the whole-gather graphs up to 256 rows (256), alternated twice (~5 min);
#   opsdyn the three fused ops under both schedules at M=16/128/1024 on two shapes: what the ready
#          queue costs their kernels, where every task exists (never benchmarked before; ~2 min);
#   moetrace  experiments/trace_moe.py at 1 and 1024 tokens (qwen3_30b_a3b-sized, EP=2, both schedules):
#          per task kind its time, its wait and the gap before it (where the dynamic schedule's
#          hand-offs cost), the dispatch and send_back copies among them (~2 min).
set -uo pipefail
cd "$(dirname "$0")/.."
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo} NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
RESULTS=${RESULTS:-$(mktemp -d)}
quiet() { grep -vE '^(W1|\[W|Setting OMP|\*{5})'; }
rows() { grep -E '^\[[0-9]+/[0-9]+\]' | cut -c1-120; }
# ab NAME VAR "V1 V2" LIMIT [bench-gpu.sh args]: VAR=V1, V2, V1, V2 in turn (none started past LIMIT s), each a
# bench-gpu.sh run into $RESULTS/NAME-<value> (the caller's MODELS_OVERRIDE/WORKLOADS/... pass through), rows
# prefixed with "NAME <value>"
ab() {
  local name=$1 var=$2 values=$3 limit=$4 v; shift 4
  for v in $values $values; do
    [ $((SECONDS - T0)) -gt "$limit" ] && break
    env "$var=$v" RESULTS="$RESULTS/$name-$v" timeout 150 bash launch/bench-gpu.sh "$@" 2>&1 | rows | sed "s/^/$name $v /"
  done
}
# moe_ab NAME VAR "V1 V2" TOKENS: nn.MoE under the dynamic schedule, zipf 1.5, VAR alternated by `ab`, then the
# static schedule once beside it (rows prefixed "static")
moe_ab() {
  local name=$1 var=$2 values=$3 tokens=$4 models=qwen3_30b_a3b,mixtral_8x7b
  MODELS_OVERRIDE=$models WORKLOADS=moe SCHEDULE=dynamic \
    ab "$name" "$var" "$values" 360 bench=gpu_moe "bench.tokens=$tokens" model.routing_skew=1.5
  RESULTS=$RESULTS/$name-static MODELS_OVERRIDE=$models WORKLOADS=moe SCHEDULE=static \
    timeout 150 bash launch/bench-gpu.sh bench=gpu_moe "bench.tokens=$tokens" model.routing_skew=1.5 2>&1 \
    | rows | sed 's/^/static /'
}
T0=$SECONDS
for step in ${@:-sync trace whole moe moegroup moepin moetrace}; do
  case $step in
    sync)
      echo "== sync latency"
      timeout 120 python3 -m torch.distributed.run --nproc_per_node=2 experiments/sync_latency.py 2>&1 | quiet | tail -12 ;;
    trace)
      echo "== gemm_rs at M=16, qwen3_8b (x [16, 6144] @ w [6144, 4096] per rank), traced"
      OUT=${TRACE_OUT:-/tmp} timeout 150 python3 -m torch.distributed.run --nproc_per_node=2 experiments/trace_gemm_rs.py 16 4096 12288 \
        2>&1 | quiet | tail -30 ;;
    whole)
      echo "== whole-gather tiles at M=16/128: old single tile, then today's classes (twice)"
      for rep in 1 2; do
        ETDIST_WHOLE_TILES=64,128,64,4,4 RESULTS=$RESULTS/whole-old WORKLOADS=ag_gemm,mlp timeout 150 \
          bash launch/bench-gpu.sh 'bench.tokens=[16,128]' bench.symm_mem=false 2>&1 | rows | sed 's/^/old /'
        RESULTS=$RESULTS/whole-new WORKLOADS=ag_gemm,mlp timeout 150 \
          bash launch/bench-gpu.sh 'bench.tokens=[16,128]' bench.symm_mem=false 2>&1 | rows | sed 's/^/new /'
        [ $((SECONDS - T0)) -gt 420 ] && break
      done ;;
    moe)
      echo "== nn.MoE small-class tiles at 1/16/128 tokens (static)"
      CONFIGS=${MOE_CONFIGS:-"64,64,128,8,3 64,64,64,8,4 16,64,64,8,4 16,64,32,8,6"} TOKENS='[1,16,128]' \
        timeout 280 bash experiments/tune-moe.sh 2>&1 | cut -c1-140 ;;
    moegroup)
      echo "== nn.MoE expert tile order at 1024/4096 tokens: row tile after row tile (old), then groups of 8"
      MODELS_OVERRIDE=qwen3_30b_a3b,mixtral_8x7b WORKLOADS=moe SCHEDULE=static \
        ab moegroup ETDIST_MOE_GROUP_M "1 8" 480 bench=gpu_moe 'bench.tokens=[1024,4096]' ;;
    moepin)
      echo "== nn.MoE dynamic, router chain queued (pin 0) against pinned (pin 1), zipf 1.5"
      for pin in 0 1 0 1; do
        [ $((SECONDS - T0)) -gt 420 ] && break
        sched=dynamic; [ $pin = 1 ] && [ ! -d "$RESULTS/moepin-1" ] && sched=both
        ETDIST_MOE_PIN_ROUTER=$pin RESULTS=$RESULTS/moepin-$pin MODELS_OVERRIDE=qwen3_30b_a3b,mixtral_8x7b \
          WORKLOADS=moe SCHEDULE=$sched timeout 150 bash launch/bench-gpu.sh bench=gpu_moe 'bench.tokens=[1,128,1024]' \
          model.routing_skew=1.5 2>&1 | rows | sed "s/^/pin $pin /"
      done ;;
    early)
      echo "== nn.MoE dynamic, gate/up released by a walk (early 0) against pushed at launch (early 1), zipf 1.5"
      moe_ab early ETDIST_EARLY_PUSH "0 1" '[1,128,1024]' ;;
    chain)
      echo "== nn.MoE dynamic, down tiles released (early 1) against seeded behind gate/up (early 2), zipf 1.5"
      moe_ab chain ETDIST_EARLY_PUSH "1 2" '[1,16,128,1024]' ;;
    moetail)
      echo "== nn.MoE dynamic, return and combine queued (tail 0) against walked after the queue (tail 1), zipf 1.5"
      MODELS_OVERRIDE=qwen3_30b_a3b,mixtral_8x7b WORKLOADS=moe SCHEDULE=dynamic \
        ab moetail ETDIST_MOE_TAIL "0 1" 360 bench=gpu_moe 'bench.tokens=[1,128,1024]' model.routing_skew=1.5 ;;
    moelarge)
      echo "== nn.MoE static, the large tiles from 512 rows per expert (512) against from 64 (64), uniform routing"
      MODELS_OVERRIDE=qwen3_30b_a3b,mixtral_8x7b WORKLOADS=moe SCHEDULE=static \
        ab moelarge ETDIST_MOE_LARGE_ROWS "512 64" 360 bench=gpu_moe 'bench.tokens=[128,512,1024]' ;;
    moedown)
      echo "== nn.MoE dynamic, down tiles 128 wide (as before) against 256 (the default for short experts), zipf 1.5"
      moe_ab moedown ETDIST_MOE_DOWN_N "128 256" '[16,1024,4096]' ;;
    moehalf)
      echo "== nn.MoE dynamic, last row tiles full height (0, as before) against half height (1, the default), zipf 1.5"
      moe_ab moehalf ETDIST_MOE_HALF_TAILS "0 1" '[1024,4096]' ;;
    moefine)
      echo "== nn.MoE dynamic, routing / combine in the class's blocks (0, as before) against small ones (1, the default), zipf 1.5"
      moe_ab moefine ETDIST_MOE_FINE_BLOCKS "0 1" '[1,128,1024,4096]' ;;
    rstail)
      echo "== gemm_rs above 128 rows: every tile in slices (tail 0), then only the last wave's (tail 1, the default)"
      MODELS_OVERRIDE=gemma2_27b,qwen3_32b,llama31_70b,gpt3_175b,llama31_405b WORKLOADS=gemm_rs \
        ab rstail ETDIST_GEMM_RS_SPLIT_TAIL "0 1" 420 'bench.tokens=[1000,1024,8192]' bench.symm_mem=false ;;
    rsown)
      echo "== gemm_rs above 128 rows: owner 0's tiles first on every rank (own 0, the default), then each rank's own last"
      ETDIST_GEMM_RS_SPLIT_TAIL=${RSOWN_TAIL:-1} MODELS_OVERRIDE=gemma2_27b,qwen3_32b,llama31_70b,gpt3_175b,llama31_405b \
        WORKLOADS=gemm_rs ab rsown ETDIST_GEMM_RS_OWN_LAST "0 1" 420 'bench.tokens=[1000,1024,8192]' bench.symm_mem=false ;;
    rsfuse)
      echo "== gemm_rs, whole-tile plans: a reduce task (fuse 0), then own tiles last reduced in their epilogue (1, the default)"
      MODELS_OVERRIDE=qwen3_8b,llama31_8b,gemma2_9b,llama31_70b WORKLOADS=gemm_rs \
        ab rsfuse ETDIST_GEMM_RS_FUSE_OWN "0 1" 420 'bench.tokens=[1024,4096,8192]' bench.symm_mem=false ;;
    mlptail)
      echo "== the fused MLP above 128 rows: every down tile whole (splits 1), then the last ones in 3 slices (the default)"
      MODELS_OVERRIDE=llama31_8b,gemma2_9b,gemma2_27b,qwen3_32b,gpt3_175b,llama31_405b WORKLOADS=mlp \
        ab mlptail ETDIST_MLP_TAIL_SPLITS "1 3" 420 'bench.tokens=[1000,1024]' bench.symm_mem=false ;;
    ownx)
      echo "== ag_gemm and the MLP above 128 rows: own rows through the gather (0), then straight from x (1, the default)"
      MODELS_OVERRIDE=qwen3_8b,gemma2_27b,llama31_70b WORKLOADS=ag_gemm,mlp \
        ab ownx ETDIST_AG_GEMM_OWN_FROM_X "0 1" 540 'bench.tokens=[1000,8192]' bench.symm_mem=false ;;
    mid)
      echo "== gemm_rs, ag_gemm and the MLP at M=129-256: sources (owners) in order (0), then side by side (1, the default)"
      MODELS_OVERRIDE=llama31_8b,llama31_70b WORKLOADS=gemm_rs,ag_gemm,mlp \
        ab mid ETDIST_INTERLEAVE_SOURCES "0 1" 600 'bench.tokens=[129,160,256]' bench.symm_mem=false ;;
    midwhole)
      echo "== ag_gemm and the MLP at M=129-256: per-source graphs (128, the default), then whole-gather ones (256)"
      MODELS_OVERRIDE=llama31_8b,llama31_70b WORKLOADS=ag_gemm,mlp \
        ab midwhole ETDIST_WHOLE_MAX_M "128 256" 480 'bench.tokens=[129,160,256]' bench.symm_mem=false ;;
    opsdyn)
      echo "== gemm_rs, ag_gemm and the MLP, static and dynamic schedules"
      RESULTS=$RESULTS/opsdyn SCHEDULE=both MODELS_OVERRIDE=qwen3_8b,llama31_70b timeout 300 \
        bash launch/bench-gpu.sh 'bench.tokens=[16,128,1024]' bench.symm_mem=false 2>&1 | rows ;;
    moetrace)
      for tokens in 1 1024; do
        echo "== nn.MoE traced at $tokens tokens, both schedules"
        OUT=${TRACE_OUT:-/tmp} timeout 150 python3 -m torch.distributed.run --nproc_per_node=2 experiments/trace_moe.py $tokens \
          2>&1 | quiet | grep -vE 'UserWarning|_warn_once' | tail -32
      done ;;
    *) echo "unknown step $step (sync, trace, whole, moe, moegroup, moepin, early, chain, moetail, moelarge, rstail, rsown, rsfuse, mlptail, ownx, mid, midwhole, opsdyn, moetrace)"; exit 2 ;;
  esac
  echo "-- $step done at $((SECONDS - T0)) s"
done
echo "records: $RESULTS"
