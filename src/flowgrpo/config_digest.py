"""The settings a replica took from its own recipe that must agree with the run's, sent in its
READY handshake (``ServiceInfo.settings`` and ``settings_digest``) and compared by the coordinator.

Under the ``remote`` launcher, and for replicas deployed by compose or Kubernetes, every service
process reads its own recipe (``flowgrpo serve ROLE --recipe R``). Nothing else would stop a
trainer started with another ``trainer.loss.clip_eps`` from training something else than the
run's recipe says, silently. So each replica sends the settings of :data:`MUST_AGREE` for its
role, flattened to ``{dotted.key: canonical JSON}``, with their sha256; the coordinator computes
the same from its own run config and refuses a replica that differs (:func:`refusal`), naming the
first differing key and both values.

Which settings: those a role reads from its own config, not from the coordinator's requests, and
that change what it computes. Not the sampler's settings, the seed or the step: they travel in
every ``Generate`` and ``TrainStep`` request. Not what may differ per replica without changing a
result: addresses, devices, paths (checkpoints, checkpoint folders, plug-in models), timeouts,
retries, concurrency, batch sizes that only cut work into pieces, compile and activation
checkpointing (speed and memory), how weights travel (bus, CUDA IPC, shared base). Torch-free.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from flowgrpo import __version__
from flowgrpo.v1 import common_pb2

Settings = dict[str, str]  # dotted key -> the value as canonical JSON
SHOWN_CHARS = 200  # of a key or value in a refusal

# Per role, the config paths (a section stands for every key under it) that must agree with the
# run's recipe; docs/ARCHITECTURE.md ("The service runtime") says why each is here.
MUST_AGREE: dict[str, tuple[str, ...]] = {
    # the engine, its precision and how LoRA updates enter it change the samples and their log-probs
    "rollout": ("rollout.engine", "rollout.dtype", "rollout.lora_mode"),
    # the reward's terms and every scorer setting that changes a score (not its model paths,
    # devices, server address, timeouts, retries or thread counts)
    "reward": (
        "reward.scorers",
        "reward.jpeg_quality",
        "reward.compose",
        "reward.pickscore.dtype",
        "reward.ocr.engine",
        "reward.ocr.judge.model",
        "reward.ocr.judge.temperature",
        "reward.ocr.judge.max_tokens",
        "reward.ocr.judge.image_format",
        "reward.ocr.offline.limit_type",
        "reward.ocr.offline.limit_side_len",
        "reward.ocr.offline.text_score",
    ),
    # the algorithm and everything it trains with; publish_dtype rounds the weights rollouts sample with
    "trainer": (
        "trainer.algorithm",
        "trainer.dtype",
        "trainer.policy",
        "trainer.optim",
        "trainer.loss",
        "trainer.publish_dtype",
    ),
}


def canonical(value: Any) -> str:
    """``value`` as canonical JSON: sorted keys, no spaces, floats as Python's shortest repr
    (``1e-05``, ``Infinity``), tuples as lists."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def flatten(value: Any, key: str) -> Settings:
    """``value`` (a config section, a list, a scalar) under ``key`` as ``{dotted.key: canonical
    JSON}``, sorted by key: a dataclass's fields and a mapping's keys joined with dots, list and
    tuple items as ``key[i]``; an empty list, mapping or dataclass is one key (``[]``, ``{}``)."""
    parts: dict[str, Any]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = {f"{key}.{f.name}": getattr(value, f.name) for f in dataclasses.fields(value)}
    elif isinstance(value, Mapping):
        parts = {f"{key}.{name}": item for name, item in value.items()}
    elif isinstance(value, list | tuple):
        parts = {f"{key}[{i}]": item for i, item in enumerate(value)}
    else:
        return {key: canonical(value)}
    if not parts:
        return {key: canonical(value)}
    flat: Settings = {}
    for part_key, item in parts.items():
        flat.update(flatten(item, part_key))
    return dict(sorted(flat.items()))


def role_settings(role: str, config: Any) -> Settings:
    """The settings of :data:`MUST_AGREE` for ``role`` from its service config (or a run config:
    the sections have the same names); a role with none listed has none."""
    flat: Settings = {}
    for path in MUST_AGREE.get(role, ()):
        flat.update(flatten(_lookup(config, path), path))
    return dict(sorted(flat.items()))


def digest(settings: Mapping[str, str]) -> str:
    """The sha256 (hex) of ``settings`` as canonical JSON."""
    return hashlib.sha256(canonical(dict(settings)).encode()).hexdigest()


def differing(got: Mapping[str, str], want: Mapping[str, str]) -> list[str]:
    """The keys whose values differ, or that only one side has, sorted; a ``name`` both sides
    have with other values first (a tagged section's, ``trainer.algorithm.name``): it explains
    the rest of its section."""
    keys = [key for key in got.keys() | want.keys() if got.get(key) != want.get(key)]

    def renamed(key: str) -> bool:
        return key.endswith(".name") and key in got and key in want

    return sorted(keys, key=lambda key: (not renamed(key), key))


def refusal(info: common_pb2.ServiceInfo, want: Mapping[str, str]) -> str | None:
    """Why the replica that answered ``info`` may not serve a run whose recipe gives ``want``
    (one line naming the first differing key and both values), or None when they agree."""
    who = f"{info.role} {info.replica_id} at {info.grpc_address}"
    if not info.settings_digest:
        return (
            f"{who} sent no settings digest in its READY handshake (it runs flowgrpo "
            f"{info.software_version or '(unknown)'}, this coordinator {__version__}): run the same "
            "flowgrpo version everywhere"
        )
    got = dict(info.settings)
    if info.settings_digest != digest(got):
        return (
            f"{who} sent settings whose digest is not theirs ({info.settings_digest[:12]}, not "
            f"{digest(got)[:12]}; it runs flowgrpo {info.software_version or '(unknown)'}, this "
            f"coordinator {__version__}): run the same flowgrpo version everywhere"
        )
    keys = differing(got, want)
    if not keys:
        return None
    which = "the only differing setting" if len(keys) == 1 else f"first of {len(keys)} differing settings"
    return f"{who} {_difference(keys[0], got, want)}: start it with the run's recipe ({which})"


def _difference(key: str, got: Mapping[str, str], want: Mapping[str, str]) -> str:
    name = _shown(key)
    if key not in got:
        return f"was started without {name}, the run's recipe has {_shown(want[key])}"
    if key not in want:
        return f"was started with {name}={_shown(got[key])}, which the run's recipe does not have"
    return f"was started with {name}={_shown(got[key])}, the run's recipe has {_shown(want[key])}"


def _shown(text: str, most: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``most`` characters: a replica's settings are its to choose, the message's
    length is not."""
    return text if len(text) <= most else f"{text[: most - 3]}..."


def _lookup(config: Any, path: str) -> Any:
    value = config
    for name in path.split("."):
        if not hasattr(value, name):
            raise KeyError(f"config_digest: {type(config).__name__} has no {path} (at {name!r})")
        value = getattr(value, name)
    return value


def _plain(value: Any) -> Any:
    """JSON's data model for ``value``: enums by value, tuples as lists, mapping keys as strings."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"config_digest: a {type(value).__name__} ({value!r}) has no canonical JSON form")
