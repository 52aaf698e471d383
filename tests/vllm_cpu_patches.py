"""Source patches the opt-in CPU test venvs of vLLM and vLLM-Omni need, by name:

    python tests/vllm_cpu_patches.py torchvision bagel_autocast

Applied by tests/rewards/vllm_env.sh and tests/rollout/vllm_omni_env.sh, never to a GPU install.
Each patch names the text it replaces; a patch whose text is no longer there fails loudly, so a new
release cannot silently change what the tests run. Applying one twice changes nothing.

- ``torchvision``: PyPI's torchvision is a CUDA build beside the CPU torch: its compiled-op
  registrations fail ("operator torchvision::nms does not exist"); vLLM imports torchvision only
  for its pure-Python transforms, so those registrations are made optional.
- ``bagel_autocast``: vLLM-Omni's BAGEL pipeline disables autocast on CPU, but its transformer casts
  to bf16 in places, so fp32 activations meet bf16 weights; on CPU it runs under bf16 autocast, as
  on a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PATCHES = {  # name: (module, old text, new text, least number of occurrences)
    "torchvision": (
        "torchvision",
        "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n",
        "try:  # patched: the compiled ops need CUDA torch\n"
        "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
        "except Exception:\n    pass\nfrom torchvision import (\n",
        1,
    ),
    "bagel_autocast": (
        "vllm_omni.diffusion.models.bagel.pipeline_bagel",
        'enabled=self.device.type != "cpu",',
        "enabled=True,  # patched: bf16 autocast on CPU too",
        9,
    ),
}


def module_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{name} is not installed in {sys.prefix}")
    return Path(spec.origin)


def patch(path: Path, old: str, new: str, *, at_least: int = 1) -> None:
    text = path.read_text()
    if new in text and old not in text:
        return  # applied before
    found = text.count(old)
    if found < at_least:
        raise SystemExit(f"{path}: expected {at_least}+ occurrences of {old!r}, found {found}")
    path.write_text(text.replace(old, new))
    print(f"patched {path} ({found}x)")


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(PATCHES))
    if unknown or not names:
        raise SystemExit(f"usage: vllm_cpu_patches.py NAME...; unknown {unknown}, known {sorted(PATCHES)}")
    for name in names:
        module, old, new, at_least = PATCHES[name]
        patch(module_file(module), old, new, at_least=at_least)


if __name__ == "__main__":
    main(sys.argv[1:])
