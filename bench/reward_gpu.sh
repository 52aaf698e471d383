#!/usr/bin/env bash
# PickScore in the real CLIP-H geometry with random weights on one H200: images/s, in one device call.
#
# The geometry is PickScore_v1's (a fine-tuned laion CLIP-ViT-H-14): vision ViT-H/14 at 224 px,
# 32 layers x 1280 wide, 16 heads, MLP 5120; text 24 layers x 1024 wide, 16 heads, 77 tokens;
# projection 1024 (~986M parameters). Two rows per dtype: "pickscore" includes the processor's
# CPU preprocessing of 512 px images (PIL resize + crop, one thread), "pickscore_model" is the
# model alone on preprocessed pixels and tokens.
#
# Nothing to carry: the GPU image has python3 3.12 with torch, transformers, pillow and numpy,
# and flowgrpo.rewards imports nothing else for PickScore. Every figure: the median of 3 timed
# runs after a warm-up, with its range (the JSON: one row per scorer). From the repository root:
#   run(command="bash bench/reward_gpu.sh", timeout_s=600)
# On this CPU machine, a quick check of the script itself:
#   DEVICE=cpu IMAGES=4 BATCH=2 DTYPES=float32 bash bench/reward_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
DEVICE=${DEVICE:-cuda}
IMAGES=${IMAGES:-512}
BATCH=${BATCH:-64}
DTYPES=${DTYPES:-bfloat16 float32}

if [[ $DEVICE == cuda* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
for dtype in $DTYPES; do
    json=()
    if [[ -n ${OUT:-} ]]; then json=(--json "$OUT/reward_gpu_$dtype.json"); fi
    $PY -m flowgrpo.services.bench.reward --scorers pickscore --pickscore-geometry vit-h-14 --device "$DEVICE" \
        --dtype "$dtype" --images "$IMAGES" --batch-size "$BATCH" --repeats 3 "${json[@]}"
done
