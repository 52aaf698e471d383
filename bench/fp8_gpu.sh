#!/usr/bin/env bash
# FP8 rollouts against bf16 at the 7B geometry on one GPU (docs/fp8.md), in device calls of
# 10 minutes at most:
#   run(command="SHAPES=512x8,512x32 bash bench/fp8_gpu.sh rollout", carry=[".whl"], timeout_s=600)
#   run(command="SHAPES=1024x8 GAP=0 bash bench/fp8_gpu.sh rollout", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/fp8_gpu.sh system data.prompts_per_step=2", carry=[".whl"], timeout_s=600)
# (measured 2026-12-05: 512 px b8 and b32 without the gap 330 s on an H100, 1024 px b8 with the
# gap 280 s on an H200; the GEMM table and the kernel profiles, added since, take seconds more;
# 2026-12-06: the system at 32 images a step, bf16 then FP8, 489 s on an H100.)
# rollout: `flowgrpo bench fp8` (the bf16 and FP8 matmul peaks; per shape images/s bf16 and FP8,
#   compiled, their ratio and MFU against both peaks; torchao's float8 on the same layers between
#   the two (TORCHAO=0 skips it); ours again with Hopper's fast accumulation, its row and its gap
#   (FAST_ACCUM=0 skips it); the log-prob gap of FP8 samples scored under bf16 per window step
#   against the clip ranges); SHAPES (512x8,512x32,1024x8), GAP (16), GAP_RESOLUTION (512).
# system: the one-GPU system (examples/bagel_pickscore_lora_1gpu.yaml, bench/system_gpu.sh) with
#   bf16 rollouts and with FP8 rollouts, back to back: images/s end to end, each part's MFU and
#   peak memory; LAYERS (28: the whole 7B), STEPS (4, the first a warm-up; the fewest the bench
#   takes), VARIANTS ("bf16 fp8"; at the recipe's 128 images a step one variant fits a 10-minute
#   call: VARIANTS=bf16, then VARIANTS=fp8 on the same machine; fp8-mb1: FP8 rollouts and the
#   trainer at micro-batch 1 without checkpointing). Arguments after `system` go to
#   `flowgrpo bench system` as overrides of both variants: at 32 images a step
#   (`data.prompts_per_step=2`: 2 prompts x 16) both variants fit one call and an 80 GB H100
#   (peaks 75.4 GiB bf16, 70.4 GiB FP8 on 2026-12-06).
# Writes $OUT/fp8.json, $OUT/fp8.log or $OUT/system.json, $OUT/system.log.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: bash bench/fp8_gpu.sh rollout|system [KEY=VALUE ...]}
shift
OUT=${OUT:-/tmp/fp8-bench}
mkdir -p "$OUT"
source bench/gpu_env.sh
case $part in
    rollout)
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
        torchao=(--torchao); [ "${TORCHAO:-1}" = 0 ] && torchao=()
        fast=(--fast-accum); [ "${FAST_ACCUM:-1}" = 0 ] && fast=()
        $PY -m flowgrpo.services.cli bench fp8 --shapes "${SHAPES:-512x8,512x32,1024x8}" "${torchao[@]}" "${fast[@]}" \
            --gap-samples "${GAP:-16}" --gap-resolution "${GAP_RESOLUTION:-512}" --json "$OUT/fp8.json" 2>&1 | tee "$OUT/fp8.log"
        ;;
    system)
        variants=()
        for v in ${VARIANTS:-bf16 fp8}; do  # one a call at 28 layers: a 128-image step takes ~2.5 min
            case $v in
                bf16) variants+=(--variant bf16) ;;
                fp8) variants+=(--variant fp8:rollout.precision=fp8) ;;
                # the trainer's fastest setting alone on an H100 (micro-batch 1, no checkpointing:
                # 5.63 s, 63.7% MFU, 49.5 GiB, against 6.49 s at the recipe's micro-batch 4 with
                # checkpointing, 45.9 GiB; docs/performance.md), beside the FP8 rollout
                fp8-mb1) variants+=(--variant "fp8-mb1:rollout.precision=fp8,trainer.loss.micro_batch_size=1,trainer.activation_checkpointing=false") ;;
                *) echo "VARIANTS: bf16, fp8 and/or fp8-mb1, not $v" >&2; exit 2 ;;
            esac
        done
        OUT=$OUT LAYERS=${LAYERS:-28} bash bench/system_gpu.sh --steps "${STEPS:-4}" "${variants[@]}" "$@"
        ;;
    *) echo "part $part: rollout or system" >&2; exit 2 ;;
esac
