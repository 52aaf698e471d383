"""FSDP2 with 2 processes (gloo, CPU) gives the same update as 1 process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .fsdp_worker import main as one_process
from .torchrun import one_and_two_ranks

WORKER = Path(__file__).with_name("fsdp_worker.py")
KINDS = ["lora", "full"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return one_and_two_ranks(tmp_path_factory.mktemp("fsdp"), WORKER, one_process, KINDS)


def read(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    return load_file(str(out / "published.safetensors")), json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_two_fsdp_processes_give_the_update_of_one(runs: Path, kind: str) -> None:
    (one, m1), (two, m2) = read(runs / "one" / kind), read(runs / "two" / kind)
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
