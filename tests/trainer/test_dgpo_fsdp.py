"""DGPO with FSDP2 over 2 processes (gloo, CPU) gives the update of 1 process, although each rank
holds only part of each prompt group: the groups' sums are added over the ranks before any sample's
coefficient is set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .dgpo_fsdp_worker import main as one_process
from .torchrun import one_and_two_ranks

WORKER = Path(__file__).with_name("dgpo_fsdp_worker.py")
KINDS = ["lora", "full"]
TensorFile = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return one_and_two_ranks(tmp_path_factory.mktemp("dgpo-fsdp"), WORKER, one_process, KINDS)


def read(out: Path) -> tuple[TensorFile, TensorFile, dict[str, float]]:
    metrics = json.loads((out / "metrics.json").read_text())
    return load_file(str(out / "published.safetensors")), load_file(str(out / "old.safetensors")), metrics


@pytest.mark.parametrize("kind", KINDS)
def test_two_fsdp_processes_give_the_dgpo_update_of_one(runs: Path, kind: str) -> None:
    (one, old_one, m1), (two, old_two, m2) = read(runs / "one" / kind), read(runs / "two" / kind)
    assert one.keys() == two.keys() and old_one.keys() == old_two.keys()
    # tolerance: FSDP reduces gradients in another order than one process accumulates them, and
    # AdamW's second step divides by the first's gradient: 1e-5 is 1e-2 of a step of lr 1e-3 (one
    # weight of the full gen path's 190k parts by 2.9e-6, the rest by < 1e-6)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-5, msg=name)
    for name in old_one:
        torch.testing.assert_close(old_two[name], old_one[name], rtol=1e-5, atol=1e-5, msg=name)
    assert m1["actor/dgpo/weight"] != pytest.approx(0.5, abs=1e-6) and m1["actor/kl_loss"] > 0
    for key in (
        "actor/pg_loss",
        "actor/dgpo/weight",
        "actor/dgpo/error_gap",
        "actor/kl_loss",
        "actor/pg_clipfrac",
    ):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4)
