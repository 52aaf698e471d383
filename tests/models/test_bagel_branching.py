"""Branched rollouts (``SamplerSettings.branch``) on the tiny random BAGEL (CPU, fp32): a prompt
group's samples share their initial noise, so the ODE steps before the group's window are one
trajectory, computed once per group; from the window's first step each sample has its own row.

Deterministic mode is compared bitwise; batched mode within 1e-4 (absolute and relative):
its forwards see other rows (prompts padded to the longest, one prefix row instead of G sample
rows), which changes the matmuls' shapes and so their fp32 rounding (1.5e-6 at most here over 8
steps), while two different samples differ by O(1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgrpo.models.bagel import sampling
from flowgrpo.models.bagel.attention import query_runs
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, load_vae, make_tiny_bagel
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest, Trajectories
from flowgrpo.sampler_math import initial_noise, window_begin
from flowgrpo.sampler_params import SamplerParams

pytestmark = pytest.mark.bitwise  # tests/test_instruction_sets.py re-runs these on other ISAs

SEED, STEP = 11, 0  # the three groups' windows begin at steps 0, 2 and 3 (asserted below)
PARAMS = SamplerParams(num_points=9, height=64, width=64, window_size=2, window_range=(0, 5), branch=True)
FIELDS = [f.name for f in dataclasses.fields(Trajectories)]
BATCHED = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> BagelSampler:
    folder: Path = make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)
    model = load_bagel_model(folder, dtype=torch.float32).eval()
    return BagelSampler(model, load_vae(folder, dtype=torch.float32), load_special_tokens(folder))


def groups(sizes: tuple[int, ...] = (3, 3, 3)) -> list[list[SampleRequest]]:
    """Prompts of different lengths, ``sizes[p]`` samples of prompt p."""
    g = torch.Generator().manual_seed(5)
    out = []
    for p, (size, length) in enumerate(zip(sizes, [3, 7, 5], strict=False)):
        ids = torch.randint(1, 380, (length,), generator=g)
        out.append([SampleRequest(f"p{p}", s, ids) for s in range(size)])
    return out


def interleaved(parts: list[list[SampleRequest]]) -> list[SampleRequest]:
    """The groups' samples taken in turn: a group's rows are not consecutive in the request."""
    longest = max(len(p) for p in parts)
    return [p[i] for i in range(longest) for p in parts if i < len(p)]


@pytest.fixture
def group_noise_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unbranched sampling from each group's shared initial noise: the reference that branched
    sampling must reproduce (only the prefix's compute is shared)."""

    def shared(shape: tuple[int, ...], **coords: Any) -> torch.Tensor:
        return initial_noise(shape, **{**coords, "shared": True})

    monkeypatch.setattr(sampling, "initial_noise", shared)


@pytest.fixture
def forward_rows(sampler: BagelSampler) -> Iterator[list[int]]:
    """The rows of every model forward (both CFG branches of each row counted); each forward's
    context is also checked: its query runs, which the sampler takes from host lengths, are those
    of its mask on the device."""
    rows: list[int] = []
    original: Callable[..., torch.Tensor] = sampler.model.predict_velocity

    def counting(cache: Any, x_t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows.append(x_t.shape[0])
        assert cache.query_runs() == query_runs(cache.key_mask)
        return original(cache, x_t, *args, **kwargs)

    sampler.model.predict_velocity = counting  # type: ignore[method-assign]
    try:
        yield rows
    finally:
        del sampler.model.predict_velocity


def begins(params: SamplerParams) -> list[int]:
    return [window_begin(params, SEED, STEP, f"p{p}") for p in range(3)]


def assert_same(a: Trajectories, b: Trajectories) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name


def assert_close(a: Trajectories, b: Trajectories) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
        elif name == "images":  # uint8: a rounding difference may move a pixel by one level
            assert (x.int() - y.int()).abs().max() <= 1
        else:
            torch.testing.assert_close(x, y, **BATCHED, msg=name)


def test_the_test_windows_include_a_branch_at_the_start_and_later_ones() -> None:
    assert begins(PARAMS) == [0, 2, 3]


def test_deterministic_branching_is_bitwise_unbranched_sampling_from_the_groups_noise(
    sampler: BagelSampler, group_noise_everywhere: None
) -> None:
    reqs = interleaved(groups())
    det = replace(PARAMS, deterministic=True)
    branched = sampler.generate(reqs, det, seed=SEED, step=STEP)
    unbranched = sampler.generate(reqs, replace(det, branch=False), seed=SEED, step=STEP)
    assert_same(branched, unbranched)  # every stored tensor: window latents, log-probs, ..., images
    assert branched.images is not None


def test_batched_branching_equals_unbranched_sampling_within_rounding(
    sampler: BagelSampler, group_noise_everywhere: None
) -> None:
    reqs = interleaved(groups())
    reference = sampler.generate(reqs, replace(PARAMS, deterministic=True), seed=SEED, step=STEP)
    branched = sampler.generate(reqs, PARAMS, seed=SEED, step=STEP)
    unbranched = sampler.generate(reqs, replace(PARAMS, branch=False), seed=SEED, step=STEP)
    assert_close(branched, reference)
    assert_close(unbranched, reference)
    assert torch.equal(branched.window_begin, reference.window_begin)
    assert torch.equal(branched.timesteps, reference.timesteps) and torch.equal(
        branched.sigmas, reference.sigmas
    )


def test_the_prefix_is_computed_once_per_group(sampler: BagelSampler, forward_rows: list[int]) -> None:
    """Rows through the model: groups x prefix steps + samples x the remaining steps, times the two
    CFG branches; without branching every sample every step."""
    sizes = (3, 2, 4)
    reqs = interleaved(groups(sizes))
    steps, b = PARAMS.num_steps, begins(PARAMS)
    sampler.generate(reqs, replace(PARAMS, decode_images=False), seed=SEED, step=STEP)
    branched = sum(begin + (steps - begin) * g for begin, g in zip(b, sizes, strict=True))
    assert forward_rows == [2 * sum(1 if i < begin else g for begin, g in zip(b, sizes, strict=True))
                            for i in range(steps)]  # fmt: skip
    assert sum(forward_rows) == 2 * branched == 2 * (0 + 8 * 3 + 2 + 6 * 2 + 3 + 5 * 4)
    forward_rows.clear()
    sampler.generate(reqs, replace(PARAMS, decode_images=False, branch=False), seed=SEED, step=STEP)
    assert forward_rows == [2 * sum(sizes)] * steps
    forward_rows.clear()  # deterministic: the same rows, one row (two with CFG) per forward
    sampler.generate(reqs, replace(PARAMS, decode_images=False, deterministic=True), seed=SEED, step=STEP)
    assert forward_rows == [2] * branched
    forward_rows.clear()  # no CFG (text scale 1): one branch
    sampler.generate(reqs, replace(PARAMS, decode_images=False, cfg_text_scale=1.0), seed=SEED, step=STEP)
    assert sum(forward_rows) == branched


def test_a_group_shares_its_window_start_and_its_samples_part_there(sampler: BagelSampler) -> None:
    parts = groups()
    out = sampler.generate(interleaved(parts), replace(PARAMS, decode_images=False), seed=SEED, step=STEP)
    rows = {p: [i for i, r in enumerate(interleaved(parts)) if r.prompt_uid == f"p{p}"] for p in range(3)}
    start = out.latents[:, 0]  # x[begin]
    for p, members in rows.items():
        first = members[0]
        for other in members[1:]:
            assert torch.equal(start[other], start[first]), "x[begin] is the group's shared prefix end"
            assert not torch.equal(out.latents[other, 1], out.latents[first, 1]), "own SDE noise"
            assert not torch.equal(out.final_latents[other], out.final_latents[first])
        for q in range(p + 1, 3):
            assert not torch.equal(start[rows[q][0]], start[first]), "another group, another prefix"
    # a group that branches at step 0 starts its window from the group's initial noise itself
    shape = tuple(out.final_latents.shape[1:])
    noise = initial_noise(shape, seed=SEED, step=STEP, prompt_uid="p0", sample_index=1, shared=True)
    assert all(torch.equal(start[i], noise) for i in rows[0])


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_group_split_across_calls_equals_one_call(sampler: BagelSampler, deterministic: bool) -> None:
    """As two replicas (or two batches of one replica) would sample it: each call computes the
    prefix for its part of the group; randomness by coordinates makes it the same prefix."""
    reqs = interleaved(groups())
    params = replace(PARAMS, deterministic=deterministic, decode_images=False)
    whole = sampler.generate(reqs, params, seed=SEED, step=STEP)
    first, second = reqs[:4], reqs[4:]  # p0 and p1 have samples in both calls
    split = sampling.concat_trajectories(
        [
            sampler.generate(first, params, seed=SEED, step=STEP),
            sampler.generate(second, params, seed=SEED, step=STEP),
        ]
    )
    if deterministic:
        assert_same(split, whole)
    else:
        assert_close(split, whole)


def test_branching_changes_only_the_initial_noise_and_the_noise_is_the_groups(sampler: BagelSampler) -> None:
    reqs = groups()[1]
    params = replace(PARAMS, deterministic=True, decode_images=False)
    branched = sampler.generate(reqs, params, seed=SEED, step=STEP)
    unbranched = sampler.generate(reqs, replace(params, branch=False), seed=SEED, step=STEP)
    assert torch.equal(branched.window_begin, unbranched.window_begin)
    assert not torch.equal(branched.latents[0, 0], unbranched.latents[0, 0]), (
        "per-group, not per-sample noise"
    )
