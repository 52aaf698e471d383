#!/usr/bin/env bash
# The whole system against its FLOP limit on one GPU, in ONE device call: a random checkpoint of
# the 7B geometry (written once to .ckpt/ in the checkout, so a warm machine keeps it between
# calls), then `flowgrpo bench system` on a recipe (default examples/bagel_pickscore_lora_1gpu.yaml:
# rollout, trainer and reward on one GPU, sync schedule), once per --variant. Prints, per variant,
# the limit (measured bf16 matmul peak / FLOPs per image) and the breakdown of those FLOPs, the
# achieved images/s and achieved / limit, each step's time split (rollout, reward, logp_old,
# update, weight publication, idle) and the MFU of rollout, trainer and the whole, each the median
# (min-max) over the steps after the first (the warm-up), and each GPU's peak memory in use.
#   run(command="bash bench/system_gpu.sh --variant shared --variant copied:trainer.share_base=false,rollout.base_weights=checkpoint",
#       carry=[".whl"], kind="nvidia-h200", timeout_s=600)
# (.whl: bench/fetch_gpu_wheels.sh.) Arguments go to `flowgrpo bench system` (--variant, --steps,
# --recipe, KEY=VALUE overrides of every variant). A CPU smoke test of the script (tiny model,
# the demo recipe, 64 px): DEVICE=cpu bash bench/system_gpu.sh --variant base --variant lr0:trainer.optim.lr=0
# Writes $OUT/system.json, $OUT/system.log, $OUT/gpu.txt, $OUT/checkpoint.log and the last lines of
# each service's log ($OUT/logs.tgz: <variant>-<service>.log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/system-bench}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
source bench/gpu_env.sh
RUNS=/tmp/system-runs
if [[ $DEVICE == cuda* ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    LAYERS=${LAYERS:-28}  # of the 7B geometry's 28 (fewer: the same code paths, faster; bench/gpu_check.sh)
    CKPT=${CKPT:-$PWD/.ckpt/bagel-7b-random$([[ $LAYERS == 28 ]] || echo "-${LAYERS}l")}
    RECIPE=${RECIPE:-examples/bagel_pickscore_lora_1gpu.yaml}
    MODEL=(--model 7b --layers "$LAYERS" --device cuda --dtype bf16)
    # PickScore's geometry (CLIP ViT-H/14) with random weights when no local PickScore is given,
    # and the repository's prompts (the recipe names a prepared dataset)
    CLIP=${CLIP:-$PWD/.ckpt/clip-vit-h-14-random}
    [[ -f $CLIP/config.json ]] || $PY -c "import sys; from flowgrpo.rewards.tiny_clip import VIT_H_14, make_tiny_clip; make_tiny_clip(sys.argv[1], geometry=VIT_H_14)" "$CLIP"
    SMOKE=(data.prompts="$PWD/examples/data/tiny" data.kind=pickscore reward.pickscore.model="$CLIP" reward.pickscore.processor="$CLIP" data.val_prompts=0)
else
    CKPT=${CKPT:-$PWD/.ckpt/bagel-tiny-random}
    RECIPE=${RECIPE:-examples/tiny_demo.yaml}
    MODEL=(--model tiny --device cpu --dtype fp32)
    SMOKE=(--device cpu --launcher inprocess --steps 4 data.group_size=4 data.prompts_per_step=1 data.val_prompts=0
           sampling.num_points=4 "sampling.window_range=[0, 3]" trainer.loss.micro_batch_size=4 trainer.loss.mini_batches=1)
fi
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
[[ -f $CKPT/ema.safetensors ]] || $PY -m flowgrpo.services.bench.trainer "${MODEL[@]}" --write-checkpoint "$CKPT" 2>&1 | tee "$OUT/checkpoint.log"
rm -rf "$RUNS"
$PY -m flowgrpo.services.cli bench system --recipe "$RECIPE" --progress --keep "$RUNS" --json "$OUT/system.json" \
    model.checkpoint="$CKPT" "${SMOKE[@]}" "$@" 2>&1 | tee "$OUT/system.log"
status=$?
# the last lines of the services' logs, for a failed or slow run, in one file: a device call
# returns 8 files, and one file a log took system.json's place (2026-12-06)
tails=$(mktemp -d)
for log in "$RUNS"/*/logs/*.log; do
    [[ -f $log ]] && tail -40 "$log" > "$tails/$(basename "$(dirname "$(dirname "$log")")")-$(basename "$log")"
done
tar czf "$OUT/logs.tgz" -C "$tails" . && rm -rf "$tails"
exit $status
