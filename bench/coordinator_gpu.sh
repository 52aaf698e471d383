#!/usr/bin/env bash
# The coordinator's figures on 2 GPUs of one host, in ONE device call: a complete random
# checkpoint of the 7B geometry, then bench/coordinator_2gpu.yaml (LoRA, JPEG reward, rollout on
# cuda:0, trainer on cuda:1, `local` launcher) through `flowgrpo bench schedule`: sync, then async
# with eta = 1. Prints images/s of each and the ratio (target >= 1.5x), the overlap, the time
# per step of each coordinator phase, each service's busy seconds per step (from the traces),
# each the median (min-max) over the steps after the first (the warm-up), the largest
# rollout/trainer log-prob gap, and each GPU's peak memory in use.
#   run(command="bash bench/coordinator_gpu.sh", carry=[".whl"], kind="nvidia-h200-x2", timeout_s=600)
# (.whl: bench/fetch_gpu_wheels.sh.) A CPU smoke test of the script (tiny model, 64 px):
#   DEVICE=cpu bash bench/coordinator_gpu.sh
# Writes $OUT/schedule.json (every step's metrics), $OUT/schedule.log, the services' logs and $OUT/gpu.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/coordinator-bench}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
source bench/gpu_env.sh
CKPT=${CKPT:-/tmp/bagel-7b-random}
if [[ $DEVICE == cuda* ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    MODEL=(--model 7b --device cuda --dtype bf16)
    SMOKE=()
else
    MODEL=(--model tiny --device cpu --dtype fp32)
    SMOKE=(sampling.resolution=64 sampling.num_points=6 sampling.window_range=[0,2] rollout.device=cpu
           rollout.dtype=float32 launch.rollout_devices=[cpu] trainer.device=cpu trainer.dtype=float32
           trainer.publish_cuda_ipc=false schedule.steps=4)
fi
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
[[ -f $CKPT/ema.safetensors ]] || $PY -m flowgrpo.services.bench.trainer "${MODEL[@]}" --write-checkpoint "$CKPT" 2>&1 | tee "$OUT/checkpoint.log"
rm -rf /tmp/coordinator-runs
if [[ $DEVICE == cuda* ]]; then  # each GPU's memory in use, once a second, for the peaks
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 1000 > "$OUT/gpu_mem.csv" &
    SAMPLER=$!
fi
$PY -m flowgrpo.services.cli bench schedule --recipe bench/coordinator_2gpu.yaml --steps 0 --progress --keep /tmp/coordinator-runs \
    --json "$OUT/schedule.json" model.checkpoint="$CKPT" "${SMOKE[@]}" "$@" 2>&1 | tee "$OUT/schedule.log"
status=$?
if [[ -n ${SAMPLER:-} ]]; then
    kill "$SAMPLER"
    awk -F', ' '{if ($2 > peak[$1]) peak[$1] = $2} END {for (g in peak) printf "GPU %s peak memory in use: %.1f GiB\n", g, peak[g] / 1024}' \
        "$OUT/gpu_mem.csv" | sort | tee -a "$OUT/schedule.log"
fi
for mode in sync async; do  # the services' logs, for a failed or slow run
    for f in /tmp/coordinator-runs/$mode/logs/*.log; do [[ -f $f ]] && tail -40 "$f" > "$OUT/$mode-$(basename "$f")"; done
done
exit $status
