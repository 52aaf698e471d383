"""What a checkpoint every step costs the trainer (``flowgrpo bench trainer --checkpoint-every-step
DIR``): a training step followed by the checkpoint of that step, three ways, each a warm-up and
``--reps`` (>= 3) timed cycles:

- ``none``: the step alone (the baseline);
- ``sync``: the step, then ``save_checkpoint`` (what ``trainer.async_save=false`` blocks for);
- ``async``: the step, then ``start_checkpoint`` after waiting for the previous one, as the
  trainer does (``trainer.async_save=true``): the copy to host memory blocks, the writing, hashing
  and renaming overlap the next step (and slow it where they share its cores or memory bandwidth).

Reported per way: the cycle's seconds, the part of it the save kept the trainer from training
(``save_s``), and the cycle over the step alone (``cycle_over_none``): the per-step cost of a
checkpoint every step. ``checkpoint_bytes``: one checkpoint on disk. DIR should be the disk the
run's checkpoints go to. Under torchrun every rank writes its shards (the full gen path: DCP).
"""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed

from flowgrpo.configs.trainer import LossConfig, TrainerConfig
from flowgrpo.services.bench.common import sync
from flowgrpo.services.bench.stats import Figure, Runs, ratio, run_timed
from flowgrpo.services.bench.trainer_step import StepBench, Variant, configure_variant
from flowgrpo.services.trainer.checkpoint import (
    HostStager,
    PendingCheckpoint,
    save_checkpoint,
    start_checkpoint,
)
from flowgrpo.services.trainer.step import TrainStep

WAYS = ("none", "sync", "async")


def measure_checkpoint_cost(
    bench: StepBench, variant: Variant, folder: Path, say: Callable[..., None]
) -> dict[str, Any]:
    """The three ways, each with ``variant``'s settings (compile, activation checkpointing,
    micro-batch, autocast)."""
    configure_variant(variant, bench)
    if bench.initial is not None:  # LoRA: back to the sampled weights, as every variant starts
        bench.policy.load_published(bench.initial)
    loss = LossConfig(mini_batches=bench.mini_batches, micro_batch_size=variant.micro)
    trainer = TrainStep(bench.policy, bench.special, TrainerConfig(loss=loss), bench.dist)
    trainer.forwards.mixed_precision = variant.autocast
    stager = HostStager(pinned=bench.device.type == "cuda")
    saver = _Saver(trainer, bench, folder, stager)
    report: dict[str, Any] = {"variant": variant.name, "folder": str(folder)}
    runs: dict[str, Runs[float]] = {}
    try:
        for way in WAYS:
            cycle = functools.partial(saver.cycle, way)
            runs[way] = run_timed(cycle, repeats=bench.repeats, device=bench.device)
            saver.finish()
            report[way] = {"cycle_s": runs[way].seconds, "save_s": Figure.of(runs[way].outputs)}
            say(f"checkpoint every step, {way}: cycle {runs[way].seconds:.3f}", flush=True)
    finally:
        saver.finish()
        stager.close()
    for way in ("sync", "async"):
        report[way]["cycle_over_none"] = ratio(runs[way].seconds, runs["none"].seconds)
    report["checkpoint_bytes"] = saver.last_bytes
    if bench.dist.enabled:  # every rank's saves are over before rank 0 removes them
        torch.distributed.barrier()
    if bench.dist.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return report


class _Saver:
    """One step and (by way) its checkpoint; the async way waits for the previous save first."""

    def __init__(self, trainer: TrainStep, bench: StepBench, folder: Path, stager: HostStager) -> None:
        self.trainer, self.bench, self.folder, self.stager = trainer, bench, folder, stager
        self.pending: PendingCheckpoint | None = None
        self.saved = 0
        self.last_bytes = 0

    def cycle(self, way: str) -> float:
        """The step, then the save's blocking part: its seconds (0 for ``none``)."""
        batch = [replace(t, policy_version=self.trainer.version) for t in self.bench.batch]
        self.trainer.run(batch, self.bench.params, step=1)
        if way == "none":
            return 0.0
        sync(self.bench.device)
        begin = time.perf_counter()
        self.saved += 1
        if way == "sync":
            self._measure(save_checkpoint(self.folder / way, self.trainer, self.saved, keep_last=2))
        else:
            self.finish()
            self.pending = start_checkpoint(self.folder / way, self.trainer, self.saved, self.stager,
                                            keep_last=2)  # fmt: skip
        sync(self.bench.device)
        return time.perf_counter() - begin

    def finish(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._measure(pending.wait())

    def _measure(self, path: Path | None) -> None:
        if path is not None:  # rank 0
            self.last_bytes = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
