"""``rollout.base_weights=trainer``: the rollout's frozen weights ARE the trainer's, mapped from the
trainer's GPU allocation (``trainer.share_base``; CUDA IPC, same GPU) instead of loaded again,
so on one GPU the 28 GB base of BAGEL-7B is in memory once (docs/colocated.md).

What is mapped and what is owned:
- everything a policy update never writes (the und path, embeddings, norms, heads) is the
  trainer's memory, read-only here;
- with ``lora_mode=merge`` the gen path is this rollout's own copy (a merge writes it), made from
  the trainer's at the first attach; the trainer's frozen gen-path weights are the base every
  merge starts from (no second copy of the base, as the plain merge keeps);
- with ``rollout.precision=fp8`` that own copy is the FP8 one (the trainer's bf16 weights
  quantized at the first attach; every merge is quantized from the trainer's base): the gen path
  costs this rollout 1 byte a weight, not 2;
- with ``lora_mode=peft`` the gen path is mapped too (peft never writes the base): the whole
  model is one copy in GPU memory;
- what the trainer trains in full (``trainer.policy.kind=full``: the gen path) is not in its
  base: read from the checkpoint here, as a plain rollout does.

A trainer that restarted exports a new allocation (same values: the same checkpoint); the next
update names it and the mapped parameters move onto it, the owned ones stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from flowgrpo.models.bagel.checkpoint import EMA_FILE, checkpoint_key
from flowgrpo.models.bagel.fp8 import Fp8Linear


class SharedBaseError(ValueError):
    """The trainer's base does not fit this model (another checkpoint, dtype or geometry)."""


def attach_base(
    model: nn.Module,
    views: Mapping[str, Tensor],
    *,
    owned: Callable[[str], bool],
    checkpoint: str | Path,
) -> tuple[frozenset[str], dict[str, Tensor]]:
    """Point ``model``'s parameters at the trainer's ``views`` (checkpoint key -> tensor).

    ``owned(key)``: the parameter gets its own copy (at the first attach; later attaches keep
    the copy). Parameters the views lack and that are still on the meta device are read from
    ``checkpoint``. Returns the names of the parameters that alias the trainer's memory and, by
    module, the trainer's base weight of every owned ``<module>.weight`` (the merge base)."""
    if not views:
        raise SharedBaseError("the trainer's shared base is empty: it shares no weight")
    keyed = ((checkpoint_key(n), n, p) for n, p in model.named_parameters())
    params = {key: (n, p) for key, n, p in keyed if key is not None}  # LoRA tensors: never in a base
    fp8 = {n + ".weight": m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    _check_views(
        views, {k: p for k, (_, p) in params.items()}, {k for k, (n, _) in params.items() if n in fp8}
    )
    state: dict[str, Tensor] = {}
    shared: set[str] = set()
    merge_bases: dict[str, Tensor] = {}
    missing: list[tuple[str, str, torch.dtype]] = []
    for key, (name, param) in params.items():
        if key not in views:
            if param.is_meta:  # an FP8 layer's is read in fp32, then quantized
                missing.append((key, name, torch.float32 if name in fp8 else param.dtype))
        elif owned(key):
            if name in fp8 and param.is_meta:
                fp8[name].set_weight(views[key])  # this rollout's FP8 copy, quantized from the trainer's
            elif param.is_meta:
                state[name] = views[key].clone()
            if key.endswith(".weight"):
                merge_bases[key.removesuffix(".weight")] = views[key]
        elif name in fp8:
            raise SharedBaseError(
                f"{name} is held in FP8 here: it cannot alias the trainer's {views[key].dtype} weight"
            )
        else:
            state[name] = views[key]
            shared.add(name)
    for name, tensor in _read_missing(checkpoint, missing, next(iter(views.values())).device).items():
        if name in fp8:
            fp8[name].set_weight(tensor)
        else:
            state[name] = tensor
    model.load_state_dict(state, strict=False, assign=True)
    return frozenset(shared), merge_bases


def _check_views(views: Mapping[str, Tensor], params: Mapping[str, Tensor], quantized: set[str]) -> None:
    """Every view names a parameter of the same shape and dtype (an FP8 layer's weight, in
    ``quantized``, is quantized from a view of any dtype)."""
    unknown = sorted(set(views) - set(params))
    mismatched = sorted(
        f"{k}: the trainer's is {list(v.shape)} {v.dtype}, this model's {list(params[k].shape)} "
        f"{params[k].dtype}"
        for k, v in views.items()
        if k in params and (v.shape != params[k].shape or (v.dtype != params[k].dtype and k not in quantized))
    )
    if unknown or mismatched:
        shown = "; ".join([*(f"{k}: not in this model" for k in unknown[:4]), *mismatched[:4]])
        raise SharedBaseError(
            f"the trainer's shared base does not fit this rollout ({len(unknown)} unknown, "
            f"{len(mismatched)} mismatched: {shown}): give trainer and rollout the same checkpoint "
            "and the same dtype (trainer.dtype = rollout.dtype)"
        )


def _read_missing(
    checkpoint: str | Path, missing: list[tuple[str, str, torch.dtype]], device: torch.device
) -> dict[str, Tensor]:
    """What the trainer does not share (it trains it), from the checkpoint, in each parameter's
    dtype, on the device of the shared weights."""
    if not missing:
        return {}
    with safe_open(str(Path(checkpoint) / EMA_FILE), framework="pt", device=str(device)) as f:
        return {name: f.get_tensor(key).to(dtype) for key, name, dtype in missing}
