"""One FlowGRPO training step on a tiny BAGEL (CPU, fp32, deterministic shapes)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowgrpo.algorithms.flow_grpo.objective import FlowGRPOObjective
from flowgrpo.configs.trainer import LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, make_tiny_bagel
from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.sampler_math import StepResult
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import LogProbGapError, TrainStep, Trajectory

PARAMS = SamplerParams(num_points=6, height=32, width=32, window_size=2, window_range=(0, 4),
                       deterministic=True, decode_images=False, cfg_text_scale=2.0)  # fmt: skip
PROMPTS = {"p0": [384, 5, 6, 7, 385], "p1": [384, 9, 10, 385]}
LORA = PolicyConfig(kind="lora", lora_rank=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


def rollout(
    sampler: BagelSampler,
    advantages: list[float],
    version: int = 0,
    step: int = 0,
    params: SamplerParams = PARAMS,
) -> list[Trajectory]:
    requests = [SampleRequest(uid, i, torch.tensor(ids)) for uid, ids in PROMPTS.items() for i in range(2)]
    out = sampler.generate(requests, params, seed=3, step=step)
    return [
        Trajectory(
            r.prompt_uid,
            r.sample_index,
            version,
            a,
            r.prompt_ids,
            out.latents[i],
            out.log_probs[i],
            out.sigmas[i],
        )
        for i, (r, a) in enumerate(zip(requests, advantages, strict=True))
    ]


def trainer(tiny: Path, policy: PolicyConfig = LORA, **loss: object) -> TrainStep:
    model = load_bagel_model(tiny, dtype=torch.float32)
    cfg = LossConfig(**{"mini_batches": 1, "micro_batch_size": 1, **loss})  # type: ignore[arg-type]
    return TrainStep(
        TrainablePolicy(model, policy),
        load_special_tokens(tiny),
        TrainerConfig(optim=OptimConfig(lr=1e-3), loss=cfg),
    )


def sampler_for(tiny: Path) -> BagelSampler:
    return BagelSampler(load_bagel_model(tiny, dtype=torch.float32), None, load_special_tokens(tiny))


def test_sync_recompute_equals_behaviour_and_ratio_is_one(tiny: Path) -> None:
    """Deterministic mode, policy version 0: the trainer's logp_old is the rollout's, bitwise."""
    step = trainer(tiny)
    batch = rollout(sampler_for(tiny), [1.5, -0.5, 0.25, 2.0])  # hand-set, not centred
    metrics = step.run(batch, PARAMS)
    assert metrics["actor/rollout_logp_gap/max"] == 0.0
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/pg_clipfrac"] == 0.0
    # ratio 1 everywhere: the loss is -mean(A) over (sample, window step) entries
    assert metrics["actor/pg_loss"] == pytest.approx(-sum([1.5, -0.5, 0.25, 2.0]) / 4, abs=1e-7)
    assert step.version == 1 and metrics["trainer/lag/max"] == 0.0
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_steps"] == 0


@pytest.mark.parametrize(
    ("policy", "mode"),
    [(LORA, "flow_grpo"), (PolicyConfig(kind="full"), "flow_grpo"), (LORA, "grpo_guard")],
    ids=["lora", "full", "lora-grpo-guard"],
)
def test_advantage_sign_moves_the_log_prob(tiny: Path, policy: PolicyConfig, mode: str) -> None:
    sampler = sampler_for(tiny)
    for advantage in (1.0, -1.0):
        step = trainer(tiny, policy, clip_eps=0.5, mode=mode)
        batch = rollout(sampler, [advantage, 0.0, 0.0, 0.0])[:1]
        before = batch[0].log_probs.sum()
        step.run(batch, PARAMS)
        with torch.no_grad():
            after = step.forwards.window_log_probs(batch, PARAMS).log_prob.sum()
        assert (after - before) * advantage > 0, f"A={advantage}: log-prob {before} -> {after}"


def test_published_lora_makes_the_rollout_sample_what_the_trainer_model_samples(tiny: Path) -> None:
    step = trainer(tiny)
    sampler = sampler_for(tiny)
    step.run(rollout(sampler, [1.0, -1.0, 0.5, -0.5]), PARAMS)
    published = PolicyUpdate(step.version, "lora", dict(step.policy.published()), lora_rank=4, lora_alpha=8.0)
    assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in published.tensors)
    PolicyApplier(sampler.model, lora_mode="peft").apply(published)
    trainer_sampler = BagelSampler(step.policy.model, None, sampler.special)
    requests = [SampleRequest("p0", 0, torch.tensor(PROMPTS["p0"]))]
    with torch.no_grad():
        ours = trainer_sampler.generate(requests, PARAMS, seed=5, step=1)
        theirs = sampler.generate(requests, PARAMS, seed=5, step=1)
    assert torch.equal(ours.latents, theirs.latents) and torch.equal(ours.log_probs, theirs.log_probs)

    # and the next training step sees no gap against that rollout (peft mode: bitwise, at v1)
    batch = rollout(sampler, [1.0, -1.0, 0.5, -0.5], version=1, step=1)
    metrics = step.run(batch, PARAMS)
    assert metrics["actor/rollout_logp_gap/max"] == 0.0 and metrics["actor/ratio_mean"] == 1.0


def test_merged_lora_rollout_differs_only_by_rounding(tiny: Path) -> None:
    step = trainer(tiny)
    sampler = sampler_for(tiny)
    step.run(rollout(sampler, [1.0, -1.0, 0.5, -0.5]), PARAMS)
    update = PolicyUpdate(1, "lora", dict(step.policy.published()), lora_rank=4, lora_alpha=8.0)
    PolicyApplier(sampler.model, lora_mode="merge").apply(update)
    metrics = step.run(rollout(sampler, [1.0, -1.0, 0.5, -0.5], version=1, step=1), PARAMS)
    assert metrics["actor/rollout_logp_gap/max"] < 1e-4


def test_off_policy_samples_get_importance_weights(tiny: Path) -> None:
    step = trainer(tiny)
    sampler = sampler_for(tiny)
    step.run(rollout(sampler, [1.0, -1.0, 0.5, -0.5]), PARAMS)  # now at version 1
    stale = rollout(sampler, [1.0, -1.0, 0.5, -0.5], version=0, step=1)  # drawn with v0 weights
    with torch.no_grad():  # the proximal policy: the v1 weights the step starts from
        prox = [
            float(lp) for t in stale for lp in step.forwards.window_log_probs([t], PARAMS).log_prob.flatten()
        ]
    behaviour = [float(lp) for t in stale for lp in t.log_probs]
    # the recompute checked against another path: at v0 (a trainer with the same start, never
    # updated) it gives the rollout sampler's own log-probs, bitwise; at v1 the update moved them
    control = trainer(tiny)
    with torch.no_grad():
        at_v0 = [
            float(lp)
            for t in stale
            for lp in control.forwards.window_log_probs([t], PARAMS).log_prob.flatten()
        ]
    assert at_v0 == behaviour
    metrics = step.run(stale, PARAMS)
    assert metrics["trainer/lag/max"] == 1.0
    gaps = [abs(p - b) for p, b in zip(prox, behaviour, strict=True)]  # v0 behaviour vs v1 proximal
    assert max(gaps) > 1e-6  # a recompute that ignored the weights would give 0 and pass below
    assert metrics["actor/rollout_logp_gap/max"] == pytest.approx(max(gaps), rel=1e-6)
    # Kish's effective sample size n_eff / n of the truncated weights w = min(p_prox / p_behaviour, cap),
    # compared as 1 - ESS: the weights are close to 1, and all-equal weights would give exactly 1
    w = [min(math.exp(p - b), step.loss.is_cap) for p, b in zip(prox, behaviour, strict=True)]
    ess = sum(w) ** 2 / (len(w) * sum(x * x for x in w))
    assert 1 - metrics["actor/is_ess"] == pytest.approx(1 - ess, rel=1e-3), (metrics["actor/is_ess"], ess)


def test_mini_batches_and_micro_batches_accumulate_to_the_same_first_gradient(tiny: Path) -> None:
    batch = rollout(sampler_for(tiny), [1.0, -1.0, 0.5, 2.0])
    grads = []
    for micro in (1, 3):
        step = trainer(tiny)
        step.loss = replace(step.loss, micro_batch_size=micro)
        step.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]  # keep the gradient
        step.run(batch, PARAMS)
        grads.append(
            torch.cat([p.grad.flatten() for p in step.policy.trainable().values() if p.grad is not None])
        )
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)  # masks, not duplicates


@pytest.mark.parametrize(("mini_batches", "recomputed"), [(1, 0), (2, 2)])
def test_the_first_mini_batch_takes_its_logp_old_from_its_own_forward(
    tiny: Path, mini_batches: int, recomputed: int
) -> None:
    """Nothing updates the weights before the first mini-batch's forwards, so they are the
    proximal policy's: its rows are not recomputed (one mini-batch: no logp_old pass at all), and
    the logp_old the step ends with is bitwise a recompute of every row (deterministic CPU)."""
    batch = rollout(sampler_for(tiny), [1.5, -0.5, 0.25, 2.0])
    step = trainer(tiny, mini_batches=mini_batches)
    expected = step.objective.recompute(batch, PARAMS).clone()  # every row, before any update
    window_log_probs, without_grad = step.forwards.window_log_probs, []

    def counting(part: list[Trajectory], params: SamplerParams) -> StepResult:
        if not torch.is_grad_enabled():
            without_grad.append(len(part))
        return window_log_probs(part, params)

    vars(step.forwards)["window_log_probs"] = counting
    metrics = step.run(batch, PARAMS)
    assert sum(without_grad) == recomputed  # rows, micro-batches of 1
    assert isinstance(step.objective, FlowGRPOObjective)
    assert torch.equal(step.objective._logp_old, expected)
    gap = (expected - torch.stack([t.log_probs for t in batch])).abs()
    assert metrics["actor/rollout_logp_gap/max"] == float(gap.max())
    # the first mini-batch's ratio is exactly 1; the second's moved with the first update
    assert (metrics["actor/ratio_mean"] == 1.0) == (mini_batches == 1)


def counted_prefills(step: TrainStep) -> list[int]:
    """The rows of every prefill the step's model runs from now on."""
    model = step.policy.model
    prefill, rows = model.prefill, []

    def counting(ids: torch.Tensor, mask: torch.Tensor) -> object:
        rows.append(ids.shape[0])
        return prefill(ids, mask)

    vars(model)["prefill"] = counting
    return rows


@pytest.mark.parametrize(
    ("mode", "params", "prefills"),
    [
        ("deterministic", PARAMS, [1, 1]),  # each prompt alone, as the sampler prefills it
        ("batch_invariant", replace(PARAMS, deterministic=False, batch_invariant=True), [1, 1]),
        ("batched", replace(PARAMS, deterministic=False), [2]),  # both prompts in one prefill
    ],
)
def test_a_step_prefills_each_distinct_prompt_once_and_trains_as_a_prefill_per_micro_batch(
    tiny: Path, mode: str, params: SamplerParams, prefills: list[int]
) -> None:
    """Inside a step the prompts' prefill is the step's one prefill of its distinct prompts,
    shared by the logp_old pass and every micro-batch. A trainer prefilling every micro-batch's
    rows (as before) computes the same step: bitwise where the sampler's results do not depend
    on the batch (and both then score the rollout's samples exactly), else within rounding.

    The rollout samples with the mode's own settings: deterministic mode's forwards run on one
    thread, the others on every thread, and a rollout of the one scored by a trainer of the other
    compares two thread counts, whose GEMMs split their sums apart on some CPUs (MKL on an AMD
    EPYC with AVX-512: a gap of 5.96e-08)."""
    batch = rollout(sampler_for(tiny), [1.5, -0.5, 0.25, 2.0], params=params)
    shared, per_micro = trainer(tiny, mini_batches=2), trainer(tiny, mini_batches=2)
    per_micro.forwards.begin_step = lambda batch: None  # type: ignore[method-assign]  # no step cache
    shared_rows, per_micro_rows = counted_prefills(shared), counted_prefills(per_micro)
    metrics = [shared.run(batch, params), per_micro.run(batch, params)]
    assert shared_rows == prefills  # 2 prompts of 4 samples: each once
    # micro-batches of 1 sample: the logp_old pass of the second mini-batch's 2, the update's 4
    assert per_micro_rows == [1] * 6
    figures = [{k: v for k, v in m.items() if not k.startswith("timing_s/")} for m in metrics]
    weights = [list(step.policy.trainable().values()) for step in (shared, per_micro)]
    if mode == "batched":
        assert figures[0] == pytest.approx(figures[1], rel=1e-4, abs=1e-6)
        for a, b in zip(*weights, strict=True):
            torch.testing.assert_close(a, b)
        return
    assert figures[0] == figures[1] and figures[0]["actor/rollout_logp_gap/max"] == 0.0
    for a, b in zip(*weights, strict=True):
        assert torch.equal(a, b)


def test_a_trainable_language_half_is_prefilled_every_micro_batch(tiny: Path) -> None:
    """The prefill reads the language half: while any of it trains, a step's updates would make
    a step-long prefill stale, so every micro-batch prefills its own rows."""
    step = trainer(tiny, mini_batches=2)
    step.policy.model.language_model.model.embed_tokens.weight.requires_grad_(True)
    rows = counted_prefills(step)
    step.run(rollout(sampler_for(tiny), [1.5, -0.5, 0.25, 2.0]), PARAMS)
    assert rows == [1] * 6


class Stop(Exception):
    pass


def test_a_step_abandoned_before_its_first_update_leaves_the_trainer_as_it_was(tiny: Path) -> None:
    """``may_stop`` raising between micro-batches (a caller that gave up) ends the step with
    nothing of it applied; from the first optimizer update on, the step is no longer stopped."""
    batch = rollout(sampler_for(tiny), [1.0, -1.0, 0.5, -0.5])
    step, fresh = trainer(tiny, mini_batches=2), trainer(tiny, mini_batches=2)
    before = {k: v.detach().clone() for k, v in step.policy.trainable().items()}
    calls = 0

    def stop_at_the_fourth_check() -> None:  # checks 1, 2: logp_old of the second mini-batch;
        nonlocal calls  # 3, 4: the first mini-batch's micro-batches: the 4th comes after the first's backward
        calls += 1
        if calls == 4:
            raise Stop

    with pytest.raises(Stop):
        step.run(batch, PARAMS, may_stop=stop_at_the_fourth_check)
    assert step.version == 0 and step.steps_done == 0 and not step.optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in step.policy.trainable().items())
    # the abandoned step left nothing behind: the next one is the step a fresh trainer takes
    ours, theirs = step.run(batch, PARAMS), fresh.run(batch, PARAMS)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert ours[key] == theirs[key], key
    # once the first mini-batch's update is applied, a stop request is no longer honoured
    seen = 0

    def count() -> None:
        nonlocal seen
        seen += 1

    step.run(batch, PARAMS, may_stop=count)
    assert seen == 2 + 2 + 1  # 2 logp_old parts, 2 micro-batches, before the update; then never


def test_the_on_policy_gap_is_measured_free_and_is_zero_for_exact_numerics(tiny: Path) -> None:
    """The update's first forward runs the weights that sampled (lag 0): its gap to the behaviour
    log-probs is measured without a recompute, exactly 0 on deterministic CPU, so logp_old=bypass
    with the strictest alarm (0) trains like recompute."""
    batch = rollout(sampler_for(tiny), [1.5, -0.5, 0.25, 2.0])
    bypass = trainer(tiny, logp_old="bypass", max_logp_gap=0.0, mini_batches=2, bypass_check_every=10**6)
    bypass.objective.last_gap, bypass.steps_done = (
        0.0,
        1,
    )  # a gap measured before, not a check step: bypass now
    recompute = trainer(tiny, mini_batches=2)
    ours, theirs = bypass.run(batch, PARAMS), recompute.run(batch, PARAMS)
    assert ours["actor/logp_old_bypassed"] == 1.0 and theirs["actor/logp_old_bypassed"] == 0.0
    assert ours["actor/on_policy_logp_gap/max"] == theirs["actor/on_policy_logp_gap/max"] == 0.0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ratio_mean"):
        assert ours[key] == theirs[key], key


@pytest.mark.parametrize("logp_old", ["bypass", "recompute"])
def test_a_rollout_not_sampling_the_trainers_weights_stops_the_step_before_any_update(
    tiny: Path, logp_old: str
) -> None:
    """The weight-sync alarm: behaviour log-probs of another policy (here: the base, while the
    trainer already trained one step) on samples that claim the trainer's version."""
    step = trainer(tiny, logp_old=logp_old, max_logp_gap=1e-6, bypass_check_every=10**6)
    step.objective.last_gap = 0.0
    step.run(rollout(sampler_for(tiny), [1.0, -1.0, 0.5, -0.5]), PARAMS)  # version 1 now
    stale = rollout(sampler_for(tiny), [1.0, -1.0, 0.5, -0.5], version=1)  # sampled by the base
    before = {k: v.detach().clone() for k, v in step.policy.trainable().items()}
    with pytest.raises(LogProbGapError, match="broken weight sync"):
        step.run(stale, PARAMS)
    assert step.version == 1 and all(torch.equal(v, before[k]) for k, v in step.policy.trainable().items())


def test_bypass_without_an_alarm_is_refused() -> None:
    with pytest.raises(ValueError, match="max_logp_gap"):
        LossConfig(logp_old="bypass").validate()


@pytest.mark.bitwise
@pytest.mark.parametrize("micro_batch", [1, 2, 3])
def test_batch_invariant_rollouts_and_trainer_compute_the_same_log_probs_bitwise(
    tiny: Path, micro_batch: int
) -> None:
    """``batch_invariant``: the rollout samples 8 trajectories of 2 prompts in one batch (all
    threads, not the deterministic mode's batch of one), the trainer re-scores them in shuffled
    micro-batches of another size, before and after a LoRA version is published to the rollout
    (peft: the trainer's own LoRA computation): the gap is 0, bitwise, at every version. Without
    the setting the same batches part at float rounding (the control)."""
    params = replace(PARAMS, deterministic=False, batch_invariant=True)
    sampler = sampler_for(tiny)
    step = trainer(tiny, micro_batch_size=micro_batch, mini_batches=2, max_logp_gap=0.0)
    applier = PolicyApplier(sampler.model, lora_mode="peft")
    for version in (0, 1):
        batch = sampled(sampler, params, version, order_seed=micro_batch + version)
        metrics = step.run(batch, params)
        assert metrics["actor/rollout_logp_gap/max"] == 0.0, f"version {version}"
        assert metrics["actor/on_policy_logp_gap/max"] == 0.0
        update = dict(step.policy.published())
        applier.apply(PolicyUpdate(step.version, "lora", update, lora_rank=4, lora_alpha=8.0))
    # micro-batches of one against the batch of 8: the shapes farthest apart, whose sums part on
    # every instruction set tried (micro-batches of 3 matched the batch bitwise on MKL's SSE4.2 path)
    control = trainer(tiny, micro_batch_size=1, mini_batches=2)
    plain = replace(params, batch_invariant=False)
    assert (
        control.run(sampled(sampler_for(tiny), plain, 0, order_seed=0), plain)["actor/rollout_logp_gap/max"]
        > 0
    )


def sampled(
    sampler: BagelSampler, params: SamplerParams, version: int, *, order_seed: int
) -> list[Trajectory]:
    """8 trajectories (2 prompts x 4) drawn in ONE batch, in a shuffled order."""
    requests = [SampleRequest(uid, i, torch.tensor(ids)) for uid, ids in PROMPTS.items() for i in range(4)]
    out = sampler.generate(requests, params, seed=3, step=version)
    batch = [
        Trajectory(r.prompt_uid, r.sample_index, version, (-1.0) ** i, r.prompt_ids, out.latents[i],
                   out.log_probs[i], out.sigmas[i])
        for i, r in enumerate(requests)
    ]  # fmt: skip
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(order_seed)).tolist()
    return [batch[i] for i in order]


class SecondOfTwoRanks(Dist):
    """Rank 1 of 2 without a process group: its share of rows, its own sums (what the objective
    computes on that rank before any all-reduce)."""

    def __init__(self) -> None:
        super().__init__(rank=1, world=2)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def max(self, value: torch.Tensor) -> torch.Tensor:
        return value


def test_grpo_guard_on_a_rank_above_0_has_the_proximal_means_of_every_row_it_trains(tiny: Path) -> None:
    """6 rows in 2 mini-batches of 3 on 2 ranks: rank 1 trains row 1 and a padding row, then row 4
    and a padding row. The proximal step means must be those of exactly these rows: a recompute
    shared over the whole batch gave rank 1 rows 1, 3 and 5, and row 4's missing mean (taken as 0)
    made its ratio exp(drift / 2 var) far from 1 (and a padding row's could overflow: inf x mask 0
    is a NaN loss)."""
    sampler = sampler_for(tiny)
    batch = (rollout(sampler, [1.0, -1.0, 0.5, -0.5]) + rollout(sampler, [0.3, -0.3, 0.0, 0.0], step=1))[:6]
    model = load_bagel_model(tiny, dtype=torch.float32)
    loss = LossConfig(mode="grpo_guard", mini_batches=2, micro_batch_size=2, clip_eps=0.2)
    step = TrainStep(
        TrainablePolicy(model, LORA), load_special_tokens(tiny), TrainerConfig(loss=loss), SecondOfTwoRanks()
    )
    metrics = step.run(batch, PARAMS)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor/skipped_steps"] == 0
    # this rank's sums over the mini-batch's 3 rows (no all-reduce here): its one valid row of 3
    assert abs(3 * metrics["actor/ratio_mean"] - 1.0) < 0.05  # 0.76 with row 4's mean lost


def fp8_rollout(tiny: Path, advantages: list[float]) -> list[Trajectory]:
    """The same requests drawn by an FP8 rollout (rollout.precision=fp8: the gen path's linear
    layers quantized; on a CPU PyTorch's reference kernel), each trajectory marked as such."""
    from flowgrpo.models.bagel.fp8 import quantize_gen_path

    sampler = sampler_for(tiny)
    quantize_gen_path(sampler.model)
    return [replace(t, fp8=True) for t in rollout(sampler, advantages)]


def test_fp8_samples_are_weighted_by_the_truncated_importance_ratio_at_lag_0(tiny: Path) -> None:
    """TIS: w = min(pi_old / pi_fp8, cap) on every window step of an FP8 sample, at lag 0 too.
    Before the first update the ratio to logp_old is 1, so the step's pg_loss is mean(-A w): the
    weights written out from the trainer's own recompute. The same trajectories unmarked train
    as on-policy samples (pg_loss mean(-A))."""
    advantages = [1.0, -1.0, 0.5, -0.25]
    batch = fp8_rollout(tiny, advantages)
    step = trainer(tiny, is_cap=1.0002)  # gaps here are ~1e-4: a cap that binds on some steps
    with torch.no_grad():
        old = [step.forwards.window_log_probs([t], PARAMS).log_prob.flatten() for t in batch]
    ratios = [torch.exp(o - t.log_probs) for o, t in zip(old, batch, strict=True)]
    gaps = torch.cat([(o - t.log_probs).abs() for o, t in zip(old, batch, strict=True)])
    assert float(gaps.min()) > 0  # FP8 sampled another function than the fp32 trainer
    weights = [r.clamp(max=1.0002) for r in ratios]
    expected = torch.cat([-a * w for a, w in zip(advantages, weights, strict=True)]).double().mean()
    metrics = step.run(batch, PARAMS)
    assert metrics["actor/pg_loss"] == pytest.approx(float(expected), rel=1e-5)
    every = torch.cat(ratios)
    assert metrics["actor/is_capped"] == pytest.approx(float((every > 1.0002).double().mean()))
    assert 0 < metrics["actor/is_capped"] < 1
    assert metrics["actor/is_weight/max"] == pytest.approx(float(torch.cat(weights).max()), rel=1e-6)
    assert metrics["actor/fp8_logp_gap/max"] == pytest.approx(float(gaps.max()), rel=1e-5)
    assert metrics["actor/fp8_logp_gap/p50"] == pytest.approx(float(gaps.double().median()), rel=0.3)
    assert metrics["actor/on_policy_fp8_logp_gap/rows"] == 4.0
    assert metrics["actor/on_policy_logp_gap/rows"] == 0
    assert metrics["actor/on_policy_fp8_logp_gap/max"] == pytest.approx(float(gaps.max()), rel=1e-5)
    unmarked = trainer(tiny, is_cap=1.0002).run([replace(t, fp8=False) for t in batch], PARAMS)
    assert unmarked["actor/pg_loss"] == pytest.approx(-sum(advantages) / 4, rel=1e-6)
    assert "actor/fp8_logp_gap/max" not in unmarked and "actor/is_capped" not in unmarked


def test_the_fp8_alarm_has_its_own_threshold(tiny: Path) -> None:
    """FP8 samples are compared against trainer.loss.max_fp8_logp_gap, not max_logp_gap: an
    exact-numerics threshold for the rest (0) lets them through; a threshold below their
    quantization gap stops the step before any update, naming the key."""
    batch = fp8_rollout(tiny, [1.0, -1.0, 0.5, -0.25])
    trainer(tiny, max_logp_gap=0.0).run(batch, PARAMS)
    step = trainer(tiny, max_fp8_logp_gap=1e-9)
    before = {k: v.detach().clone() for k, v in step.policy.trainable().items()}
    with pytest.raises(LogProbGapError, match=r"on FP8 samples .*trainer.loss.max_fp8_logp_gap=1e-09"):
        step.run(batch, PARAMS)
    assert step.version == 0 and all(torch.equal(v, before[k]) for k, v in step.policy.trainable().items())


def test_a_bypassing_trainer_refuses_an_fp8_sample_naming_it(tiny: Path) -> None:
    """The trainer's own guard, behind the recipe's: under logp_old=bypass the rollout's log-probs
    stand for the old policy's, which an FP8 rollout's are not. A request with one FP8 sample is
    refused before any rank trains, naming the sample and the fix; the same sample unmarked passes
    this check (it then fails on its missing inputs, which this request does not carry)."""
    from flowgrpo.config import load_config
    from flowgrpo.configs.trainer import TrainerServiceConfig
    from flowgrpo.runtime.errors import InvalidArgument
    from flowgrpo.services.trainer.core import TrainerCore
    from flowgrpo.v1 import trainer_pb2

    overrides = [f"trainer.checkpoint={tiny}", "trainer.device=cpu", "trainer.dtype=float32",
                 "trainer.loss.logp_old=bypass", "trainer.loss.max_logp_gap=1e-3"]  # fmt: skip
    core = TrainerCore(load_config(TrainerServiceConfig, None, overrides), Dist())
    try:
        sample = trainer_pb2.TrainSample(prompt_uid="p0", sample_index=1, advantage=-1.0, precision="fp8")
        request = trainer_pb2.TrainStepRequest(step=1, samples=[sample])
        request.params.CopyFrom(PARAMS.to_proto())
        with pytest.raises(InvalidArgument) as refused:
            core.check(request)
        message = str(refused.value)
        assert message.startswith("TrainStepRequest.samples[0]: sample p0/1 was drawn by an FP8 rollout")
        assert "use trainer.loss.logp_old=recompute" in message and "\n" not in message
        request.samples[0].precision = ""
        with pytest.raises(InvalidArgument, match=r"samples\[0\].inputs: sample p0/1 lacks input columns"):
            core.check(request)
    finally:
        core.close()
