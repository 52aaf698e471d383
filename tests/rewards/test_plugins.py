"""User rewards as plug-ins: loading by file or module path, and per-sample errors for a plug-in
that raises, returns the wrong length, NaN or the wrong type."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from flowgrpo.rewards import Sample, SampleError, SampleScore
from flowgrpo.rewards.plugins import PluginError, PluginScorer, check_result, load_plugin

PLUGIN = """
import numpy as np

def brightness(images, prompts, ground_truths, metadata):
    values = [float(image.mean()) / 255 for image in images]
    return values, {"first_red": [float(image[0, 0, 0]) for image in images]}

def picky(images, prompts, ground_truths, metadata):
    for m in metadata:
        if m.get("explode"):
            raise ValueError("cannot score " + m["explode"])
    return np.array([len(p) for p in prompts], dtype=np.float32)

def short(images, prompts, ground_truths, metadata):
    return [1.0] * (len(images) - 1)

def nan_for_empty(images, prompts, ground_truths, metadata):
    return [float("nan") if not p else 1.0 for p in prompts]

def text(images, prompts, ground_truths, metadata):
    return "good"

def two_args(images, prompts):
    return [0.0] * len(images)
"""


@pytest.fixture
def plugin_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(PLUGIN))
    return path


def samples(*prompts: str, explode: str = "") -> list[Sample]:
    image = np.full((4, 4, 3), 51, np.uint8)
    return [Sample(image, prompt=p, metadata={"explode": explode} if p == explode else {}) for p in prompts]


def test_a_plugin_from_a_file_scores_with_extras(plugin_file: Path) -> None:
    scorer = PluginScorer.load("bright", f"{plugin_file}:brightness")
    assert scorer.score(samples("a", "b")) == [SampleScore(0.2, {"first_red": 51.0})] * 2


def test_a_plugin_from_a_module_path(plugin_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(plugin_file.parent))
    scorer = PluginScorer.load("picky", "my_rewards:picky")
    assert scorer.score(samples("abc")) == [SampleScore(3.0)]


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("no_colon", "expected 'path/to/file.py:function'"),
        ("/nowhere/x.py:f", "does not exist"),
        ("flowgrpo.nothing_here:f", "cannot import flowgrpo.nothing_here"),
        ("flowgrpo.rewards.jpeg:nope", "no function 'nope'"),
    ],
)
def test_bad_targets_are_refused_clearly(target: str, fragment: str) -> None:
    with pytest.raises(PluginError, match="plug-in") as error:
        load_plugin(target)
    assert fragment in str(error.value)


def test_a_function_with_the_wrong_signature_is_refused_at_load(plugin_file: Path) -> None:
    with pytest.raises(
        PluginError, match=r"cannot be called as \(images, prompts, ground_truths, metadata\)"
    ):
        load_plugin(f"{plugin_file}:two_args")


def test_a_plugin_that_raises_fails_only_the_samples_it_raises_on(plugin_file: Path) -> None:
    scorer = PluginScorer.load("picky", f"{plugin_file}:picky")
    outcomes = scorer.score(samples("ab", "bomb", "abcd", explode="bomb"))
    assert outcomes[0] == SampleScore(2.0) and outcomes[2] == SampleScore(4.0)
    error = outcomes[1]
    assert isinstance(error, SampleError) and error.kind == "internal"
    assert "plug-in picky" in error.message and "raised ValueError: cannot score bomb" in error.message


def test_wrong_length_fails_every_sample(plugin_file: Path) -> None:
    outcomes = PluginScorer.load("short", f"{plugin_file}:short").score(samples("a", "b", "c"))
    assert all(isinstance(o, SampleError) for o in outcomes)
    assert "returned 2 scores for 3 samples" in outcomes[0].message  # type: ignore[union-attr]


def test_nan_fails_its_own_sample(plugin_file: Path) -> None:
    outcomes = PluginScorer.load("nan", f"{plugin_file}:nan_for_empty").score(samples("a", "", "c"))
    assert outcomes[0] == SampleScore(1.0) and outcomes[2] == SampleScore(1.0)
    assert isinstance(outcomes[1], SampleError) and "returned nan for this sample" in outcomes[1].message


def test_a_result_of_the_wrong_type_fails_every_sample(plugin_file: Path) -> None:
    outcomes = PluginScorer.load("text", f"{plugin_file}:text").score(samples("a", "b"))
    assert all(isinstance(o, SampleError) and "returned scores as str" in o.message for o in outcomes)


def test_check_result_checks_extras_too() -> None:
    bad_extra = check_result(([1.0, 2.0], {"x": [1.0]}), 2, "p")
    assert all(isinstance(o, SampleError) and "extra 'x'" in o.message for o in bad_extra)
    inf_extra = check_result(([1.0, 2.0], {"x": [1.0, float("inf")]}), 2, "p")
    assert inf_extra[0] == SampleScore(1.0, {"x": 1.0}) and isinstance(inf_extra[1], SampleError)
    assert check_result(np.array([1, 2]), 2, "p") == [SampleScore(1.0), SampleScore(2.0)]
    assert isinstance(check_result([True], 1, "p")[0], SampleError), "a bool is not a score"
