"""The policy being trained: LoRA adapters (through ``peft``) on the gen path, or every gen-path
(``moe_gen``) parameter, with the und path frozen either way (SPEC section 3).

Trainable parameters are fp32 (master weights and optimizer state); the frozen weights stay in
the load dtype. ``published`` gives what changed, in the policy-update naming that rollouts
load; ``reference()`` runs a forward with the reference policy for the KL term (adapters
disabled for LoRA, a frozen copy of the gen path for full training).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import Tensor, nn

from flowgrpo.models.bagel.config import is_gen_path
from flowgrpo.models.bagel.policy import LORA_A, LORA_B
from flowgrpo.services.trainer.config import PolicyConfig
from flowgrpo.services.trainer.distributed import full_tensor, shard_like

ADAPTER = "default"


class TrainablePolicy:
    """Wraps a loaded BAGEL model: marks what trains, names what is published."""

    def __init__(self, model: nn.Module, config: PolicyConfig) -> None:
        self.config = config
        self.kind = config.kind
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = _add_lora(model, config) if config.kind == "lora" else _unfreeze_gen_path(model)
        self._reference: dict[str, Tensor] = {}
        if config.kind == "full":  # the KL reference: the gen path as loaded
            self._reference = {n: p.detach().clone() for n, p in self.trainable().items()}

    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def published(self) -> dict[str, Tensor]:
        """The trainable tensors under their published names (LoRA: ``<module>.lora_A.weight``)."""
        full = {n: full_tensor(p.detach()) for n, p in self.trainable().items()}  # gathers shards
        if self.kind == "full":
            return full
        return {lora_published_name(n): t for n, t in full.items()}

    def load_published(self, tensors: dict[str, Tensor]) -> None:
        """Set the trainable tensors from their published form (checkpoint resume)."""
        by_name = {
            lora_published_name(n) if self.kind == "lora" else n: p for n, p in self.trainable().items()
        }
        missing, unknown = sorted(set(by_name) - set(tensors)), sorted(set(tensors) - set(by_name))
        if missing or unknown:
            raise ValueError(
                f"trainable tensors do not match: missing {missing[:5]}, unexpected {unknown[:5]}"
            )
        with torch.no_grad():
            for name, param in by_name.items():
                param.copy_(shard_like(param, tensors[name]))

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Forwards inside run the reference policy (no gradient flows to it)."""
        if self.kind == "lora":
            layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
            for layer in layers:
                layer.enable_adapters(False)
            try:
                yield
            finally:
                for layer in layers:
                    layer.enable_adapters(True)
            return
        params = self.trainable()
        current = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self._reference[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(current[n])


def lora_published_name(param_name: str) -> str:
    """``<module>.lora_A.default.weight`` (peft) -> ``<module>.lora_A.weight`` (published)."""
    for part, suffix in ((".lora_A.", LORA_A), (".lora_B.", LORA_B)):
        if part in param_name:
            return param_name.split(part, maxsplit=1)[0] + suffix
    raise ValueError(f"{param_name} is not a LoRA parameter")


def _add_lora(model: nn.Module, config: PolicyConfig) -> nn.Module:
    names = [n for n, _ in model.named_modules()]
    unmatched = [t for t in config.lora_targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(f"trainer.policy.lora_targets {unmatched} match no module of the model")
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=list(config.lora_targets),
        lora_dropout=0.0,
        init_lora_weights="gaussian" if config.lora_init == "gaussian" else True,
    )
    with torch.random.fork_rng(devices=[]):  # peft draws A from the global generator
        torch.manual_seed(config.init_seed)
        model = inject_adapter_in_model(lora, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.data = param.data.float()  # fp32 trainable weights and optimizer state
            param.requires_grad_(True)
    return model


def _unfreeze_gen_path(model: nn.Module) -> nn.Module:
    for name, param in model.named_parameters():
        if is_gen_path(name):
            param.data = param.data.float()
            param.requires_grad_(True)
    return model
