"""The load-test engine (``rollout.engine=synthetic``): the real engine's shapes and dtypes for any
size and window, values that are functions of each sample's coordinates, the real loop's stop
points, and weight updates checked whole like the real engine's."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from flowgrpo.configs.run import load_run_config
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, load_vae, make_tiny_bagel
from flowgrpo.models.bagel.policy import PolicyUpdate, PolicyUpdateError
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.rewards.base import Sample
from flowgrpo.rewards.build import build_reward
from flowgrpo.rewards.config import RewardConfig, ScorerSpec
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.coordinator.train import train
from flowgrpo.services.rollout.synthetic import SyntheticEngine

PARAMS = SamplerParams(num_points=6, height=32, width=48, window_size=2, window_range=(0, 4))
Q = "language_model.model.layers.0.self_attn.q_proj_moe_gen"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


def requests() -> list[SampleRequest]:
    return [SampleRequest(uid, i, torch.tensor([384, 5, 6, 385])) for uid in ("a", "b") for i in range(3)]


def test_it_returns_what_the_real_engine_returns_in_shape_dtype_window_and_schedule(tiny: Path) -> None:
    synthetic = SyntheticEngine.from_checkpoint(tiny, step_delay_s=0.0, max_batch_samples=4)
    model, vae = load_bagel_model(tiny, dtype=torch.float32), load_vae(tiny, dtype=torch.float32)
    real = BagelSampler(model, vae, load_special_tokens(tiny))
    ours = synthetic.generate(requests(), PARAMS, seed=3, step=2)
    theirs = real.generate(requests(), PARAMS, seed=3, step=2)
    for name in ("latents", "log_probs", "sigmas", "timesteps", "window_begin", "final_latents", "images"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert (a.shape, a.dtype) == (b.shape, b.dtype), name
    for name in ("sigmas", "timesteps", "window_begin"):  # the real schedule at the real window
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert torch.isfinite(ours.log_probs).all() and ours.log_probs.abs().max() < 5


def test_a_sample_is_a_function_of_its_coordinates_not_of_its_batch(tiny: Path) -> None:
    engine = SyntheticEngine.from_checkpoint(tiny, step_delay_s=0.0, max_batch_samples=2)
    together = engine.generate(requests(), PARAMS, seed=1, step=1)
    alone = engine.generate(requests()[4:5], PARAMS, seed=1, step=1)
    assert torch.equal(together.latents[4], alone.latents[0]) and torch.equal(
        together.images[4], alone.images[0]
    )
    other_step = engine.generate(requests()[4:5], PARAMS, seed=1, step=2)
    assert not torch.equal(other_step.latents[0], alone.latents[0])


def test_it_paces_like_the_real_loop_and_stops_where_it_does(tiny: Path) -> None:
    engine = SyntheticEngine.from_checkpoint(tiny, step_delay_s=0.01, max_batch_samples=2)
    calls = 0

    def give_up_at_the_fourth() -> None:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise TimeoutError("the caller gave up")

    with pytest.raises(TimeoutError):
        engine.generate(requests(), PARAMS, seed=0, step=0, between_steps=give_up_at_the_fourth)
    assert calls == 4
    engine.generate(requests(), PARAMS, seed=0, step=0, between_steps=lambda: None)  # 3 batches x 5 steps


def test_updates_are_checked_whole_and_only_move_the_version(tiny: Path) -> None:
    engine = SyntheticEngine.from_checkpoint(tiny, step_delay_s=0.0, max_batch_samples=4)
    shape = load_bagel_model(tiny, dtype=torch.float32).get_parameter(Q + ".weight").shape
    good = {Q + ".lora_A.weight": torch.zeros(4, shape[1]), Q + ".lora_B.weight": torch.zeros(shape[0], 4)}
    engine.apply_update(PolicyUpdate(1, "lora", good, lora_rank=4, lora_alpha=8.0))
    assert engine.policy_version == 1
    bad = {Q + ".lora_A.weight": torch.zeros(4, shape[1] + 1), Q + ".lora_B.weight": torch.zeros(shape[0], 4)}
    with pytest.raises(PolicyUpdateError, match="mis-shaped"):
        engine.apply_update(PolicyUpdate(2, "lora", bad, lora_rank=4, lora_alpha=8.0))
    with pytest.raises(PolicyUpdateError, match="not newer"):
        engine.apply_update(PolicyUpdate(1, "lora", good, lora_rank=4, lora_alpha=8.0))
    assert engine.policy_version == 1


def test_a_whole_run_goes_through_the_real_services_with_it(tiny: Path, tmp_path: Path) -> None:
    """The demo recipe with the load-test engine and scorer: the coordinator, the bus, the reward
    service and the trainer all real; steps complete, every sample is scored and trained."""
    demo = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"
    overrides = [f"run_dir={tmp_path}", f"model.checkpoint={tiny}", "rollout.engine=synthetic",
                 "launch.launcher=inprocess", "schedule.steps=2", "schedule.eval_every=0",
                 "schedule.save_every=0", "data.val_prompts=0",
                 "reward.scorers=[{name: synthetic, weight: 1.0}]"]  # fmt: skip
    history = train(load_run_config(demo, overrides), progress=None)
    cfg = load_run_config(demo, overrides)
    assert [int(m["training/global_step"]) for m in history] == [1, 2]
    assert all(m["trainer/samples"] == cfg.samples_per_step for m in history)
    assert all(math.isfinite(m["actor/pg_loss"]) for m in history)


def test_no_recipe_uses_the_load_test_engine() -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    for recipe in sorted(examples.glob("*.yaml")):
        section = yaml.safe_load(recipe.read_text()).get("rollout") or {}
        assert section.get("engine", "native") != "synthetic", recipe.name


def test_the_load_test_scorer_takes_its_delay_per_image_and_scores_the_image() -> None:
    reward = build_reward(RewardConfig(scorers=[ScorerSpec("synthetic")], synthetic_delay_s=0.01))
    images = [np.full((8, 8, 3), value, dtype=np.uint8) for value in (0, 255, 255)]
    started = time.perf_counter()
    batch = reward.score([Sample(image, prompt="a prompt") for image in images])
    assert time.perf_counter() - started >= 0.03
    assert [r.reward for r in batch.results] == pytest.approx([0.0, 1.0, 1.0])
