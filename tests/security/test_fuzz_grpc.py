"""Random messages against real rollout, trainer, reward and coordinator processes (loopback, no
token): at least ``MESSAGES`` per service, a third each of random bytes (sent through a generic
call with identity serializers), random well-formed messages (every field drawn from the
message descriptors, edge values favoured) and legitimate requests with one field replaced by
such a value. Every call is answered within ``DEADLINE_S``, with its result or a clear refusal
(``ANSWERS``): never UNKNOWN or INTERNAL, a payload that does not parse included (it gets
INVALID_ARGUMENT naming the method: grpc's own answer was UNKNOWN and a logged traceback), and
never a hang (DEADLINE_EXCEEDED). No process may die, and afterwards each service answers a
health check and a legitimate call. The draws are seeded: a failure names the seed and payload to
replay."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowgrpo import PROTOCOL_VERSION
from flowgrpo.bus import BusServer, serve_store
from flowgrpo.bus.torch_tensors import put_tensor
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.runtime import wait_ready
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.coordinator.registry import VERIFY_S
from flowgrpo.v1 import (
    common_pb2,
    coordinator_pb2,
    reward_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
)
from tests.security.test_inputs import Running, start_all
from tests.services.launch import kill_service

MESSAGES = 1000  # per service
SEED = 20250101
# a fuzzed call's answers: its result, or a refusal that says why (runtime/errors.py): a bad
# argument, a state that does not allow it, or data that a mutated bus ref names and nobody serves
ANSWERS = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.UNAVAILABLE)  # fmt: skip
# a Score stream's per-sample errors that fail the fuzz: a crash, a sample given up on
SAMPLE_FAILURES = (common_pb2.ERROR_CODE_INTERNAL, common_pb2.ERROR_CODE_DEADLINE_EXCEEDED)
# an answer takes at most: 3 s where Register checks the address it is given (VERIFY_S; the fuzzed
# coordinator's is shorter, below), 1 s where a ref names a port nobody serves (FETCH), 2.7 s for the
# costliest call drawn that is accepted (a Generate of 254 steps) on the loaded 2-core machine; 10 s
# left a hang to pass as DEADLINE_EXCEEDED
DEADLINE_S = 5.0
# The fuzzed coordinator waits this long (not VERIFY_S, 3 s) for a registrant's handshake: 6 of the
# 255 Register calls drawn name an address nobody serves and wait it out whole, 18 s of the
# coordinator's 19 s at 3 s. The same refusal (INVALID_ARGUMENT) comes sooner; that the real wait
# fits in DEADLINE_S is asserted on the constants (test_the_real_verification_fits_the_deadline).
FUZZ_VERIFY_S = 0.5
HANGS = 3  # a service that hung this often stops being fuzzed: each costs DEADLINE_S
FETCH = "bus.fetch_timeout_s=1.0"  # a mutated ref that names a port nobody serves fails within 1 s
# cheap: one denoising step of a 16 x 16 image, so a request that passes costs little
PARAMS = SamplerParams(num_points=2, cfg_text_scale=2.0, noise_level=1.0, window_size=1, window_range=(0, 1),
                       height=16, width=16, deterministic=True).to_proto()  # fmt: skip
Q = "language_model.model.layers.0.self_attn.q_proj_moe_gen"
COORDINATOR = """
    import asyncio, sys
    from flowgrpo.runtime import Service, serve
    from flowgrpo.runtime.config import ServerConfig
    from flowgrpo.services.coordinator import registry as registry_module
    from flowgrpo.services.coordinator.registry import CoordinatorService
    registry_module.VERIFY_S = float(sys.argv[2])
    from flowgrpo.v1.coordinator_pb2_grpc import add_CoordinatorServicer_to_server
    registry = CoordinatorService("fuzz")
    service = Service("flowgrpo.v1.Coordinator", registry, add_CoordinatorServicer_to_server)
    asyncio.run(serve(registry, ServerConfig(ready_file=sys.argv[1]), [service]))
"""


@dataclass(frozen=True)
class Method:
    path: str  # "/flowgrpo.v1.Rollout/Generate"
    request: type[Message]
    base: Message  # a legitimate request, mutated one field at a time
    stream: bool = False


@dataclass
class Target:
    role: str
    running: Running
    methods: list[Method] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.running.address


# --- random values from the descriptors --------------------------------------------------------

STRINGS = ["", "a", "..", "../../..", "/", "/etc/passwd", "\x00", "\n", "é", "\u202e", "x" * 5000, "lora",
           "gen_path", "sde", "cps", "global", "text_channel", "fixed", "random", "progressive", "images",
           "prompt_ids", "latents", "log_probs", "sigmas", "weights", "uint8", "int64", "float32",
           "bfloat16", "tcp://", "tcp://:", "tcp://a:b", "ipc://", "rollout", "reward", "trainer",
           PROTOCOL_VERSION]  # fmt: skip
INT32 = [0, 1, -1, 2, 3, 7, 16, 255, 1024, 2**20, 2**31 - 1, -(2**31)]  # 2**20: a multiple of 16
INT64 = [*INT32, 2**53, 99999999, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 3.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324]
C = FieldDescriptor


def random_text(rng: random.Random) -> str:
    if rng.random() < 0.7:
        return rng.choice(STRINGS)
    chars = (rng.randint(0x20, 0x7E) if rng.random() < 0.7 else rng.randint(0, 0x10FFFF) for _ in range(40))
    return "".join(chr(c) for c in chars if not 0xD800 <= c <= 0xDFFF)[: rng.randint(0, 40)]


def random_scalar(f: Any, rng: random.Random) -> object:
    kind = f.cpp_type
    if kind == C.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if kind in (C.CPPTYPE_INT32, C.CPPTYPE_INT64):
        pool = INT32 if kind == C.CPPTYPE_INT32 else INT64
        bits = 31 if kind == C.CPPTYPE_INT32 else 63
        return rng.choice(pool) if rng.random() < 0.7 else rng.randint(-(2**bits), 2**bits - 1)
    if kind in (C.CPPTYPE_UINT32, C.CPPTYPE_UINT64):
        return rng.choice([0, 1, 2**32 - 1]) if rng.random() < 0.7 else rng.randint(0, 2**32 - 1)
    if kind in (C.CPPTYPE_DOUBLE, C.CPPTYPE_FLOAT):
        return rng.choice(FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
    if kind == C.CPPTYPE_ENUM:
        return rng.choice([v.number for v in f.enum_type.values] + [12345])
    if f.type == C.TYPE_BYTES:
        return rng.randbytes(rng.randint(0, 80))
    return random_text(rng)


def fill(msg: Message, rng: random.Random, depth: int = 0) -> Message:
    """Set each field of ``msg`` (recursively, to depth 3) with probability 1/2 to random values."""
    for f in msg.DESCRIPTOR.fields:
        if rng.random() < 0.5:
            set_random(msg, f, rng, depth)
    return msg


def set_random(msg: Message, f: Any, rng: random.Random, depth: int) -> None:
    container = getattr(msg, f.name)
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key_field, value_field = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        msg.ClearField(f.name)
        for _ in range(rng.randint(0, 3)):
            key = random_scalar(key_field, rng)
            if value_field.message_type is None:
                container[key] = random_scalar(value_field, rng)
            elif depth < 3:
                fill(container[key], rng, depth + 1)
            else:
                container[key].SetInParent()
    elif f.is_repeated:
        msg.ClearField(f.name)
        for _ in range(rng.choice([0, 1, 2, 3, 40])):
            if f.message_type is not None:
                item = container.add()
                if depth < 3:
                    fill(item, rng, depth + 1)
            else:
                container.append(random_scalar(f, rng))
    elif f.message_type is not None:
        msg.ClearField(f.name)
        if depth < 3:
            fill(container, rng, depth + 1)
        else:
            container.SetInParent()
    else:
        setattr(msg, f.name, random_scalar(f, rng))


def fields_of(msg: Message) -> list[tuple[Message, Any]]:
    """(message, field) pairs of ``msg`` and of its set sub-messages, to replace one of."""
    pairs: list[tuple[Message, Any]] = [(msg, f) for f in msg.DESCRIPTOR.fields]
    for f, value in msg.ListFields():
        if f.message_type is None or f.message_type.GetOptions().map_entry:
            continue
        for item in value if f.is_repeated else [value]:
            pairs += fields_of(item)
    return pairs


def mutated(base: Message, rng: random.Random) -> Message:
    msg = type(base)()
    msg.CopyFrom(base)
    pairs = fields_of(msg)
    if pairs:  # some requests have no fields
        target, f = rng.choice(pairs)
        set_random(target, f, rng, depth=2)
    return msg


def random_bytes(method: Method, rng: random.Random) -> bytes:
    legit = method.base.SerializeToString()
    kind = rng.randrange(3)
    if kind == 0 or not legit:
        return rng.randbytes(rng.choice([0, 1, 2, 5, 17, 64, 300]))
    if kind == 1:  # bit flips of a legitimate request
        data = bytearray(legit)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    return legit[: rng.randrange(len(legit))]  # truncated


def payload(method: Method, rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:
        return random_bytes(method, rng)
    if kind == 1:
        return fill(method.request(), rng).SerializeToString()
    return mutated(method.base, rng).SerializeToString()


def parses(method: Method, data: bytes) -> bool:
    try:
        method.request.FromString(data)
    except DecodeError:
        return False
    return True


# --- the services ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Target]]:
    root = tmp_path_factory.mktemp("fuzz")
    tiny = make_tiny_bagel(root / "tiny", seed=0)
    roles = {
        "rollout": [f"rollout.checkpoint={tiny}", FETCH],
        "trainer": [f"trainer.checkpoint={tiny}", f"trainer.checkpoint_dir={root / 'run' / 'checkpoints'}",
                    "trainer.policy.lora_rank=4", "trainer.policy.lora_alpha=8",
                    "trainer.loss.mini_batches=1", "trainer.loss.micro_batch_size=1", FETCH],
        "reward": ["reward.scorers=[{name: jpeg_compressibility}]", FETCH],
    }  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        coordinator = pool.submit(spawn_coordinator, root)
        try:
            started = start_all(roles, root)
        except Exception:
            with contextlib.suppress(Exception):
                kill_service(coordinator.result().proc)
            raise
        try:
            started["coordinator"] = coordinator.result()
        except Exception:
            for running in started.values():
                kill_service(running.proc)
            raise
    targets = {role: Target(role, running) for role, running in started.items()}
    try:
        with serve_store() as store:
            add_methods(targets, store)
            yield targets
    finally:
        for running in started.values():
            running.stop()
        outside = [p for p in root.rglob("step_*") if root / "run" / "checkpoints" not in p.parents]
        assert not outside, f"checkpoints written outside the trainer's folder: {outside}"


def spawn_coordinator(root: Path) -> Running:
    """The coordinator's registry served by the runtime in a process of its own."""
    script, ready = root / "coordinator.py", root / "coordinator.ready.json"
    script.write_text(textwrap.dedent(COORDINATOR))
    proc = subprocess.Popen([sys.executable, str(script), str(ready), str(FUZZ_VERIFY_S)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_service(proc)
            raise AssertionError(f"the coordinator did not start: {proc.communicate()[1][-4000:]}")
        time.sleep(0.05)
    address = json.loads(ready.read_text())["grpc_address"]
    running = Running.watch(proc, address)
    asyncio.run(wait_ready(address, role="coordinator", timeout_s=60))
    return running


def add_methods(targets: dict[str, Target], store: BusServer) -> None:
    """Each service's methods with a legitimate request of each (drawn from the real rollout)."""
    prompt = put_tensor(store.store, "data/p0", "prompt_ids", torch.tensor([384, 5, 6, 385])).to_proto()
    group = rollout_pb2.PromptGroup(prompt_uid="p0", prompt_ids=prompt, sample_indices=[0])
    generate = rollout_pb2.GenerateRequest(step=1, seed=3, groups=[group], params=PARAMS, release_tag="fuzz")
    with grpc.insecure_channel(targets["rollout"].address) as channel:
        drawn = rollout_pb2_grpc.RolloutStub(channel).Generate(generate, timeout=120).samples[0]
    update = common_pb2.WeightUpdate(policy_version=1, kind="lora", lora=common_pb2.LoraSpec(rank=4, alpha=8))
    for name, shape in ((Q + ".lora_A.weight", (4, 64)), (Q + ".lora_B.weight", (64, 4))):
        ref = put_tensor(store.store, f"weights/{name}", "weights", torch.full(shape, 0.01)).to_proto()
        update.tensors.append(common_pb2.NamedTensor(name=name, ref=ref))
    inputs = {"prompt_ids": prompt, **{c: drawn.outputs[c] for c in ("latents", "log_probs", "sigmas")}}
    sample = trainer_pb2.TrainSample(prompt_uid="p0", sample_index=0, advantage=1.0, inputs=inputs)
    info = common_pb2.ServiceInfo(role="reward", replica_id="r", grpc_address=targets["coordinator"].address,
                                  protocol_version=PROTOCOL_VERSION)  # fmt: skip
    score = reward_pb2.ScoreRequest(sample_id="p0/0", image=drawn.outputs["images"], prompt="a picture")
    load = rollout_pb2.LoadWeightsRequest(update=update)
    train = trainer_pb2.TrainStepRequest(step=1, samples=[sample], params=PARAMS)
    for role, service, methods in [
        ("rollout", "Rollout", [("Generate", generate), ("LoadWeights", load),
                                ("Release", rollout_pb2.ReleaseRequest(tags=["fuzz-x"]))]),
        ("trainer", "Trainer", [("TrainStep", train), ("SaveCheckpoint", trainer_pb2.SaveCheckpointRequest()),
                                ("State", trainer_pb2.TrainerStateRequest())]),
        ("reward", "Reward", [("Score", score), ("Info", reward_pb2.RewardInfoRequest())]),
        ("coordinator", "Coordinator", [("Register", coordinator_pb2.RegisterRequest(info=info)),
                                        ("Heartbeat", coordinator_pb2.HeartbeatRequest(replica_id="r")),
                                        ("Leave", coordinator_pb2.LeaveRequest(replica_id="r")),
                                        ("RunStatus", coordinator_pb2.RunStatusRequest())]),
    ]:  # fmt: skip
        targets[role].methods = [
            Method(f"/flowgrpo.v1.{service}/{name}", type(base), base, stream=name == "Score")
            for name, base in methods
        ]


# --- the fuzz loop -----------------------------------------------------------------------------


@dataclass
class Outcome:
    sent: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    unparsable: int = 0  # calls refused with a payload that does not parse
    hangs: int = 0  # calls unanswered within DEADLINE_S
    slowest: tuple[float, str] = (0.0, "")  # seconds, method and answer


def call(channel: grpc.Channel, method: Method, payloads: list[bytes], outcome: Outcome) -> None:
    identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    started = time.monotonic()
    try:
        if method.stream:  # each result counts its per-sample error code: not INTERNAL, not a timeout
            for reply in channel.stream_stream(method.path, identity, identity)(
                iter(payloads), timeout=DEADLINE_S
            ):
                result = reward_pb2.ScoreResult.FromString(reply)
                name = "sample " + common_pb2.ErrorCode.Name(result.error.code)
                outcome.codes[name] = outcome.codes.get(name, 0) + 1
                if result.error.code in SAMPLE_FAILURES:
                    outcome.failures.append(f"{method.path}: a per-sample {name} {result.error}")
        else:
            channel.unary_unary(method.path, identity, identity)(payloads[0], timeout=DEADLINE_S)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code, details = error.code(), error.details()  # type: ignore[attr-defined]
        if code not in ANSWERS:  # a crash (UNKNOWN, INTERNAL), a hang (DEADLINE_EXCEEDED), or else
            outcome.hangs += code == grpc.StatusCode.DEADLINE_EXCEEDED
            outcome.failures.append(f"{method.path} {code.name}: {details} <- {[p[:120] for p in payloads]}")
        elif not all(parses(method, p) for p in payloads):
            outcome.unparsable += 1
    seconds = time.monotonic() - started
    outcome.slowest = max(outcome.slowest, (seconds, f"{method.path} {code.name}"))
    outcome.codes[code.name] = outcome.codes.get(code.name, 0) + 1
    outcome.sent += len(payloads)


def fuzz(target: Target, seed: int) -> Outcome:
    rng, outcome = random.Random(seed), Outcome()
    with grpc.insecure_channel(target.address) as channel:
        while outcome.sent < MESSAGES and outcome.hangs < HANGS:
            method = rng.choice(target.methods)
            count = rng.randint(1, 4) if method.stream else 1
            call(channel, method, [payload(method, rng) for _ in range(count)], outcome)
    return outcome


def still_serving(target: Target) -> None:
    proc = target.running.proc
    assert proc.poll() is None, f"the {target.role} process died: {''.join(target.running.log)[-4000:]}"
    with grpc.insecure_channel(target.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        legit = {
            "rollout": "Generate",
            "trainer": "SaveCheckpoint",
            "reward": "Score",
            "coordinator": "RunStatus",
        }
        method = next(m for m in target.methods if m.path.endswith("/" + legit[target.role]))
        identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
        request = method.base.SerializeToString()
        if method.stream:
            [reply] = channel.stream_stream(method.path, identity, identity)(iter([request]), timeout=60)
            result = reward_pb2.ScoreResult.FromString(reply)
            assert not result.HasField("error") and math.isfinite(result.reward), result
        else:
            channel.unary_unary(method.path, identity, identity)(request, timeout=120)


def test_the_real_verification_fits_the_deadline() -> None:
    """The coordinator fuzzed here verifies within FUZZ_VERIFY_S; a real one within VERIFY_S,
    which must fit in DEADLINE_S too (with a second to spare for the call around it)."""
    assert FUZZ_VERIFY_S < VERIFY_S <= DEADLINE_S - 1


@pytest.mark.parametrize("role", ["rollout", "trainer", "reward", "coordinator"])
def test_random_messages_never_crash_a_service(targets: dict[str, Target], role: str) -> None:
    target = targets[role]
    started = time.monotonic()
    outcome = fuzz(target, SEED + len(role))
    seconds = time.monotonic() - started
    print(f"{role}: {outcome.sent} messages in {seconds:.1f} s, the slowest answer {outcome.slowest}")
    assert not outcome.failures, (
        f"{len(outcome.failures)} calls crashed, hung or got an unexpected code (seed {SEED + len(role)}, "
        f"deadline {DEADLINE_S} s), codes {outcome.codes}:\n" + "\n".join(outcome.failures[:10])
    )
    assert outcome.sent >= MESSAGES
    refused = outcome.codes.get("INVALID_ARGUMENT", 0) + outcome.codes.get(
        "sample ERROR_CODE_INVALID_ARGUMENT", 0
    )
    assert refused > 0, outcome.codes  # the checks ran
    # the unparsable ones refused, and logged in a line per 10 s at most, never with a traceback
    log = "".join(target.running.log)  # its last 400 lines
    assert outcome.unparsable > 0 and "Unexpected [" not in log, log[-2000:]
    assert log.count("does not parse") <= seconds / 10 + 1, (seconds, log[-2000:])
    still_serving(target)
