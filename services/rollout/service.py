"""The rollout actor: Generate, LoadWeights and Release over gRPC, tensors over the bus.

State: the engine (model, VAE, policy version), this replica's bus store (trajectories and
images it produced, kept until the coordinator releases their tag) and a bus client (prompt ids
and weights come from other producers' stores). Messages run one at a time, so a policy update
always lands between two Generate requests, never inside one.

Every field of a request is checked as it comes in, before any work (``_check_*``): a bad one
is INVALID_ARGUMENT naming the field and its range, and the replica keeps serving. What the
request points at is checked once fetched: prompt ids inside the vocabulary, finite weights.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
import torch
from opentelemetry import trace

from flowgrpo.bus import (
    BusClient,
    BusError,
    BusServer,
    DataLost,
    TensorRef,
    TensorStore,
    cuda_ipc,
    serve_store,
)
from flowgrpo.bus.dtypes import itemsize
from flowgrpo.bus.relay import Keeper, RelayedFetch, Source
from flowgrpo.bus.torch_tensors import put_tensor, to_torch
from flowgrpo.columns import FP8, TRAJECTORY_COLUMNS
from flowgrpo.config_digest import role_settings
from flowgrpo.configs.rollout import RolloutServiceConfig
from flowgrpo.devices import release_cached_memory
from flowgrpo.fields import FieldError, check_float, check_id, check_int
from flowgrpo.models.bagel.checkpoint import read_bagel_config
from flowgrpo.models.bagel.policy import PolicyUpdate, PolicyUpdateError
from flowgrpo.models.bagel.sampling import SampleRequest, Trajectories
from flowgrpo.models.bagel.wire import (
    MAX_DIM,
    MAX_SAMPLE_INDEX,
    MAX_STEP,
    MAX_VERSION,
    WEIGHT_DTYPES,
    ModelLimits,
    check_finite,
    check_ref,
    check_token_ids,
    sampler_params_from_proto,
)
from flowgrpo.runtime import Actor, InvalidArgument, Unavailable, message, raise_if_abandoned
from flowgrpo.runtime.data import fetch_inputs
from flowgrpo.runtime.errors import ServiceError
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.rollout import relay
from flowgrpo.services.rollout.engine import BaseWeightsMissing, NativeBagelEngine, RolloutEngine
from flowgrpo.services.rollout.shared_base import SharedBaseError
from flowgrpo.services.rollout.synthetic import SyntheticEngine
from flowgrpo.telemetry import links_from
from flowgrpo.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

OUTPUT_COLUMNS = (*TRAJECTORY_COLUMNS, "timesteps", "images")
STAGE = common_pb2.StageSpec(stage="rollout", consumes=["prompt_ids"], produces=list(OUTPUT_COLUMNS))
MAX_RELEASE_TAGS = 4096  # tags of one Release
MAX_LORA_RANK = 4096
MAX_LORA_ALPHA = 1e6
MAX_DEVICE_ID_CHARS = 128  # a boot id, a GPU UUID


class RolloutService(Actor, rollout_pb2_grpc.RolloutServicer):
    role = "rollout"

    def __init__(self, config: RolloutServiceConfig, engine: RolloutEngine | None = None) -> None:
        super().__init__(config.replica_id)
        self.config = config
        self.engine: RolloutEngine | None = engine  # loaded in start() unless given
        self.bus: BusServer | None = None  # this replica's store of produced tensors
        self.keeper: Keeper | None = None  # the weight versions it relays, in that store
        self.client = BusClient(config.bus)
        self.stages = [STAGE]
        self.settings = role_settings(self.role, config)  # the coordinator compares them with its recipe's
        self.limits: ModelLimits | None = None  # the checkpoint's image side, prompt length, vocabulary

    async def start(self) -> None:
        cfg = self.config.rollout
        with self.startup_phase("model", f"{cfg.engine} engine on {cfg.device}, {cfg.dtype}"):
            self.limits = ModelLimits.of(await self.compute(read_bagel_config, cfg.checkpoint))
            if self.engine is None:
                self.engine = await self.compute(self._load_engine)
        self.bus = serve_store(self.config.bus)
        self.bus_endpoint = self.bus.endpoint
        self.keeper = Keeper(self.bus.store, self.replica_id)
        self.policy_version = self.engine.policy_version

    async def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.client.close()
        if self.bus is not None:
            self.bus.close()

    def _load_engine(self) -> RolloutEngine:
        cfg = self.config.rollout
        if cfg.engine == "synthetic":
            log.warning(
                "rollout.engine=synthetic: a load-test engine; its images and log-probs are not a model's"
            )
            return SyntheticEngine.from_checkpoint(
                cfg.checkpoint,
                step_delay_s=cfg.synthetic.step_delay_s,
                max_batch_samples=cfg.max_batch_samples,
            )
        if cfg.engine == "vllm_omni":
            from flowgrpo.services.rollout.omni.engine import VllmOmniBagelEngine  # needs vllm-omni

            return VllmOmniBagelEngine.from_checkpoint(
                cfg.checkpoint,
                device=cfg.device,
                dtype=getattr(torch, cfg.dtype),
                weight_sync=cfg.vllm_omni.weight_sync,
                deploy_config=cfg.vllm_omni.deploy_config,
            )
        return NativeBagelEngine.from_checkpoint(
            cfg.checkpoint,
            device=cfg.device,
            dtype=getattr(torch, cfg.dtype),
            max_batch_samples=cfg.max_batch_samples,
            lora_mode=cfg.lora_mode,
            compile=cfg.compile,
            base_weights=cfg.base_weights,
            fp8=cfg.precision == "fp8",
            fp8_fast_accum=cfg.fp8_fast_accum,
        )

    # --- RPCs ----------------------------------------------------------------------------------

    @message
    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        params, refs = self._check_generate(request)
        engine = self._engine()
        if isinstance(engine, NativeBagelEngine) and engine.waiting_for_base:
            raise Unavailable(
                "this rollout waits for the trainer's shared base weights (rollout.base_weights=trainer): "
                "the coordinator sends them with the first LoadWeights; try again after it"
            )
        try:
            response = await self.compute(self._generate, request, params, refs)
        finally:  # after a failed or abandoned call too: the trainer on this GPU trains next
            released = await self._release_memory()
        if released is not None:
            response.metrics.values["timing_s/release_memory"] = released
        return response

    async def _release_memory(self) -> float | None:
        if not self.config.rollout.release_memory:
            return None
        return await self.compute(release_cached_memory, self.config.rollout.device)

    @message
    async def LoadWeights(
        self, request: rollout_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.LoadWeightsResponse:
        started = time.perf_counter()
        base = request.update.base if request.update.HasField("base") else None
        if base is not None:
            with _invalid_argument():
                _check_bucket("WeightUpdate.base", base)
            if request.update.policy_version == self.policy_version:  # the version held: the base only
                await self.compute(self._attach_base, base)  # (a start, or a replica that rejoins)
                return rollout_pb2.LoadWeightsResponse(
                    policy_version=self.policy_version, load_s=time.perf_counter() - started
                )
        self._check_update(request.update)  # the whole update, before anything changes
        with _invalid_argument():
            sources, stall_s = relay.check_sources(request, self._own_source())
        if base is not None:
            await self.compute(self._attach_base, base)
        fetch = _Fetch(sources, stall_s, request.relay)
        update = await self.compute(self._fetch_update, request.update, fetch)
        try:
            await self.compute(self._engine().apply_update, update)
        except BaseException as error:
            if fetch.held is not None:
                self._keeper().drop(update.version)  # never relay what this replica refused
            if isinstance(error, PolicyUpdateError):
                raise InvalidArgument(str(error)) from None
            if isinstance(error, BaseWeightsMissing):
                raise Unavailable(str(error)) from None
            raise
        self.policy_version = self._engine().policy_version
        response = rollout_pb2.LoadWeightsResponse(
            policy_version=self.policy_version, load_s=time.perf_counter() - started, fetch_s=fetch.seconds
        )
        relay.report(response, fetch.relayed, fetch.held)
        return response

    @message
    async def Release(
        self, request: rollout_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ReleaseResponse:
        if len(request.tags) > MAX_RELEASE_TAGS:
            raise InvalidArgument(
                f"ReleaseRequest.tags: {len(request.tags)} tags; at most {MAX_RELEASE_TAGS}"
            )
        with _invalid_argument():
            for i, tag in enumerate(request.tags):
                check_id(f"ReleaseRequest.tags[{i}]", tag)
        store = self._store()
        before = store.info().used_bytes
        for tag in request.tags:
            store.release(tag=tag)
        return rollout_pb2.ReleaseResponse(released_bytes=before - store.info().used_bytes)

    # --- request checks (before any work) ------------------------------------------------------

    def _check_generate(self, request: rollout_pb2.GenerateRequest) -> tuple[SamplerParams, list[TensorRef]]:
        """The sampler settings and the prompt-id references of a well-formed request. The seed
        takes any int64: it is hashed into the noise coordinates, never used as a seed itself."""
        with _invalid_argument():
            check_int("GenerateRequest.step", request.step, 0, MAX_STEP)
            check_int("GenerateRequest.min_policy_version", request.min_policy_version, 0, MAX_VERSION)
            if request.release_tag:
                check_id("GenerateRequest.release_tag", request.release_tag)
            params = sampler_params_from_proto(request.params, self._limits(), "GenerateRequest.params")
            refs = self._check_groups(request.groups)
        if self.policy_version < request.min_policy_version:
            raise InvalidArgument(
                f"this replica holds policy version {self.policy_version}, the request needs >= "
                f"{request.min_policy_version}: send LoadWeights first"
            )
        return params, refs

    def _check_groups(self, groups: Sequence[rollout_pb2.PromptGroup]) -> list[TensorRef]:
        if not groups or not any(g.sample_indices for g in groups):
            raise InvalidArgument("Generate needs at least one prompt group with sample indices")
        count, limit = sum(len(g.sample_indices) for g in groups), self.config.rollout.max_request_samples
        if count > limit:
            raise InvalidArgument(
                f"Generate asks for {count} samples; this replica takes at most {limit} per request "
                "(rollout.max_request_samples): split the request"
            )
        limits, seen, refs = self._limits(), set(), []
        for i, group in enumerate(groups):
            where = f"GenerateRequest.groups[{i}]"
            check_id(f"{where}.prompt_uid", group.prompt_uid)
            for index in group.sample_indices:
                check_int(f"{where}.sample_indices", index, 0, MAX_SAMPLE_INDEX)
                if (group.prompt_uid, index) in seen:
                    raise FieldError(
                        f"{where}.sample_indices: sample {index} of prompt {group.prompt_uid!r} is asked "
                        "for twice in this request; need distinct (prompt_uid, sample index) pairs"
                    )
                seen.add((group.prompt_uid, index))
            dims = [(1, limits.max_prompt_tokens)]
            max_bytes = self.config.bus.max_bytes
            refs.append(check_ref(f"{where}.prompt_ids", group.prompt_ids, "prompt_ids", ("int64",),
                                  dims=dims, max_bytes=max_bytes))  # fmt: skip
        return refs

    def _check_update(self, update: common_pb2.WeightUpdate) -> None:
        """A policy update this replica could apply, checked before anything is fetched."""
        with _invalid_argument():
            if update.kind not in ("lora", "gen_path"):
                raise FieldError(f"WeightUpdate.kind={update.kind[:64]!r}: expected 'lora' or 'gen_path'")
            check_int("WeightUpdate.policy_version", update.policy_version, 1, MAX_VERSION)
            if update.kind == "lora":
                check_int("WeightUpdate.lora.rank", update.lora.rank, 1, MAX_LORA_RANK)
                check_float("WeightUpdate.lora.alpha", update.lora.alpha, 1e-12, MAX_LORA_ALPHA)
            elif update.lora.rank or update.lora.alpha:
                raise FieldError("WeightUpdate.lora: set for kind 'gen_path'; it belongs to kind 'lora' only")
            names = [t.name for t in update.tensors]
            for i, tensor in enumerate(update.tensors):
                check_id(f"WeightUpdate.tensors[{i}].name", tensor.name)
                check_ref(f"WeightUpdate.tensors[{i}].ref", tensor.ref, "weights", WEIGHT_DTYPES,
                          dims=None, max_bytes=self.config.bus.max_bytes)  # fmt: skip
            for b, bucket in enumerate(update.cuda_ipc):
                names += [t.name for t in bucket.tensors]
                _check_bucket(f"WeightUpdate.cuda_ipc[{b}]", bucket)
            if not names:
                raise FieldError("WeightUpdate: no tensors (neither tensors nor cuda_ipc name any)")
            if len(set(t.name for t in update.tensors)) != len(update.tensors):
                raise FieldError("WeightUpdate.tensors: a tensor name appears twice")
        if update.policy_version <= self.policy_version:
            raise InvalidArgument(
                f"WeightUpdate.policy_version={update.policy_version} is not newer than the loaded "
                f"version {self.policy_version}"
            )

    # --- work (on the actor's compute thread) --------------------------------------------------

    def _generate(
        self, request: rollout_pb2.GenerateRequest, params: SamplerParams, refs: list[TensorRef]
    ) -> rollout_pb2.GenerateResponse:
        started = time.perf_counter()
        samples = self._sample_requests(request.groups, refs)
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

    def _sample_requests(
        self, groups: Sequence[rollout_pb2.PromptGroup], refs: list[TensorRef]
    ) -> list[SampleRequest]:
        fetched = fetch_inputs(self.client, refs, "prompt ids")
        with tracer.start_as_current_span("rollout.prompts", links=links_from(f.trace for f in fetched)):
            ids = [to_torch(f).clone() for f in fetched]
        with _invalid_argument():
            for i, prompt in enumerate(ids):
                check_token_ids(f"GenerateRequest.groups[{i}].prompt_ids", prompt, self._limits().vocab)
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
            "final_latents": out.final_latents[row],
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
            precision=FP8 if self.config.rollout.precision == "fp8" else "",
        )

    def _attach_base(self, bucket: common_pb2.CudaIpcBucket) -> None:
        """Map the trainer's base when this replica takes its weights from it (else: ignored)."""
        engine = self._engine()
        if not isinstance(engine, NativeBagelEngine) or self.config.rollout.base_weights != "trainer":
            return
        try:
            engine.attach_base(bucket)
        except (
            SharedBaseError,
            cuda_ipc.CudaIpcError,
        ) as error:
            raise InvalidArgument(f"WeightUpdate.base: {error}") from None

    def _fetch_update(self, update: common_pb2.WeightUpdate, fetch: _Fetch) -> PolicyUpdate:
        started = time.perf_counter()
        tensors = self._update_tensors(update, fetch)
        fetch.seconds = time.perf_counter() - started
        with _invalid_argument():
            for name, tensor in tensors.items():
                check_finite(f"WeightUpdate tensor {name!r}", tensor)
        return PolicyUpdate(
            version=update.policy_version,
            kind=update.kind,  # type: ignore[arg-type]
            tensors=tensors,
            lora_rank=update.lora.rank,
            lora_alpha=update.lora.alpha,
        )

    def _update_tensors(self, update: common_pb2.WeightUpdate, fetch: _Fetch) -> dict[str, torch.Tensor]:
        """From the trainer's GPU when this replica is a GPU on the same host (CUDA IPC views,
        copied by the apply), else over the bus: from the nearest holder the coordinator named,
        kept in this replica's store for the ones after it when asked to relay."""
        on_gpu = self.config.rollout.device.startswith("cuda")
        if update.cuda_ipc and on_gpu and all(cuda_ipc.can_open(b) for b in update.cuda_ipc):
            return {n: t for b in update.cuda_ipc for n, t in cuda_ipc.open_bucket(b).items()}
        if not update.tensors:
            where = ", ".join(f"host {b.host_id} GPU {b.device_uuid}" for b in update.cuda_ipc)
            raise InvalidArgument(
                f"weights v{update.policy_version} are only on CUDA IPC ({where}), which this replica "
                "cannot open: run it on that host with the GPU visible, or set trainer.publish_bus=true"
            )
        refs = [TensorRef.from_proto(t.ref) for t in update.tensors]
        keeper = self._keeper() if fetch.relay else None
        try:
            fetch.relayed, fetch.held = relay.fetch_and_keep(
                self.client, keeper, update.policy_version, refs, sources=fetch.sources, stall_s=fetch.stall_s
            )
        except DataLost as error:
            raise ServiceError(f"policy weights lost: {error}", grpc.StatusCode.UNAVAILABLE) from None
        except BusError as error:
            raise ServiceError(f"policy weights not available on the bus: {error}") from None
        fetched = fetch.relayed.fetched
        return {t.name: to_torch(f) for t, f in zip(update.tensors, fetched, strict=True)}

    def _engine(self) -> RolloutEngine:
        assert self.engine is not None, "the engine is loaded in start(), before any message"
        return self.engine

    def _store(self) -> TensorStore:
        assert self.bus is not None, "the store is created in start(), before any message"
        return self.bus.store

    def _keeper(self) -> Keeper:
        assert self.keeper is not None, "made in start(), before any message"
        return self.keeper

    def _own_source(self) -> Source | None:
        return Source(self.bus.endpoint, self.bus.store.store_id) if self.bus is not None else None

    def _limits(self) -> ModelLimits:
        assert self.limits is not None, "read in start(), before any message"
        return self.limits


def _check_bucket(field: str, bucket: common_pb2.CudaIpcBucket) -> None:
    """What torch's IPC opener trusts, checked: the handles' layouts, the reference counter's file
    name and slot (torch decrements that slot when the mapping is released), the sizes and
    offsets (every tensor inside the shared bytes), names once each. What no check can see (that
    ``storage_bytes`` is the real allocation's size) is why CUDA IPC is same-host, same-user only."""
    check_id(f"{field}.host_id", bucket.host_id, MAX_DEVICE_ID_CHARS)
    check_id(f"{field}.device_uuid", bucket.device_uuid, MAX_DEVICE_ID_CHARS)
    try:
        cuda_ipc.check_handles(bucket)
    except ValueError as error:
        raise FieldError(f"{field}.{error}") from None
    if not cuda_ipc.REF_COUNTER_FILE.fullmatch(bucket.ref_counter_handle.decode("ascii", "replace")):
        raise FieldError(f"{field}.ref_counter_handle: not a torch reference-counter file name")
    check_int(f"{field}.ref_counter_offset", bucket.ref_counter_offset, 0, cuda_ipc.REF_COUNTER_SLOTS - 1)
    check_int(f"{field}.storage_bytes", bucket.storage_bytes, 1, 2**62)
    check_int(f"{field}.storage_offset", bucket.storage_offset, 0, 2**62)
    if len({t.name for t in bucket.tensors}) != len(bucket.tensors):
        raise FieldError(f"{field}.tensors: a tensor name appears twice")
    for i, entry in enumerate(bucket.tensors):
        where = f"{field}.tensors[{i}]"
        check_id(f"{where}.name", entry.name)
        if entry.dtype not in WEIGHT_DTYPES:
            raise FieldError(f"{where}.dtype={entry.dtype[:64]!r}: need one of {', '.join(WEIGHT_DTYPES)}")
        for dim in entry.shape:
            check_int(f"{where}.shape", dim, 0, MAX_DIM)
        nbytes = math.prod(entry.shape) * itemsize(entry.dtype)
        if not 0 <= entry.offset <= bucket.storage_bytes - nbytes:
            raise FieldError(
                f"{where}.offset={entry.offset}: its {nbytes} bytes must lie inside the bucket's "
                f"storage_bytes={bucket.storage_bytes}"
            )


@dataclass
class _Fetch:
    """One LoadWeights' relay plan in, and what its fetch did out."""

    sources: list[Source]
    stall_s: float
    relay: bool
    relayed: RelayedFetch | None = None
    held: Source | None = None  # where this replica serves the version once kept
    seconds: float = 0.0


@contextlib.contextmanager
def _invalid_argument() -> Iterator[None]:
    """A request field out of range is the caller's error: INVALID_ARGUMENT, naming it."""
    try:
        yield
    except FieldError as error:
        raise InvalidArgument(str(error)) from None
