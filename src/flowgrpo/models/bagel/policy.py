"""Policy updates: the changed tensors the trainer publishes, applied to a sampling model.

The format (``flowgrpo.v1.WeightUpdate``) names tensors with the published BAGEL names:

- ``kind="gen_path"``: full tensors of trainable gen-path parameters (names containing
  ``moe_gen``), copied in place;
- ``kind="lora"``: for each adapted module ``<module>.lora_A.weight`` [r, in] and
  ``<module>.lora_B.weight`` [out, r]. ``lora_mode="merge"`` (fast sampling) merges them as
  W = W_base + (alpha / r) B A; the base weights of adapted modules are kept, so every version is
  merged onto the base, never onto the previous merge (no drift in bf16), and a later update may
  adapt fewer modules. A layer held in FP8 (``rollout.precision=fp8``: ``fp8.Fp8Linear``) gets
  the merge (or a gen-path tensor) in fp32 and quantizes it once. ``lora_mode="peft"`` runs them
  unmerged through peft's own LoRA layers, the computation the trainer differentiates: behaviour
  and recomputed log-probs are then bitwise equal (CPU, deterministic mode) at every policy
  version, not only within rounding.

Every update is checked whole before anything changes: a name the model cannot place, a
mis-shaped tensor or half a LoRA pair fails with the names, and the model is left as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from flowgrpo.models.bagel.config import is_gen_path
from flowgrpo.models.bagel.fp8 import Fp8Linear

UpdateKind = Literal["lora", "gen_path"]
LoraMode = Literal["merge", "peft"]
PEFT_ADAPTER = "default"
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


class PolicyUpdateError(ValueError):
    """An update that does not fit the model; nothing was applied."""


@dataclass
class PolicyUpdate:
    version: int
    kind: UpdateKind
    tensors: dict[str, Tensor]
    lora_rank: int = 0
    lora_alpha: float = 0.0

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank


@dataclass
class PolicyApplier:
    """Applies updates to ``model`` in place and remembers which version it holds."""

    model: nn.Module
    version: int = 0
    lora_mode: LoraMode = "merge"
    # rollout.base_weights=trainer: module -> its base weight in the trainer's shared allocation
    # (merge mode merges onto it instead of keeping a copy), and the parameters that ARE that
    # allocation, which no update may write
    shared_base: dict[str, Tensor] = field(default_factory=dict)
    read_only: frozenset[str] = frozenset()
    _base: dict[str, Tensor] = field(default_factory=dict)  # merge mode: module -> its own base copy
    _adapted: set[str] = field(default_factory=set)  # merge mode: modules holding a merged LoRA
    _peft_modules: tuple[tuple[str, ...], int] | None = None  # peft mode: (modules, rank) injected

    def apply(self, update: PolicyUpdate) -> None:
        params = dict(self.model.named_parameters())
        pairs = check_update(update, params, self.version)
        if update.kind == "gen_path":
            if any(n.removesuffix(".weight") in self._adapted for n in update.tensors):
                raise PolicyUpdateError(
                    "a gen_path update touches LoRA-merged weights; use one update kind per run"
                )
            shared = sorted(n for n in update.tensors if n in self.read_only)
            _fail_if(shared, "tensors this rollout maps from the trainer's shared base (read-only here)")
            self._apply_gen_path(update, params)
        elif self.lora_mode == "peft":
            self._apply_lora_peft(update, pairs)
        else:
            shared = sorted(m for m in pairs if m + ".weight" in self.read_only)
            _fail_if(shared, "modules whose weights are the trainer's shared base (merge needs its own)")
            self._apply_lora(update, pairs, params)
        self.version = update.version

    @torch.no_grad()
    def _apply_gen_path(self, update: PolicyUpdate, params: Mapping[str, nn.Parameter]) -> None:
        for name, tensor in update.tensors.items():
            self._write(name, tensor, params)

    def _write(self, name: str, tensor: Tensor, params: Mapping[str, nn.Parameter]) -> None:
        """Copy ``tensor`` into parameter ``name``; an FP8 layer's weight is quantized instead."""
        layer = self._fp8_layer(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if layer is not None:
            layer.set_weight(tensor)
        else:
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    def _fp8_layer(self, module: str) -> Fp8Linear | None:
        layer = self.model.get_submodule(module)
        return layer if isinstance(layer, Fp8Linear) else None

    @torch.no_grad()
    def _apply_lora(
        self,
        update: PolicyUpdate,
        pairs: Mapping[str, tuple[Tensor, Tensor]],
        params: Mapping[str, nn.Parameter],
    ) -> None:
        for module in sorted(self._adapted - set(pairs)):  # adapted before, not any more
            name = module + ".weight"
            self._write(name, self._base_of(module, params[name]), params)
        for module, (a, b) in pairs.items():
            name = module + ".weight"
            base = self._base_of(module, params[name])
            exact = self._fp8_layer(module) is not None  # quantized from the fp32 sum, not from bf16
            self._write(name, merge_lora(base, a, b, update.lora_scale, keep_fp32=exact), params)
        self._adapted = set(pairs)

    def _base_of(self, module: str, weight: Tensor) -> Tensor:
        """The base weight a merge starts from: the shared one, or a copy kept at first merge
        (an FP8 layer's is the weight it was quantized from: ``base_weights``)."""
        if module in self.shared_base:
            return self.shared_base[module]
        if module not in self._base and self._fp8_layer(module) is not None:
            raise PolicyUpdateError(f"{module} is held in FP8 and its unquantized base was not kept")
        return self._base.setdefault(module, weight.detach().clone())

    def keep_bases(self, bases: Mapping[str, Tensor]) -> None:
        """Merge LoRA onto these weights (module -> weight), not onto copies taken at the first
        merge: an FP8 model's weights before quantization (``fp8.quantize_gen_path``)."""
        self._base.update(bases)

    @torch.no_grad()
    def _apply_lora_peft(self, update: PolicyUpdate, pairs: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        layout = (tuple(sorted(pairs)), update.lora_rank)
        if self._peft_modules is None:
            config = LoraConfig(
                r=update.lora_rank,
                lora_alpha=round(update.lora_alpha),  # peft's field is an int; the exact scale is set below
                target_modules=list(layout[0]),
                lora_dropout=0.0,
            )
            inject_adapter_in_model(config, self.model, adapter_name=PEFT_ADAPTER)
            self._peft_modules = layout
        elif self._peft_modules != layout:
            raise PolicyUpdateError(
                "lora_mode 'peft' needs the same modules and rank in every update; "
                f"loaded {len(self._peft_modules[0])} modules of rank {self._peft_modules[1]}, "
                f"got {len(layout[0])} of rank {layout[1]}"
            )
        modules = dict(self.model.named_modules())
        for name, (a, b) in pairs.items():
            layer = modules[name]
            device = layer.base_layer.weight.device
            layer.lora_A[PEFT_ADAPTER].weight.data = a.to(device, torch.float32).clone()
            layer.lora_B[PEFT_ADAPTER].weight.data = b.to(device, torch.float32).clone()
            layer.scaling[PEFT_ADAPTER] = update.lora_scale


# --- checks and merges both rollout engines use ------------------------------------------------


def check_update(
    update: PolicyUpdate, params: Mapping[str, Tensor], version: int
) -> dict[str, tuple[Tensor, Tensor]]:
    """Check a whole update against a model's parameters (``params``: names to tensors, a meta
    model's will do) holding ``version``; nothing is applied. Returns the LoRA pairs by module
    (empty for a gen-path update); raises PolicyUpdateError naming everything that does not fit."""
    if update.version <= version:
        raise PolicyUpdateError(
            f"policy version {update.version} is not newer than the loaded version {version}"
        )
    if update.kind == "gen_path":
        _check_gen_path(update, params)
        return {}
    if update.kind == "lora":
        return _check_lora(update, params)
    raise PolicyUpdateError(f"unknown update kind {update.kind!r}: expected 'lora' or 'gen_path'")


def merge_lora(base: Tensor, a: Tensor, b: Tensor, scale: float, *, keep_fp32: bool = False) -> Tensor:
    """W = W_base + scale B A in fp32, rounded once to the base's dtype (on the base's device);
    ``keep_fp32``: not rounded (an FP8 layer quantizes the fp32 sum itself)."""
    delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
    merged = base.float() + scale * delta
    return merged if keep_fp32 else merged.to(base.dtype)


def _check_gen_path(update: PolicyUpdate, params: Mapping[str, Tensor]) -> None:
    unknown = sorted(n for n in update.tensors if n not in params)
    frozen = sorted(n for n in update.tensors if n in params and not is_gen_path(n))
    shapes = sorted(
        f"{n}: got {list(t.shape)}, the model has {list(params[n].shape)}"
        for n, t in update.tensors.items()
        if n in params and t.shape != params[n].shape
    )
    _fail_if(unknown, "names the model cannot place")
    _fail_if(frozen, "tensors outside the gen path (the und path is frozen and never published)")
    _fail_if(shapes, "mis-shaped tensors")


def _check_lora(update: PolicyUpdate, params: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    if update.lora_rank <= 0 or update.lora_alpha <= 0:
        raise PolicyUpdateError(
            "a LoRA update needs rank > 0 and alpha > 0, "
            f"got rank {update.lora_rank} alpha {update.lora_alpha}"
        )
    modules = {n.removesuffix(LORA_A).removesuffix(LORA_B) for n in update.tensors}
    bad_names = sorted(n for n in update.tensors if not n.endswith((LORA_A, LORA_B)))
    _fail_if(bad_names, f"names that are neither '<module>{LORA_A}' nor '<module>{LORA_B}'")
    half = sorted(m for m in modules if (m + LORA_A in update.tensors) != (m + LORA_B in update.tensors))
    _fail_if(half, "modules with only one of lora_A / lora_B")
    unknown = sorted(m for m in modules if _base_weight(m, params) is None)
    _fail_if(unknown, "LoRA modules the model cannot place")
    frozen = sorted(m for m in modules if not is_gen_path(m))
    _fail_if(frozen, "LoRA modules outside the gen path")
    pairs = {m: (update.tensors[m + LORA_A], update.tensors[m + LORA_B]) for m in modules}
    errors = (_lora_shape_error(m, a, b, _shape(m, params), update.lora_rank) for m, (a, b) in pairs.items())
    shapes = sorted(e for e in errors if e)
    _fail_if(shapes, "mis-shaped LoRA tensors")
    return pairs


def _base_weight(module: str, params: Mapping[str, Tensor]) -> Tensor | None:
    """The weight LoRA adapts: ``<module>.weight``, or ``<module>.base_layer.weight`` once peft wrapped it."""
    return params.get(module + ".weight", params.get(module + ".base_layer.weight"))


def _shape(module: str, params: Mapping[str, Tensor]) -> torch.Size:
    weight = _base_weight(module, params)
    assert weight is not None  # checked before
    return weight.shape


def _lora_shape_error(module: str, a: Tensor, b: Tensor, weight: torch.Size, rank: int) -> str:
    out_features, in_features = weight
    if tuple(a.shape) == (rank, in_features) and tuple(b.shape) == (out_features, rank):
        return ""
    return (
        f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected "
        f"[{rank}, {in_features}] / [{out_features}, {rank}]"
    )


def _fail_if(items: list[str], what: str) -> None:
    if items:
        shown = "; ".join(items[:8]) + (f"; ... ({len(items)} in all)" if len(items) > 8 else "")
        raise PolicyUpdateError(f"policy update refused, {what}: {shown}")
