#!/usr/bin/env bash
# The prompt-following task at a size where the GPU matters, in device calls on one warm machine
# (the model stays in .ckpt/ between them; a machine is warm 30 s after a call), either each stage
# in its own call:
#   run(command="bash bench/compose_scale_gpu.sh sft", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/compose_scale_gpu.sh rl", carry=[".whl"], timeout_s=600)
# or both in the background, followed by calls that wait (outputs packed in results.tgz):
#   run(command="bash bench/compose_scale_gpu.sh start", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/compose_scale_gpu.sh wait", timeout_s=600)   # until it prints its exit
# (the GPU check can run beside it in the first call, the environment laid out once for both:
#   "source bench/gpu_env.sh; WAIT_S=1 bash bench/compose_scale_gpu.sh start; COMMIT=... bash bench/gpu_check.sh")
# sft: the 306M-parameter drawer in BAGEL's layout (make-tiny-bagel --drawer-size 300m: 10 layers of
#   1024, the cell codec, the task's tokenizer) taught to draw SIZE px pairs by `flowgrpo sft`
#   (bench/sft_compose_gpu.sh: batch 256 at lr 1e-3, the better of the two variants measured,
#   fp32 weights under bf16 autocast on a GPU (BF16=1 there); evaluated on the held-out
#   combinations every EVAL_EVERY steps); the step nearest TARGET held-out accuracy is
#   kept in MODEL. RESUME=1 in a further call on the same warm machine goes on from each
#   variant's last checkpoint (the rl stage's: keeps the runs that finished).
# rl: `flowgrpo bench algos` on that model through the real services (launcher local: the
#   coordinator, rollout, trainer and reward processes; rollout and trainer on the one GPU, the
#   base shared and the LoRA published by CUDA IPC, as examples/bagel_pickscore_lora_1gpu.yaml),
#   FlowGRPO (examples/tiny_compose.yaml's recipe), GRPO-Guard at the recipe's rate and at the
#   rate a LoRA needed on the tiny task (grpo_guard_lr5e-4), against AWM (the frontier table's
#   best), 3 seeds, each run paired with its lr = 0 control: held-out accuracy against images
#   and GPU seconds (docs/algorithms.md, "3 seeds from the batch-256 base").
# Outputs under OUT (/tmp/compose-scale): sft/ (the curve, choice.json), algos.json, algos.png,
# algos.log; a summary line last. Environment: OUT, MODEL (.ckpt/compose-300m), SIZE (128),
# STEPS (3000), EVAL_EVERY (125), TARGET (0.4), SFT_LIMIT_S (270), BF16 (1 on a GPU),
# VARIANTS, RESUME (0), IMAGES (3840: each algorithm's
# budget), EVAL_IMAGES (640), ALGORITHMS ("flow_grpo_branch grpo_guard grpo_guard_lr5e-4 awm"),
# REFERENCE (flow_grpo_branch: whose final gain is the target), SEEDS ("0 1 2"; with RESUME=1 a
# further rl call adds seeds or algorithms and keeps the finished runs), JOBS (12: runs at once on
# the GPU, which one 300M run leaves mostly idle; 12 took 407 s on an H100 80GB),
# DEVICE (cuda; cpu: a smoke test of the plumbing here with the tiny drawer, 64 px and a few steps).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: bash bench/compose_scale_gpu.sh sft|rl|start|wait}
OUT=${OUT:-/tmp/compose-scale}
MODEL=${MODEL:-$PWD/.ckpt/compose-300m}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-128}
mkdir -p "$OUT"
started=$SECONDS

if [[ $stage == start || $stage == wait ]]; then
    # start: both stages one after the other in a new process session, which outlives this call (a
    # lent machine ends what a call leaves running in its own session only), then wait as below.
    # wait: until that pipeline ends or WAIT_S (540) pass; then its outputs, packed, to OUT. A
    # further `wait` call on the same warm machine follows it on: no stage is bound to one call's
    # 10 minutes, and nothing idles between the stages.
    BG=/tmp/compose-scale-bg
    if [[ $stage == start ]]; then
        rm -rf "$BG" && mkdir -p "$BG"
        setsid env OUT="$BG/out" bash -c 'bash bench/compose_scale_gpu.sh sft && bash bench/compose_scale_gpu.sh rl
            echo $? > '"$BG/done" > "$BG/pipeline.log" 2>&1 < /dev/null &
    fi
    [[ -d $BG ]] || { echo "no pipeline on this machine: call start first" >&2; exit 1; }
    deadline=$((SECONDS + ${WAIT_S:-540}))
    while [[ ! -f $BG/done ]] && ((SECONDS < deadline)); do
        sleep 15
        ((SECONDS % 120 < 15)) && echo "[$((SECONDS - started)) s] $(tail -n 1 "$BG/pipeline.log")"
    done
    tail -n 40 "$BG/pipeline.log"
    # each variant's validation grids are ~4 MB at 128 px: the last of each travels (16 MiB a file)
    last_grids=$(cd "$BG" && for d in out/sft/*/eval; do ls "$d"/*.png 2>/dev/null | sort | tail -n 1; done)
    tar cf /tmp/compose-scale-results.tar -C "$BG" --exclude='*.safetensors' --exclude='*.png' pipeline.log out
    [[ -z $last_grids ]] || tar rf /tmp/compose-scale-results.tar -C "$BG" $last_grids
    # the rl runs so far (their metrics and logs: an unfinished rl stage has not packed them yet)
    runs=$(cd /tmp && find compose-scale-runs \( -name metrics.jsonl -o -name '*.log' \) 2>/dev/null)
    [[ -z $runs ]] || tar rf /tmp/compose-scale-results.tar -C /tmp $runs
    gzip -c /tmp/compose-scale-results.tar > "$OUT/results.tgz"
    cp "$BG"/out/algos.json "$BG"/out/algos.png "$BG"/out/sft/choice.json "$OUT/" 2>/dev/null
    if [[ -f $BG/done ]]; then
        echo "COMPOSE SCALE: pipeline exit $(cat "$BG/done") after $((SECONDS - started)) s"
        exit "$(cat "$BG/done")"
    fi
    echo "COMPOSE SCALE: still running after $((SECONDS - started)) s: call wait again on this machine"
    exit 3
fi
# after start/wait, which import nothing: a wait must not lay out /tmp/fgsrc again under a
# pipeline that may run from it
source bench/gpu_env.sh
if [[ $stage == sft ]]; then
    # in fp32 (no TF32) on an H200, two variants at once: 0.29-0.32 s a step of 64, 800 steps in
    # 330 s, 0.4-1.8% held out (2026-12-06). Under bf16 autocast on an H100, the GPU check beside
    # them: a step of 64 0.25 s (median), of 256 0.35 s; 22.8% at step 1,250 of 64, 63.6% at step
    # 750 of 256 (2026-12-07, docs/algorithms.md); alone on the GPU, 0.19 s a step of 256: 60.1% at
    # step 625 and 63.6% at step 750 inside 270 s
    [[ $DEVICE == cuda* ]] && bf16=1 || bf16=0
    OUT="$OUT/sft" MODEL_OUT="$MODEL" GEOMETRY=${GEOMETRY:-300m} SIZE=$SIZE STEPS=${STEPS:-3000} \
        EVAL_EVERY=${EVAL_EVERY:-125} TARGET=${TARGET:-0.4} LIMIT_S=${SFT_LIMIT_S:-270} BF16=${BF16:-$bf16} \
        VARIANTS=${VARIANTS:-"b256:batch_size=256 micro_batch_size=256 optim.lr=1e-3"} \
        RESUME=${RESUME:-0} DEVICE=$DEVICE bash bench/sft_compose_gpu.sh
    exit $?
fi
[[ $stage == rl ]] || { echo "stage $stage: sft, rl, start or wait" >&2; exit 2; }
[[ -f $MODEL/ema.safetensors ]] || { echo "no model at $MODEL: run the sft stage first (same warm machine)" >&2; exit 1; }
# RESUME=1 (a further call on the same warm machine): the finished runs are kept, and run no more
[[ ${RESUME:-0} == 1 ]] || rm -rf /tmp/compose-scale-runs
if [[ $DEVICE == cuda* ]]; then
    # the one-GPU system's placement and precision (examples/bagel_pickscore_lora_1gpu.yaml)
    PLACE=(rollout.device=cuda:0 rollout.dtype=bfloat16 rollout.lora_mode=merge rollout.max_batch_samples=64
           rollout.base_weights=trainer trainer.device=cuda:0 trainer.dtype=bfloat16 trainer.share_base=true
           trainer.publish_cuda_ipc=true trainer.publish_bus=false)
else
    PLACE=()
fi
algorithms=(${ALGORITHMS:-flow_grpo_branch grpo_guard grpo_guard_lr5e-4 awm})
# LoRA as BAGEL-7B is trained (rank 64, alpha 128), each recipe's own loss and lr (grpo_guard_lr5e-4:
# the rate measured for a LoRA on the tiny task); every run through the real services
$PY -m flowgrpo.services.cli bench algos --algorithms "${algorithms[@]}" --seeds ${SEEDS:-0 1 2} \
    --images "${IMAGES:-3840}" --eval-images "${EVAL_IMAGES:-640}" --jobs "${JOBS:-12}" \
    --reference "${REFERENCE:-flow_grpo_branch}" \
    --keep /tmp/compose-scale-runs --json "$OUT/algos.json" --plot "$OUT/algos.png" \
    model.checkpoint="$MODEL" sampling.resolution="$SIZE" launch.launcher=local trainer.policy.kind=lora \
    "${PLACE[@]}" 2>&1 | tee "$OUT/algos.log"
status=$?
# the services' logs, for a failed or slow run (one file: a call brings back 8)
tar czf "$OUT/logs.tgz" -C /tmp/compose-scale-runs $(cd /tmp/compose-scale-runs 2>/dev/null && ls -d */logs 2>/dev/null) 2>/dev/null
echo "COMPOSE SCALE rl: exit $status in $((SECONDS - started)) s"
exit $status
