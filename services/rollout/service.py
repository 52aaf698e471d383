"""The rollout actor: Generate, LoadWeights and Release over gRPC, tensors over the bus.

State: the engine (model, VAE, policy version), this replica's bus store (trajectories and
images it produced, kept until the coordinator releases their tag) and a bus client (prompt ids
and weights come from other producers' stores). Messages run one at a time, so a policy update
always lands between two Generate requests, never inside one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
import grpc.aio
import torch
from opentelemetry import trace

from flowgrpo.bus import (
    BusClient,
    BusServer,
    TensorRef,
    TensorStore,
    serve_store,
)
from flowgrpo.bus.torch_tensors import put_tensor, to_torch
from flowgrpo.models.bagel.policy import PolicyUpdate, PolicyUpdateError
from flowgrpo.models.bagel.sampling import SampleRequest, SamplerParams, Trajectories
from flowgrpo.models.bagel.wire import sampler_params_from_proto
from flowgrpo.runtime import Actor, InvalidArgument, message, raise_if_abandoned
from flowgrpo.runtime.data import fetch_inputs
from flowgrpo.services.rollout.config import RolloutServiceConfig
from flowgrpo.services.rollout.engine import NativeBagelEngine, RolloutEngine
from flowgrpo.telemetry import links_from
from flowgrpo.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

tracer = trace.get_tracer(__name__)

OUTPUT_COLUMNS = ("latents", "log_probs", "sigmas", "timesteps", "images")
STAGE = common_pb2.StageSpec(stage="rollout", consumes=["prompt_ids"], produces=list(OUTPUT_COLUMNS))


class RolloutService(Actor, rollout_pb2_grpc.RolloutServicer):
    role = "rollout"

    def __init__(self, config: RolloutServiceConfig, engine: RolloutEngine | None = None) -> None:
        super().__init__(config.replica_id)
        self.config = config
        self.engine: RolloutEngine | None = engine  # loaded in start() unless given
        self.bus: BusServer | None = None  # this replica's store of produced tensors
        self.client = BusClient(config.bus)
        self.stages = [STAGE]

    async def start(self) -> None:
        if self.engine is None:
            self.engine = await self.compute(self._load_engine)
        self.bus = serve_store(self.config.bus)
        self.bus_endpoint = self.bus.endpoint
        self.policy_version = self.engine.policy_version

    async def stop(self) -> None:
        self.client.close()
        if self.bus is not None:
            self.bus.close()

    def _load_engine(self) -> RolloutEngine:
        cfg = self.config.rollout
        return NativeBagelEngine.from_checkpoint(
            cfg.checkpoint,
            device=cfg.device,
            dtype=getattr(torch, cfg.dtype),
            max_batch_samples=cfg.max_batch_samples,
            lora_mode=cfg.lora_mode,
            compile=cfg.compile,
        )

    # --- RPCs ----------------------------------------------------------------------------------

    @message
    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        if self.policy_version < request.min_policy_version:
            raise InvalidArgument(
                f"this replica holds policy version {self.policy_version}, the request needs >= "
                f"{request.min_policy_version}: send LoadWeights first"
            )
        try:
            params = sampler_params_from_proto(request.params)
        except ValueError as error:
            raise InvalidArgument(str(error)) from None
        return await self.compute(self._generate, request, params)

    @message
    async def LoadWeights(
        self, request: rollout_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.LoadWeightsResponse:
        started = time.perf_counter()
        update = await self.compute(self._fetch_update, request.update)
        try:
            await self.compute(self._engine().apply_update, update)
        except PolicyUpdateError as error:
            raise InvalidArgument(str(error)) from None
        self.policy_version = self._engine().policy_version
        return rollout_pb2.LoadWeightsResponse(
            policy_version=self.policy_version, load_s=time.perf_counter() - started
        )

    @message
    async def Release(
        self, request: rollout_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ReleaseResponse:
        store = self._store()
        before = store.info().used_bytes
        for tag in request.tags:
            store.release(tag=tag)
        return rollout_pb2.ReleaseResponse(released_bytes=before - store.info().used_bytes)

    # --- work (on the actor's compute thread) --------------------------------------------------

    def _generate(
        self, request: rollout_pb2.GenerateRequest, params: SamplerParams
    ) -> rollout_pb2.GenerateResponse:
        started = time.perf_counter()
        samples = self._sample_requests(request.groups)
        with tracer.start_as_current_span("rollout.generate", attributes={"samples": len(samples)}):
            out = self._engine().generate(  # a caller that gives up frees us within one denoising step
                samples, params, seed=request.seed, step=request.step, between_steps=raise_if_abandoned
            )
            tag = request.release_tag or f"step{request.step}"
            response = rollout_pb2.GenerateResponse(
                samples=[self._publish(tag, row, s, out) for row, s in enumerate(samples)]
            )
        elapsed = time.perf_counter() - started
        response.metrics.values.update(
            {
                "timing_s/gen": elapsed,
                "rollout/samples": len(samples),
                "rollout/images_per_s": len(samples) / elapsed,
            }
        )
        return response

    def _sample_requests(self, groups: Sequence[rollout_pb2.PromptGroup]) -> list[SampleRequest]:
        if not groups or not any(g.sample_indices for g in groups):
            raise InvalidArgument("Generate needs at least one prompt group with sample indices")
        count, limit = sum(len(g.sample_indices) for g in groups), self.config.rollout.max_request_samples
        if count > limit:
            raise InvalidArgument(
                f"Generate asks for {count} samples; this replica takes at most {limit} per request "
                "(rollout.max_request_samples): split the request"
            )
        refs = [TensorRef.from_proto(g.prompt_ids) for g in groups]
        for group, ref in zip(groups, refs, strict=True):
            if ref.column != "prompt_ids":
                raise InvalidArgument(
                    f"group {group.prompt_uid!r}: prompt_ids refers to column {ref.column!r}"
                )
        fetched = fetch_inputs(self.client, refs, "prompt ids")
        with tracer.start_as_current_span("rollout.prompts", links=links_from(f.trace for f in fetched)):
            ids = [to_torch(f).clone() for f in fetched]
        return [
            SampleRequest(group.prompt_uid, int(index), prompt)
            for group, prompt in zip(groups, ids, strict=True)
            for index in group.sample_indices
        ]

    def _publish(self, tag: str, row: int, sample: SampleRequest, out: Trajectories) -> rollout_pb2.Sample:
        store, version = self._store(), self.policy_version
        columns = {
            "latents": out.latents[row],
            "log_probs": out.log_probs[row],
            "sigmas": out.sigmas[row],
            "timesteps": out.timesteps[row],
        }
        if out.images is not None:
            columns["images"] = out.images[row]
        prefix = f"{tag}/{sample.prompt_uid}/{sample.sample_index}"
        # A retried request regenerates the same sample: the latest answer replaces the earlier one.
        store.release(prefix=prefix + "/")
        refs = {
            name: put_tensor(
                store, f"{prefix}/{name}", name, tensor, policy_version=version, tag=tag
            ).to_proto()
            for name, tensor in columns.items()
        }
        return rollout_pb2.Sample(
            prompt_uid=sample.prompt_uid,
            sample_index=sample.sample_index,
            policy_version=version,
            outputs=refs,
            window_begin=int(out.window_begin[row]),
        )

    def _fetch_update(self, update: common_pb2.WeightUpdate) -> PolicyUpdate:
        if update.kind not in ("lora", "gen_path"):
            raise InvalidArgument(f"WeightUpdate.kind {update.kind!r}: expected 'lora' or 'gen_path'")
        return PolicyUpdate(
            version=update.policy_version,
            kind=update.kind,  # type: ignore[arg-type]
            tensors=self._update_tensors(update),
            lora_rank=update.lora.rank,
            lora_alpha=update.lora.alpha,
        )

    def _update_tensors(self, update: common_pb2.WeightUpdate) -> dict[str, torch.Tensor]:
        """From the trainer's GPU when this replica is a GPU on the same host (CUDA IPC views,
        copied by the apply), else over the bus."""
        if update.cuda_ipc and self.config.rollout.device.startswith("cuda"):
            from flowgrpo.bus import cuda_ipc

            if all(cuda_ipc.can_open(b) for b in update.cuda_ipc):
                return {n: t for b in update.cuda_ipc for n, t in cuda_ipc.open_bucket(b).items()}
        if not update.tensors:
            where = ", ".join(f"host {b.host_id} GPU {b.device_uuid}" for b in update.cuda_ipc)
            raise InvalidArgument(
                f"weights v{update.policy_version} are only on CUDA IPC ({where}), which this replica "
                "cannot open: run it on that host with the GPU visible, or set trainer.publish_bus=true"
            )
        fetched = fetch_inputs(
            self.client, [TensorRef.from_proto(t.ref) for t in update.tensors], "policy weights"
        )
        return {t.name: to_torch(f) for t, f in zip(update.tensors, fetched, strict=True)}

    def _engine(self) -> RolloutEngine:
        assert self.engine is not None, "the engine is loaded in start(), before any message"
        return self.engine

    def _store(self) -> TensorStore:
        assert self.bus is not None, "the store is created in start(), before any message"
        return self.bus.store
