"""The trainer actor: TrainStep, SaveCheckpoint and State over gRPC, weights on the bus.

State: the policy and its optimizer (``FlowGRPOStep``), this replica's bus store (the published
weights) and a bus client (trajectories come from the rollouts' stores). One message at a time:
a checkpoint is never taken in the middle of an update.
"""

from __future__ import annotations

import logging
import time

import grpc
import grpc.aio
import torch
from opentelemetry import trace

from flowgrpo.bus import BusClient, BusServer, TensorRef, serve_store
from flowgrpo.bus.torch_tensors import to_torch
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens
from flowgrpo.models.bagel.wire import sampler_params_from_proto
from flowgrpo.runtime import Actor, InvalidArgument, message
from flowgrpo.runtime.data import fetch_inputs
from flowgrpo.services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from flowgrpo.services.trainer.config import TrainerServiceConfig
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.publish import publish
from flowgrpo.services.trainer.step import FlowGRPOStep, Trajectory
from flowgrpo.telemetry import links_from
from flowgrpo.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

INPUT_COLUMNS = ("prompt_ids", "latents", "log_probs", "sigmas")
STAGE = common_pb2.StageSpec(stage="trainer", consumes=[*INPUT_COLUMNS, "advantages"], produces=["weights"])


class TrainerService(Actor, trainer_pb2_grpc.TrainerServicer):
    role = "trainer"

    def __init__(self, config: TrainerServiceConfig) -> None:
        super().__init__(config.replica_id)
        self.config = config
        self.trainer: FlowGRPOStep | None = None  # policy + optimizer, built in start()
        self.step = 0  # last completed training step (the coordinator's numbering)
        self.current = common_pb2.WeightUpdate()  # the newest publication
        self.bus: BusServer | None = None
        self.client = BusClient(config.bus)
        self.stages = [STAGE]

    async def start(self) -> None:
        self.trainer = await self.compute(self._build)
        self.bus = serve_store(self.config.bus)
        self.bus_endpoint = self.bus.endpoint
        resumed = await self.compute(self._resume)
        if resumed is not None:
            self.step = resumed
            self.current = publish(self.bus.store, self.trainer.policy, self.trainer.version, self._dtype())
        self.policy_version = self.trainer.version

    async def stop(self) -> None:
        self.client.close()
        if self.bus is not None:
            self.bus.close()

    def _build(self) -> FlowGRPOStep:
        cfg = self.config.trainer
        model = load_bagel_model(cfg.checkpoint, dtype=getattr(torch, cfg.dtype), device=cfg.device)
        policy = TrainablePolicy(model, cfg.policy)
        return FlowGRPOStep(policy, load_special_tokens(cfg.checkpoint), cfg.optim, cfg.loss)

    def _resume(self) -> int | None:
        cfg = self.config.trainer
        path = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir and cfg.resume else None
        if path is None:
            return None
        step = load_checkpoint(path, self._trainer())
        log.info("resumed from %s: step %d, policy version %d", path, step, self._trainer().version)
        return step

    # --- RPCs ----------------------------------------------------------------------------------

    @message
    async def TrainStep(
        self, request: trainer_pb2.TrainStepRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainStepResponse:
        try:
            params = sampler_params_from_proto(request.params)
        except ValueError as error:
            raise InvalidArgument(str(error)) from None
        if not request.samples:
            raise InvalidArgument("TrainStep needs at least one sample")
        return await self.compute(self._train, request, params)

    @message
    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        folder = request.path or self.config.trainer.checkpoint_dir
        if not folder:
            raise InvalidArgument(
                "no checkpoint folder: set trainer.checkpoint_dir or SaveCheckpointRequest.path"
            )
        started = time.perf_counter()
        step = request.step or self.step
        path = await self.compute(
            save_checkpoint, folder, self._trainer(), step, self.config.trainer.keep_last
        )
        return trainer_pb2.SaveCheckpointResponse(path=str(path), save_s=time.perf_counter() - started)

    @message
    async def State(
        self, request: trainer_pb2.TrainerStateRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStateResponse:
        return trainer_pb2.TrainerStateResponse(
            step=self.step, policy_version=self._trainer().version, current=self.current
        )

    # --- work (on the actor's compute thread) --------------------------------------------------

    def _train(self, request: trainer_pb2.TrainStepRequest, params: object) -> trainer_pb2.TrainStepResponse:
        batch, traces = self._fetch_batch(request)
        trainer = self._trainer()
        with tracer.start_as_current_span(
            "trainer.step", links=links_from(traces), attributes={"step": request.step}
        ):
            metrics = trainer.run(batch, params)  # type: ignore[arg-type]
            started = time.perf_counter()
            self.current = publish(self._store().store, trainer.policy, trainer.version, self._dtype())
            metrics["timing_s/update_weights"] = time.perf_counter() - started
        self.step, self.policy_version = request.step, trainer.version
        response = trainer_pb2.TrainStepResponse(step=request.step, update=self.current)
        response.metrics.values.update(metrics)
        return response

    def _fetch_batch(
        self, request: trainer_pb2.TrainStepRequest
    ) -> tuple[list[Trajectory], list[dict[str, str]]]:
        refs: list[TensorRef] = []
        for sample in request.samples:
            missing = [c for c in INPUT_COLUMNS if c not in sample.inputs]
            if missing:
                raise InvalidArgument(
                    f"sample {sample.prompt_uid}/{sample.sample_index} lacks input columns {missing}; "
                    f"the trainer needs {list(INPUT_COLUMNS)}"
                )
            refs += [TensorRef.from_proto(sample.inputs[c]) for c in INPUT_COLUMNS]
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

    def _dtype(self) -> str:
        return self.config.trainer.publish_dtype

    def _trainer(self) -> FlowGRPOStep:
        assert self.trainer is not None, "built in start(), before any message"
        return self.trainer

    def _store(self) -> BusServer:
        assert self.bus is not None, "created in start(), before any message"
        return self.bus
