"""LoRA adapters in the standard PEFT folder format, as policy updates.

A PEFT adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``base_model_name_or_path``) and ``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``, where ``<module>`` is the
published BAGEL module name. The trainer saves its checkpoints in this format and
``flowgrpo generate --lora`` reads them; on the bus the same tensors travel without the
``base_model.model.`` prefix.

``peft.PeftModel.from_pretrained(BagelModel, folder)`` loads them too: ``target_modules`` lists
the full name of every adapted module, because peft takes a list entry as a name *suffix*, and
a bare ``down_proj`` would also wrap the und path's ``mlp.down_proj`` (frozen, with no weights
in the file: peft then warns of missing adapter keys).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from flowgrpo.fileio import atomic_output, atomic_write
from flowgrpo.models.bagel.policy import LORA_A, LORA_B, PolicyUpdate, PolicyUpdateError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def load_peft_adapter(folder: str | Path, version: int = 1) -> PolicyUpdate:
    """The adapter of ``folder`` as a LoRA policy update of the given version."""
    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} not found: {folder} is not a PEFT LoRA adapter folder")
    config = json.loads((folder / CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise PolicyUpdateError(f"{folder / CONFIG_FILE}: peft_type {config['peft_type']!r}, expected 'LORA'")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise PolicyUpdateError(
            f"{folder / CONFIG_FILE}: per-module rank_pattern/alpha_pattern is not supported"
        )
    tensors = {}
    for key, tensor in load_file(str(folder / WEIGHTS_FILE)).items():
        name = key.removeprefix(PEFT_PREFIX)
        if not name.endswith((LORA_A, LORA_B)):
            raise PolicyUpdateError(f"{folder / WEIGHTS_FILE}: key {key!r} is not a lora_A/lora_B weight")
        tensors[name] = tensor
    return PolicyUpdate(
        version, "lora", tensors, lora_rank=int(config["r"]), lora_alpha=float(config["lora_alpha"])
    )


def save_peft_adapter(folder: str | Path, update: PolicyUpdate, base_model: str = "") -> Path:
    """Write ``update`` (kind "lora") as a PEFT adapter folder; each file atomically.
    ``base_model``: the BAGEL checkpoint folder the adapter was trained on (peft's
    ``base_model_name_or_path``)."""
    if update.kind != "lora":
        raise PolicyUpdateError(f"only LoRA updates have a PEFT adapter form, not {update.kind!r}")
    folder = Path(folder)
    modules = sorted({n.removesuffix(LORA_A).removesuffix(LORA_B) for n in update.tensors})
    config = {
        "peft_type": "LORA",
        "r": update.lora_rank,
        "lora_alpha": update.lora_alpha,
        "target_modules": modules,  # full names: exactly the adapted modules, nothing else
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
        "task_type": None,
    }
    with atomic_output(folder / WEIGHTS_FILE) as tmp:
        tensors = {PEFT_PREFIX + n: t.detach().cpu().contiguous() for n, t in update.tensors.items()}
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write(folder / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return folder
