"""Trainer checkpoints: trainable weights, optimizer state, RNG, counters; atomic and verified.

Layout of ``<dir>/step_00000042/``:

- ``adapter/`` (LoRA, the standard PEFT adapter folder) or ``gen_path.safetensors`` (full);
- ``optimizer.safetensors`` (AdamW moments keyed ``<param name>/<key>``) + ``optimizer.json``;
- ``rng.safetensors`` (CPU and CUDA generator states);
- ``trainer.json`` (step, policy version, counters) and ``manifest.json``: the SHA-256 of every
  other file, written last.

A checkpoint is written into a hidden temporary folder and renamed into place, so a crash
never leaves a half checkpoint under a real name. Loading verifies the manifest and every hash
BEFORE anything is applied: a corrupt or truncated checkpoint is refused whole, naming the file.
No pickle: tensors in safetensors, the rest JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from flowgrpo.models.bagel.peft_format import load_peft_adapter, save_peft_adapter
from flowgrpo.models.bagel.policy import PolicyUpdate
from flowgrpo.services.trainer.distributed import full_tensor, shard_like
from flowgrpo.services.trainer.step import FlowGRPOStep

PREFIX = "step_"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, truncated or does not fit this trainer."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def latest_checkpoint(folder: str | Path) -> Path | None:
    folder = Path(folder)
    found = sorted(p for p in folder.glob(f"{PREFIX}*") if p.is_dir()) if folder.is_dir() else []
    return found[-1] if found else None


def save_checkpoint(folder: str | Path, trainer: FlowGRPOStep, step: int, keep_last: int = 3) -> Path | None:
    """Write the checkpoint of ``step`` atomically; keep the ``keep_last`` newest.

    Under FSDP every rank must call it (the shards are gathered); rank 0 writes and returns the
    path, the others return None."""
    published = {n: t.detach().cpu().contiguous() for n, t in trainer.policy.published().items()}
    optimizer = _optimizer_tensors(trainer)
    if trainer.dist.rank != 0:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=folder))
    try:
        _write_weights(tmp, trainer, published)
        _write_optimizer(tmp, trainer, optimizer)
        save_file(_rng_state(), str(tmp / "rng.safetensors"))
        counters = {"step": step, "version": trainer.version, "steps_done": trainer.steps_done,
                    "last_gap": trainer.last_gap, "kind": trainer.policy.kind}  # fmt: skip
        (tmp / "trainer.json").write_text(json.dumps(counters, indent=2))
        (tmp / MANIFEST).write_text(json.dumps(_hashes(tmp), indent=2, sort_keys=True))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(p for p in folder.glob(f"{PREFIX}*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)
    return final


def load_checkpoint(path: str | Path, trainer: FlowGRPOStep) -> int:
    """Verify, then restore ``trainer`` from ``path``; returns the checkpoint's step."""
    path = Path(path)
    _verify(path)
    counters = json.loads((path / "trainer.json").read_text())
    if counters["kind"] != trainer.policy.kind:
        raise CheckpointError(
            f"{path} holds a {counters['kind']!r} policy, this trainer trains {trainer.policy.kind!r}"
        )
    if trainer.policy.kind == "lora":
        tensors = load_peft_adapter(path / "adapter").tensors
    else:
        tensors = load_file(str(path / "gen_path.safetensors"))
    trainer.policy.load_published(tensors)
    _read_optimizer(path, trainer)
    _set_rng_state(load_file(str(path / "rng.safetensors")))
    trainer.version, trainer.steps_done = int(counters["version"]), int(counters["steps_done"])
    trainer.last_gap = float(counters["last_gap"])
    return int(counters["step"])


# --- parts ---------------------------------------------------------------------------------


def _write_weights(tmp: Path, trainer: FlowGRPOStep, published: dict[str, torch.Tensor]) -> None:
    if trainer.policy.kind == "lora":
        cfg = trainer.policy.config
        save_peft_adapter(
            tmp / "adapter", PolicyUpdate(trainer.version, "lora", published, cfg.lora_rank, cfg.lora_alpha)
        )
    else:
        save_file(published, str(tmp / "gen_path.safetensors"))


def _param_names(trainer: FlowGRPOStep) -> list[str]:
    """Optimizer parameter index -> name: the order the optimizer was built with."""
    return list(trainer.policy.trainable())


def _optimizer_tensors(trainer: FlowGRPOStep) -> dict[str, torch.Tensor]:
    """AdamW's state as whole tensors keyed ``<param name>/<key>`` (shards gathered)."""
    names = _param_names(trainer)
    return {
        f"{names[index]}/{key}": full_tensor(value.detach()).cpu().contiguous()
        for index, entry in trainer.optimizer.state_dict()["state"].items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    }


def _write_optimizer(tmp: Path, trainer: FlowGRPOStep, tensors: dict[str, torch.Tensor]) -> None:
    state = trainer.optimizer.state_dict()
    names = _param_names(trainer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    (tmp / "optimizer.json").write_text(json.dumps({"param_groups": groups, "params": names}, indent=2))


def _read_optimizer(path: Path, trainer: FlowGRPOStep) -> None:
    meta = json.loads((path / "optimizer.json").read_text())
    names = _param_names(trainer)
    if meta["params"] != names:
        raise CheckpointError(
            f"{path / 'optimizer.json'}: the trainable parameters differ from this trainer's"
        )
    tensors = load_file(str(path / "optimizer.safetensors"))
    params = list(trainer.policy.trainable().values())
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        index = names.index(name)
        # moments are laid out like their parameter (sharded under FSDP); the step count is a scalar
        state.setdefault(index, {})[field] = shard_like(params[index], value) if value.dim() else value
    current = trainer.optimizer.state_dict()
    groups = [
        {**g, "params": cg["params"]}
        for g, cg in zip(meta["param_groups"], current["param_groups"], strict=True)
    ]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def _verify(path: Path) -> None:
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        expected = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path / MANIFEST} is corrupt: {error}") from None
    actual = _hashes(path)
    for name, digest in expected.items():
        if name not in actual:
            raise CheckpointError(
                f"{path / name} is missing: the checkpoint is incomplete; nothing was loaded"
            )
        if actual[name] != digest:
            raise CheckpointError(
                f"{path / name} is corrupt or truncated (SHA-256 mismatch); nothing was loaded"
            )


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
