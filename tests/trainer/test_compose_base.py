"""The committed compose base (examples/models/compose-base) is what its documented command makes.

`bash examples/models/make_compose_base.sh` made it (minutes of CPU: too long for CI). Here:
its files are the ones provenance.json names; the first two steps of that command (the untrained
drawer, the rendered pairs) give the same bytes; a short run of its third (`flowgrpo sft`)
reproduces the start of the committed training curve; and the committed model, evaluated again
on the held-out combinations, draws as recorded: good but imperfect (the issue asks 20-60%).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from flowgrpo.config import load_config
from flowgrpo.services.trainer.sft_config import SftConfig

from .inprocess_cli import flowgrpo

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "models" / "compose-base"
RECIPE = ROOT / "examples" / "sft_compose.yaml"
PROVENANCE = json.loads((BASE / "provenance.json").read_text())
CURVE = [json.loads(line) for line in (BASE / "sft_metrics.jsonl").read_text().splitlines()]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(*args: str) -> None:
    """``flowgrpo ARGS`` from the repository root, in this process."""
    flowgrpo(*args, cwd=ROOT)


def test_the_committed_files_are_those_its_provenance_names() -> None:
    for name, digest in PROVENANCE["files_sha256"].items():
        assert sha256(BASE / name) == digest, name
    assert {"ema.safetensors", "ae.safetensors"} <= set(PROVENANCE["files_sha256"])


@pytest.mark.long  # handed out first under xdist (tests/conftest.py)
def test_a_short_run_of_its_command_reproduces_the_start_of_its_curve(tmp_path: Path) -> None:
    cli("make-tiny-bagel", str(tmp_path / "drawer"), "--drawer", "examples/data/compose/train.txt")
    assert sha256(tmp_path / "drawer" / "ema.safetensors") == PROVENANCE["untrained_ema_sha256"]
    cli("data", "compose-images", str(tmp_path / "pairs"), "--layouts", "32")
    pairs = hashlib.sha256()
    for line in (tmp_path / "pairs" / "metadata.jsonl").read_text().splitlines():
        pairs.update(line.encode())
        pairs.update((tmp_path / "pairs" / json.loads(line)["file_name"]).read_bytes())
    assert pairs.hexdigest() == PROVENANCE["pairs_sha256"]
    cli("sft", str(RECIPE), f"run_dir={tmp_path / 'run'}", f"model={tmp_path / 'drawer'}",
        f"data.images={tmp_path / 'pairs'}", "steps=20", "eval.prompts=")  # fmt: skip
    rerun = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ours = {r["step"]: r["sft/loss"] for r in rerun if "sft/loss" in r}
    committed = {r["step"]: r["sft/loss"] for r in CURVE if "sft/loss" in r and r["step"] in ours}
    assert sorted(committed) == [10, 20]
    # the same machine reproduces it bitwise; another CPU's kernels round differently
    for step, loss in committed.items():
        assert ours[step] == pytest.approx(loss, rel=1e-3), step


@pytest.mark.long  # handed out first under xdist (tests/conftest.py)
def test_the_base_draws_the_held_out_combinations_as_recorded() -> None:
    from flowgrpo.services.trainer.sft import Evaluator

    cfg = load_config(SftConfig, RECIPE, [f"model={BASE}", "data.images=unused"])
    metrics, _ = Evaluator(cfg)(None)
    recorded = PROVENANCE["held_out"]
    accuracy = metrics["eval/compose/accuracy/mean"]
    categories = {
        k.split("/")[-2]: round(v, 3)
        for k, v in metrics.items()
        if k.startswith("eval/compose/accuracy/") and k.count("/") == 4
    }
    print(f"held-out accuracy {accuracy:.3f}, per category {categories}")
    assert sorted(categories) == ["attribution", "counting", "position", "relation", "single", "two_object"]
    assert accuracy == pytest.approx(recorded["compose/accuracy/mean"], abs=0.02)
    assert 0.2 <= accuracy <= 0.6  # good but imperfect: room for RL to show something
