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
from safetensors.torch import load_file, save_file

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


def run(nproc: int, checkpoint: Path, *jobs: tuple[str, Path, Path] | tuple[str, Path, Path, Path]) -> None:
    """Each job (mode, CKPT_DIR, OUT[, DAMAGED]) in turn in one torchrun job, each on a trainer of
    its own (checkpoint_worker.py)."""
    torchrun(nproc, WORKER, str(checkpoint), *(",".join(map(str, job)) for job in jobs))


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    different = [n for n in expected if not torch.equal(actual[n], expected[n])]
    assert not different, f"not bitwise equal: {different[:5]}"


def numbers(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("timing_s/")}


@pytest.fixture(scope="module")
def saved(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank jobs, two torchrun jobs in all:
    - ``two/``: step 1, checkpoint (``two/ckpt/``), step 2; ``async/saved/``: the same with a
      background save (``async/ckpt/``);
    - then ``resumed/``: a damaged copy of ``two/ckpt``'s checkpoint refused (``damaged/``),
      then ``two/ckpt`` resumed and step 2; ``async/out/``: ``async/ckpt`` resumed and step 2;
      ``one/out/``: a checkpoint saved by one process (``one/ckpt/``, several files to read
      from) loaded, with ``one/expected.safetensors`` its whole state and the next draws of
      the generator it saved."""
    out = tmp_path_factory.mktemp("fsdp-ckpt")
    run(2, tiny, ("save", out / "two" / "ckpt", out / "two"),
        ("save_async", out / "async" / "ckpt", out / "async" / "saved"))  # fmt: skip
    checkpoint = latest_checkpoint(out / "two" / "ckpt")
    assert checkpoint is not None
    shutil.copytree(checkpoint, out / "damaged")
    shard = out / "damaged" / "gen_path" / "shard-00002-model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])  # hashed by rank 1: the refusal reaches rank 0 too
    one = trainer(tiny, FULL)
    one.run(trajectories(tiny, 1), PARAMS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_module, "FILE_BYTES", 32 << 10)  # several files to read from
        path = save_checkpoint(out / "one" / "ckpt", one, step=1)
    assert path is not None and len(list((path / "gen_path").iterdir())) > 2
    # a rank without a generator state of its own: rank 0's
    expected = {**whole_state(one), "rng": torch.rand(3).expand(2, 3).contiguous()}
    save_file(expected, str(out / "one" / "expected.safetensors"))
    run(2, tiny, ("resume", out / "two" / "ckpt", out / "resumed", out / "damaged"),
        ("resume", out / "async" / "ckpt", out / "async" / "out"),
        ("load", out / "one" / "ckpt", out / "one" / "out"))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def saved_by_two(saved: Path) -> Path:
    """2 ranks: step 1, checkpoint (``ckpt/``), step 2; the worker's outputs."""
    return saved / "two"


def test_two_ranks_resume_the_next_step_bitwise(saved: Path, saved_by_two: Path) -> None:
    checkpoint = latest_checkpoint(saved_by_two / "ckpt")
    assert checkpoint is not None
    shards = sorted(p.name for p in (checkpoint / "gen_path").iterdir())
    assert shards == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)], "one file a rank"
    damaged = saved / "damaged" / "gen_path"
    assert (damaged / shards[1]).stat().st_size == (checkpoint / "gen_path" / shards[1]).stat().st_size - 64
    assert (damaged / shards[0]).read_bytes() == (checkpoint / "gen_path" / shards[0]).read_bytes()

    for rank in (0, 1):
        refused = (saved / "resumed" / f"refused_{rank}.txt").read_text()
        assert f"{shards[1]} is corrupt or truncated" in refused, refused
    for name in ("state.safetensors", "after.safetensors"):  # as loaded, and after the next step
        assert_same(load_file(saved / "resumed" / name), load_file(saved_by_two / name))
    resumed, straight = (
        json.loads((p / "metrics.json").read_text()) for p in (saved / "resumed", saved_by_two)
    )
    assert numbers(resumed) == numbers(straight), "every metric of the resumed step, bitwise"


def test_a_two_rank_background_save_resumes_like_a_synchronous_one(saved: Path, saved_by_two: Path) -> None:
    """trainer.async_save on 2 ranks: the checkpoint written while the state is gathered and step
    2 trains (DCP's collectives on a gloo group of their own, beside FSDP's) resumes exactly as
    the synchronous save of the same step: weights, moments, RNG, then step 2 bitwise."""
    ckpt = saved / "async" / "ckpt"
    assert latest_checkpoint(ckpt) == ckpt / "step_00000001"
    assert not list(ckpt.glob(".*")), "no partial folder left"
    for name in ("state.safetensors", "after.safetensors"):
        assert_same(load_file(saved / "async" / "out" / name), load_file(saved_by_two / name))
        assert_same(load_file(saved / "async" / "saved" / name), load_file(saved_by_two / name))
    resumed, straight = (
        json.loads((d / "metrics.json").read_text()) for d in (saved / "async" / "out", saved_by_two)
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


def test_a_one_process_checkpoint_loads_on_two_ranks(saved: Path) -> None:
    assert_same(load_file(saved / "one" / "out" / "state.safetensors"),
                load_file(saved / "one" / "expected.safetensors"))  # fmt: skip


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
