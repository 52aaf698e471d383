"""The compose reward: does the image show what its compose prompt says? Offline, no weights.

The ground truth (the canonical prompt ``flowgrpo data prepare compose`` stores; the prompt when
it is empty) is parsed by the grammar and the image checked by the verifier
(:mod:`flowgrpo.compose.verify`, docs/compose_task.md). The value is, by ``reward.compose.score``:

- ``partial`` (the default): the share of the prompt's constraints met, in [0, 1]. Denser than
  all-or-nothing: an image with the right blobs in the wrong place is better than an empty one,
  so a group of samples that all fail still has something to rank;
- ``strict``: GenEval's all-or-nothing, 1 when every constraint is met, else 0.

Extras (logged as ``critic/score/compose/<extra>/mean``, each a mean over the samples that
carry it, so none averages a quantity over samples it does not apply to):

- ``accuracy`` (every sample): 1 when every constraint is met; its mean is GenEval's accuracy;
- ``accuracy/<category>`` (only the samples of that category): the category's accuracy;
- ``met/<kind>`` (only the samples with a constraint of that kind: present, count, size,
  position, relation, nothing_else): the share of that kind met in the sample;
- ``scene/<stat>`` (every sample), what the image holds whatever was asked: the watch against
  reward hacking that the verdict cannot be (a policy may satisfy the checks while its scenes
  drift): ``blobs`` (blobs found), ``extra_blobs`` (found beyond the prompt's number, 0 when
  fewer), ``blob_diameter`` (their mean diameter as a share of the side, 0 without blobs),
  ``clutter`` (the share of the image neither background nor in a blob or region) and
  ``regions`` (washes of colour too large to be blobs).

A ground truth the grammar cannot read is that sample's ``invalid_argument`` error (naming the
text and the word), never a 0; so is an image the verifier does not read (over 1024 px a side).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

from flowgrpo.compose.grammar import PromptError, blobs_of, check_spec, parse
from flowgrpo.compose.verify import Scene, Verdict, analyse, judge
from flowgrpo.rewards.base import Outcome, Sample, SampleError, SampleScore, Scorer
from flowgrpo.yamlfile import brief

ScoreMode = Literal["partial", "strict"]
SCORE_MODES: tuple[ScoreMode, ...] = ("partial", "strict")


class ComposeScorer(Scorer):
    """The verifier's partial credit (or its all-or-nothing verdict) per image."""

    def __init__(self, score: ScoreMode = "partial", name: str = "compose") -> None:
        if score not in SCORE_MODES:
            raise ValueError(f"compose score {score!r}: use one of {', '.join(SCORE_MODES)}")
        self.name, self.mode = name, score

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        return [self._one(sample) for sample in samples]

    def _one(self, sample: Sample) -> Outcome:
        text = sample.ground_truth or sample.prompt
        if not text:
            return SampleError(
                "invalid_argument", "no compose prompt: the ground truth and the prompt are empty"
            )
        try:
            spec = parse(text)
        except PromptError as error:
            return SampleError(
                "invalid_argument",
                f"ground truth {brief(text)} is not a compose prompt: {error.reason} "
                "(prepare compose data with `flowgrpo data prepare compose`)",
            )
        try:
            scene = analyse(sample.image)
        except ValueError as error:  # an image the verifier does not read (size, dtype)
            return SampleError("invalid_argument", f"compose: {error}")
        verdict = judge(check_spec(spec), scene)
        value = verdict.score if self.mode == "partial" else float(verdict.correct)
        return SampleScore(value, extras(verdict) | scene_stats(scene, len(blobs_of(spec))))


def extras(verdict: Verdict) -> dict[str, float]:
    """``accuracy``, ``accuracy/<category>`` and ``met/<kind>`` of one verdict (module doc)."""
    correct = float(verdict.correct)
    out = {"accuracy": correct, f"accuracy/{verdict.spec.category}": correct}
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for check in verdict.checks:
        by_kind[check.kind].append(check.met)
    for kind, met in by_kind.items():
        out[f"met/{kind}"] = sum(met) / len(met)
    return out


def scene_stats(scene: Scene, asked: int) -> dict[str, float]:
    """``scene/<stat>`` of one image whose prompt asks for ``asked`` blobs (module doc)."""
    found = len(scene.blobs)
    diameters = [b.diameter / scene.side for b in scene.blobs]
    return {
        "scene/blobs": float(found),
        "scene/extra_blobs": float(max(found - asked, 0)),
        "scene/blob_diameter": sum(diameters) / found if found else 0.0,
        "scene/clutter": scene.clutter,
        "scene/regions": float(len(scene.regions)),
    }
