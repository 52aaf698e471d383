"""torchao's float8 inference on the same layers (``bench fp8 --torchao``): the maintained library's
answer to what ``models/bagel/fp8.py`` hand-writes, measured beside it in the same run.

``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` quantizes the weight of each
gen-path linear layer (``gen_path_linears``, the layers ``quantize_gen_path`` swaps) to e4m3 with a
scale per output channel, and each activation per row in the forward: the same scaling rule as
``Fp8Linear``, in torchao's tensor subclass (``Float8Tensor``) instead of a module of our own. The
bf16 weights are kept aside and put back after, so the run goes on with the unquantized model.

torchao refuses its float8 below compute capability 8.9 (a CPU included) and takes bf16 weights
only; the benchmark says so in one line rather than measuring something else.
"""

from __future__ import annotations

import importlib.metadata

import torch
from torch import nn

from flowgrpo.models.bagel.fp8 import FP8_CAPABILITY, gen_path_linears


def torchao_version() -> str | None:
    """The installed torchao's version, or None (``pip install 'flowgrpo[fp8]'``)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def refusal(device: torch.device, dtype: str) -> str | None:
    """Why torchao's float8 cannot run here, in one line; None where it can."""
    if torchao_version() is None:
        return "torchao is not installed (pip install 'flowgrpo[fp8]')"
    if dtype != "bf16":
        return f"torchao's row-wise float8 takes bf16 weights, not {dtype} (--dtype bf16)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        return f"torchao's float8 needs a GPU of compute capability 8.9+ (Ada, Hopper), not {device}"
    return None


def quantize_gen_path_torchao(model: nn.Module) -> dict[str, torch.Tensor]:
    """Quantize the gen-path linears in place with torchao's row-wise float8; returns their bf16
    weights by module name, for :func:`restore`."""
    from torchao.quantization import (  # not typed (pyproject's mypy overrides); the fp8 extra
        Float8DynamicActivationFloat8WeightConfig,
        PerRow,
        quantize_,
    )

    layers = gen_path_linears(model)
    if not layers:
        raise ValueError("torchao: no gen-path linear layer to quantize in this model")
    originals = {name: layer.weight for name, layer in layers.items()}
    wrong = {str(w.dtype) for w in originals.values() if w.dtype != torch.bfloat16}
    if wrong:
        raise ValueError(f"torchao's row-wise float8 takes bf16 weights; the gen path's: {', '.join(wrong)}")
    chosen = set(layers)
    quantize_(
        model,
        Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        filter_fn=lambda _module, fqn: fqn in chosen,
    )
    return originals


def restore(model: nn.Module, originals: dict[str, torch.Tensor]) -> None:
    """Put the bf16 weights :func:`quantize_gen_path_torchao` kept back in their layers."""
    for name, weight in originals.items():
        assert isinstance(weight, nn.Parameter)  # as the layer held it
        _linear(model, name).weight = weight


def _linear(model: nn.Module, name: str) -> nn.Linear:
    layer = model.get_submodule(name)
    assert isinstance(layer, nn.Linear), f"{name} is a {type(layer).__name__}, not a linear layer"
    return layer
