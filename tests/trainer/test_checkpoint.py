"""Trainer checkpoints: resume reproduces the next step bitwise; damage is refused whole; the
exported adapter loads in peft; read outside a trainer, a checkpoint gives the published weights."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from flowgrpo.configs.trainer import DEFAULT_LORA_TARGETS, PolicyConfig
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.services.trainer import checkpoint as checkpoint_module
from flowgrpo.services.trainer.checkpoint import (
    STAGER_STAGES_MORE_THAN_ONCE,
    CheckpointError,
    CheckpointWriteError,
    HostStager,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    read_policy_update,
    save_checkpoint,
    start_checkpoint,
    storage_cause,
)

from .test_step import LORA, PARAMS, PROMPTS, rollout, sampler_for, tiny, trainer

__all__ = ["tiny"]  # the module-scoped checkpoint fixture


def state(step: object) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in step.policy.trainable().items()}  # type: ignore[attr-defined]


@pytest.mark.bitwise
@pytest.mark.parametrize("policy", [LORA, PolicyConfig(kind="full")], ids=["lora", "full"])
def test_resume_reproduces_the_next_step_bitwise(tiny: Path, tmp_path: Path, policy: PolicyConfig) -> None:
    sampler = sampler_for(tiny)
    first, second = rollout(sampler, [1.0, -1.0, 0.5, -0.5]), rollout(sampler, [0.3, -0.2, 1.0, -1.1], step=1)
    for t in second:
        t.policy_version = 1
    straight = trainer(tiny, policy)
    straight.run(first, PARAMS)
    path = save_checkpoint(tmp_path / "ckpt", straight, step=1)
    expected = straight.run(second, PARAMS)

    resumed = trainer(tiny, policy)
    assert load_checkpoint(path, resumed) == 1 and resumed.version == 1
    metrics = resumed.run(second, PARAMS)
    after, reference = state(resumed), state(straight)
    assert all(torch.equal(after[n], reference[n]) for n in reference), "weights after the resumed step"

    def numbers(m: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in m.items() if not k.startswith("timing_s/")}

    assert numbers(metrics) == numbers(expected), "every metric of the resumed step, bitwise"


def test_damaged_checkpoints_are_refused_and_nothing_is_loaded(tiny: Path, tmp_path: Path) -> None:
    step = trainer(tiny)
    step.run(rollout(sampler_for(tiny), [1.0, -1.0, 0.5, -0.5]), PARAMS)
    path = save_checkpoint(tmp_path, step, step=1)
    fresh = trainer(tiny)
    before = state(fresh)

    stray = path / "optimizer" / "shard-00009-model-00001-of-00001.safetensors"
    shutil.copy(next((path / "optimizer").iterdir()), stray)  # DCP would read it: refused
    with pytest.raises(CheckpointError, match=r"shard-00009-model-00001-of-00001.safetensors is not in"):
        load_checkpoint(path, fresh)
    stray.unlink()
    weights = path / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors is corrupt or truncated"):
        load_checkpoint(path, fresh)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        load_checkpoint(path, fresh)
    assert all(torch.equal(p, before[n]) for n, p in state(fresh).items()) and fresh.version == 0


def test_keeps_the_last_n_and_finds_the_latest(tiny: Path, tmp_path: Path) -> None:
    step = trainer(tiny)
    for s in range(1, 5):
        save_checkpoint(tmp_path, step, step=s, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    assert latest_checkpoint(tmp_path / "none") is None


def test_an_exported_adapter_loads_in_peft_on_exactly_the_trained_modules(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    step = trainer(tiny)
    sampler = sampler_for(tiny)
    step.run(rollout(sampler, [1.0, -1.0, 0.5, -0.5]), PARAMS)
    path = save_checkpoint(tmp_path, step, step=1, base_model=str(tiny))
    assert path is not None
    config = json.loads((path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny.resolve())

    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(sampler.model, str(path / "adapter"))
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    caught = [w for w in caught if not issubclass(w.category, ResourceWarning)]  # a GC'd file elsewhere
    assert [str(w.message) for w in caught] == [] and logged == []  # no missing/unexpected keys

    def adapted(model: torch.nn.Module, prefix: str = "") -> set[str]:
        return {n.removeprefix(prefix) for n, m in model.named_modules() if isinstance(m, LoraLayer)}

    trained = adapted(step.policy.model)
    assert len(trained) == 2 * len(DEFAULT_LORA_TARGETS) == 14  # two layers, seven gen-path linears each
    assert adapted(loaded, "base_model.model.") == trained

    # peft loaded exactly the trained adapter weights (bitwise), and its model samples what the
    # trainer's samples: to fp32 rounding, since the two models' tensors live at other addresses
    # and a BLAS may sum in another order by alignment (MKL's AVX2 kernels do; AVX-512 ones not)
    ours_lora = {n: p for n, p in step.policy.model.named_parameters() if "lora_" in n}
    theirs_lora = {
        n.removeprefix("base_model.model."): p for n, p in loaded.named_parameters() if "lora_" in n
    }
    assert ours_lora.keys() == theirs_lora.keys() and len(ours_lora) == 28
    assert all(torch.equal(ours_lora[n], theirs_lora[n]) for n in ours_lora)
    requests = [SampleRequest("p0", 0, torch.tensor(PROMPTS["p0"]))]
    ours = BagelSampler(step.policy.model, None, sampler.special).generate(requests, PARAMS, seed=5, step=1)
    peft_loaded = loaded.get_base_model()
    assert isinstance(peft_loaded, BagelModel)  # the project's own model class, adapted in place
    theirs = BagelSampler(peft_loaded, None, sampler.special).generate(requests, PARAMS, seed=5, step=1)
    torch.testing.assert_close(theirs.latents, ours.latents, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(theirs.log_probs, ours.log_probs, atol=1e-4, rtol=1e-4)
    untrained = BagelSampler(sampler.model, None, sampler.special)  # the control: the adapter matters
    with loaded.disable_adapter():
        base = untrained.generate(requests, PARAMS, seed=5, step=1)
    assert (base.latents - ours.latents).abs().max() > 1e-3


@pytest.mark.parametrize("policy", [LORA, PolicyConfig(kind="full")], ids=["lora", "full"])
def test_read_policy_update_gives_what_the_trainer_publishes(
    tiny: Path, tmp_path: Path, policy: PolicyConfig
) -> None:
    step = trainer(tiny, policy)
    step.run(rollout(sampler_for(tiny), [1.0, -1.0, 0.5, -0.5]), PARAMS)
    path = save_checkpoint(tmp_path, step, step=1)
    assert path is not None and checkpoint_steps(tmp_path) == {1: path}
    update = read_policy_update(path)
    published = step.policy.published()
    assert (update.kind, update.version) == ("lora" if policy.kind == "lora" else "gen_path", 1)
    assert update.tensors.keys() == published.keys()
    assert all(torch.equal(update.tensors[n], published[n]) for n in published)
    (path / "trainer.json").write_text("{}")  # verified first: a changed file is refused
    with pytest.raises(CheckpointError, match=r"trainer\.json is corrupt"):
        read_policy_update(path)


def test_storage_causes_are_named_from_every_writer_that_reports_them() -> None:
    """What the save's error says, whichever writer met the storage's refusal: Python's own
    OSError, safetensors' error (the errno only in its text), DCP's CheckpointException (a
    BaseException holding each rank's error), an errno wrapped as the cause of another error.
    (EACCES cannot be provoked for real by a chmod when the tests run as root.)"""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def raised(error: BaseException) -> BaseException:
        try:
            raise error
        except BaseException as caught:
            return caught

    denied = raised(PermissionError(errno.EACCES, "Permission denied", "/ckpt/x"))
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    dcp = CheckpointException("save failed", {0: _wrap_exception(raised(full))})
    wrapped = RuntimeError("writing failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    assert storage_cause(denied) == "permission denied (EACCES)"
    assert storage_cause(full) == "no space left on device (ENOSPC)"
    assert storage_cause(dcp) == "no space left on device (ENOSPC)"
    assert storage_cause(wrapped) == "read-only file system (EROFS)"
    assert storage_cause(OSError(errno.ENAMETOOLONG, "x")) == "file name too long (errno 36)"
    assert storage_cause(ValueError("not storage")) is None  # a bug is not called a full disk


def close_after_every_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's stager as torch 2.11 and 2.12 have it: `DefaultStager._stage` closes its copier
    when it has staged (their source, the line 2.13 removed)."""
    stage = DefaultStager._stage

    def closing(self: DefaultStager, state_dict: dict[str, object], **kwargs: object) -> object:
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", closing)


@pytest.fixture(params=["this torch", "torch 2.11"])
def stager(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[HostStager]:
    """As the trainer makes it on a CPU, with this torch's DCP stager and with torch 2.11's,
    which stages once (host buffers kept from one save to the next where torch allows it)."""
    if request.param == "torch 2.11":
        close_after_every_stage(monkeypatch)
    made = HostStager(pinned=False, reuse=request.param == "this torch" and STAGER_STAGES_MORE_THAN_ONCE)
    yield made
    made.close()


def test_whether_a_dcp_stager_stages_twice_is_known_for_this_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """STAGER_STAGES_MORE_THAN_ONCE says what this torch's DefaultStager does; with torch 2.11's
    behaviour a reused stager fails as it did on the H200 (`KeyError: <class 'type'>`)."""
    tensors = {"w": torch.arange(4.0), "m": torch.ones(2)}

    def stage_twice(stager: DefaultStager) -> bool:
        try:
            return all(torch.equal(stager.stage(tensors)[k], v) for _ in range(2) for k, v in tensors.items())
        except KeyError:
            return False
        finally:
            stager.close()

    options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                             use_non_blocking_copy=False)  # fmt: skip
    assert stage_twice(DefaultStager(options)) == STAGER_STAGES_MORE_THAN_ONCE
    close_after_every_stage(monkeypatch)
    assert not stage_twice(DefaultStager(options))
    once = HostStager(pinned=False, reuse=False)
    assert all(torch.equal(once(tensors)[k], v) for _ in range(3) for k, v in tensors.items())


def contents_of(path: Path) -> dict[str, object]:
    """Every file of a checkpoint but its manifest, by what it holds: tensors (safetensors
    headers list their metadata in no fixed order, so two saves of one state differ in bytes),
    parsed JSON."""
    out: dict[str, object] = {}
    for file in sorted(f for f in path.rglob("*") if f.is_file() and f.name != "manifest.json"):
        name = str(file.relative_to(path))
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                out[name] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
        else:
            out[name] = json.loads(file.read_text())
    return out


def assert_same_contents(actual: dict[str, object], expected: dict[str, object]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
            got = actual[name]
            assert isinstance(got, dict) and got.keys() == value.keys(), name
            assert all(torch.equal(got[k], v) for k, v in value.items()), name
        else:
            assert actual[name] == value, name


@pytest.mark.bitwise
@pytest.mark.parametrize("policy", [LORA, PolicyConfig(kind="full")], ids=["lora", "full"])
def test_an_async_save_holds_its_steps_state_while_the_next_step_trains(
    tiny: Path, tmp_path: Path, policy: PolicyConfig, stager: HostStager
) -> None:
    """The background save writes the state of the step it was asked at, though the next step
    changes every weight and moment while it writes: the same files, byte for byte, as a
    synchronous save of that step, and a trainer resumed from it trains the next step bitwise."""
    sampler = sampler_for(tiny)
    first, second = rollout(sampler, [1.0, -1.0, 0.5, -0.5]), rollout(sampler, [0.3, -0.2, 1.0, -1.1], step=1)
    for t in second:
        t.policy_version = 1
    step = trainer(tiny, policy)
    step.run(first, PARAMS)
    synced = save_checkpoint(tmp_path / "sync", step, step=1)
    pending = start_checkpoint(tmp_path / "async", step, 1, stager)
    expected = step.run(second, PARAMS)  # while the checkpoint is written
    path = pending.wait()
    assert path == tmp_path / "async" / "step_00000001" and synced is not None
    assert_same_contents(contents_of(path), contents_of(synced))

    resumed = trainer(tiny, policy)
    assert load_checkpoint(path, resumed) == 1
    metrics = resumed.run(second, PARAMS)
    assert all(torch.equal(p, state(step)[n]) for n, p in state(resumed).items())
    numbers = {k: v for k, v in metrics.items() if not k.startswith("timing_s/")}
    assert numbers == {k: v for k, v in expected.items() if not k.startswith("timing_s/")}

    # the next step's save, through the same stager (the trainer's every step with async_save)
    again = start_checkpoint(tmp_path / "async", step, 2, stager)
    synced = save_checkpoint(tmp_path / "sync", step, step=2)
    path = again.wait()
    assert synced is not None and path is not None
    assert_same_contents(contents_of(path), contents_of(synced))


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background saves wait at their seal (manifest and rename) until the event is set."""
    release = threading.Event()
    seal = checkpoint_module._seal

    def held_seal(final: Path, digests: dict[str, str]) -> None:
        if threading.current_thread() is not threading.main_thread():  # the background's only
            assert release.wait(60)
        seal(final, digests)

    monkeypatch.setattr(checkpoint_module, "_seal", held_seal)
    yield release
    release.set()


def test_a_checkpoint_being_written_is_nowhere_until_it_is_whole(
    tiny: Path, tmp_path: Path, stager: HostStager, held: threading.Event
) -> None:
    """Until its rename, a background save is a hidden partial folder: no resume sees it."""
    step = trainer(tiny)
    step.run(rollout(sampler_for(tiny), [1.0, -1.0, 0.5, -0.5]), PARAMS)
    save_checkpoint(tmp_path, step, step=1)
    pending = start_checkpoint(tmp_path, step, 2, stager)
    time.sleep(0.5)
    assert not pending.done() and sorted(checkpoint_steps(tmp_path)) == [1]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert (tmp_path / ".step_00000002.partial" / "trainer.json").is_file()  # the small files: at once
    held.set()
    assert pending.wait() == tmp_path / "step_00000002"
    assert sorted(checkpoint_steps(tmp_path)) == [1, 2] and not list(tmp_path.glob(".*"))


def test_a_background_save_the_storage_refuses_leaves_nothing_and_says_so(
    tiny: Path, tmp_path: Path, stager: HostStager, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = trainer(tiny)
    step.run(rollout(sampler_for(tiny), [1.0, -1.0, 0.5, -0.5]), PARAMS)
    save_checkpoint(tmp_path, step, step=1)

    def full(final: Path, digests: dict[str, str]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device")
        seal(final, digests)

    seal = checkpoint_module._seal

    monkeypatch.setattr(checkpoint_module, "_seal", full)
    pending = start_checkpoint(tmp_path, step, 2, stager)
    with pytest.raises(CheckpointWriteError, match=r"step 2 .*no space left on device \(ENOSPC\); "
                       r"the previous checkpoint step_00000001 is intact"):  # fmt: skip
        pending.wait()
    assert pending.failed() and sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
