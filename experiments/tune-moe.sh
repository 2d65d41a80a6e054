#!/usr/bin/env bash
# A/B the MoE kernel's tiles on this node's GPUs, through the sweep command; the records go to a
# scratch folder, not bench/results. Prints one row per (config, model, tokens). FIELD names the
# size class: tiles (default; small) or tiles_large (what nn.MoE takes where the average expert
# gets >= 64 rows: give TOKENS large enough); each config goes to nn.MoE as bench.moe_config.
#   bash experiments/tune-moe.sh                                   # the configs below, static schedule
#   CONFIGS="64,64,128,8,3 128,64,128,8,3" MODELS=mixtral_8x7b TOKENS='[128,4096]' bash experiments/tune-moe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
CONFIGS=${CONFIGS:-"64,64,128,8,3 128,64,128,8,3 128,64,64,8,4 64,64,64,4,4"}
MODELS=${MODELS:-qwen3_30b_a3b,mixtral_8x7b}
TOKENS=${TOKENS:-'[16,1024,4096]'}
out=$(mktemp -d)
for c in $CONFIGS; do   # the folder name has no commas: Hydra would read them as a sweep
  RESULTS="$out/${c//,/-}" MODELS_OVERRIDE=$MODELS WORKLOADS=moe SCHEDULE=${SCHEDULE:-static} \
    timeout 300 bash launch/bench-gpu.sh bench=gpu_moe "bench.tokens=$TOKENS" "bench.moe_config='${FIELD:-tiles}=$c'" \
    > "$out/$c.log" 2>&1
  grep -E '^\[[0-9]+/[0-9]+\]' "$out/$c.log" | sed "s/^/$c /"
  grep -m1 -E 'Error|error:' "$out/$c.log" | sed "s/^/$c FAILED: /"
done
echo "logs and records: $out"
