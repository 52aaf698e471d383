#!/usr/bin/env bash
# Every BAGEL rollout figure in ONE device call: the bf16 matmul peak, the forward variants
# (general / query path, eager / compiled / CUDA-graphed), images/s and MFU of 14-step CFG-4
# rollouts at 512px b8, b32, b1 and 1024px b8, prefill and VAE decode times, peak memory, the
# SDPA backend table, bf16-vs-fp32 velocity drift (tiny and 7B), then the GPU tests.
#   run: bash bench/rollout_gpu.sh            (extra arguments go to flowgrpo.services.bench.rollout)
# Writes $OUT/rollout.json, $OUT/rollout.log, $OUT/gpu.txt and $OUT/gpu_tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/rollout-bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' \
    | tee -a "$OUT/gpu.txt"
python3 -m flowgrpo.services.bench.rollout --json "$OUT/rollout.json" "$@" 2>&1 | tee "$OUT/rollout.log"
status=$?
python3 -m pytest -q -m gpu -p no:cacheprovider tests/models/test_bagel_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
exit $status
