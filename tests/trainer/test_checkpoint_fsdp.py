"""Full gen-path checkpoints under FSDP2 (2 gloo processes): every rank writes its shards; resume
reproduces the next step bitwise; a checkpoint reshards between 2 ranks and 1 process."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flowgrpo.configs.trainer import PolicyConfig
from flowgrpo.services.trainer import checkpoint as checkpoint_module
from flowgrpo.services.trainer.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_policy_update,
    save_checkpoint,
)

from .checkpoint_worker import PARAMS, trajectories, whole_state
from .test_step import tiny, trainer
from .torchrun import torchrun

__all__ = ["tiny"]  # the module-scoped checkpoint fixture

WORKER = Path(__file__).with_name("checkpoint_worker.py")
FULL = PolicyConfig(kind="full")


def run(nproc: int, checkpoint: Path, ckpt_dir: Path, mode: str, out: Path, *damaged: Path) -> None:
    torchrun(nproc, WORKER, str(checkpoint), str(ckpt_dir), mode, str(out), *map(str, damaged))


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    different = [n for n in expected if not torch.equal(actual[n], expected[n])]
    assert not different, f"not bitwise equal: {different[:5]}"


def numbers(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("timing_s/")}


@pytest.fixture(scope="module")
def saved_by_two(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks: step 1, checkpoint (``ckpt/``), step 2; the worker's outputs."""
    out = tmp_path_factory.mktemp("two")
    run(2, tiny, out / "ckpt", "save", out)
    return out


def test_two_ranks_resume_the_next_step_bitwise(tiny: Path, saved_by_two: Path, tmp_path: Path) -> None:
    checkpoint = latest_checkpoint(saved_by_two / "ckpt")
    assert checkpoint is not None
    shards = sorted(p.name for p in (checkpoint / "gen_path").iterdir())
    assert shards == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)], "one file a rank"
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    shard = damaged / "gen_path" / shards[1]  # hashed by rank 1: the refusal reaches rank 0 too
    shard.write_bytes(shard.read_bytes()[:-64])

    run(2, tiny, saved_by_two / "ckpt", "resume", tmp_path / "out", damaged)
    for rank in (0, 1):
        refused = (tmp_path / "out" / f"refused_{rank}.txt").read_text()
        assert f"{shards[1]} is corrupt or truncated" in refused, refused
    for name in ("state.safetensors", "after.safetensors"):  # as loaded, and after the next step
        assert_same(load_file(tmp_path / "out" / name), load_file(saved_by_two / name))
    resumed, straight = (
        json.loads((p / "metrics.json").read_text()) for p in (tmp_path / "out", saved_by_two)
    )
    assert numbers(resumed) == numbers(straight), "every metric of the resumed step, bitwise"


def test_a_two_rank_background_save_resumes_like_a_synchronous_one(
    tiny: Path, saved_by_two: Path, tmp_path: Path
) -> None:
    """trainer.async_save on 2 ranks: the checkpoint written while the state is gathered and step
    2 trains (DCP's collectives on a gloo group of their own, beside FSDP's) resumes exactly as
    the synchronous save of the same step: weights, moments, RNG, then step 2 bitwise."""
    run(2, tiny, tmp_path / "ckpt", "save_async", tmp_path / "saved")
    assert latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step_00000001"
    assert not list((tmp_path / "ckpt").glob(".*")), "no partial folder left"
    run(2, tiny, tmp_path / "ckpt", "resume", tmp_path / "out")
    for name in ("state.safetensors", "after.safetensors"):
        assert_same(load_file(tmp_path / "out" / name), load_file(saved_by_two / name))
        assert_same(load_file(tmp_path / "saved" / name), load_file(saved_by_two / name))
    resumed, straight = (
        json.loads((d / "metrics.json").read_text()) for d in (tmp_path / "out", saved_by_two)
    )
    assert numbers(resumed) == numbers(straight)


def test_a_two_rank_checkpoint_loads_into_one_process(tiny: Path, saved_by_two: Path) -> None:
    checkpoint = latest_checkpoint(saved_by_two / "ckpt")
    assert checkpoint is not None
    one = trainer(tiny, FULL)
    assert load_checkpoint(checkpoint, one) == 1 and one.version == 1
    saved = load_file(saved_by_two / "state.safetensors")
    assert {k.split("/")[0] for k in saved} == {"weight", "step", "exp_avg", "exp_avg_sq", "rng"}
    assert not torch.equal(*saved.pop("rng")), "each rank had a generator state of its own"
    assert_same(whole_state(one), saved)
    update = read_policy_update(checkpoint)  # outside a trainer (flowgrpo generate --run): whole tensors
    published = one.policy.published()
    assert update.tensors.keys() == published.keys()
    assert all(torch.equal(update.tensors[n], published[n]) for n in published)
    # nothing pickled: JSON and safetensors only (DCP's default writer would add a pickled .metadata),
    # and the safetensors files of each folder hold exactly its tensors, whatever the sharding
    stored: dict[str, set[str]] = {}
    for path in (p for p in checkpoint.rglob("*") if p.is_file()):
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert path.suffix == ".safetensors", path
            with safe_open(str(path), framework="pt") as f:
                stored.setdefault(path.parent.name, set()).update(f.keys())
    names = set(one.policy.trainable())
    moments = {f"{n}/{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")}
    rng = stored.pop("rng")
    assert "cpu" in rng and all(re.fullmatch(r"cuda\d+", k) for k in rng - {"cpu"}), rng
    assert stored == {"gen_path": names, "optimizer": moments}


def test_a_one_process_checkpoint_loads_on_two_ranks(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = trainer(tiny, FULL)
    one.run(trajectories(tiny, 1), PARAMS)
    monkeypatch.setattr(checkpoint_module, "FILE_BYTES", 32 << 10)  # several files to read from
    path = save_checkpoint(tmp_path / "ckpt", one, step=1)
    assert path is not None and len(list((path / "gen_path").iterdir())) > 2
    expected = {**whole_state(one), "rng": torch.rand(3).expand(2, 3)}  # a rank without its own: rank 0's
    run(2, tiny, tmp_path / "ckpt", "load", tmp_path / "out")
    assert_same(load_file(tmp_path / "out" / "state.safetensors"), expected)


def test_a_truncated_shard_is_refused_and_nothing_is_loaded(
    tiny: Path, saved_by_two: Path, tmp_path: Path
) -> None:
    checkpoint = latest_checkpoint(saved_by_two / "ckpt")
    assert checkpoint is not None
    damaged = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, damaged)
    shard = damaged / "optimizer" / "shard-00001-model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    fresh = trainer(tiny, FULL)
    before = whole_state(fresh)
    with pytest.raises(
        CheckpointError, match=r"optimizer/shard-00001-model-00001-of-00001\.safetensors is corrupt"
    ):
        load_checkpoint(damaged, fresh)
    assert_same(whole_state(fresh), before)
    assert fresh.version == 0 and not fresh.optimizer.state
