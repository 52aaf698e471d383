#!/usr/bin/env bash
# Do the rollout and the trainer compute the same bf16 function? One device call: two copies of
# the 7B geometry with the same random bf16 weights on one GPU, the rollout engine (compiled, LoRA
# by --lora-mode) and the trainer's FlowGRPO step (LoRA r 64, autocast, compiled) as their services
# build them; 512 px, 14 steps, CFG 4, window 2, rollout batch 8 (2 prompts x 4), trainer
# micro-batch 2. Per mode (plain batched forward; sampling.batch_invariant): the log-prob gap per
# window step before and after a published LoRA update, the rollout's images/s, the trainer's
# step time and the recompute's time (medians of 3 after a warm-up, with ranges).
#   run(command="bash bench/consistency_gpu.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=600)
#   run(command="bash bench/consistency_gpu.sh --lora-mode merge", ...)   # the rollout's default
#   run(command="COMPILE=0 bash bench/consistency_gpu.sh", ...)            # both sides eager
# (.whl: bench/fetch_gpu_wheels.sh.) A CPU smoke test (tiny model, fp32): DEVICE=cpu bash bench/consistency_gpu.sh
# Writes $OUT/consistency.json and $OUT/consistency.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/consistency-bench}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
source bench/gpu_env.sh
if [[ $DEVICE == cuda* ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    SIZE=(--model 7b --dtype bf16 --device cuda --resolution 512 --num-points 15 --prompt-len 24
          --lora-rank 64 --lr 1e-4)
    [[ ${COMPILE:-1} == 1 ]] && SIZE+=(--compile)  # COMPILE=0: both sides eager
else
    SIZE=(--model tiny --dtype fp32 --device cpu)
fi
$PY -m flowgrpo.services.cli bench consistency "${SIZE[@]}" --batch 8 --group 4 --micro-batch 2 \
    --json "$OUT/consistency.json" "$@" 2>&1 | tee "$OUT/consistency.log"
