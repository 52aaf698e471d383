"""Trainer checkpoints: trainable weights, optimizer state, RNG, counters; atomic and verified.

Layout of ``<dir>/step_00000042/``:

- ``adapter/`` (LoRA: the standard PEFT adapter folder, gathered; rank 0 writes it) or
  ``gen_path/`` (full: every gen-path parameter through torch.distributed.checkpoint, DCP);
- ``optimizer/`` (DCP: AdamW's state keyed ``<param name>/<key>``; absent before the first step)
  and ``optimizer.json`` (the param groups and the parameter order);
- ``rng/rank_00000.safetensors``, one per rank: that rank's CPU and CUDA generator states;
- ``trainer.json`` (format, step, policy version, counters, ranks) and ``manifest.json``: the
  SHA-256 of every other file, written last.

A DCP folder holds ``shard-<rank + 1>-model-<i>-of-<n>.safetensors`` files: every rank writes its
own shards, in parallel, with their offsets in the safetensors header. Nothing is gathered, and
DCP copies one file (about ``FILE_BYTES`` of a rank's shards) to host memory at a time. Loading
reshards: a checkpoint saved by N ranks loads into M. With several hosts, ``checkpoint_dir`` must
be one filesystem that every rank shares.

A checkpoint is written into a hidden temporary folder (``.step_00000042.partial``) that rank 0
renames into place once every rank has written, so a crash never leaves a half checkpoint under a
real name. Loading verifies the manifest and every hash on every rank (each rank hashes a share of
the files and all learn every result) BEFORE anything is applied: a corrupt, truncated, missing
or unlisted file is refused, naming it, and nothing is loaded.

No pickle on disk: tensors in safetensors (DCP's ``HuggingFaceStorageWriter`` writes no pickled
``.metadata``, unlike its default ``FileSystemWriter``), the rest JSON. DCP does exchange its
save and load plans between ranks as pickled objects over the process group, in memory.

The RNG state is per rank; resumed on more ranks than saved it, the extra ranks take rank 0's.

Asynchronous saves (``trainer.async_save``, :func:`start_checkpoint`): what the next steps
change (weights, AdamW moments, the policy's old copy, the LoRA adapter) is copied to host
memory and the small files (RNG, counters) are written before the call returns; the copies are
written by DCP's ``async_save`` in a background thread (over a gloo group of its own when there
are several ranks, so its collectives never interleave with the training's), and then rank 0
alone hashes every file, writes the manifest and renames the folder into place. Until that
rename the checkpoint is a hidden partial folder that no resume reads: a process killed in the
middle loses only the checkpoint being written, never an older one. One save is written at a
time (the next one waits for it), so one host copy of the state is the memory it costs.

Outside a trainer (``flowgrpo generate --run``), :func:`find_run_checkpoint` finds a checkpoint
of a run folder and :func:`read_policy_update` reads its weights, verified, in one process, as
the policy update a rollout applies.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.torch_version import TorchVersion

from flowgrpo.models.bagel.peft_format import load_peft_adapter, save_peft_adapter
from flowgrpo.models.bagel.policy import PolicyUpdate
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.policy import TrainablePolicy, lora_published_name

PREFIX = "step_"
MANIFEST = "manifest.json"
PARTIAL = ".partial"
FORMAT = 2  # 1: one process wrote whole tensors (gen_path.safetensors, optimizer.safetensors)
FILE_BYTES = 1 << 30  # of one rank's shards per DCP file: DCP copies a whole file to host memory


class Checkpointed(Protocol):
    """What a checkpoint holds of a trainer: its policy, optimizer and counters (a FlowGRPO,
    DiffusionNFT or supervised fine-tuning step alike)."""

    version: int

    @property
    def keeps_old_policy(self) -> bool:
        """Whether the policy's old copy (DiffusionNFT's sampling policy, AWM's average of past
        policies) is part of the state."""
        ...

    def counters(self) -> dict[str, float]:
        """The step's counters (``version``, ``steps_done`` and the algorithm's own)."""
        ...

    def restore(self, counters: dict[str, float]) -> None: ...
    @property
    def policy(self) -> TrainablePolicy: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def dist(self) -> Dist: ...


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, truncated or does not fit this trainer."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's files do not match its manifest (corrupt, truncated, missing, unlisted) or
    it has no manifest: found before anything was loaded, so an earlier one may be taken."""


class CheckpointWriteError(CheckpointError):
    """The storage refused a checkpoint (no space, permission denied, a read-only or failing
    filesystem); nothing was renamed into place, the earlier checkpoints are untouched."""


# errno -> what a user reads; other errnos: os.strerror, lower-cased
_STORAGE_CAUSES = {
    errno.ENOSPC: "no space left on device (ENOSPC)",
    errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    errno.EACCES: "permission denied (EACCES)",
    errno.EPERM: "operation not permitted (EPERM)",
    errno.EROFS: "read-only file system (EROFS)",
    errno.EFBIG: "file too large (EFBIG)",
    errno.EIO: "input/output error (EIO)",
}
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")  # how Rust (safetensors) quotes an errno


def storage_cause(error: BaseException) -> str | None:
    """What the filesystem refused, when ``error`` (or one it wraps: its cause, its context, a
    DCP rank's failure) is a storage error; None otherwise. safetensors raises its own error
    type with the errno only in its text, DCP a ``CheckpointException`` holding each rank's."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        number = _errno_of(current)
        if number is not None:
            return _STORAGE_CAUSES.get(number, f"{os.strerror(number).lower()} (errno {number})")
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        if isinstance(current, CheckpointException):
            pending += [failure for failure, _ in current.failures.values()]
    return None


def _errno_of(error: BaseException) -> int | None:
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    found = _OS_ERROR_IN_TEXT.search(str(error)) if type(error).__name__ == "SafetensorError" else None
    return int(found.group(1)) if found else None


def _previous(folder: Path) -> str:
    """What a failed save left to resume from, as the error says it."""
    latest = latest_checkpoint(folder)
    if latest is None:
        return "no earlier checkpoint exists"
    return f"the previous checkpoint {latest.name} is intact"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def confined_folder(folder: str | Path, requested: str) -> Path:
    """Where a SaveCheckpoint request may write: the trainer's own ``folder``, always. A
    requested path, when given, must name that same folder: no ``..`` part, and once every
    symlink is resolved, the same directory (a link inside the folder pointing elsewhere, or
    any other absolute path, is refused). Raises ValueError saying what it resolved to."""
    own = Path(folder).resolve()
    if not requested:
        return Path(folder)
    if ".." in Path(requested).parts:
        raise ValueError(f"{requested[:200]!r} has a '..' part; checkpoints go to {own} only")
    try:
        target = Path(requested).resolve()
    except (OSError, RuntimeError, ValueError) as error:  # a symlink loop, a NUL byte
        raise ValueError(
            f"{requested[:200]!r} does not resolve ({error}); checkpoints go to {own} only"
        ) from None
    if target != own:
        raise ValueError(
            f"{requested[:200]!r} resolves to {str(target)[:200]}, not this trainer's checkpoint "
            f"folder {own} (trainer.checkpoint_dir): leave the path empty"
        )
    return Path(folder)


def latest_checkpoint(folder: str | Path) -> Path | None:
    folder = Path(folder)
    found = sorted(p for p in folder.glob(f"{PREFIX}*") if p.is_dir()) if folder.is_dir() else []
    return found[-1] if found else None


def checkpoint_steps(folder: str | Path) -> dict[int, Path]:
    """Step -> checkpoint folder, ascending, of every checkpoint under ``folder`` (none: {})."""
    folder = Path(folder)
    found = sorted(p for p in folder.glob(f"{PREFIX}*") if p.is_dir()) if folder.is_dir() else []
    return {int(p.name.removeprefix(PREFIX)): p for p in found if p.name.removeprefix(PREFIX).isdigit()}


def save_checkpoint(
    folder: str | Path, trainer: Checkpointed, step: int, keep_last: int = 3, base_model: str = ""
) -> Path | None:
    """Write the checkpoint of ``step`` atomically; keep the ``keep_last`` newest.

    Every rank calls it and writes its own shards; rank 0 writes the rest, renames the folder
    into place and returns its path, the others return None. ``base_model``: the BAGEL folder
    the trainer loaded, named in a LoRA adapter's ``adapter_config.json``."""
    dist, folder = trainer.dist, Path(folder)
    final = folder / checkpoint_name(step)
    with _write_errors(final, step, dist.rank):
        _write_checkpoint(final, trainer, step, base_model)
    if dist.rank != 0:
        return None
    _prune(folder, keep_last)
    return final


@contextlib.contextmanager
def _write_errors(final: Path, step: int, rank: int) -> Iterator[None]:
    """A failed write leaves nothing (rank 0 removes the partial folder); a refusal of the
    storage becomes a :class:`CheckpointWriteError` naming the cause and what is left."""
    try:
        yield
    except BaseException as error:
        if rank == 0:
            shutil.rmtree(_partial(final), ignore_errors=True)
        cause = storage_cause(error)
        if cause is None:
            raise
        folder = final.parent
        raise CheckpointWriteError(
            f"cannot write the checkpoint of step {step} in {folder}: {cause}; {_previous(folder)}"
        ) from error


def _prune(folder: Path, keep_last: int) -> None:
    """Keep the ``keep_last`` newest checkpoints; remove the partial folders of saves that crashed."""
    for old in sorted(p for p in folder.glob(f"{PREFIX}*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)
    for stale in folder.glob(f".{PREFIX}*{PARTIAL}"):
        shutil.rmtree(stale, ignore_errors=True)


def _partial(final: Path) -> Path:
    """The hidden folder a checkpoint is written into: the same name on every rank."""
    return final.parent / f".{final.name}{PARTIAL}"


def _write_checkpoint(final: Path, trainer: Checkpointed, step: int, base_model: str) -> None:
    """Every file into the partial folder, hashed, then (rank 0) renamed to ``final``, synced."""
    dist, tmp = trainer.dist, _partial(final)
    _make_partial(final, dist)
    _write_weights(tmp, trainer, base_model)
    _write_old_policy(tmp, trainer)
    _write_optimizer(tmp, trainer)
    _write_small_files(tmp, trainer, step)
    names = _files(tmp)
    _check_shared(tmp, names, dist)
    digests = _hashes(tmp, names, dist)  # every rank hashes its share
    if dist.rank == 0:
        _seal(final, digests)


def _make_partial(final: Path, dist: Dist) -> None:
    """An empty partial folder for ``final`` (rank 0 makes it; every rank waits for it)."""
    if dist.rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(_partial(final), ignore_errors=True)  # left by a save that crashed
        _partial(final).mkdir()
    _barrier(dist)


def _write_small_files(tmp: Path, trainer: Checkpointed, step: int) -> None:
    """Each rank's RNG; rank 0's counters (trainer.json); then every rank has written."""
    dist = trainer.dist
    _write_rng(tmp / "rng" / _rng_name(dist.rank))
    if dist.rank == 0:
        counters = {"format": FORMAT, "step": step, **trainer.counters(), "kind": trainer.policy.kind,
                    "ranks": dist.world}  # fmt: skip
        (tmp / "trainer.json").write_text(json.dumps(counters, indent=2))
    _barrier(dist)


def _seal(final: Path, digests: dict[str, str]) -> None:
    """The manifest, every file synced, the partial folder renamed to ``final`` (rank 0)."""
    tmp = _partial(final)
    (tmp / MANIFEST).write_text(json.dumps(digests, indent=2, sort_keys=True))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


# --- asynchronous saves (trainer.async_save) -------------------------------------------------


class PendingCheckpoint:
    """A checkpoint being written in the background (:func:`start_checkpoint`). :meth:`wait`
    returns its path once it is whole and renamed into place (None on ranks > 0), or raises what
    stopped it (:class:`CheckpointWriteError` for a refusal of the storage); nothing is left of a
    failed one."""

    def __init__(self, step: int, path: Path, write: Callable[[], Path | None]) -> None:
        self.step, self.path = step, path
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._write = write
        self._thread = threading.Thread(target=self._run, name=f"checkpoint {path.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._write()
        except BaseException as error:  # re-raised by wait(), in the trainer's own thread
            self._error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def failed(self) -> bool:
        return self.done() and self._error is not None

    def wait(self) -> Path | None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


# torch 2.11 and 2.12 close a DefaultStager's copier at the end of every stage
# (`DefaultStager._stage` ends in `self._state_dict_stager.close()`, which empties its copy
# dispatch: the next stage fails with `KeyError: <class 'type'>`, seen on the H200 at the second
# save); from 2.13 on it stays open and keeps its host buffers from one save to the next.
STAGER_STAGES_MORE_THAN_ONCE = TorchVersion(torch.__version__) >= "2.13"


class HostStager:
    """Host copies of tensors, taken synchronously (DCP's ``DefaultStager``; pinned memory on a
    GPU, so the device-to-host copy runs at full speed). Where torch allows it (``reuse``, torch
    2.13 on) the buffers are kept from one save to the next, and a buffer is reused by the next
    save: wait for one save before staging the next; before, each stage has a stager of its own."""

    def __init__(self, pinned: bool, reuse: bool = STAGER_STAGES_MORE_THAN_ONCE) -> None:
        self._options = StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                       use_async_staging=False, use_non_blocking_copy=False)  # fmt: skip
        self._reuse = reuse
        self._stager: DefaultStager | None = None

    def __call__(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        if self._stager is None:
            self._stager = DefaultStager(self._options)
        staged = self._stager.stage(tensors)
        if not self._reuse:
            self.close()
        if not isinstance(staged, dict):  # a Future only with asynchronous staging, not asked for
            raise TypeError(f"DCP's stager returned a {type(staged).__name__}")
        return staged

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


@dataclass
class _Staged:
    """What a background save writes: host copies taken when the save began."""

    dcp: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # folder name -> tensors
    adapter: PolicyUpdate | None = None  # LoRA (rank 0)
    base_model: str = ""


def start_checkpoint(
    folder: str | Path,
    trainer: Checkpointed,
    step: int,
    stager: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    *,
    keep_last: int = 3,
    base_model: str = "",
) -> PendingCheckpoint:
    """Begin the checkpoint of ``step`` and return while it is written (every rank calls it).

    Before it returns, what the next steps change is copied by ``stager`` (a DCP stager: host
    memory, pinned on a GPU) and the small files (RNG, counters, the optimizer's groups) are in
    the partial folder; a background thread then writes the copies through DCP, one folder after
    the other, over a gloo group of its own, and rank 0 hashes every file, writes the manifest
    and renames the folder into place. The caller waits for one save before it starts the next."""
    dist, folder = trainer.dist, Path(folder)
    final = folder / checkpoint_name(step)
    group = _checkpoint_group() if dist.enabled else None  # made by every rank, in step, here
    with _write_errors(final, step, dist.rank):
        _make_partial(final, dist)
        staged = _stage(trainer, stager, base_model)
        _write_optimizer_meta(_partial(final), trainer)
        _write_small_files(_partial(final), trainer, step)
        _check_shared(_partial(final), _files(_partial(final)), dist)

    def write() -> Path | None:
        with _write_errors(final, step, dist.rank):
            for name, tensors in staged.dcp.items():
                writer = _dcp_writer(_partial(final) / name, tensors, dist)
                with _one_process_quietly(), _dcp_errors(f"writing {_partial(final) / name}"):
                    dcp_save(tensors, storage_writer=writer, process_group=group, no_dist=not dist.enabled)
            if dist.rank != 0:
                return None  # every rank's shards are written once rank 0's DCP saves returned
            if staged.adapter is not None:
                save_peft_adapter(_partial(final) / "adapter", staged.adapter, staged.base_model)
            _seal(final, _hashes(_partial(final), _files(_partial(final)), Dist()))  # rank 0 alone
        _prune(folder, keep_last)
        return final

    return PendingCheckpoint(step, final, write)


def _stage(
    trainer: Checkpointed, stager: Callable[[dict[str, Tensor]], dict[str, Tensor]], base_model: str
) -> _Staged:
    """Host copies of the weights, the policy's old copy and AdamW's state (every rank its
    shards), and of the LoRA adapter (gathered, rank 0)."""
    staged = _Staged(base_model=str(Path(base_model).resolve()) if base_model else "")
    if trainer.policy.kind == "full":
        staged.dcp["gen_path"] = stager(dict(trainer.policy.trainable()))
    else:
        published = {n: t.detach().to("cpu", copy=True) for n, t in trainer.policy.published().items()}
        if trainer.dist.rank == 0:
            cfg = trainer.policy.config
            staged.adapter = PolicyUpdate(trainer.version, "lora", published, cfg.lora_rank, cfg.lora_alpha)
    if trainer.keeps_old_policy:
        staged.dcp["old_policy"] = stager(trainer.policy.old_state())
    optimizer = _optimizer_tensors(trainer)
    if optimizer:
        staged.dcp["optimizer"] = stager(optimizer)
    return staged


_CHECKPOINT_GROUP: Any = None


def _checkpoint_group() -> Any:
    """The gloo group background saves run their collectives on: never the training's, so the
    two never interleave (DCP's async saves need a CPU backend anyway). Made once, by every rank."""
    global _CHECKPOINT_GROUP
    if _CHECKPOINT_GROUP is None:
        _CHECKPOINT_GROUP = torch_dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUP


def load_checkpoint(path: str | Path, trainer: Checkpointed) -> int:
    """Verify, then restore ``trainer`` from ``path``; returns the checkpoint's step. Every rank
    calls it (the hashes are shared out, DCP reads collectively)."""
    path, dist = Path(path), trainer.dist
    _verify(path, dist)
    counters = _read_counters(path)
    if counters["kind"] != trainer.policy.kind:
        raise CheckpointError(
            f"{path} holds a {counters['kind']!r} policy, this trainer trains {trainer.policy.kind!r}"
        )
    # every check first, then everything is applied: never half-loaded
    weights = _check_weights(path, trainer)
    old_policy = _check_old_policy(path, trainer)
    optimizer = _check_optimizer(path, trainer)
    weights()
    old_policy()
    optimizer()
    rng = path / "rng" / _rng_name(dist.rank)
    _set_rng_state(load_file(str(rng if rng.is_file() else path / "rng" / _rng_name(0))))
    trainer.restore(counters)
    return int(counters["step"])


def _read_counters(path: Path) -> dict[str, Any]:
    counters: dict[str, Any] = json.loads((path / "trainer.json").read_text())
    if counters.get("format") != FORMAT:
        raise CheckpointError(
            f"{path / 'trainer.json'}: checkpoint format {counters.get('format', 1)}, this trainer "
            f"reads format {FORMAT} only"
        )
    return counters


# --- reading a run's checkpoints outside the trainer ---------------------------------------


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a training run, with what sampling from it needs."""

    path: Path
    step: int
    base: str  # the BAGEL folder the run's trainer loaded (its frozen weights)
    resolution: int  # the run's sampling.resolution (px, square)


def find_run_checkpoint(run_dir: str | Path, step: int | None = None) -> RunCheckpoint:
    """The checkpoint of ``step`` (None: the latest) of the run in ``run_dir``; its
    ``config.yaml`` names the base checkpoint and where the trainer saved. What the checkpoint
    holds (LoRA or the full gen path) its own ``trainer.json`` says: see read_policy_update."""
    from flowgrpo.configs.run import read_recipe_sections

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir} is not a run folder (no config.yaml): give the run_dir of a run")
    cfg = read_recipe_sections(run_dir / "config.yaml", saved=True)
    folder = Path(cfg.trainer.checkpoint_dir) if cfg.trainer.checkpoint_dir else run_dir / "checkpoints"
    found = checkpoint_steps(folder)
    if not found:
        raise CheckpointError(
            f"run {run_dir} has no checkpoint in {folder} (it saves every schedule.save_every steps)"
        )
    if step is None:
        step = max(found)
    if step not in found:
        steps = ", ".join(str(s) for s in found)
        raise CheckpointError(
            f"run {run_dir} has no checkpoint of step {step}; it has steps {steps} (in {folder})"
        )
    base = cfg.trainer.checkpoint or cfg.model.checkpoint
    return RunCheckpoint(found[step], step, base, cfg.sampling.resolution)


def read_policy_update(path: str | Path) -> PolicyUpdate:
    """The policy a checkpoint holds, verified first, as the update a rollout applies (LoRA: the
    adapter; full: every gen-path tensor, whole, as saved); of the checkpoint's policy version.
    One process reads it, whatever number of ranks saved it."""
    path, one = Path(path), Dist()
    _verify(path, one)
    counters = _read_counters(path)
    version = int(counters["version"])
    if counters["kind"] == "lora":
        return load_peft_adapter(path / "adapter", version)
    folder = path / "gen_path"
    tensors = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in _stored(folder).items()}
    if not tensors:
        raise CheckpointError(f"{folder} holds no gen-path tensors")
    _dcp_load(HuggingFaceStorageReader(str(folder)), tensors, one)
    return PolicyUpdate(version, "gen_path", tensors)


# --- weights and optimizer -----------------------------------------------------------------


def _write_weights(tmp: Path, trainer: Checkpointed, base_model: str) -> None:
    if trainer.policy.kind == "full":
        _dcp_save(tmp / "gen_path", dict(trainer.policy.trainable()), trainer.dist)
        return
    published = {n: t.detach().cpu().contiguous() for n, t in trainer.policy.published().items()}
    if trainer.dist.rank == 0:  # LoRA is small: gathered, in the format rollouts load (and peft)
        cfg = trainer.policy.config
        update = PolicyUpdate(trainer.version, "lora", published, cfg.lora_rank, cfg.lora_alpha)
        save_peft_adapter(tmp / "adapter", update, str(Path(base_model).resolve()) if base_model else "")


def _check_weights(path: Path, trainer: Checkpointed) -> Callable[[], None]:
    """Check that the stored weights fit; returns what applies them."""
    if trainer.policy.kind == "lora":
        tensors = load_peft_adapter(path / "adapter").tensors
        shapes = {lora_published_name(n): p.shape for n, p in trainer.policy.trainable().items()}
        if {n: t.shape for n, t in tensors.items()} != shapes:
            raise CheckpointError(
                f"{path / 'adapter'} does not fit this trainer's LoRA: names or shapes differ"
            )
        return lambda: trainer.policy.load_published(tensors)
    params: dict[str, Tensor] = dict(trainer.policy.trainable())
    reader = _fitting_reader(path / "gen_path", params)
    return lambda: _dcp_load(reader, params, trainer.dist)


def _write_old_policy(tmp: Path, trainer: Checkpointed) -> None:
    """The policy's old copy (DiffusionNFT's sampling policy, AWM's average): part of the state a
    resumed run needs (it is an
    average of every earlier version, not something the weights can give back)."""
    if trainer.keeps_old_policy:
        _dcp_save(tmp / "old_policy", trainer.policy.old_state(), trainer.dist)


def _check_old_policy(path: Path, trainer: Checkpointed) -> Callable[[], None]:
    stored = (path / "old_policy").is_dir()
    if stored != trainer.keeps_old_policy:
        raise CheckpointError(
            f"{path} {'holds' if stored else 'has no'} an old copy of the policy (DiffusionNFT's old "
            f"policy, AWM's average) and this trainer {'keeps none' if stored else 'keeps one'}: resume "
            "with the algorithm it was saved with (and its settings)"
        )
    if not stored:
        return lambda: None
    old = trainer.policy.old_state()
    reader = _fitting_reader(path / "old_policy", old)
    return lambda: _dcp_load(reader, old, trainer.dist)


def _param_names(trainer: Checkpointed) -> list[str]:
    """Optimizer parameter index -> name: the order the optimizer was built with."""
    return list(trainer.policy.trainable())


def _write_optimizer(tmp: Path, trainer: Checkpointed) -> None:
    tensors = _optimizer_tensors(trainer)
    if tensors:  # none before the first step
        _dcp_save(tmp / "optimizer", tensors, trainer.dist)
    _write_optimizer_meta(tmp, trainer)


def _optimizer_tensors(trainer: Checkpointed) -> dict[str, Tensor]:
    """AdamW's state keyed ``<param name>/<key>``: moments sharded like their parameter, the
    step a scalar; empty before the first step."""
    state = trainer.optimizer.state_dict()["state"]
    names = _param_names(trainer)
    return {f"{names[index]}/{key}": value for index, entry in state.items() for key, value in entry.items()}


def _write_optimizer_meta(tmp: Path, trainer: Checkpointed) -> None:
    if trainer.dist.rank == 0:
        state = trainer.optimizer.state_dict()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        meta = {"param_groups": groups, "params": _param_names(trainer)}
        (tmp / "optimizer.json").write_text(json.dumps(meta, indent=2))


def _check_optimizer(path: Path, trainer: Checkpointed) -> Callable[[], None]:
    """Check that the stored optimizer state fits; returns what applies it."""
    meta = json.loads((path / "optimizer.json").read_text())
    names = _param_names(trainer)
    if meta["params"] != names:
        raise CheckpointError(
            f"{path / 'optimizer.json'}: the trainable parameters differ from this trainer's"
        )
    params = list(trainer.policy.trainable().values())
    folder = path / "optimizer"
    stored = _stored(folder)
    unknown = sorted(k for k in stored if k.rpartition("/")[0] not in names)
    if unknown:
        raise CheckpointError(f"{folder}: state of unknown parameters {unknown[:5]}")
    # the tensors DCP reads into: moments laid out like their parameter (DTensors under FSDP)
    tensors = {
        key: torch.zeros_like(params[names.index(key.rpartition("/")[0])], dtype=dtype)
        if len(size)
        else torch.zeros((), dtype=dtype)
        for key, (size, dtype) in stored.items()
    }
    reader = _fitting_reader(folder, tensors) if tensors else None

    def apply() -> None:
        if reader is not None:
            _dcp_load(reader, tensors, trainer.dist)
        state: dict[int, dict[str, Tensor]] = {}
        for key, value in tensors.items():
            name, _, field = key.rpartition("/")
            state.setdefault(names.index(name), {})[field] = value
        current = trainer.optimizer.state_dict()
        groups = [
            {**g, "params": cg["params"]}
            for g, cg in zip(meta["param_groups"], current["param_groups"], strict=True)
        ]
        for group in groups:
            if "betas" in group:
                group["betas"] = tuple(group["betas"])
        trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})

    return apply


# --- DCP -----------------------------------------------------------------------------------


def _dcp_save(folder: Path, tensors: dict[str, Tensor], dist: Dist) -> None:
    """Each rank writes its shards of ``tensors`` (DTensors, or plain tensors written once) into
    safetensors files under ``folder``, in files of about ``FILE_BYTES`` per rank."""
    writer = _dcp_writer(folder, tensors, dist)
    with _one_process_quietly(), _dcp_errors(f"writing {folder}"):
        dcp_save(tensors, storage_writer=writer, no_dist=not dist.enabled)


def _dcp_writer(folder: Path, tensors: dict[str, Tensor], dist: Dist) -> HuggingFaceStorageWriter:
    if not all(isinstance(t, Tensor) for t in tensors.values()):
        raise TypeError("only tensors are checkpointed through DCP (anything else would be pickled)")
    index, size, files = 1, 0, {}
    for name, tensor in tensors.items():
        share = tensor.numel() * tensor.element_size() // dist.world
        if size and size + share > FILE_BYTES:
            index, size = index + 1, 0
        files[name], size = index, size + share
    return HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=files, save_distributed=True)


def _stored(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (whole shape, dtype) of the tensors of a DCP folder (from the safetensors headers)."""
    if not folder.is_dir():
        return {}
    metadata = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) for k, m in metadata.items()}  # type: ignore[union-attr]


def _fitting_reader(folder: Path, tensors: dict[str, Tensor]) -> HuggingFaceStorageReader:
    stored = {k: size for k, (size, _) in _stored(folder).items()}
    wanted = {k: tuple(t.shape) for k, t in tensors.items()}
    if stored != wanted:
        differ = sorted(set(stored.items()) ^ set(wanted.items()))
        raise CheckpointError(f"{folder} does not fit this trainer: names or shapes differ {differ[:5]}")
    return HuggingFaceStorageReader(str(folder))


def _dcp_load(reader: HuggingFaceStorageReader, tensors: dict[str, Tensor], dist: Dist) -> None:
    """Read into ``tensors`` in place, each rank its own shards (from whichever files hold them)."""
    with torch.no_grad(), _one_process_quietly(), _dcp_errors(f"reading {reader.path}"):
        dcp_load(tensors, storage_reader=reader, no_dist=not dist.enabled)


@contextlib.contextmanager
def _dcp_errors(doing: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` derives from BaseException, not Exception: a handler that
    catches Exception (a gRPC service's error boundary) lets it through, and the call then never
    answers. Re-raised as a CheckpointError naming the first failing rank and its error."""
    try:
        yield
    except CheckpointException as error:
        rank, (first, _) = min(error.failures.items(), key=lambda item: item[0])
        cause = storage_cause(first) or f"{type(first).__name__}: {first}"
        raise CheckpointError(f"{doing} failed on rank {rank}: {cause}") from first


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns that it assumes one process whenever it runs without a process group: intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# --- RNG -----------------------------------------------------------------------------------


def _rng_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _write_rng(path: Path) -> None:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    path.parent.mkdir(exist_ok=True)
    save_file(state, str(path))
    _fsync_file(path)


def _set_rng_state(state: dict[str, Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# --- integrity -----------------------------------------------------------------------------


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _hashes(folder: Path, names: list[str], dist: Dist) -> dict[str, str]:
    """SHA-256 of the files ``names`` of ``folder`` ("" for a missing one), every rank hashing a
    share of them; every rank gets all."""
    table = torch.zeros(len(names), 33, dtype=torch.int64)  # digest bytes, then "present"
    for i in range(dist.rank, len(names), dist.world):
        path = folder / names[i]
        if path.is_file():
            with open(path, "rb") as f:
                table[i, :32] = torch.tensor(list(hashlib.file_digest(f, "sha256").digest()))
            table[i, 32] = 1
    table = dist.sum(table)
    return {
        name: bytes(row[:32].tolist()).hex() if row[32] else ""
        for name, row in zip(names, table, strict=True)
    }


def _verify(path: Path, dist: Dist) -> None:
    if not (path / MANIFEST).is_file():
        raise CheckpointDamaged(f"{path} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        expected = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as error:
        raise CheckpointDamaged(f"{path / MANIFEST} is corrupt: {error}") from None
    unlisted = sorted(set(_files(path)) - set(expected))
    if unlisted:  # DCP reads every safetensors file of its folder
        raise CheckpointDamaged(f"{path / unlisted[0]} is not in {MANIFEST}; nothing was loaded")
    actual = _hashes(path, sorted(expected), dist)
    for name, digest in sorted(expected.items()):
        if not actual[name]:
            raise CheckpointDamaged(
                f"{path / name} is missing: the checkpoint is incomplete; nothing was loaded"
            )
        if actual[name] != digest:
            raise CheckpointDamaged(
                f"{path / name} is corrupt or truncated (SHA-256 mismatch); nothing was loaded"
            )


def _check_shared(folder: Path, names: list[str], dist: Dist) -> None:
    """Every rank must see every rank's files (one filesystem), or no rank goes on."""
    seen = torch.tensor([zlib.crc32("\n".join(names).encode())], dtype=torch.int64)
    if dist.enabled and int(dist.max(seen.clone())) != -int(dist.max(-seen)):
        raise CheckpointError(
            f"the ranks see different files in {folder}: checkpoint_dir must be one filesystem "
            "that every rank shares"
        )


def _barrier(dist: Dist) -> None:
    if dist.enabled:
        torch_dist.barrier()


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            _fsync_file(p)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
