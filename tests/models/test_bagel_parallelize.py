"""What parallelize.py applies from outside the model (tiny model, CPU, fp32): activation
checkpointing changes no number, wrappings stack and undo outermost first. FSDP2 is tested with
two processes in tests/trainer/test_fsdp.py. Each test says whether it expects bitwise equality."""

from __future__ import annotations

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
    ids, mask = prompts([5, 3])
    with torch.no_grad():
        cond = model.prefill(ids, mask)
    cache = KVCache.cat_rows([cond, KVCache.empty(model.config, 2, torch.float32, "cpu")])
    g = torch.Generator().manual_seed(4)
    x, t = torch.randn(4, 12, 64, generator=g), torch.rand(4, generator=g)
    pos = latent_position_ids(3, 4, model.config.max_latent_size)
    model.zero_grad(set_to_none=True)
    velocity = model.predict_velocity(cache, x, t, pos, **MARKERS)
    velocity.square().mean().backward()
    return velocity.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


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
