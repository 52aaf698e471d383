"""What every trainer rank does: build the sharded policy, fetch a batch, train, gather what is
published, save and resume checkpoints. Rank 0's actor (``service.py``) calls these and tells
the other ranks (``follow.py``) to call them too, in the same order."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from opentelemetry import trace

from flowgrpo.bus import BusClient, TensorRef
from flowgrpo.bus.torch_tensors import to_torch
from flowgrpo.models.bagel.checkpoint import load_special_tokens
from flowgrpo.models.bagel.sampling import SamplerParams
from flowgrpo.models.bagel.wire import sampler_params_from_proto
from flowgrpo.runtime import InvalidArgument
from flowgrpo.runtime.data import fetch_inputs
from flowgrpo.services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from flowgrpo.services.trainer.config import TrainerServiceConfig
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.publish import Publisher
from flowgrpo.services.trainer.step import FlowGRPOStep, Trajectory
from flowgrpo.telemetry import links_from
from flowgrpo.v1 import common_pb2, trainer_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

INPUT_COLUMNS = ("prompt_ids", "latents", "log_probs", "sigmas")


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
            keep_reference=cfg.loss.kl_beta > 0,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
        )
        self.trainer = FlowGRPOStep(policy, load_special_tokens(cfg.checkpoint), cfg.optim, cfg.loss, dist)
        self.client = BusClient(config.bus)
        # the store is rank 0's bus server's, set by the service once it serves (None: a follower)
        self.publisher = Publisher(policy, None, cfg.publish_dtype, cfg.publish_bus, cfg.publish_cuda_ipc)

    def resume(self) -> int | None:
        cfg = self.config.trainer
        path = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir and cfg.resume else None
        if path is None:
            return None
        step = load_checkpoint(path, self.trainer)
        log.info("resumed from %s: step %d, policy version %d", path, step, self.trainer.version)
        return step

    @staticmethod
    def check(request: trainer_pb2.TrainStepRequest) -> SamplerParams:
        """Refuse a malformed request (before any rank starts on it); return its sampler settings."""
        if not request.samples:
            raise InvalidArgument("TrainStep needs at least one sample")
        for sample in request.samples:
            missing = [c for c in INPUT_COLUMNS if c not in sample.inputs]
            if missing:
                raise InvalidArgument(
                    f"sample {sample.prompt_uid}/{sample.sample_index} lacks input columns {missing}; "
                    f"the trainer needs {list(INPUT_COLUMNS)}"
                )
        try:
            return sampler_params_from_proto(request.params)
        except ValueError as error:
            raise InvalidArgument(str(error)) from None

    def train(
        self, request: trainer_pb2.TrainStepRequest, may_stop: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """One training step on the request's samples (every rank fetches the whole batch).
        ``may_stop``: see :meth:`FlowGRPOStep.run`; one process only (ranks that stopped
        alone would leave the others waiting in a collective)."""
        params = self.check(request)
        batch, traces = self._fetch_batch(request)
        with tracer.start_as_current_span(
            "trainer.step", links=links_from(traces), attributes={"step": request.step}
        ):
            return self.trainer.run(batch, params, may_stop if self.dist.world == 1 else None)

    def publish(self) -> common_pb2.WeightUpdate:
        """Publish the current version (a collective under FSDP: every rank calls it; rank 0's
        publisher has the store and returns the update)."""
        return self.publisher.publish(self.trainer.version)

    def save(self, folder: str, step: int) -> Path | None:
        cfg = self.config.trainer
        return save_checkpoint(folder, self.trainer, step, cfg.keep_last, base_model=cfg.checkpoint)

    def close(self) -> None:
        self.client.close()

    def _fetch_batch(
        self, request: trainer_pb2.TrainStepRequest
    ) -> tuple[list[Trajectory], list[dict[str, str]]]:
        refs = [TensorRef.from_proto(s.inputs[c]) for s in request.samples for c in INPUT_COLUMNS]
        fetched = fetch_inputs(self.client, refs, "trajectories")
        width = len(INPUT_COLUMNS)
        batch = []
        for i, sample in enumerate(request.samples):
            ids, latents, log_probs, sigmas = (
                to_torch(f).clone() for f in fetched[i * width : (i + 1) * width]
            )
            batch.append(Trajectory(sample.prompt_uid, sample.sample_index, sample.policy_version,
                                    sample.advantage, ids, latents, log_probs, sigmas))  # fmt: skip
        return batch, [f.trace for f in fetched]
