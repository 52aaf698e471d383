#!/usr/bin/env bash
# Make examples/models/compose-base, the tiny BAGEL that has learnt to draw the compose task's
# prompts (docs/compose_task.md), from nothing, with the project's own commands (about 5 minutes
# on 2 quiet CPU cores; the committed model: 36.4% held-out accuracy at step 1,500):
#   1. the untrained tiny drawer (random weights of seed 0, the cell codec, a tokenizer of the
#      training prompts): flowgrpo make-tiny-bagel --drawer;
#   2. 32 rendered layouts of every training prompt (7,776 pairs): flowgrpo data compose-images;
#   3. flowgrpo sft examples/sft_compose.yaml for STEPS steps (1,500), evaluated on the held-out
#      combinations every 250 steps.
# Then the model folder (published layout), the training curve and evaluations (sft_metrics.jsonl)
# and provenance.json (the command, the digests of what went in and came out) are copied into
# examples/models/compose-base. tests/trainer/test_compose_base.py checks that a short run of the
# same command reproduces the start of the committed curve and the committed accuracy.
#   bash examples/models/make_compose_base.sh            # WORK=/tmp/compose-base STEPS=...
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/compose-base}
STEPS=${STEPS:-1500}
OUT=examples/models/compose-base
FLOWGRPO=${FLOWGRPO:-flowgrpo}
mkdir -p "$WORK"
[ -d "$WORK/drawer" ] || $FLOWGRPO make-tiny-bagel "$WORK/drawer" --drawer examples/data/compose/train.txt
[ -d "$WORK/pairs" ] || $FLOWGRPO data compose-images "$WORK/pairs" --layouts 32
$FLOWGRPO sft examples/sft_compose.yaml "run_dir=$WORK/run" "model=$WORK/drawer" "data.images=$WORK/pairs" \
    "steps=$STEPS" keep_last=1000
rm -rf "$OUT" && mkdir -p "$OUT"
cp "$WORK/run/model/"* "$OUT/"
python3 - "$WORK" "$OUT" "$STEPS" <<'PY'
import hashlib, json, sys
from pathlib import Path
work, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
rows = [r for r in rows if r["step"] <= steps]
(out / "sft_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
pairs = hashlib.sha256()
for line in (work / "pairs" / "metadata.jsonl").read_text().splitlines():
    pairs.update(line.encode())
    pairs.update((work / "pairs" / json.loads(line)["file_name"]).read_bytes())
evaluation = [r for r in rows if "eval/compose/accuracy/mean" in r][-1]
provenance = {
    "command": f"bash examples/models/make_compose_base.sh (STEPS={steps})",
    "steps": steps,
    "untrained_ema_sha256": sha(work / "drawer" / "ema.safetensors"),
    "pairs_sha256": pairs.hexdigest(),
    "files_sha256": {p.name: sha(p) for p in sorted(out.iterdir()) if p.name.endswith(".safetensors")},
    "held_out": {k.removeprefix("eval/"): v for k, v in evaluation.items() if k.startswith("eval/compose/accuracy")},
}
(out / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
print(json.dumps(provenance["held_out"], indent=1))
PY
echo "wrote $OUT"
