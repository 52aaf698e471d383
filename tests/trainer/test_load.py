"""The trainer's meta-device loader builds the policy that eager loading builds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowgrpo.configs.trainer import PolicyConfig
from flowgrpo.models.bagel.checkpoint import EMA_FILE, CheckpointError, load_bagel_model
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.policy import TrainablePolicy
from tests.trainer.test_step import LORA, tiny

__all__ = ["tiny"]  # the module-scoped checkpoint fixture


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_meta_loading_equals_eager_loading(tiny: Path, kind: str) -> None:
    config = replace(LORA, kind=kind)
    streamed = load_policy(tiny, config, Dist(), dtype=torch.float32, device="cpu", keep_reference=True)
    eager = TrainablePolicy(load_bagel_model(tiny, dtype=torch.float32), config, keep_reference=True)
    a, b = dict(streamed.model.named_parameters()), dict(eager.model.named_parameters())
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert not value.is_meta, name
        assert torch.equal(value, b[name]), name
        assert (value.dtype, value.requires_grad) == (b[name].dtype, b[name].requires_grad), name
    assert streamed.trainable().keys() == eager.trainable().keys()
    if kind == "lora":  # A drawn, B zero: the base policy to start with
        lora_a = [p for n, p in a.items() if ".lora_A." in n]
        assert lora_a and all(float(p.detach().abs().sum()) > 0 for p in lora_a)
        assert all(float(p.detach().abs().sum()) == 0 for n, p in a.items() if ".lora_B." in n)


def test_lora_init_depends_on_seed_and_name_only(tiny: Path) -> None:
    def lora_a(config: PolicyConfig) -> dict[str, torch.Tensor]:
        policy = load_policy(tiny, config, Dist(), dtype=torch.float32, device="cpu")
        return {n: p.detach() for n, p in policy.published().items() if n.endswith(".lora_A.weight")}

    base = lora_a(LORA)
    reordered = lora_a(replace(LORA, lora_targets=list(reversed(LORA.lora_targets))))
    other_seed = lora_a(replace(LORA, init_seed=1))
    assert base.keys() == reordered.keys() == other_seed.keys()
    assert all(torch.equal(base[n], reordered[n]) for n in base)
    assert not any(torch.equal(base[n], other_seed[n]) for n in base)
    torch.testing.assert_close(
        torch.cat([t.flatten() for t in base.values()]).std(),
        torch.tensor(1 / LORA.lora_rank),
        rtol=0.1,
        atol=0,
    )


def test_a_mis_shaped_checkpoint_is_refused_before_anything_loads(tiny: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny.iterdir():
        if item.name != EMA_FILE:
            (broken / item.name).symlink_to(item)
    tensors = load_file(str(tiny / EMA_FILE))
    key = "language_model.model.layers.0.mlp_moe_gen.up_proj.weight"
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, str(broken / EMA_FILE))
    with pytest.raises(CheckpointError, match=r"mis-shaped keys: 1 \(" + key.replace(".", r"\.")):
        load_policy(broken, LORA, Dist(), dtype=torch.float32, device="cpu")
