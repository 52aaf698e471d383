"""Hostile requests against real rollout, trainer and reward processes (a tiny BAGEL on the CPU),
over raw gRPC stubs: every out-of-range field is INVALID_ARGUMENT naming the field (a Score
request: a per-sample INVALID_ARGUMENT error, the stream going on), SaveCheckpoint cannot write
outside the trainer's own folder nor touch another run's checkpoints, and a legitimate request
still works afterwards."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowgrpo.bus import BusServer, TensorRef, serve_store
from flowgrpo.bus.torch_tensors import put_tensor
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.checkpoint import checkpoint_name, latest_checkpoint
from flowgrpo.v1 import (
    common_pb2,
    common_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from tests.bus.cuda_ipc_layouts import fields_of, recorded
from tests.services.launch import kill_service, spawn_service

PARAMS = SamplerParams(num_points=6, cfg_text_scale=2.0, noise_level=1.0, window_range=(0, 4),
                       height=32, width=32, deterministic=True).to_proto()  # fmt: skip
TRAINER = ["trainer.policy.lora_rank=4", "trainer.policy.lora_alpha=8", "trainer.loss.mini_batches=1",
           "trainer.loss.micro_batch_size=1", "trainer.optim.lr=1e-3"]  # fmt: skip
Q = "language_model.model.layers.0.self_attn.q_proj_moe_gen"  # a LoRA target of the tiny model
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass
class Running:
    """A service process whose log is read as it comes: hostile requests make services log, and
    a pipe nobody reads fills up and stalls the service's event loop (a test artefact)."""

    address: str
    proc: subprocess.Popen[str]
    log: deque[str]
    reader: threading.Thread

    @classmethod
    def watch(cls, proc: subprocess.Popen[str], address: str) -> Running:
        log: deque[str] = deque(maxlen=400)
        assert proc.stderr is not None
        reader = threading.Thread(target=log.extend, args=(proc.stderr,), daemon=True)
        reader.start()
        return cls(address, proc, log, reader)

    def stop(self) -> None:
        """SIGTERM drains the service; it must exit 0."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_service(self.proc)
            raise
        self.reader.join(timeout=10)
        assert self.proc.returncode == 0, "".join(self.log)[-4000:]


def start(role: str, overrides: Sequence[str], ready: Path) -> Running:
    return Running.watch(*spawn_service(role, overrides, ready))


def start_all(roles: dict[str, list[str]], root: Path) -> dict[str, Running]:
    """The services of ``roles`` (role -> overrides), started at once (their start-ups overlap)."""
    with ThreadPoolExecutor(len(roles)) as pool:
        futures = {r: pool.submit(start, r, o, root / f"{r}.ready.json") for r, o in roles.items()}
        started, failed = {}, None
        for role, future in futures.items():
            try:
                started[role] = future.result()
            except Exception as error:
                failed = error
    if failed is not None:
        for running in started.values():
            kill_service(running.proc)
        raise failed
    return started


@dataclass
class Services:
    root: Path
    store: BusServer  # this test's producer: prompt ids, weights, hostile tensors
    prompt: TensorRef
    rollout: rollout_pb2_grpc.RolloutStub
    trainer: trainer_pb2_grpc.TrainerStub
    reward: reward_pb2_grpc.RewardStub
    health: dict[str, health_pb2_grpc.HealthStub]
    own: Path  # the trainer's checkpoint_dir
    other: Path  # another run's checkpoints: must stay untouched
    drawn: rollout_pb2.GenerateResponse  # legitimate samples, kept on the rollout's store
    keys: Iterator[int]  # unique store keys

    def put(self, key: str, column: str, value: torch.Tensor) -> common_pb2.TensorRef:
        return put_tensor(self.store.store, f"{key}/{next(self.keys)}", column, value).to_proto()


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("security")
    tiny = make_tiny_bagel(root / "tiny", seed=0)
    own, other = root / "run-a" / "checkpoints", root / "run-b" / "checkpoints"
    own.mkdir(parents=True)
    plant_checkpoint(other / checkpoint_name(5))
    roles = {
        "rollout": [f"rollout.checkpoint={tiny}"],
        "trainer": [f"trainer.checkpoint={tiny}", f"trainer.checkpoint_dir={own}", *TRAINER],
        "reward": ["reward.scorers=[{name: jpeg_compressibility}]"],
    }
    started = start_all(roles, root)
    channels = {role: grpc.insecure_channel(running.address) for role, running in started.items()}
    try:
        with serve_store() as store:
            prompt = put_tensor(store.store, "data/p0", "prompt_ids", torch.tensor([384, 5, 6, 7, 385]))
            rollout = rollout_pb2_grpc.RolloutStub(channels["rollout"])
            yield Services(
                root=root,
                store=store,
                prompt=prompt,
                rollout=rollout,
                trainer=trainer_pb2_grpc.TrainerStub(channels["trainer"]),
                reward=reward_pb2_grpc.RewardStub(channels["reward"]),
                health={role: health_pb2_grpc.HealthStub(c) for role, c in channels.items()},
                own=own,
                other=other,
                drawn=rollout.Generate(generate_request(prompt, tag="drawn"), timeout=120),
                keys=itertools.count(),
            )
    finally:
        for channel in channels.values():
            channel.close()
        for running in started.values():
            running.stop()


def plant_checkpoint(path: Path) -> None:
    """Another run's checkpoint (the files a real one has; their content does not matter here)."""
    (path / "rng").mkdir(parents=True)
    (path / "trainer.json").write_text('{"step": 5}')
    (path / "rng" / "rank_00000.safetensors").write_bytes(b"other run")
    (path / "manifest.json").write_text("{}")


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/" for p in folder.rglob("*")}


def generate_request(prompt: TensorRef, tag: str = "t", seed: int = 3) -> rollout_pb2.GenerateRequest:
    group = rollout_pb2.PromptGroup(prompt_uid="p0", prompt_ids=prompt.to_proto(), sample_indices=[0, 1])
    return rollout_pb2.GenerateRequest(step=1, seed=seed, groups=[group], params=PARAMS, release_tag=tag)


def refused(call: Callable[..., object], request: object, fragment: str) -> str:
    with pytest.raises(grpc.RpcError) as error:
        call(request, timeout=60)
    details = error.value.details() or ""  # type: ignore[attr-defined]
    assert error.value.code() == INVALID, details  # type: ignore[attr-defined]
    assert fragment in details, details
    return details


def assert_serving(s: Services) -> None:
    for role, stub in s.health.items():
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, role


def set_indices(indices: list[int]) -> Callable[[rollout_pb2.GenerateRequest, Services], None]:
    def mutate(r: rollout_pb2.GenerateRequest, s: Services) -> None:
        r.groups[0].sample_indices[:] = indices

    return mutate


def set_param(name: str, value: object) -> Callable[[object, Services], None]:
    def mutate(r: object, s: Services) -> None:
        setattr(r.params, name, value)  # type: ignore[attr-defined]

    return mutate


def set_ref(**fields: object) -> Callable[[rollout_pb2.GenerateRequest, Services], None]:
    def mutate(r: rollout_pb2.GenerateRequest, s: Services) -> None:
        ref = r.groups[0].prompt_ids
        for name, value in fields.items():
            if name == "shape":
                ref.shape[:] = value  # type: ignore[index]
            else:
                setattr(ref, name, value)

    return mutate


def prompt_ids(values: list[int]) -> Callable[[rollout_pb2.GenerateRequest, Services], None]:
    def mutate(r: rollout_pb2.GenerateRequest, s: Services) -> None:
        r.groups[0].prompt_ids.CopyFrom(s.put(f"hostile/ids{values}", "prompt_ids", torch.tensor(values)))

    return mutate


# Every sampler setting, as Generate and TrainStep both read it: (name, value, fragment).
PARAM_CASES = [
    ("cfg_text_scale", math.nan, "cfg_text_scale=nan"),
    ("cfg_text_scale", math.inf, "cfg_text_scale=inf"),
    ("cfg_text_scale", -1.0, "cfg_text_scale"),
    ("cfg_text_scale", 1e300, "cfg_text_scale"),
    ("cfg_img_scale", math.nan, "cfg_img_scale"),
    ("cfg_interval_lo", -0.5, "cfg_interval[0]=-0.5"),
    ("cfg_interval_hi", 2.0, "cfg_interval[1]=2.0"),
    ("cfg_interval_hi", math.nan, "cfg_interval[1]=nan"),
    ("cfg_renorm_min", math.nan, "cfg_renorm_min"),
    ("cfg_renorm_min", 2.0, "cfg_renorm_min"),
    ("cfg_renorm_type", "nope", "cfg_renorm_type"),
    ("timestep_shift", 0.0, "timestep_shift"),
    ("timestep_shift", -3.0, "timestep_shift"),
    ("timestep_shift", math.nan, "timestep_shift"),
    ("noise_level", math.nan, "noise_level"),
    ("noise_level", math.inf, "noise_level"),
    ("noise_level", -1.0, "noise_level"),
    ("noise_level", 11.0, "noise_level"),
    ("sde_type", "ode", "sde_type='ode'"),
    ("window_strategy", "", "window_strategy"),
    ("num_points", 0, "num_points"),
    ("num_points", 1, "num_points"),
    ("num_points", -1, "num_points"),
    ("num_points", 2**31 - 1, "num_points"),
    ("window_size", 0, "window_size=0"),
    ("window_size", 2**31 - 1, "window_size"),
    ("window_range_lo", -1, "window_range[0]=-1"),
    ("window_range_hi", 99, "window_range=[0, 99]"),
    ("height", 1024, "height=1024"),  # with the width: a 2^20-pixel image (the tiny grid is 128 px)
    ("height", 2**20, "height"),
    ("width", 2**31 - 1, "width"),
    ("height", 0, "height=0"),
    ("height", -16, "height=-16"),
    ("width", 40, "width=40"),
    ("width", 144, "width=144"),
]

GENERATE_CASES = [
    *[(f"params.{n}={v}", set_param(n, v), f"GenerateRequest.params.{f}") for n, v, f in PARAM_CASES],
    ("huge image", lambda r, s: (set_param("height", 1024)(r, s), set_param("width", 1024)(r, s)), "height"),
    ("cps noise > 1", lambda r, s: (set_param("sde_type", "cps")(r, s), set_param("noise_level", 1.5)(r, s)),
     "noise_level"),
    ("negative sample index", set_indices([-5]), "sample_indices=-5"),
    ("huge sample index", set_indices([2**31 - 1]), "sample_indices"),
    ("duplicate sample index", set_indices([1, 1]), "asked for twice"),
    ("no groups", lambda r, s: r.ClearField("groups"), "at least one prompt group"),
    ("empty prompt uid", lambda r, s: setattr(r.groups[0], "prompt_uid", ""), "prompt_uid"),
    ("huge prompt uid", lambda r, s: setattr(r.groups[0], "prompt_uid", "u" * 5000), "prompt_uid"),
    ("control char uid", lambda r, s: setattr(r.groups[0], "prompt_uid", "p\n0"), "prompt_uid"),
    ("negative step", lambda r, s: setattr(r, "step", -1), "GenerateRequest.step=-1"),
    ("huge step", lambda r, s: setattr(r, "step", 2**62), "GenerateRequest.step"),
    ("negative min version", lambda r, s: setattr(r, "min_policy_version", -1), "min_policy_version"),
    ("huge release tag", lambda r, s: setattr(r, "release_tag", "t" * 300), "release_tag"),
    ("control char tag", lambda r, s: setattr(r, "release_tag", "t\x00"), "release_tag"),
    ("ref column", set_ref(column="latents"), "prompt_ids.column"),
    ("ref dtype", set_ref(dtype="float32"), "prompt_ids.dtype"),
    ("ref no dims", set_ref(shape=[], nbytes=0), "prompt_ids.shape"),
    ("ref empty prompt", set_ref(shape=[0], nbytes=0), "prompt_ids.shape"),
    ("ref negative dim", set_ref(shape=[-5], nbytes=-40), "prompt_ids.shape"),
    ("ref too long", set_ref(shape=[5000], nbytes=40000), "prompt_ids.shape"),
    ("ref nbytes", set_ref(nbytes=2**62), "prompt_ids.nbytes"),
    ("ref no endpoint", set_ref(endpoint=""), "prompt_ids.endpoint"),
    ("ref bad endpoint", set_ref(endpoint="tcp://a:b"), "prompt_ids.endpoint"),
    ("ref port range", set_ref(endpoint="tcp://127.0.0.1:99999"), "prompt_ids.endpoint"),
    ("ref long port", set_ref(endpoint="tcp://h:" + "9" * 5000), "prompt_ids.endpoint"),
    ("ref http", set_ref(endpoint="http://example.com/"), "prompt_ids.endpoint"),
    ("ref wildcard", set_ref(endpoint="tcp://*:5555"), "prompt_ids.endpoint"),
    ("ref ipc", set_ref(endpoint="ipc://"), "prompt_ids.endpoint"),
    ("ref no key", set_ref(key=""), "prompt_ids.key"),
    ("ref no store", set_ref(store_id=""), "prompt_ids.store_id"),
    ("ids above the vocabulary", prompt_ids([384, 100000, 385]), "need 0 <= id < 512"),
    ("negative ids", prompt_ids([384, -1, 385]), "need 0 <= id < 512"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "fragment"), [c[1:] for c in GENERATE_CASES], ids=[c[0] for c in GENERATE_CASES]
)
def test_generate_refuses_each_out_of_range_field(
    services: Services, mutate: Callable[[rollout_pb2.GenerateRequest, Services], None], fragment: str
) -> None:
    request = generate_request(services.prompt, tag="hostile")
    mutate(request, services)
    refused(services.rollout.Generate, request, fragment)


def lora_update(s: Services, version: int, scale: float = 0.01) -> common_pb2.WeightUpdate:
    g = torch.Generator().manual_seed(version)
    tensors = {Q + ".lora_A.weight": torch.randn(4, 64, generator=g) * scale,
               Q + ".lora_B.weight": torch.randn(64, 4, generator=g) * scale}  # fmt: skip
    update = common_pb2.WeightUpdate(
        policy_version=version, kind="lora", lora=common_pb2.LoraSpec(rank=4, alpha=8)
    )
    for name, tensor in tensors.items():
        ref = s.put(f"weights/v{version}/{name}/{scale}", "weights", tensor)
        update.tensors.append(common_pb2.NamedTensor(name=name, ref=ref))
    return update


def on_update(change: Callable[[common_pb2.WeightUpdate, Services], object]) -> Callable[..., None]:
    def mutate(u: common_pb2.WeightUpdate, s: Services) -> None:
        change(u, s)

    return mutate


def bucket(
    storage_bytes: int, offset: int, dtype: str = "float32", **fields: object
) -> common_pb2.CudaIpcBucket:
    """A bucket well formed but for what the case changes (it points at no real GPU memory): its
    handles shaped as torch 2.11 was recorded to export them (tests/bus/cuda_ipc_layouts.json)."""
    entry = common_pb2.BucketTensor(name=Q + ".lora_A.weight", dtype=dtype, shape=[4, 64], offset=offset)
    well_formed = {"host_id": "h", "device_uuid": "GPU-x", "storage_bytes": storage_bytes,
                   **fields_of(recorded()["2.11"])}  # fmt: skip
    return common_pb2.CudaIpcBucket(**(well_formed | fields), tensors=[entry])  # type: ignore[arg-type]


def twice(b: common_pb2.CudaIpcBucket) -> common_pb2.CudaIpcBucket:
    b.tensors.append(b.tensors[0])
    return b


LOAD_CASES = [
    ("no kind", lambda u, s: setattr(u, "kind", ""), "WeightUpdate.kind"),
    ("unknown kind", lambda u, s: setattr(u, "kind", "pickle"), "WeightUpdate.kind"),
    ("version 0", lambda u, s: setattr(u, "policy_version", 0), "WeightUpdate.policy_version=0"),
    ("negative version", lambda u, s: setattr(u, "policy_version", -1), "policy_version=-1"),
    ("version from far ahead", lambda u, s: setattr(u, "policy_version", 2**62), "policy_version"),
    ("rank 0", lambda u, s: setattr(u.lora, "rank", 0), "WeightUpdate.lora.rank=0"),
    ("negative rank", lambda u, s: setattr(u.lora, "rank", -4), "lora.rank"),
    ("huge rank", lambda u, s: setattr(u.lora, "rank", 2**30), "lora.rank"),
    ("alpha NaN", lambda u, s: setattr(u.lora, "alpha", math.nan), "lora.alpha=nan"),
    ("alpha inf", lambda u, s: setattr(u.lora, "alpha", math.inf), "lora.alpha"),
    ("alpha 0", lambda u, s: setattr(u.lora, "alpha", 0.0), "lora.alpha"),
    ("alpha negative", lambda u, s: setattr(u.lora, "alpha", -8.0), "lora.alpha"),
    ("lora on gen_path", lambda u, s: setattr(u, "kind", "gen_path"), "WeightUpdate.lora"),
    ("no tensors", lambda u, s: u.ClearField("tensors"), "no tensors"),
    ("empty name", lambda u, s: setattr(u.tensors[0], "name", ""), "tensors[0].name"),
    ("duplicate name", lambda u, s: setattr(u.tensors[1], "name", u.tensors[0].name), "appears twice"),
    ("ref column", lambda u, s: setattr(u.tensors[0].ref, "column", "latents"), "tensors[0].ref.column"),
    ("ref dtype", lambda u, s: setattr(u.tensors[0].ref, "dtype", "int64"), "tensors[0].ref.dtype"),
    ("ref negative dim", lambda u, s: u.tensors[0].ref.shape.__setitem__(0, -4), "tensors[0].ref.shape"),
    ("ref rank 9", lambda u, s: u.tensors[0].ref.shape.extend([1] * 7), "tensors[0].ref.shape"),
    ("ref nbytes", lambda u, s: setattr(u.tensors[0].ref, "nbytes", 7), "tensors[0].ref.nbytes"),
    ("ref endpoint", lambda u, s: setattr(u.tensors[0].ref, "endpoint", ""), "tensors[0].ref.endpoint"),
    ("bucket size", lambda u, s: u.cuda_ipc.append(bucket(0, 0)), "cuda_ipc[0].storage_bytes"),
    ("bucket offset", lambda u, s: u.cuda_ipc.append(bucket(1024, -1)), "cuda_ipc[0].tensors[0].offset"),
    ("bucket overrun", lambda u, s: u.cuda_ipc.append(bucket(1000, 0)), "cuda_ipc[0].tensors[0].offset"),
    ("bucket dtype", lambda u, s: u.cuda_ipc.append(bucket(4096, 0, "int8")), "cuda_ipc[0].tensors[0].dtype"),
    ("bucket short handle", lambda u, s: u.cuda_ipc.append(bucket(4096, 0, handle=b"x")),
     "cuda_ipc[0].handle"),
    ("bucket event handle", lambda u, s: u.cuda_ipc.append(bucket(4096, 0, event_handle=b"e" * 5)),
     "cuda_ipc[0].event_handle"),
    ("bucket expandable-segment handle",
     lambda u, s: u.cuda_ipc.append(bucket(4096, 0, handle=b"\x02e" + b"\x00" * 64)),
     "cuda_ipc[0].handle: an expandable-segment handle"),
    ("base one byte short", lambda u, s: u.base.CopyFrom(bucket(4096, 0, handle=b"\x02c" + b"\x00" * 63)),
     "WeightUpdate.base.handle: 65 bytes"),
    ("bucket counter file",
     lambda u, s: u.cuda_ipc.append(bucket(4096, 0, ref_counter_handle=b"/../../etc/x")),
     "cuda_ipc[0].ref_counter_handle"),
    ("bucket counter slot", lambda u, s: u.cuda_ipc.append(bucket(4096, 0, ref_counter_offset=10000)),
     "cuda_ipc[0].ref_counter_offset"),
    ("bucket host id", lambda u, s: u.cuda_ipc.append(bucket(4096, 0, host_id="h" * 1000)),
     "cuda_ipc[0].host_id"),
    ("bucket twice a name", lambda u, s: u.cuda_ipc.append(twice(bucket(4096, 0))),
     "cuda_ipc[0].tensors: a tensor"),
    ("base size", lambda u, s: u.base.CopyFrom(bucket(0, 0)), "WeightUpdate.base.storage_bytes"),
    ("base counter slot", lambda u, s: u.base.CopyFrom(bucket(4096, 0, ref_counter_offset=-1)),
     "WeightUpdate.base.ref_counter_offset"),
    ("base overrun", lambda u, s: u.base.CopyFrom(bucket(1000, 0)), "WeightUpdate.base.tensors[0].offset"),
    ("NaN weights", lambda u, s: u.CopyFrom(lora_update(s, 50, math.nan)), "NaN or infinite"),
    ("inf weights", lambda u, s: u.CopyFrom(lora_update(s, 50, math.inf)), "NaN or infinite"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "fragment"), [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES])
def test_load_weights_refuses_each_out_of_range_field(
    services: Services, mutate: Callable[[common_pb2.WeightUpdate, Services], None], fragment: str
) -> None:
    update = lora_update(services, 1)
    mutate(update, services)
    refused(services.rollout.LoadWeights, rollout_pb2.LoadWeightsRequest(update=update), fragment)


@pytest.mark.parametrize(
    ("tags", "fragment"),
    [([""], "ReleaseRequest.tags[0]"), (["ok", "a\x00"], "ReleaseRequest.tags[1]"),
     (["t" * 300], "tags[0]"), ([f"t{i}" for i in range(5000)], "at most 4096")],
    ids=["empty", "control char", "huge", "too many"],
)  # fmt: skip
def test_release_refuses_bad_tags(services: Services, tags: list[str], fragment: str) -> None:
    refused(services.rollout.Release, rollout_pb2.ReleaseRequest(tags=tags), fragment)


def test_the_rollout_still_serves_a_legitimate_generate_load_and_release(services: Services) -> None:
    assert_serving(services)
    update = lora_update(services, 1)
    loaded = services.rollout.LoadWeights(rollout_pb2.LoadWeightsRequest(update=update), timeout=60)
    assert loaded.policy_version == 1
    request = generate_request(services.prompt, tag="after", seed=-(2**63))  # any int64 seed is a seed
    request.min_policy_version = 1
    response = services.rollout.Generate(request, timeout=120)
    assert [(s.sample_index, s.policy_version) for s in response.samples] == [(0, 1), (1, 1)]
    released = services.rollout.Release(rollout_pb2.ReleaseRequest(tags=["after"]), timeout=60)
    assert released.released_bytes == sum(ref.nbytes for s in response.samples for ref in s.outputs.values())


# --- trainer ----------------------------------------------------------------------------------


TRAJECTORY = ("latents", "log_probs", "sigmas")


def train_request(s: Services) -> trainer_pb2.TrainStepRequest:
    """A legitimate step on the samples the rollout drew: the trainer's next step."""
    step = s.trainer.State(trainer_pb2.TrainerStateRequest(), timeout=60).step + 1
    samples = [
        trainer_pb2.TrainSample(
            prompt_uid=d.prompt_uid, sample_index=d.sample_index, policy_version=d.policy_version,
            advantage=advantage,
            inputs={"prompt_ids": s.prompt.to_proto(), **{c: d.outputs[c] for c in TRAJECTORY}},
        )
        for d, advantage in zip(s.drawn.samples, [1.0, -1.0], strict=True)
    ]  # fmt: skip
    return trainer_pb2.TrainStepRequest(step=step, samples=samples, params=PARAMS)


def on_sample(**fields: object) -> Callable[[trainer_pb2.TrainStepRequest, Services], None]:
    def mutate(r: trainer_pb2.TrainStepRequest, s: Services) -> None:
        for name, value in fields.items():
            setattr(r.samples[0], name, value)

    return mutate


def on_input(which: str, **fields: object) -> Callable[[trainer_pb2.TrainStepRequest, Services], None]:
    def mutate(r: trainer_pb2.TrainStepRequest, s: Services) -> None:
        ref = r.samples[0].inputs[which]
        for name, value in fields.items():
            if name == "shape":
                ref.shape[:] = value  # type: ignore[index]
            else:
                setattr(ref, name, value)

    return mutate


def input_tensor(column: str, fill: float | None, ids: list[int] | None = None) -> Callable[..., None]:
    """Replace one input by a tensor of this test's store: same shape, ``fill`` values (or ids)."""

    def mutate(r: trainer_pb2.TrainStepRequest, s: Services) -> None:
        ref = r.samples[0].inputs[column]
        value = (
            torch.tensor(ids) if ids is not None else torch.full(tuple(ref.shape), fill, dtype=torch.float32)
        )
        r.samples[0].inputs[column].CopyFrom(s.put(f"hostile/{column}/{fill}/{ids}", column, value))

    return mutate


TRAIN_CASES = [
    *[(f"params.{n}={v}", set_param(n, v), f"TrainStepRequest.params.{f}") for n, v, f in PARAM_CASES[::3]],
    ("step ahead", lambda r, s: setattr(r, "step", r.step + 5), "TrainStepRequest.step"),
    ("step 99999999", lambda r, s: setattr(r, "step", 99999999), "TrainStepRequest.step=99999999"),
    ("step behind", lambda r, s: setattr(r, "step", r.step - 1), "TrainStepRequest.step"),
    ("negative step", lambda r, s: setattr(r, "step", -1), "TrainStepRequest.step=-1"),
    ("no samples", lambda r, s: r.ClearField("samples"), "at least one sample"),
    ("advantage NaN", on_sample(advantage=math.nan), "samples[0].advantage=nan"),
    ("advantage inf", on_sample(advantage=math.inf), "samples[0].advantage=inf"),
    ("advantage -inf", on_sample(advantage=-math.inf), "samples[0].advantage"),
    ("advantage huge", on_sample(advantage=1e300), "samples[0].advantage"),
    ("version from the future", on_sample(policy_version=10**6), "samples[0].policy_version=1000000"),
    ("negative version", on_sample(policy_version=-1), "samples[0].policy_version=-1"),
    ("negative sample index", on_sample(sample_index=-1), "samples[0].sample_index=-1"),
    ("huge sample index", on_sample(sample_index=2**31 - 1), "samples[0].sample_index"),
    ("empty prompt uid", on_sample(prompt_uid=""), "samples[0].prompt_uid"),
    ("unknown precision", on_sample(precision="fp4"), "samples[0].precision='fp4': one of ['', 'fp8']"),
    ("duplicate sample", lambda r, s: r.samples.append(r.samples[0]), "appears twice"),
    ("missing column", lambda r, s: r.samples[0].inputs.__delitem__("log_probs"),
     "lacks input columns ['log_probs']"),
    ("latents shape", on_input("latents", shape=[3, 5, 64], nbytes=3840), "inputs['latents'].shape"),
    ("latents column", on_input("latents", column="images"), "inputs['latents'].column"),
    ("log_probs dtype", on_input("log_probs", dtype="float64", nbytes=16), "inputs['log_probs'].dtype"),
    ("sigmas nbytes", on_input("sigmas", nbytes=2**40), "inputs['sigmas'].nbytes"),
    ("prompt endpoint", on_input("prompt_ids", endpoint="tcp://[zz]:1"), "inputs['prompt_ids'].endpoint"),
    ("NaN latents", input_tensor("latents", math.nan), "['latents']: the tensor holds NaN"),
    ("inf log_probs", input_tensor("log_probs", math.inf), "['log_probs']: the tensor holds NaN or infinite"),
    ("sigmas above 1", input_tensor("sigmas", 2.0), "['sigmas']: values from 2.0"),
    ("ids above the vocabulary", input_tensor("prompt_ids", 0, [384, 9999, 385]), "need 0 <= id < 512"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "fragment"), [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES]
)
def test_train_step_refuses_each_out_of_range_field(
    services: Services, mutate: Callable[[trainer_pb2.TrainStepRequest, Services], None], fragment: str
) -> None:
    request = train_request(services)
    mutate(request, services)
    refused(services.trainer.TrainStep, request, fragment)


def test_save_checkpoint_writes_only_into_the_trainers_own_folder(services: Services) -> None:
    s = services
    before, outside = tree(s.other), sorted(p for p in s.root.rglob("step_*") if s.own not in p.parents)
    link = s.own / "elsewhere"  # a symlink inside the folder, pointing at the other run
    link.symlink_to(s.other, target_is_directory=True)
    step = s.trainer.State(trainer_pb2.TrainerStateRequest(), timeout=60).step
    attempts = [
        (str(s.other), 99999999, "SaveCheckpointRequest.path"),  # plant a "latest" checkpoint there
        (str(s.other), step, "resolves to"),
        (str(s.own / ".." / ".." / "run-b" / "checkpoints"), step, "has a '..' part"),
        ("../run-b/checkpoints", step, "has a '..' part"),
        (str(link), step, "resolves to"),
        (str(link / "deeper"), step, "resolves to"),
        (str(s.own / checkpoint_name(3)), step, "resolves to"),  # inside, but not the folder itself
        ("/", step, "resolves to"),
        ("checkpoints", step, "resolves to"),  # relative: not the configured folder
        ("a\x00b", step, "does not resolve"),
        ("", 99999999, "SaveCheckpointRequest.step=99999999"),
        ("", -1, "SaveCheckpointRequest.step=-1"),
        ("", step + 1, f"SaveCheckpointRequest.step={step + 1}"),
    ]
    for path, at, fragment in attempts:
        refused(s.trainer.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest(step=at, path=path), fragment)
    assert tree(s.other) == before, "another run's checkpoints were touched"
    assert latest_checkpoint(s.other) == s.other / checkpoint_name(5)
    assert sorted(p for p in s.root.rglob("step_*") if s.own not in p.parents) == outside
    assert sorted(p.name for p in s.own.iterdir()) == ["elsewhere"], "nothing written by a refused save"
    link.unlink()

    assert_serving(s)
    saved = s.trainer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(step=step), timeout=120)
    assert (
        Path(saved.path) == s.own / checkpoint_name(step) and (Path(saved.path) / "manifest.json").is_file()
    )
    again = s.trainer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=str(s.own)), timeout=120)
    assert Path(again.path) == s.own / checkpoint_name(step), "its own folder, named explicitly, is fine"
    assert tree(s.other) == before


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0", "-m"]  # fmt: skip


def test_every_torchrun_rank_refuses_bad_fetched_values_and_stays_in_step(services: Services) -> None:
    """Rank 0 refuses NaN latents once fetched, after announcing the step: rank 1 refuses them
    too, before any collective, and the next legitimate step trains on both ranks."""
    s, own = services, services.root / "torchrun" / "checkpoints"
    overrides = [f"trainer.checkpoint={s.root / 'tiny'}", f"trainer.checkpoint_dir={own}", *TRAINER]
    running = Running.watch(*spawn_service("trainer", overrides, s.root / "torchrun.ready.json", TORCHRUN))
    try:
        with grpc.insecure_channel(running.address) as channel:
            trainer = trainer_pb2_grpc.TrainerStub(channel)
            request = train_request(s)
            request.step = 1
            bad = trainer_pb2.TrainStepRequest()
            bad.CopyFrom(request)
            input_tensor("latents", math.nan)(bad, s)
            refused(trainer.TrainStep, bad, "['latents']: the tensor holds NaN")
            response = trainer.TrainStep(request, timeout=60)
            assert response.update.policy_version == 1 and math.isfinite(
                response.metrics.values["actor/pg_loss"]
            )
            common_pb2_grpc.LifecycleStub(channel).Drain(common_pb2.DrainRequest(grace_s=30), timeout=30)
        running.proc.wait(timeout=60)  # rank 0 drains, then stops rank 1: torchrun exits 0
        running.reader.join(timeout=10)
        assert running.proc.returncode == 0, "".join(running.log)[-4000:]
    finally:
        kill_service(running.proc)


def test_the_trainer_still_trains_a_legitimate_step(services: Services) -> None:
    assert_serving(services)
    request = train_request(services)
    response = services.trainer.TrainStep(request, timeout=300)
    assert response.step == request.step and response.update.policy_version >= 1
    assert math.isfinite(response.metrics.values["actor/pg_loss"])
    assert services.trainer.State(trainer_pb2.TrainerStateRequest(), timeout=60).step == request.step


# --- reward -----------------------------------------------------------------------------------


def score_request(s: Services, sample_id: str = "good") -> reward_pb2.ScoreRequest:
    image = s.drawn.samples[0].outputs["images"]
    return reward_pb2.ScoreRequest(sample_id=sample_id, image=image, prompt="a picture")


def image_ref(**fields: object) -> Callable[[reward_pb2.ScoreRequest], None]:
    def mutate(r: reward_pb2.ScoreRequest) -> None:
        for name, value in fields.items():
            if name == "shape":
                r.image.shape[:] = value  # type: ignore[index]
            else:
                setattr(r.image, name, value)

    return mutate


BAD = "INVALID_ARGUMENT"
SCORE_CASES = [
    ("no sample id", lambda r: setattr(r, "sample_id", ""), BAD, "ScoreRequest.sample_id"),
    ("huge sample id", lambda r: setattr(r, "sample_id", "s" * 5000), BAD, "ScoreRequest.sample_id"),
    ("huge prompt", lambda r: setattr(r, "prompt", "p" * 70000), BAD, "ScoreRequest.prompt"),
    ("huge ground truth", lambda r: setattr(r, "ground_truth", "g" * 70000), BAD, "ground_truth"),
    ("metadata", lambda r: r.metadata.update({f"k{i}": "v" for i in range(100)}), BAD,
     "ScoreRequest.metadata"),
    ("no image", lambda r: r.ClearField("image"), BAD, "no image reference"),
    ("column", image_ref(column="weights"), BAD, "column 'weights'"),
    ("dtype", image_ref(dtype="float32"), "SCHEMA_VIOLATION", "expected uint8 [H, W, 3]"),
    ("negative height", image_ref(shape=[-32, 32, 3]), BAD, "ScoreRequest.image.shape"),
    ("huge image", image_ref(shape=[2**20, 2**20, 3], nbytes=3 * 2**40), BAD,
     "ScoreRequest.image.shape"),
    ("nbytes", image_ref(nbytes=2**62), BAD, "ScoreRequest.image.nbytes"),
    ("no endpoint", image_ref(endpoint=""), BAD, "ScoreRequest.image.endpoint"),
    ("bad endpoint", image_ref(endpoint="tcp://a:b"), BAD, "ScoreRequest.image.endpoint"),
    ("long port", image_ref(endpoint="tcp://h:" + "1" * 5000), BAD, "ScoreRequest.image.endpoint"),
    ("port 0", image_ref(endpoint="tcp://127.0.0.1:0"), BAD, "ScoreRequest.image.endpoint"),
    ("control char key", image_ref(key="k\x00"), BAD, "ScoreRequest.image.key"),
    ("no store id", image_ref(store_id=""), BAD, "ScoreRequest.image.store_id"),
    ("future version", image_ref(policy_version=2**62), BAD, "ScoreRequest.image.policy_version"),
]  # fmt: skip


def test_score_gives_each_bad_request_a_typed_error_and_the_stream_goes_on(services: Services) -> None:
    requests = []
    for i, (_, mutate, _, _) in enumerate(SCORE_CASES):
        request = score_request(services, f"bad{i}")
        mutate(request)
        requests.append(request)
    results = list(services.reward.Score(iter([*requests, score_request(services)]), timeout=120))
    assert len(results) == len(requests) + 1
    for i, (name, _, code, fragment) in enumerate(SCORE_CASES):
        result = next(r for r in results if r.sample_id == requests[i].sample_id)
        assert common_pb2.ErrorCode.Name(result.error.code) == f"ERROR_CODE_{code}", (name, result.error)
        assert fragment in result.error.message, (name, result.error.message)
    good = next(r for r in results if r.sample_id == "good")
    assert not good.HasField("error") and math.isfinite(good.reward), good
    assert_serving(services)
    [again] = services.reward.Score(iter([score_request(services, "again")]), timeout=60)
    assert again.reward == good.reward


def test_a_base_at_the_held_version_is_the_base_alone_and_a_bad_update_with_a_base_changes_nothing(
    services: Services,
) -> None:
    """A replica that rejoins gets the current update again, base included: at the version it
    holds that is the base alone (ignored by a rollout that loads its own weights), not a refused
    "not newer" update. A malformed update that carries a base is refused whole, base included."""
    held = 2**40  # newer than any other test's version: this one runs last in the module
    assert (
        services.rollout.LoadWeights(
            rollout_pb2.LoadWeightsRequest(update=lora_update(services, held)), timeout=60
        ).policy_version
        == held
    )
    again = lora_update(services, held)
    again.base.CopyFrom(bucket(4096, 0))
    assert (
        services.rollout.LoadWeights(rollout_pb2.LoadWeightsRequest(update=again), timeout=60).policy_version
        == held
    )
    bad = lora_update(services, held + 1)
    bad.base.CopyFrom(bucket(4096, 0))
    bad.lora.rank = 0
    refused(
        services.rollout.LoadWeights, rollout_pb2.LoadWeightsRequest(update=bad), "WeightUpdate.lora.rank=0"
    )
    assert_serving(services)
