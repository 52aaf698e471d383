"""Everything applied to a built BagelModel from outside it (the torchtitan ``parallelize_llama``
pattern): the model files hold architecture only; this module changes how a model runs, never
what it computes.

:func:`parallelize_bagel` applies, in this order,

1. :func:`compile_query_layers`: torch.compile of each decoder layer's image-query halves;
2. :func:`checkpoint_query_layers`: activation checkpointing of the same halves (around the
   compiled code: the backward recomputes with the compiled kernels);
3. :func:`shard_model`: FSDP2, each decoder layer its own unit, then the root.

The rollout compiles only; the trainer may apply all three, on a meta-device model before its
weights are streamed in.

How methods are wrapped (compile, checkpointing): each layer's ``query_qkv`` and ``query_out``
are shadowed by an instance attribute wrapping what was there (the class method, or an earlier
wrapper), and the layer keeps a stack of what each wrapping replaced, so the ``un...`` functions
undo the outermost one exactly. FSDP2 wraps the same methods last, through its public
``register_fsdp_forward_method`` (the same instance-attribute mechanism, with no undo).

Why compile only the query path: the denoising loop spends nearly all its time in
``MoTDecoder.forward_query``. Its matmuls already run in cuBLAS; what compiling adds is the fusion
of everything between them (RMSNorms with their fp32 variance, qk-norm, RoPE, the bf16 casts, the
SwiGLU activation, residual adds), which in eager mode costs one or more trips through device
memory each. Attention stays outside the compiled regions, in eager SDPA: the runs of
``attention.query_runs`` are host-side Python that a graph would specialise on, and SDPA picks its
kernel itself (cuDNN attention on an H200 with torch 2.11, 1.6x faster than flash on these
shapes). Prefill and the one-pass training forward are left alone.

Measured on one H200 (bench/rollout_gpu.sh, 7B, CFG 4): 512px batch 8 step 486 ms with the
general path, 466 ms with the eager query path, 364 ms compiled (MFU 60% -> 62% -> 80%);
dynamic=False gave the same step time within noise. CUDA graphs of the compiled step gain ~9% at
batch 1 (GPU idle between launches) and nothing from batch 8 on, so they are not applied here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flowgrpo.models.bagel.model import BagelModel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

QUERY_METHODS = ("query_qkv", "query_out")
"""Each decoder layer's work around the image query's joint attention: what compile and activation
checkpointing wrap, and what FSDP2 registers as forward methods of the layer."""

ROOT_METHODS = ("prefill", "predict_velocity")
"""The sampler's forwards beside ``forward()``, registered as FSDP2 forward methods of the root."""


def parallelize_bagel(
    model: BagelModel,
    mesh: DeviceMesh | None,
    *,
    compile: bool,
    activation_checkpointing: bool,
    checkpoint_every: int = 1,
    param_dtype: torch.dtype | None = None,
) -> BagelModel:
    """Apply compile, activation checkpointing (of every ``checkpoint_every``-th layer) and FSDP2
    over ``mesh`` (None: one process, no sharding), each when asked, in that order.
    ``param_dtype`` is the compute dtype of the all-gathered parameters under FSDP2. Returns
    ``model``, changed in place."""
    if compile:
        compile_query_layers(model)
    if activation_checkpointing:
        checkpoint_query_layers(model, every=checkpoint_every)
    if mesh is not None:
        shard_model(model, mesh, param_dtype=param_dtype)
    return model


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


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

    What it changes: the same math, not the same numbers. Inductor fuses the norms, RoPE and
    SwiGLU into kernels that round intermediates differently; in bf16 on an H200 with the 7B
    geometry and random weights the conditional velocity at t = 1 moved by 2.98e-2 relative
    (eager vs compiled rollout), as much as the whole bf16-vs-fp32 error (2.5e-2). A rollout and
    a trainer that must compute the same function (exact log-prob ratios,
    ``trainer.loss.logp_old=bypass``) must both compile, or neither.
    """
    options: dict[str, Any] = {"mode": mode, "dynamic": dynamic, "backend": backend, "fullgraph": True}
    _wrap_query_methods(model, "compile", lambda method: torch.compile(method, **options))


def uncompile_query_layers(model: BagelModel) -> None:
    """Undo :func:`compile_query_layers` (a no-op when not compiled)."""
    _unwrap_query_methods(model, "compile")


# --------------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------------


def checkpoint_query_layers(model: BagelModel, every: int = 1) -> None:
    """Activation checkpointing of the image-query path: each checkpointed decoder layer's
    ``query_qkv`` and ``query_out`` (the per-layer work around the joint attention) keep only
    their inputs and run again in the backward. Saved per layer and row: the layer's input, q/k/v
    and the attention output: ~1.1 GiB per row (one CFG branch of one trajectory at one window
    step, 7B, 512px, all 28 layers) against ~6.6 GiB without, for ~1/3 more update time.

    ``every``: checkpoint layers 0, every, 2 x every, ... only (torchtitan's selective layer
    checkpointing): 2 keeps half the layers' activations and recomputes the other half, the
    memory and the recompute in between. Without gradients (logp_old) the methods run plainly.
    FSDP2 skips its pre-forward during the backward's recompute, so sharding may come before or
    after; :func:`parallelize_bagel` shards after.
    """
    if every < 1:
        raise ValueError(f"checkpoint every {every} layers: must be >= 1")
    layers = [layer for i, layer in enumerate(model.decoder.layers) if i % every == 0]
    _wrap_query_methods(model, "checkpoint", _checkpointed, layers)


def checkpointed_layers(model: BagelModel) -> list[int]:
    """The indices of the decoder layers :func:`checkpoint_query_layers` wrapped."""
    return [
        i
        for i, layer in enumerate(model.decoder.layers)
        if any(w.kind == "checkpoint" for w in vars(layer).get(_WRAPPINGS, []))
    ]


def uncheckpoint_query_layers(model: BagelModel) -> None:
    """Undo :func:`checkpoint_query_layers` (a no-op when not checkpointed)."""
    _unwrap_query_methods(model, "checkpoint")


def _checkpointed(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` recomputed in the backward instead of keeping its activations."""
    from torch.utils.checkpoint import checkpoint

    def run(*args: Tensor) -> Any:
        if torch.is_grad_enabled():
            # no dropout or other randomness inside: no RNG state to stash and restore
            return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False)
        return inner(*args)

    return run


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------


def shard_model(model: BagelModel, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None) -> BagelModel:
    """FSDP2 over ``mesh``: each decoder layer its own unit, then the root (embeddings, heads,
    norms); the query halves and the sampler's forwards registered as FSDP forward methods.

    ``param_dtype`` (bf16 on GPU) is the compute dtype of the all-gathered parameters; the
    sharded trainable parameters and their optimizer state stay fp32; gradients reduce in fp32.
    Forward inputs are not cast: the model keeps RoPE and the latents in fp32 on purpose, and
    FSDP's input cast rebuilds dataclass arguments (the KVCache) with ``dataclasses.replace``,
    which its init=False fields refuse.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        for method in QUERY_METHODS:  # called around the joint attention, beside forward()
            register_fsdp_forward_method(layer, method)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for method in ROOT_METHODS:
        register_fsdp_forward_method(model, method)
    return model


# --------------------------------------------------------------------------------------------
# The one mechanism for wrapping methods
# --------------------------------------------------------------------------------------------

_WRAPPINGS = "_flowgrpo_wrappings"  # a layer's instance attribute: its stack of _Wrapping


@dataclass(frozen=True)
class _Wrapping:
    """One wrapping of a layer's query methods: the wrappers it installed, and what each shadowed
    (an earlier wrapper, or None where the class method showed through)."""

    kind: str
    wrappers: dict[str, Callable[..., Any]]
    shadowed: dict[str, Callable[..., Any] | None]


def _wrap_query_methods(
    model: BagelModel,
    kind: str,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    layers: Sequence[torch.nn.Module] | None = None,
) -> None:
    """Shadow the ``QUERY_METHODS`` of ``layers`` (default: every decoder layer) with ``wrap`` of
    what they are now."""
    for layer in model.decoder.layers if layers is None else layers:
        stack: list[_Wrapping] = vars(layer).setdefault(_WRAPPINGS, [])
        if any(w.kind == kind for w in stack):
            raise RuntimeError(f"the query layers are already wrapped by {kind}")
        shadowed = {name: vars(layer).get(name) for name in QUERY_METHODS}
        wrappers = {name: wrap(getattr(layer, name)) for name in QUERY_METHODS}
        vars(layer).update(wrappers)  # instance attributes shadow the class's methods
        stack.append(_Wrapping(kind, wrappers, shadowed))


def _unwrap_query_methods(model: BagelModel, kind: str) -> None:
    """Undo the ``kind`` wrapping, which must be the outermost; a no-op where it is not applied."""
    for layer in model.decoder.layers:
        stack: list[_Wrapping] = vars(layer).get(_WRAPPINGS, [])
        if not any(w.kind == kind for w in stack):
            continue
        top = stack[-1]
        if top.kind != kind or any(vars(layer).get(n) is not f for n, f in top.wrappers.items()):
            raise RuntimeError(
                f"{kind} is not the outermost wrapping of the query layers: undo the later one first "
                "(FSDP2's cannot be undone)"
            )
        stack.pop()
        for name, previous in top.shadowed.items():
            if previous is None:
                del vars(layer)[name]
            else:
                vars(layer)[name] = previous
        if not stack:
            del vars(layer)[_WRAPPINGS]
