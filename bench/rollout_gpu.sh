#!/usr/bin/env bash
# Every BAGEL rollout figure in ONE device call: the bf16 matmul peak (before and after the timed
# sections), the forward variants (general / query path, eager / compiled / CUDA-graphed),
# images/s and MFU of 14-step CFG-4 rollouts at 512px b8, b32, b1 and 1024px b8, prefill and VAE
# decode times, peak memory, the SDPA backend table, bf16-vs-fp32 velocity drift (tiny and 7B),
# then the GPU tests. Every timed figure: the median of 3 runs after a warm-up, with its range.
#   run(command="bash bench/rollout_gpu.sh", timeout_s=600)   (extra arguments go to flowgrpo.services.bench.rollout)
# Branched rollouts (one group of 16 at 512 px, unbranched and branched with the window at steps
# 0, 2 and 5) and nothing else, in ~5 min:
#   ROLLOUT_GPU_TESTS=0 bash bench/rollout_gpu.sh --branch --branch-begins 0,2,5 --shapes '' --variants '' \
#       --no-attention --no-drift-7b
# Guided (text CFG 4) against CFG-free rollouts (flow_grpo's fast recipe, UniGRPO) at 512 px b8 and b32:
#   ROLLOUT_GPU_TESTS=0 bash bench/rollout_gpu.sh --cfg-free 512x8,512x32 --shapes '' --variants '' \
#       --no-attention --no-drift-7b
# ROLLOUT_DEADLINE (s, default 420): what would start later is skipped, so the JSON is complete in time.
# ROLLOUT_GPU_TESTS=0 skips the GPU tests at the end.
# Writes $OUT/rollout.json, $OUT/rollout.log, $OUT/gpu.txt and $OUT/gpu_tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rollout-bench}
mkdir -p "$OUT"
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' \
    | tee -a "$OUT/gpu.txt"
$PY -m flowgrpo.services.bench.rollout --deadline-s "${ROLLOUT_DEADLINE:-420}" --json "$OUT/rollout.json" "$@" 2>&1 \
    | tee "$OUT/rollout.log"
status=$?
if [ "${ROLLOUT_GPU_TESTS:-1}" != 0 ]; then
    $PY -m pytest -q -m gpu -p no:cacheprovider tests/models/test_bagel_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
fi
exit $status
