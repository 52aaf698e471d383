#!/usr/bin/env bash
# The compose base model on one GPU, in ONE device call: the untrained tiny drawer, the rendered
# training pairs, then `flowgrpo sft examples/sft_compose.yaml` for each VARIANT at once (one
# process each on the same GPU: the tiny model leaves it mostly idle), evaluated on the held-out
# combinations every EVAL_EVERY steps and checkpointed as often. The chosen variant's model is
# written at the evaluated step whose held-out accuracy is nearest TARGET (the issue asks for a
# base that is good but imperfect: 20-60%), by the same command with steps=N (sft takes the
# checkpoint of step N: every draw depends on the step alone).
#   run(command="bash bench/sft_compose_gpu.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=600)
# Outputs under OUT (default /tmp/sft-compose): <variant>/metrics.jsonl and eval grids, choice.json,
# the chosen base (published layout) in MODEL_OUT (default OUT/model); a summary line last.
# Environment: OUT, MODEL_OUT, STEPS (4000), EVAL_EVERY (250), TARGET (0.4), GEOMETRY (the drawer's:
# tiny or 300m, make-tiny-bagel --drawer-size), SIZE (64: the pairs' and the training images' side
# in px, a multiple of 16), VARIANTS (name:overrides;...; an
# override unmentioned=S trains on pairs of which the share S hold a blob their prompt does not
# name: data compose-images --unmentioned S), LIMIT_S (480: each variant's sft is stopped then, its
# curve kept), DEVICE (cuda; cpu to try the script here with a few STEPS), RESUME (1: keep the
# work folder of an earlier call on this machine, so each variant goes on from its last
# checkpoint: a run longer than one call), BF16 (0: fp32 throughout, no TF32, a GPU curve a CPU
# run repeats; 1: fp32 weights and optimizer, the forwards and backwards under bf16 autocast,
# sft's autocast_bf16: the recipe trains every weight, so none may be bf16).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sft-compose}
STEPS=${STEPS:-4000}
EVAL_EVERY=${EVAL_EVERY:-250}
TARGET=${TARGET:-0.4}
GEOMETRY=${GEOMETRY:-tiny}
SIZE=${SIZE:-64}
MODEL_OUT=${MODEL_OUT:-$OUT/model}
VARIANTS=${VARIANTS:-"recipe:;b256:batch_size=256 micro_batch_size=256;lr3e-4:optim.lr=3e-4"}
mkdir -p "$OUT"
source bench/gpu_env.sh
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
WORK=/tmp/sft-compose-work
[[ ${RESUME:-0} == 1 ]] || rm -rf "$WORK"
mkdir -p "$WORK"
started=$SECONDS
$PY -c 'import torch, scipy; print("torch", torch.__version__,
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "scipy", scipy.__version__)' \
    | tee "$OUT/env.txt"
[[ -f $WORK/drawer/ema.safetensors ]] || $PY -m flowgrpo.services.cli make-tiny-bagel "$WORK/drawer" \
    --drawer examples/data/compose/train.txt --drawer-size "$GEOMETRY" || exit 1
# the pairs of one share of unmentioned blobs (made once, shared by the variants that ask for it)
pairs_of() {
    local dir="$WORK/pairs-$1"
    [ -d "$dir" ] || $PY -m flowgrpo.services.cli data compose-images "$dir" --layouts 32 --size "$SIZE" --unmentioned "$1" >&2 || return 1
    echo "$dir"
}
# a variant's sft overrides, with unmentioned=S turned into data.images of those pairs
variant_args() {
    local share=0 args=()
    for word in $1; do
        case $word in unmentioned=*) share=${word#unmentioned=} ;; *) args+=("$word") ;; esac
    done
    echo "data.images=$(pairs_of "$share")" "${args[@]}"
}

common=("device=${DEVICE:-cuda}" dtype=float32 "autocast_bf16=$([[ ${BF16:-0} == 1 ]] && echo true || echo false)" "model=$WORK/drawer" "steps=$STEPS" "data.resolution=$SIZE"
        "eval.every=$EVAL_EVERY" "save_every=$EVAL_EVERY" keep_last=1000 log_every=50)
declare -A pids
IFS=';' read -ra specs <<< "$VARIANTS"
for spec in "${specs[@]}"; do
    name=${spec%%:*}
    read -ra extra <<< "$(variant_args "${spec#*:}")" || exit 1
    mkdir -p "$OUT/$name"
    timeout "${LIMIT_S:-480}" $PY -m flowgrpo.services.cli sft examples/sft_compose.yaml "${common[@]}" \
        "run_dir=$WORK/$name" "${extra[@]}" > "$OUT/$name/sft.log" 2>&1 &
    pids[$name]=$!
done
for name in "${!pids[@]}"; do
    wait "${pids[$name]}"; code=$?
    echo "$name: exit $code after $((SECONDS - started)) s" | tee -a "$OUT/status.txt"
    # a refusal or a crash (124: stopped at LIMIT_S, the curve kept): its own last line
    ((code == 0 || code == 124)) || echo "  $(tail -n 1 "$OUT/$name/sft.log")" | tee -a "$OUT/status.txt"
    cp "$WORK/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
    cp -r "$WORK/$name/eval" "$OUT/$name/" 2>/dev/null
done

# the variant and step: held-out accuracy nearest TARGET (ties: the later step)
$PY - "$OUT" "$TARGET" "${specs[@]}" > "$OUT/choice.json" <<'EOF' || exit 1
import json, sys
out, target, specs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
best = None
for spec in specs:
    name = spec.split(":")[0]
    try:
        rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    except OSError:
        continue
    for r in rows:
        if "eval/compose/accuracy/mean" in r and r["step"] > 0:
            key = (abs(r["eval/compose/accuracy/mean"] - target), -r["step"])
            if best is None or key < best[0]:
                best = (key, name, spec.partition(":")[2], r)
if best is None:
    sys.exit(f"no variant was evaluated after step 0 (see {out}/*/sft.log): EVAL_EVERY too large for LIMIT_S?")
_, name, extra, row = best
print(json.dumps({"variant": name, "overrides": extra, "step": row["step"], "eval": row}, indent=1))
EOF
name=$($PY -c "import json,sys; print(json.load(open('$OUT/choice.json'))['variant'])")
step=$($PY -c "import json,sys; print(json.load(open('$OUT/choice.json'))['step'])")
extra=$($PY -c "import json,sys; print(json.load(open('$OUT/choice.json'))['overrides'])")
read -ra extra <<< "$(variant_args "$extra")"
$PY -m flowgrpo.services.cli sft examples/sft_compose.yaml "${common[@]}" "run_dir=$WORK/$name" "${extra[@]}" \
    "steps=$step" > "$OUT/export.log" 2>&1 || { tail "$OUT/export.log"; exit 1; }
rm -rf "$MODEL_OUT" && mkdir -p "$(dirname "$MODEL_OUT")" && cp -r "$WORK/$name/model" "$MODEL_OUT"
$PY - "$OUT" "$((SECONDS - started))" <<'EOF'
import json, sys
out, seconds = sys.argv[1], sys.argv[2]
c = json.load(open(f"{out}/choice.json"))
acc = {k.split("/")[-2]: round(v, 3) for k, v in c["eval"].items() if k.startswith("eval/compose/accuracy/") and k.count("/") == 4}
print(f"SFT COMPOSE: variant {c['variant']} step {c['step']}: held-out accuracy "
      f"{c['eval']['eval/compose/accuracy/mean']:.3f} {acc} in {seconds} s")
EOF
