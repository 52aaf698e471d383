"""What every trainer rank does: build the sharded policy, fetch a batch, train, gather what is
published, save and resume checkpoints. Rank 0's actor (``service.py``) calls these and tells
the other ranks (``follow.py``) to call them too, in the same order."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from opentelemetry import trace

from flowgrpo.algorithms import algorithm_of
from flowgrpo.bus import BusClient, TensorRef
from flowgrpo.bus.torch_tensors import to_torch
from flowgrpo.columns import FP8, SAMPLE_PRECISIONS
from flowgrpo.configs.trainer import DgpoConfig, TrainerServiceConfig
from flowgrpo.fields import FieldError, check_float, check_id, check_int
from flowgrpo.models.bagel.checkpoint import load_special_tokens
from flowgrpo.models.bagel.sampling import token_grid
from flowgrpo.models.bagel.wire import (
    MAX_SAMPLE_INDEX,
    MAX_STEP,
    ModelLimits,
    check_finite,
    check_ref,
    check_token_ids,
    sampler_params_from_proto,
)
from flowgrpo.runtime import InvalidArgument
from flowgrpo.runtime.data import fetch_inputs
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.checkpoint import (
    CheckpointDamaged,
    HostStager,
    PendingCheckpoint,
    checkpoint_name,
    checkpoint_steps,
    load_checkpoint,
    save_checkpoint,
    start_checkpoint,
)
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.publish import Publisher
from flowgrpo.services.trainer.step import TrainStep, Trajectory
from flowgrpo.telemetry import links_from
from flowgrpo.v1 import common_pb2, trainer_pb2
from flowgrpo.yamlfile import brief

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

MAX_ADVANTAGE = 1e6  # |advantage|: the coordinator clips to advantages.clip (5); fp32 keeps headroom


@dataclass(frozen=True)
class Saved:
    """A SaveCheckpoint's outcome: where the checkpoint is (or will be), whether it is still being
    written (``trainer.async_save``), and the newest checkpoint written whole (step, path)."""

    path: Path | None
    pending: bool
    complete: tuple[int, str] | None


class TrainerCore:
    def __init__(self, config: TrainerServiceConfig, dist: Dist) -> None:
        cfg = config.trainer
        self.config = config
        self.dist = dist
        dtype = getattr(torch, cfg.dtype)
        policy = load_policy(
            cfg.checkpoint,
            cfg.policy,
            dist,
            dtype=dtype,
            device=cfg.device,
            param_dtype=dtype if cfg.device.startswith("cuda") else None,  # FSDP's gathered compute dtype
            # the KL term's reference, or DGPO's (its DPO reference is the frozen base by default)
            keep_reference=cfg.loss.kl_beta > 0
            or (isinstance(cfg.algorithm, DgpoConfig) and cfg.algorithm.reference == "base"),
            activation_checkpointing=cfg.activation_checkpointing,
            checkpoint_every=cfg.activation_checkpointing_every,
            compile=cfg.compile,
            share_base=cfg.share_base,
        )
        base = policy.base_bucket.finish() if policy.base_bucket is not None else None
        special = load_special_tokens(cfg.checkpoint)
        self.inputs = algorithm_of(cfg).columns  # what a sample must carry for this algorithm
        self.trainer = TrainStep(policy, special, cfg, dist)
        self.limits = ModelLimits.of(policy.model.config)  # what a request's images and prompts may be
        self.client = BusClient(config.bus)
        # the store is rank 0's bus server's, set by the service once it serves (None: a follower)
        self.publisher = Publisher(
            policy, None, cfg.publish_dtype, cfg.publish_bus, cfg.publish_cuda_ipc, base=base
        )
        self.pending: PendingCheckpoint | None = None  # trainer.async_save: the one being written
        self.complete: tuple[int, str] | None = None  # the newest checkpoint written whole
        self._stager: HostStager | None = None  # trainer.async_save: host buffers, reused
        self._last_save: tuple[str, int] | None = None  # (folder, step) of the last save started

    def resume(self) -> int | None:
        """Load the newest intact checkpoint: a damaged one (corrupt, truncated, incomplete) is
        named in the log and the one before it is taken; when none is intact, the newest one's
        error is raised. Nothing is loaded from a damaged checkpoint (they are verified first)."""
        cfg = self.config.trainer
        found = checkpoint_steps(cfg.checkpoint_dir) if cfg.checkpoint_dir and cfg.resume else {}
        damaged: CheckpointDamaged | None = None
        for path in reversed(found.values()):
            try:
                step = load_checkpoint(path, self.trainer)
            except CheckpointDamaged as error:
                log.warning("%s; trying the checkpoint before it", error)
                damaged = damaged or error
                continue
            log.info("resumed from %s: step %d, policy version %d", path, step, self.trainer.version)
            self.complete = (step, str(path))
            return step
        if damaged is not None:
            raise damaged
        return None

    def check(self, request: trainer_pb2.TrainStepRequest) -> SamplerParams:
        """Refuse a malformed request (before any rank starts on it); return its sampler settings.
        Every field is checked (the seed takes any int64: it is hashed into noise coordinates)."""
        if not request.samples:
            raise InvalidArgument("TrainStep needs at least one sample")
        try:
            check_int("TrainStepRequest.step", request.step, 1, MAX_STEP)
            params = sampler_params_from_proto(request.params, self.limits, "TrainStepRequest.params")
            seen: set[tuple[str, int]] = set()
            for i, sample in enumerate(request.samples):
                self._check_sample(f"TrainStepRequest.samples[{i}]", sample, params, seen)
        except FieldError as error:
            raise InvalidArgument(str(error)) from None
        return params

    def _check_sample(
        self, where: str, sample: trainer_pb2.TrainSample, params: SamplerParams, seen: set[tuple[str, int]]
    ) -> None:
        check_id(f"{where}.prompt_uid", sample.prompt_uid)
        check_int(f"{where}.sample_index", sample.sample_index, 0, MAX_SAMPLE_INDEX)
        key = (sample.prompt_uid, sample.sample_index)
        if key in seen:
            raise FieldError(f"{where}: sample {key[0]}/{key[1]} appears twice in this step")
        seen.add(key)
        version = self.trainer.version
        if not 0 <= sample.policy_version <= version:
            raise FieldError(
                f"{where}.policy_version={sample.policy_version}: need 0 <= policy_version <= {version} "
                "(this trainer's version; a sample cannot come from a newer policy)"
            )
        check_float(f"{where}.advantage", sample.advantage, -MAX_ADVANTAGE, MAX_ADVANTAGE)
        if sample.precision not in SAMPLE_PRECISIONS:
            raise FieldError(
                f"{where}.precision={brief(sample.precision)}: one of {list(SAMPLE_PRECISIONS)} "
                "('' : sampled in the weights' dtype; 'fp8': rollout.precision=fp8)"
            )
        if sample.precision == FP8 and self.config.trainer.loss.logp_old == "bypass":
            raise FieldError(
                f"{where}: sample {sample.prompt_uid}/{sample.sample_index} was drawn by an FP8 rollout, "
                "whose log-probs are not this trainer's old policy's: trainer.loss.logp_old=bypass would "
                "train on them as if they were; use trainer.loss.logp_old=recompute"
            )
        missing = [c for c in self.inputs if c not in sample.inputs]
        if missing:
            raise FieldError(
                f"{where}.inputs: sample {sample.prompt_uid}/{sample.sample_index} lacks input "
                f"columns {missing}; the trainer ({self.config.trainer.algorithm.name}) needs "
                f"{list(self.inputs)}"
            )
        for column, dtype, dims in self._input_shapes(params):
            check_ref(f"{where}.inputs[{column!r}]", sample.inputs[column], column, (dtype,),
                      dims=dims, max_bytes=self.config.bus.max_bytes)  # fmt: skip

    def _input_shapes(self, params: SamplerParams) -> list[tuple[str, str, list[tuple[int, int]]]]:
        """Column, dtype and shape of each input of a sample drawn with ``params``."""
        size, (rows, cols), limits = params.window_size, token_grid(params), self.limits
        tokens, dim = rows * cols, limits.token_dim
        shapes = {
            "prompt_ids": ("int64", [(1, limits.max_prompt_tokens)]),
            "latents": ("float32", [(size + 1, size + 1), (tokens, tokens), (dim, dim)]),
            "log_probs": ("float32", [(size, size)]),
            "sigmas": ("float32", [(size + 1, size + 1)]),
            "final_latents": ("float32", [(tokens, tokens), (dim, dim)]),
        }
        return [(column, *shapes[column]) for column in self.inputs]

    def train(
        self, request: trainer_pb2.TrainStepRequest, may_stop: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """One training step on the request's samples (every rank fetches the whole batch).
        ``may_stop``: see :meth:`TrainStep.run`; one process only (ranks that stopped
        alone would leave the others waiting in a collective)."""
        params = self.check(request)
        batch, traces = self._fetch_batch(request)
        with tracer.start_as_current_span(
            "trainer.step", links=links_from(traces), attributes={"step": request.step}
        ):
            stop = may_stop if self.dist.world == 1 else None
            return self.trainer.run(batch, params, stop, seed=request.seed, step=request.step)

    def publish(self) -> common_pb2.WeightUpdate:
        """Publish the current version (a collective under FSDP: every rank calls it; rank 0's
        publisher has the store and returns the update)."""
        with self.trainer.sampling_policy():  # DiffusionNFT's rollouts sample with its old policy
            return self.publisher.publish(self.trainer.version)

    def save(self, folder: str, step: int, complete: bool = False) -> Saved:
        """The checkpoint of ``step``: written now, or (``trainer.async_save``) copied now and
        written in the background, one at a time; ``complete``: return only once it is whole."""
        cfg = self.config.trainer
        if cfg.async_save and self._last_save == (folder, step):
            # the same step asked again (whole, at a run's end): no second copy. Decided from the
            # requests alone, never from a background thread's progress, so every rank agrees
            if complete:
                self.finish_pending()
            return self._saved(Path(folder) / checkpoint_name(step))
        self.finish_pending()  # one save in flight at most: its host copy is the next one's buffer
        self._last_save = (folder, step)
        if not cfg.async_save:
            path = save_checkpoint(folder, self.trainer, step, cfg.keep_last, base_model=cfg.checkpoint)
            if path is not None:
                self.complete = (step, str(path))
            return self._saved(path)
        self.pending = start_checkpoint(
            folder, self.trainer, step, self._stage, keep_last=cfg.keep_last, base_model=cfg.checkpoint
        )
        path = self.pending.path
        if complete:
            self.finish_pending()
        return self._saved(path)

    def _saved(self, path: Path | None) -> Saved:
        return Saved(path, self.pending is not None, self.complete_checkpoint())

    def complete_checkpoint(self) -> tuple[int, str] | None:
        """The newest checkpoint written whole, (step, path); a background save that has ended
        is taken into account (its failure is raised by the next save, not here)."""
        if self.pending is not None and self.pending.done() and not self.pending.failed():
            self.finish_pending()  # a failed one stays: the next save raises its error
        return self.complete

    def finish_pending(self) -> None:
        """Wait for the background save, if any; raise what stopped it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        path = pending.wait()
        if path is not None:
            self.complete = (pending.step, str(path))

    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._stager is None:
            self._stager = HostStager(pinned=self.config.trainer.device.startswith("cuda"))
        return self._stager(tensors)

    def close(self) -> None:
        """Finish a checkpoint still being written (a drain ends with it whole), then let go."""
        try:
            self.finish_pending()
        except Exception as error:  # closing: said, not raised
            log.warning("the last checkpoint was not written: %s", error)
        if self._stager is not None:
            self._stager.close()
        self.client.close()

    def _check_inputs(self, where: str, inputs: dict[str, torch.Tensor]) -> None:
        """The fetched values: prompt ids in the vocabulary, finite trajectories, sigmas in [0, 1].
        Every rank fetches the whole batch, so every rank refuses it alike, before any collective."""
        try:
            for column, value in inputs.items():
                if column == "prompt_ids":
                    check_token_ids(f"{where}['prompt_ids']", value, self.limits.vocab)
                elif column == "sigmas":
                    check_finite(f"{where}['sigmas']", value, 0.0, 1.0)
                else:
                    check_finite(f"{where}[{column!r}]", value)
        except FieldError as error:
            raise InvalidArgument(str(error)) from None

    def _fetch_batch(
        self, request: trainer_pb2.TrainStepRequest
    ) -> tuple[list[Trajectory], list[dict[str, str]]]:
        refs = [TensorRef.from_proto(s.inputs[c]) for s in request.samples for c in self.inputs]
        fetched = fetch_inputs(self.client, refs, "trajectories")
        width = len(self.inputs)
        batch = []
        for i, sample in enumerate(request.samples):
            inputs = {
                c: to_torch(f).clone()
                for c, f in zip(self.inputs, fetched[i * width : (i + 1) * width], strict=True)
            }
            self._check_inputs(f"TrainStepRequest.samples[{i}].inputs", inputs)
            none = torch.empty(0)  # an input this algorithm does not read
            batch.append(
                Trajectory(
                    sample.prompt_uid,
                    sample.sample_index,
                    sample.policy_version,
                    sample.advantage,
                    inputs["prompt_ids"],
                    inputs.get("latents", none),
                    inputs.get("log_probs", none),
                    inputs.get("sigmas", none),
                    inputs.get("final_latents"),
                    fp8=sample.precision == FP8,
                )
            )
        return batch, [f.trace for f in fetched]
