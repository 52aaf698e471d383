"""Speed wrappers for a BagelModel, applied from outside the model (the torchtitan pattern).

The model files hold architecture only; this module changes how a built model runs, never what it
computes. Today one wrapper: :func:`compile_query_layers`.

Why only the query path: the denoising loop spends nearly all its time in
``MoTDecoder.forward_query``. Its matmuls already run in cuBLAS; what compiling adds is the fusion
of everything between them (RMSNorms with their fp32 variance, qk-norm, RoPE, the bf16 casts, the
SwiGLU activation, residual adds), which in eager mode costs one or more trips through device
memory each. Attention stays outside the compiled regions, in eager SDPA: the runs of
``query_runs`` are host-side Python that a graph would specialise on, and SDPA picks its kernel
itself (cuDNN attention on an H200 with torch 2.11, 1.6x faster than flash on these shapes).
Prefill and the one-pass training forward are left alone.

Measured on one H200 (bench/rollout_gpu.sh, 7B, CFG 4): 512px batch 8 step 486 ms with the
general path, 466 ms with the eager query path, 364 ms compiled (MFU 60% -> 62% -> 80%);
dynamic=False gave the same step time within noise. CUDA graphs of the compiled step gain ~9% at
batch 1 (GPU idle between launches) and nothing from batch 8 on, so they are not applied here.
"""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.models.bagel.model import BagelModel


def compile_query_layers(
    model: BagelModel,
    *,
    mode: str | None = None,
    dynamic: bool | None = True,
    backend: Any = "inductor",
) -> None:
    """Compile each decoder layer's ``query_qkv`` and ``query_out`` in place.

    Every layer runs the same code on parameters of the same shapes, so one compilation serves all
    of them (the parameters are graph inputs). ``dynamic=True`` (the default) compiles once for
    every batch size and resolution; ``False`` specialises on each shape (a fresh compile for
    each). ``backend`` is any torch.compile backend (a name or a callable, as tests pass).
    ``fullgraph`` is on: a graph break here would be a bug, not a fallback.
    """
    options: dict[str, Any] = {"mode": mode, "dynamic": dynamic, "backend": backend, "fullgraph": True}
    for layer in model.decoder.layers:
        for name in _COMPILED:
            # an instance attribute shadows the class's method; uncompile_query_layers removes it
            vars(layer)[name] = torch.compile(getattr(layer, name), **options)


def uncompile_query_layers(model: BagelModel) -> None:
    """Undo :func:`compile_query_layers` (the class methods show through again)."""
    for layer in model.decoder.layers:
        for name in _COMPILED:
            vars(layer).pop(name, None)


_COMPILED = ("query_qkv", "query_out")  # the per-layer work around the query's attention
