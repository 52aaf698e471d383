"""Policy updates applied to a sampling model: exactly the in-process change, or refused whole."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowgrpo.models.bagel.config import SpecialTokens, tiny
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate, PolicyUpdateError
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.sampler_params import SamplerParams

Q = "language_model.model.layers.0.self_attn.q_proj_moe_gen"
UP = "language_model.model.layers.1.mlp_moe_gen.up_proj"
NO_LAYER = "language_model.model.layers.9.mlp_moe_gen.up_proj.weight"
UND = "language_model.model.layers.0.mlp.up_proj.weight"
SPECIAL = SpecialTokens(im_start=384, im_end=385, vision_start=386, vision_end=387)
PARAMS = SamplerParams(num_points=5, height=32, width=32, window_size=1, window_range=(0, 2),
                       deterministic=True, decode_images=False)  # fmt: skip


def model(seed: int = 0) -> BagelModel:
    torch.manual_seed(seed)
    return BagelModel(tiny()).eval()


def lora(rank: int = 4, seed: int = 1, modules: tuple[str, ...] = (Q, UP)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ref = dict(model().named_parameters())
    out = {}
    for m in modules:
        out_f, in_f = ref[m + ".weight"].shape
        out[m + ".lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.1
        out[m + ".lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.1
    return out


def sample(m: BagelModel) -> torch.Tensor:
    reqs = [SampleRequest("p", 0, torch.tensor([5, 6, 7]))]
    return BagelSampler(m, None, SPECIAL).generate(reqs, PARAMS, seed=0, step=0).final_latents


def test_lora_update_equals_the_same_change_in_process() -> None:
    target, reference = model(), model()
    tensors = lora()
    PolicyApplier(target).apply(PolicyUpdate(1, "lora", tensors, lora_rank=4, lora_alpha=8.0))
    with torch.no_grad():
        params = dict(reference.named_parameters())
        for m in (Q, UP):
            w = params[m + ".weight"]
            w.copy_(w + 2.0 * tensors[m + ".lora_B.weight"] @ tensors[m + ".lora_A.weight"])
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(target.named_parameters())[name], p, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sample(target), sample(reference), atol=1e-5, rtol=1e-5)
    assert not torch.equal(sample(target), sample(model())), "the update changed the samples"


def test_peft_mode_takes_version_after_version_like_merge_mode() -> None:
    """The second update in peft mode meets peft's wrapped modules (``base_layer``)."""
    merged, unmerged = model(), model()
    merge, peft = PolicyApplier(merged), PolicyApplier(unmerged, lora_mode="peft")
    for version, seed in ((1, 1), (2, 2)):
        update = PolicyUpdate(version, "lora", lora(seed=seed), lora_rank=4, lora_alpha=8.0)
        merge.apply(update)
        peft.apply(update)
        torch.testing.assert_close(sample(unmerged), sample(merged), atol=1e-5, rtol=1e-5)
    assert peft.version == 2


def test_each_lora_version_merges_onto_the_base() -> None:
    target = model()
    applier = PolicyApplier(target)
    applier.apply(PolicyUpdate(1, "lora", lora(seed=1), lora_rank=4, lora_alpha=8.0))
    second = lora(seed=2, modules=(Q,))
    applier.apply(PolicyUpdate(2, "lora", second, lora_rank=4, lora_alpha=8.0))
    base = dict(model().named_parameters())
    now = dict(target.named_parameters())
    expected_q = base[Q + ".weight"] + 2.0 * second[Q + ".lora_B.weight"] @ second[Q + ".lora_A.weight"]
    torch.testing.assert_close(now[Q + ".weight"], expected_q, atol=1e-6, rtol=1e-6)
    assert torch.equal(now[UP + ".weight"], base[UP + ".weight"]), (
        "a module no longer adapted returns to base"
    )
    assert applier.version == 2


def test_gen_path_update_copies_tensors_bitwise() -> None:
    target = model()
    name = UP + ".weight"
    new = torch.randn_like(dict(target.named_parameters())[name])
    PolicyApplier(target).apply(PolicyUpdate(1, "gen_path", {name: new}))
    assert torch.equal(dict(target.named_parameters())[name], new)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (PolicyUpdate(1, "gen_path", {NO_LAYER: torch.zeros(1)}),
         "names the model cannot place: language_model.model.layers.9"),
        (PolicyUpdate(1, "gen_path", {UND: torch.zeros(128, 64)}),
         "outside the gen path"),
        (PolicyUpdate(1, "gen_path", {UP + ".weight": torch.zeros(3, 3)}), "mis-shaped tensors"),
        (PolicyUpdate(1, "lora", {Q + ".lora_A.weight": torch.zeros(4, 64)}, lora_rank=4, lora_alpha=8),
         "only one of lora_A / lora_B"),
        (PolicyUpdate(1, "lora", lora(rank=2), lora_rank=4, lora_alpha=8), "mis-shaped LoRA tensors"),
        (PolicyUpdate(1, "lora", lora(), lora_rank=0, lora_alpha=8), "rank > 0"),
        (PolicyUpdate(0, "lora", lora(), lora_rank=4, lora_alpha=8), "not newer than the loaded version 0"),
    ],
)  # fmt: skip
def test_bad_updates_are_refused_whole(update: PolicyUpdate, message: str) -> None:
    target = model()
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    with pytest.raises(PolicyUpdateError, match=message):
        PolicyApplier(target).apply(update)
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters()), "nothing was applied"


def test_partial_lora_plus_valid_tensors_is_refused_before_any_change() -> None:
    target = model()
    tensors = lora()
    del tensors[UP + ".lora_B.weight"]
    before = dict(target.named_parameters())[Q + ".weight"].detach().clone()
    with pytest.raises(PolicyUpdateError):
        PolicyApplier(target).apply(replace(PolicyUpdate(1, "lora", tensors), lora_rank=4, lora_alpha=8.0))
    assert torch.equal(dict(target.named_parameters())[Q + ".weight"], before)
