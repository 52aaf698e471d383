"""What parallelize.py applies from outside the model (tiny model, CPU, fp32): activation
checkpointing changes no number, wrappings stack and undo outermost first. FSDP2 is tested with
two processes in tests/trainer/test_fsdp.py. Each test says whether it expects bitwise equality."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_bagel_model import prompts  # same folder: the shared padded-prompt builder
from torch import Tensor

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import tiny
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids
from flowgrpo.models.bagel.parallelize import (
    QUERY_METHODS,
    checkpoint_query_layers,
    checkpointed_layers,
    compile_query_layers,
    parallelize_bagel,
    uncheckpoint_query_layers,
    uncompile_query_layers,
)

MARKERS = {"soi_id": 386, "eoi_id": 387}


@pytest.fixture
def model() -> BagelModel:
    torch.manual_seed(0)
    return BagelModel(tiny())


def velocity_and_grads(model: BagelModel) -> tuple[Tensor, list[Tensor]]:
    velocity = forward(model)
    velocity.square().mean().backward()
    return velocity.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def forward(model: BagelModel) -> Tensor:
    """The velocity of a fixed query, with autograd on (gradients zeroed)."""
    ids, mask = prompts([5, 3])
    with torch.no_grad():
        cond = model.prefill(ids, mask)
    cache = KVCache.cat_rows([cond, KVCache.empty(model.config, 2, torch.float32, "cpu")])
    g = torch.Generator().manual_seed(4)
    x, t = torch.randn(4, 12, 64, generator=g), torch.rand(4, generator=g)
    pos = latent_position_ids(3, 4, model.config.max_latent_size)
    model.zero_grad(set_to_none=True)
    return model.predict_velocity(cache, x, t, pos, **MARKERS)


def shadowed(model: BagelModel) -> set[str]:
    """The query methods some layer shadows with an instance attribute."""
    return {name for layer in model.decoder.layers for name in QUERY_METHODS if name in vars(layer)}


def test_checkpointing_changes_no_number(model: BagelModel) -> None:
    """Bitwise: the velocity and every gradient with the query path checkpointed equal those
    without; undoing it leaves the class methods showing through."""
    plain, plain_grads = velocity_and_grads(model)
    checkpoint_query_layers(model)
    assert shadowed(model) == set(QUERY_METHODS)
    checked, checked_grads = velocity_and_grads(model)
    uncheckpoint_query_layers(model)
    assert shadowed(model) == set() and "_flowgrpo_wrappings" not in vars(model.decoder.layers[0])
    assert torch.equal(plain, checked)
    assert len(plain_grads) == len(checked_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, checked_grads, strict=True))


def saved_bytes_and_recomputes(model: BagelModel) -> tuple[int, int]:
    """(bytes autograd keeps for the backward outside checkpointed regions, query_out forwards the
    backward runs again) of one forward and backward; the checkpoint's own saves are inside its
    region, whose saved-tensor hooks take precedence over these."""
    kept, calls = 0, list[torch.nn.Module]()

    def pack(t: Tensor) -> Tensor:
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    def count(module: torch.nn.Module, args: object) -> None:
        calls.append(module)

    layers = model.decoder.layers
    hooks = [layer.post_attention_layernorm_moe_gen.register_forward_pre_hook(count) for layer in layers]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        velocity = forward(model)
    forward_calls = len(calls)
    velocity.square().mean().backward()
    for hook in hooks:
        hook.remove()
    return kept, len(calls) - forward_calls


def test_checkpointing_every_nth_layer_keeps_the_others_activations() -> None:
    """Exact: with every=2 of 4 layers, layers 0 and 2 are wrapped and recomputed in the backward,
    1 and 3 keep their activations, the bytes kept lie strictly between all and none checkpointed
    (and the others' kept bytes are exactly what two layers keep); every number is the same."""
    torch.manual_seed(0)
    model = BagelModel(dataclasses.replace(tiny(), layers=4))
    plain, plain_grads = velocity_and_grads(model)
    none_kept, none_recomputed = saved_bytes_and_recomputes(model)
    results = {}
    for every in (1, 2, 3):
        checkpoint_query_layers(model, every=every)
        results[every] = (checkpointed_layers(model), *saved_bytes_and_recomputes(model))
        velocity, grads = velocity_and_grads(model)
        assert torch.equal(plain, velocity)
        assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
        uncheckpoint_query_layers(model)
    assert none_recomputed == 0
    assert [results[e][0] for e in (1, 2, 3)] == [[0, 1, 2, 3], [0, 2], [0, 3]]
    assert [results[e][2] for e in (1, 2, 3)] == [4, 2, 2]  # one query_out recompute per wrapped layer
    all_kept, half_kept = results[1][1], results[2][1]
    assert all_kept < half_kept < none_kept
    assert half_kept - all_kept == pytest.approx((none_kept - all_kept) / 2, rel=0.05)
    with pytest.raises(ValueError, match="every 0 layers: must be >= 1"):
        checkpoint_query_layers(model, every=0)


def test_wrappings_stack_and_undo_outermost_first(model: BagelModel) -> None:
    """Exact: parallelize_bagel compiles, then checkpoints around the compiled methods; the compile
    cannot be undone from under the checkpointing, nor applied twice; undone in reverse order
    the layers are as built. Nothing asked, nothing applied."""
    parallelize_bagel(model, None, compile=False, activation_checkpointing=False)
    assert shadowed(model) == set()
    parallelize_bagel(model, None, compile=True, activation_checkpointing=True)
    with pytest.raises(RuntimeError, match="not the outermost"):
        uncompile_query_layers(model)
    with pytest.raises(RuntimeError, match="already wrapped by compile"):
        compile_query_layers(model, backend="eager")
    uncheckpoint_query_layers(model)
    uncheckpoint_query_layers(model)  # not applied any more: a no-op
    assert shadowed(model) == set(QUERY_METHODS)  # the compiled methods remain
    uncompile_query_layers(model)
    assert shadowed(model) == set()
