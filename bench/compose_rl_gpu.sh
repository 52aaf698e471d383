#!/usr/bin/env bash
# FlowGRPO (or any recipe variant) on the compose task, many runs at once on the lent GPU
# machine's CPU cores (16: the tiny drawer trains on the CPU as in the demo, THREADS cores a run),
# in ONE device call: every run's metrics.jsonl and its validation accuracy per category.
#   run(command="bash bench/compose_rl_gpu.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=600)
# Measured (2026-12-04, docs/LOG.md): 8 runs at 2 threads each went ~20 s a step (3-4x a run on 2
# quiet cores here), 20-23 steps in 480 s: give it 4 runs or fewer. The same run gave the same
# validation here and there (the runs are functions of their seeds). Carry .whl without its scipy
# wheel where the tree is near the 64 MiB limit: the H200 host has scipy.
# Environment: OUT (/tmp/compose-rl), RECIPE (examples/tiny_compose.yaml), STEPS (60), EVAL_EVERY (20),
# LIMIT_S (500: a run is stopped then, its metrics kept), THREADS (2), COMMON (overrides of every
# run), RUNS ("name:override override;name2:..."; the first is usually the recipe as it is).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/compose-rl}
RECIPE=${RECIPE:-examples/tiny_compose.yaml}
RUNS=${RUNS:-"recipe:"}
mkdir -p "$OUT"
source bench/gpu_env.sh
export OMP_NUM_THREADS=${THREADS:-2} MKL_NUM_THREADS=${THREADS:-2} CUDA_VISIBLE_DEVICES=""
WORK=/tmp/compose-rl-work
rm -rf "$WORK" && mkdir -p "$WORK"
started=$SECONDS
declare -A pids
IFS=';' read -ra specs <<< "$RUNS"
for spec in "${specs[@]}"; do
    name=${spec%%:*}
    read -ra extra <<< "${COMMON:-} ${spec#*:}"
    mkdir -p "$OUT/$name"
    timeout "${LIMIT_S:-500}" $PY -m flowgrpo.services.cli train "$RECIPE" "run_dir=$WORK/$name" \
        launch.launcher=inprocess "schedule.steps=${STEPS:-60}" "schedule.eval_every=${EVAL_EVERY:-20}" \
        logger.progress=lines "${extra[@]}" > "$OUT/$name/train.log" 2>&1 &
    pids[$name]=$!
done
for name in "${!pids[@]}"; do
    wait "${pids[$name]}"; echo "$name: exit $? after $((SECONDS - started)) s" >> "$OUT/status.txt"
    cp "$WORK/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
done
cat "$OUT/status.txt"
$PY - "$OUT" "${specs[@]}" <<'PY'
import json, sys
out, specs = sys.argv[1], sys.argv[2:]
cats = ["single", "two_object", "counting", "position", "relation", "attribution"]
for spec in specs:
    name = spec.split(":")[0]
    try:
        rows = [json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl")]
    except OSError:
        print(f"{name}: no metrics"); continue
    vals = [r for r in rows if "val-aux/compose/accuracy/mean@1" in r]
    steps = [r for r in rows if "critic/score/compose/accuracy/mean" in r]
    line = " ".join(f"{r['step']}:{r['val-aux/compose/accuracy/mean@1']:.3f}" for r in vals)
    last = vals[-1] if vals else {}
    per = " ".join(f"{c[:4]} {last.get(f'val-aux/compose/accuracy/{c}/mean@1', float('nan')):.2f}" for c in cats)
    ne = last.get("val-aux/compose/met/nothing_else/mean@1", float("nan"))
    train = [r["critic/score/compose/accuracy/mean"] for r in steps]
    tr = f"train {sum(train[:5]) / max(len(train[:5]), 1):.3f}->{sum(train[-5:]) / max(len(train[-5:]), 1):.3f}" if train else ""
    print(f"{name}: {len(steps)} steps; val {line}; last: {per} ne {ne:.2f}; {tr}")
PY
