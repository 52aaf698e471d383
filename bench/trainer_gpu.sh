#!/usr/bin/env bash
# Every FlowGRPO trainer figure in ONE device call (flowgrpo.services.bench.trainer; its docstring has the
# FLOP formula):
#  1. one GPU, the 7B with random bf16 weights, LoRA r 64 / alpha 128 on the default gen-path
#     targets, 512px, CFG 4, window 2 of 15 points, 16 trajectories per step, 2 optimizer steps:
#     trajectories/s, the logp_old and update passes and their MFU against the bf16 matmul peak
#     measured in the same run (before and after the timed steps), peak memory, for several
#     micro-batch / activation-checkpointing / autocast variants; the sync-mode rollout/trainer
#     log-prob gap; LoRA publication (gather, the bus put as the service does it, a consumer
#     process taking each version onto its GPU);
#  2. with 2 GPUs or more (kind nvidia-h200-x2): a random checkpoint of the 7B in the published
#     layout, loaded through the trainer's loader (meta device, FSDP2, each rank reads its rows:
#     time, peak host and device memory per rank), full gen-path training, FSDP2 over 2 processes
#     (torchrun): step time, MFU, memory per GPU, full gen-path publication (bf16 on the bus, and
#     the same-host CUDA IPC path, each with a consumer process taking it onto its GPU);
#  0. the CUDA IPC test (tests/bus/test_cuda_ipc.py, marker gpu) when pytest is there.
# Every timed figure: the median of 3 timed steps (publications) after a warm-up, with its range.
# Each LoRA variant also profiles one step (bench.kernels: GEMMs, attention, compiled, optimizer,
# the rest; the kernels' share of the step's time); PROFILE=0 skips it.
# Each algorithm's LoRA step at the 7B geometry (issue #33: trainer MFU and peak memory per method;
# FLOPs from the forwards each step runs, so every algorithm's MFU counts its own work). On an H100
# (2026-12-06) the -nft row took 181 s (its warm-up step alone 106 s), -awm and -dgpo ~50 s each,
# the setup before them ~60 s: five rows do not fit one call. Two calls:
#   PROFILE=0 FULL=0 LORA_DEADLINE=300 bash bench/trainer_gpu.sh --no-publish --variants ac8-compile-nft,ac8-compile-awm,ac8-compile-dgpo
#   PROFILE=0 FULL=0 LORA_DEADLINE=300 bash bench/trainer_gpu.sh --no-publish --variants ac8-compile,ac8-compile-guard
# The step's one prefill against a prefill per micro-batch (the trainer before StepPrompts), at
# the one-GPU recipe's micro-batch 4 and at 2, each profiled (the GPU's busy share), ~5 min:
#   FULL=0 LORA_DEADLINE=400 bash bench/trainer_gpu.sh --no-publish --variants ac4-compile,ac4-compile-microprefill,none2-compile,none2-compile-microprefill
# EXPERIMENT '-fp8' (issue #34 item 5): the frozen base's matmuls of the LoRA step in FP8, forward
# and input gradient (bench.trainer_step.fp8_bases; +2 e4m3 copies of the gen path, ~12 GiB, the
# bf16 weights kept), against the same settings in bf16 in the same call, at the one-GPU recipe's
# micro-batch 4 and at 1 without checkpointing (what might fit beside the rollout on an H100):
#   FULL=0 LORA_DEADLINE=400 bash bench/trainer_gpu.sh --no-publish --variants ac4-compile,ac4-compile-fp8,none1-compile,none1-compile-fp8
# LORA=0 or FULL=0 skips a part (one part per device call keeps each call under 10 minutes);
# LORA_DEADLINE / FULL_DEADLINE (s): what would start later is skipped.
# CKPT_EVERY_STEP=DIR: also what a checkpoint every step costs, synchronous and in the background
# (trainer.async_save), written to DIR/lora and DIR/full (the disk a run's checkpoints go to;
# the full gen path's checkpoint is its fp32 tensors and AdamW moments: ~12 bytes a parameter).
# The bus needs pyzmq, OpenTelemetry and protobuf 7, which the GPU image lacks: carry the wheels
# of bench/fetch_gpu_wheels.sh (.whl). Without them publication is timed up to the host copy.
#   run(command="bash bench/trainer_gpu.sh", carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
# A CPU smoke test of the script (tiny model, gloo): DEVICE=cpu bash bench/trainer_gpu.sh
# Writes $OUT/trainer_lora.json, $OUT/trainer_full_fsdp2.json, their logs and $OUT/gpu.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/trainer-bench}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
LORA_DEADLINE=${LORA_DEADLINE:-300}  # seconds: LoRA variants that would start later are skipped
source bench/gpu_env.sh

if [[ $DEVICE == cuda* ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
    NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
    SMOKE=()
else
    NGPU=2  # gloo processes on the CPU
    SMOKE=(--model tiny --device cpu --dtype fp32 --resolution 64 --batch 4 --group 2 --prompt-len 6
           --reps 3 --publish-reps 3)
fi
$PY -c 'import torch, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, "peft", peft.__version__)' \
    | tee -a "$OUT/gpu.txt"
$PY -c 'import zmq, opentelemetry, google.protobuf as p; print("bus: pyzmq", zmq.__version__, "protobuf", p.__version__)' \
    2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

LORA_SAVE=() FULL_SAVE=()
PROFILE_ARGS=(--profile)  # each LoRA variant: one step's kernels by kind (PROFILE=0: none)
[[ ${PROFILE:-1} == 0 ]] && PROFILE_ARGS=()
if [[ -n ${CKPT_EVERY_STEP:-} ]]; then
    LORA_SAVE=(--checkpoint-every-step "$CKPT_EVERY_STEP/lora")
    FULL_SAVE=(--checkpoint-every-step "$CKPT_EVERY_STEP/full")
fi

status=0
if [[ $DEVICE == cuda* ]] && $PY -c "import pytest" 2>/dev/null; then  # CUDA IPC across two processes
    $PY -m pytest -q -p no:cacheprovider -m gpu tests/bus/test_cuda_ipc.py 2>&1 | tail -3 | tee -a "$OUT/gpu.txt"
fi
if [[ ${LORA:-1} == 1 ]]; then
    $PY -m flowgrpo.services.bench.trainer "${SMOKE[@]}" --deadline-s "$LORA_DEADLINE" --json "$OUT/trainer_lora.json" \
        "${LORA_SAVE[@]}" "${PROFILE_ARGS[@]}" "$@" \
        2>&1 | tee "$OUT/trainer_lora.log"
    status=$?
fi
# FULL_NPROC=1 FULL_LAYERS=N: the full gen path on ONE GPU, the 7B geometry cut to N of its 28
# decoder layers (28 do not fit one H200 with AdamW: ~16 bytes a trained parameter);
# FULL_EXTRA: more options for that run, split on spaces (e.g. "--no-publish")
FULL_NPROC=${FULL_NPROC:-2}
if [[ ${FULL:-1} == 1 && $NGPU -ge $FULL_NPROC && ($FULL_NPROC -ge 2 || -n ${FULL_LAYERS:-}) ]]; then
    if [[ $DEVICE == cuda* ]]; then FULL_ARGS=(--store-gib 48); else FULL_ARGS=("${SMOKE[@]}"); FULL_VARIANTS=ac1-compile; fi
    # a random checkpoint in the published layout, then loaded through the trainer's loader
    CKPT=${CKPT:-/tmp/bagel-random}
    $PY -m flowgrpo.services.bench.trainer "${FULL_ARGS[@]}" --write-checkpoint "$CKPT" ${FULL_LAYERS:+--layers "$FULL_LAYERS"} 2>&1 | tee "$OUT/trainer_full.log"
    timeout -k 10 "${FULL_TIMEOUT:-400}" $PY -m torch.distributed.run --standalone --nproc_per_node "$FULL_NPROC" -m flowgrpo.services.bench.trainer --policy full \
        --variants "${FULL_VARIANTS:-ac4-compile}" --compile --trajectories random --reps 3 --publish-reps 3 \
        --deadline-s "${FULL_DEADLINE:-240}" --checkpoint "$CKPT" "${FULL_ARGS[@]}" "${FULL_SAVE[@]}" ${FULL_EXTRA:-} \
        --json "$OUT/trainer_full_fsdp2.json" 2>&1 | tee -a "$OUT/trainer_full.log"
    status=$((status || $?))
fi
exit $status
