"""FSDP2 with 2 processes (gloo, CPU) gives the same update as 1 process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel

from .torchrun import torchrun

WORKER = Path(__file__).with_name("fsdp_worker.py")


def run(
    nproc: int, checkpoint: Path, kind: str, out: Path
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    torchrun(nproc, WORKER, str(checkpoint), kind, str(out))
    return load_file(str(out / "published.safetensors")), json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_two_fsdp_processes_give_the_update_of_one(tmp_path: Path, kind: str) -> None:
    checkpoint = make_tiny_bagel(tmp_path / "tiny", seed=0)
    one, m1 = run(1, checkpoint, kind, tmp_path / "one")
    two, m2 = run(2, checkpoint, kind, tmp_path / "two")
    assert one.keys() == two.keys()
    # tolerance: FSDP reduces gradients in another order than one process accumulates them
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)
    assert m1["actor/kl_loss"] > 0
    for key in (
        "actor/pg_loss",
        "actor/ratio_mean",
        "actor/pg_clipfrac",
        "actor/rollout_logp_gap/max",
        "actor/kl_loss",
    ):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4)
