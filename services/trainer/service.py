"""The trainer actor (rank 0): TrainStep, SaveCheckpoint and State over gRPC, weights on the bus.

State: the ``TrainerCore`` (policy, optimizer, bus client), this replica's bus store (the
published weights), the last step and the newest publication. One message at a time: a
checkpoint is never taken in the middle of an update. Under torchrun, every operation is first
announced to the other ranks (``follow.py``), which run it too.

Requests are checked before they are announced (``TrainerCore.check``): a bad field is
INVALID_ARGUMENT naming it. Steps come in order (each TrainStep is the step after the last),
and a checkpoint is only ever written into ``trainer.checkpoint_dir``, under the trainer's own
step: a request cannot name another folder, nor a step this trainer has not reached.
"""

from __future__ import annotations

import signal
import time

import grpc.aio

from flowgrpo.algorithms import algorithm_of
from flowgrpo.algorithms.flow_grpo.objective import LogProbGapError
from flowgrpo.bus import BusServer, serve_store
from flowgrpo.config_digest import role_settings
from flowgrpo.configs.trainer import TrainerConfig, TrainerServiceConfig
from flowgrpo.devices import release_cached_memory
from flowgrpo.runtime import Actor, InvalidArgument, ServiceError, message, raise_if_abandoned
from flowgrpo.services.trainer.checkpoint import CheckpointWriteError, confined_folder
from flowgrpo.services.trainer.core import TrainerCore
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.follow import SAVE, STOP, TRAIN, CommandChannel
from flowgrpo.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc


def stage(config: TrainerConfig) -> common_pb2.StageSpec:
    """What the trainer reads and writes: its algorithm's inputs and the advantages, weights out."""
    inputs = algorithm_of(config).columns
    return common_pb2.StageSpec(stage="trainer", consumes=[*inputs, "advantages"], produces=["weights"])


class TrainerService(Actor, trainer_pb2_grpc.TrainerServicer):
    role = "trainer"

    def __init__(self, config: TrainerServiceConfig, dist: Dist | None = None) -> None:
        super().__init__(config.replica_id)
        self.config = config
        self.dist = dist or Dist()
        self.channel = CommandChannel.create() if self.dist.enabled else None  # to ranks > 0
        self.core: TrainerCore | None = None  # built in start()
        self.step = 0  # last completed training step (the coordinator's numbering)
        self.current = common_pb2.WeightUpdate()  # the newest publication
        self.bus: BusServer | None = None
        self.stages = [stage(config.trainer)]
        self.settings = role_settings(self.role, config)  # the coordinator compares them with its recipe's

    async def start(self) -> None:
        cfg = self.config.trainer
        ranks = f", {self.dist.world} ranks" if self.dist.enabled else ""
        with self.startup_phase("model", f"{cfg.policy.kind} policy on {cfg.device}, {cfg.dtype}{ranks}"):
            self.core = await self.compute(TrainerCore, self.config, self.dist)
        self.bus = serve_store(self.config.bus)
        self.bus_endpoint = self.bus.endpoint
        self.core.publisher.store = self.bus.store
        self.current = self.core.publisher.initial()
        with self.startup_phase("checkpoint", "none to resume") as phase:
            resumed = await self.compute(self.core.resume)  # every rank resumes on its own
            if resumed is not None:
                phase.detail = f"step {resumed}"
                self.step = resumed
                self.current = await self.compute(self._publish)
        self.policy_version = self.core.trainer.version

    async def stop(self) -> None:
        if self.channel is not None:
            self.channel.send(STOP)
        if self.core is not None:
            self.core.close()
        if self.bus is not None:
            self.bus.close()

    # --- RPCs ----------------------------------------------------------------------------------

    @message
    async def TrainStep(
        self, request: trainer_pb2.TrainStepRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainStepResponse:
        core = self._core()
        if request.step != self.step + 1:
            raise InvalidArgument(
                f"TrainStepRequest.step={request.step}: this trainer is at step {self.step}, so the next "
                f"step is {self.step + 1} (steps are trained in order, one at a time)"
            )
        core.check(request)  # refuse a bad request here, before the other ranks join in
        self._announce(TRAIN, request.SerializeToString())
        try:
            metrics = await self.compute(core.train, request, raise_if_abandoned)  # a caller gone: stop early
            started = time.perf_counter()
            self.current = await self.compute(self._publish)
            metrics["timing_s/update_weights"] = time.perf_counter() - started
        finally:  # after a failed or abandoned step too: the rollout on this GPU samples next
            released = await self._release_memory()
        if released is not None:
            metrics["timing_s/release_memory"] = released
        self.step, self.policy_version = request.step, core.trainer.version
        response = trainer_pb2.TrainStepResponse(
            step=request.step, update=self.current, complete=_saved_checkpoint(core.complete_checkpoint())
        )
        response.metrics.values.update(metrics)
        return response

    @message
    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        folder = self.config.trainer.checkpoint_dir
        if not folder:
            raise ServiceError("this trainer saves no checkpoints: trainer.checkpoint_dir is not set")
        try:
            folder = str(confined_folder(folder, request.path))
        except ValueError as error:
            raise InvalidArgument(f"SaveCheckpointRequest.path: {error}") from None
        if request.step not in (0, self.step):
            raise InvalidArgument(
                f"SaveCheckpointRequest.step={request.step}: this trainer is at step {self.step}; "
                f"give {self.step} (or 0, meaning the current step)"
            )
        resolved = trainer_pb2.SaveCheckpointRequest(step=self.step, path=folder, complete=request.complete)
        self._announce(SAVE, resolved.SerializeToString())
        started = time.perf_counter()
        try:
            saved = await self.compute(self._core().save, folder, resolved.step, resolved.complete)
        except CheckpointWriteError as error:  # the storage's answer, not a failure of this
            # trainer: FAILED_PRECONDITION, which no caller retries (a full disk stays full)
            raise ServiceError(str(error)) from error
        return trainer_pb2.SaveCheckpointResponse(
            path=str(saved.path), save_s=time.perf_counter() - started, pending=saved.pending,
            complete=_saved_checkpoint(saved.complete),
        )  # fmt: skip

    @message
    async def State(
        self, request: trainer_pb2.TrainerStateRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStateResponse:
        core = self._core()
        return trainer_pb2.TrainerStateResponse(
            step=self.step, policy_version=core.trainer.version, current=self.current,
            complete=_saved_checkpoint(core.complete_checkpoint()),
        )  # fmt: skip

    # --- helpers -------------------------------------------------------------------------------

    async def _release_memory(self) -> float | None:
        if not self.config.trainer.release_memory:
            return None
        return await self.compute(release_cached_memory, self.config.trainer.device)

    def _publish(self) -> common_pb2.WeightUpdate:
        return self._core().publish()

    def _announce(self, op: int, payload: bytes) -> None:
        if self.channel is not None:
            self.channel.send(op, payload)

    def _core(self) -> TrainerCore:
        assert self.core is not None, "built in start(), before any message"
        return self.core


def _saved_checkpoint(complete: tuple[int, str] | None) -> trainer_pb2.SavedCheckpoint:
    step, path = complete or (0, "")
    return trainer_pb2.SavedCheckpoint(step=step, path=path)


def follow(config: TrainerServiceConfig, dist: Dist) -> None:
    """Ranks > 0: run what rank 0 announces, until STOP. SIGTERM is left to rank 0, which drains
    and then sends STOP (torchrun signals every rank; a follower that died first would break
    the collectives of the message rank 0 is finishing)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = CommandChannel.create()
    core = TrainerCore(config, dist)
    if core.resume() is not None:
        core.publish()  # rank 0 re-publishes after a resume: join its gathers
    try:
        while True:
            op, payload = channel.receive()
            if op == STOP:
                return
            if op == TRAIN:
                try:
                    core.train(trainer_pb2.TrainStepRequest.FromString(payload))
                except InvalidArgument:  # rank 0 refused the same fetched batch, before any collective
                    continue
                except LogProbGapError:  # every rank saw the same reduced gap: all stopped, none updated
                    continue
                core.publish()
            elif op == SAVE:
                request = trainer_pb2.SaveCheckpointRequest.FromString(payload)
                core.save(request.path, request.step, request.complete)
    finally:
        core.close()
