"""Source patches the CPU test venv of vLLM-Omni needs (applied by vllm_omni_env.sh, never to a
GPU install). Each patch names what it replaces; a patch whose text is no longer there fails loudly,
so a new vLLM-Omni release cannot silently change what the tests run.

- torchvision from PyPI is a CUDA build beside the CPU torch: its compiled-op registrations fail
  ("operator torchvision::nms does not exist"); vLLM imports torchvision only for transforms.
- BAGEL's pipeline disables autocast on CPU, but its transformer casts to bf16 in places, so fp32
  activations meet bf16 weights; on CPU it runs under bf16 autocast like on a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TORCHVISION = (
    "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n",
    "try:  # patched: the compiled ops need CUDA torch\n"
    "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
    "except Exception:\n    pass\nfrom torchvision import (\n",
)
BAGEL_AUTOCAST = ('enabled=self.device.type != "cpu",', "enabled=True,  # patched: bf16 autocast on CPU too")


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


def main() -> None:
    patch(module_file("torchvision"), *TORCHVISION)
    patch(module_file("vllm_omni.diffusion.models.bagel.pipeline_bagel"), *BAGEL_AUTOCAST, at_least=9)


if __name__ == "__main__":
    main()
