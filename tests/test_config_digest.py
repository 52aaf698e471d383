"""The settings a replica sends in its READY handshake (``flowgrpo.config_digest``): flattened to
dotted keys in a canonical order, hashed, and compared with the run's, against expectations
written out by hand."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flowgrpo import __version__
from flowgrpo.config import apply_overrides
from flowgrpo.config_digest import canonical, differing, digest, flatten, refusal, role_settings
from flowgrpo.configs.run import load_run_config
from flowgrpo.services.coordinator.launch import role_config
from flowgrpo.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
CHECKPOINT = ["model.checkpoint=/ckpt/m"]  # a service config needs one (never read here)


@dataclass
class Inner:
    eps: float = 1e-5
    names: list[str] = field(default_factory=lambda: ["b", "a"])


@dataclass
class Section:
    mode: str = "x"
    inner: Inner = field(default_factory=Inner)
    pair: tuple[float, float] = (0.9, 0.999)
    empty: list[int] = field(default_factory=list)
    table: dict[str, int] = field(default_factory=lambda: {"z": 1, "a": 2})
    flag: bool = True
    gap: float = math.inf
    steps: int = 3


def test_a_section_flattens_to_dotted_keys_in_sorted_order() -> None:
    flat = flatten(Section(), "s")
    assert flat == {
        "s.empty": "[]",
        "s.flag": "true",
        "s.gap": "Infinity",
        "s.inner.eps": "1e-05",
        "s.inner.names[0]": '"b"',  # a list keeps its order: it is part of the value
        "s.inner.names[1]": '"a"',
        "s.mode": '"x"',
        "s.pair[0]": "0.9",
        "s.pair[1]": "0.999",
        "s.steps": "3",
        "s.table.a": "2",
        "s.table.z": "1",
    }
    assert list(flat) == sorted(flat)
    assert flatten(3.0, "k") == {"k": "3.0"} and flatten({}, "k") == {"k": "{}"}


def test_canonical_json_is_compact_with_sorted_keys() -> None:
    assert canonical({"b": (1, 2.5), "a": None}) == '{"a":null,"b":[1,2.5]}'
    with pytest.raises(TypeError, match="Path"):
        canonical(Path("/x"))


def test_the_digest_is_the_sha256_of_the_canonical_map_whatever_its_order() -> None:
    expected = hashlib.sha256(b'{"a.x":"1","b":"\\"y\\""}').hexdigest()
    assert digest({"b": '"y"', "a.x": "1"}) == expected
    assert digest({"a.x": "1", "b": '"y"'}) == expected
    assert digest({"a.x": "2", "b": '"y"'}) != expected


def test_differing_keys_include_those_only_one_side_has() -> None:
    got = {"a": "1", "b": "2", "d": "4"}
    want = {"a": "1", "b": "3", "c": "3"}
    assert differing(got, want) == ["b", "c", "d"]
    assert differing(want, dict(want)) == []


def info(settings: dict[str, str], digest_of: dict[str, str] | None = None) -> common_pb2.ServiceInfo:
    return common_pb2.ServiceInfo(
        role="trainer",
        replica_id="trainer-0",
        grpc_address="10.0.0.2:50051",
        software_version="1.2.3",
        settings=settings,
        settings_digest=digest(settings if digest_of is None else digest_of),
    )


WANT = {
    "trainer.algorithm.name": '"diffusion_nft"',
    "trainer.loss.clip_eps": "1e-05",
    "trainer.algorithm.beta": "1.0",
}


def test_a_replica_with_the_run_s_settings_is_not_refused() -> None:
    assert refusal(info(dict(WANT)), WANT) is None


def test_the_refusal_names_the_first_differing_key_and_both_values() -> None:
    one = {**WANT, "trainer.loss.clip_eps": "0.0001"}
    assert refusal(info(one), WANT) == (
        "trainer trainer-0 at 10.0.0.2:50051 was started with trainer.loss.clip_eps=0.0001, the run's "
        "recipe has 1e-05: start it with the run's recipe (the only differing setting)"
    )
    two = {**one, "trainer.algorithm.beta": "0.1"}
    assert refusal(info(two), WANT) == (
        "trainer trainer-0 at 10.0.0.2:50051 was started with trainer.algorithm.beta=0.1, the run's "
        "recipe has 1.0: start it with the run's recipe (first of 2 differing settings)"
    )
    three = {**two, "trainer.algorithm.name": '"awm"'}
    assert refusal(info(three), WANT) == (
        'trainer trainer-0 at 10.0.0.2:50051 was started with trainer.algorithm.name="awm", the run\'s '
        'recipe has "diffusion_nft": start it with the run\'s recipe (first of 3 differing settings)'
    )


def test_a_key_only_one_side_has_is_named_as_such() -> None:
    fewer = {k: v for k, v in WANT.items() if k != "trainer.algorithm.name"}
    assert 'was started without trainer.algorithm.name, the run\'s recipe has "diffusion_nft":' in str(
        refusal(info(fewer), WANT)
    )
    more = {**WANT, "trainer.new": "1"}
    assert "was started with trainer.new=1, which the run's recipe does not have:" in str(
        refusal(info(more), WANT)
    )


def test_a_replica_without_a_digest_or_with_a_false_one_is_refused() -> None:
    old = common_pb2.ServiceInfo(
        role="rollout", replica_id="rollout-3", grpc_address="h:1", software_version="0.9"
    )
    assert refusal(old, {}) == (
        "rollout rollout-3 at h:1 sent no settings digest in its READY handshake (it runs flowgrpo 0.9, "
        f"this coordinator {__version__}): run the same flowgrpo version everywhere"
    )
    forged = info(dict(WANT), digest_of={"other": "1"})  # the digest of other settings than those sent
    assert "sent settings whose digest is not theirs" in str(refusal(forged, WANT))


def test_a_long_value_is_cut_in_the_refusal() -> None:
    got = {**WANT, "trainer.algorithm.name": '"' + "x" * 10_000 + '"'}
    why = str(refusal(info(got), WANT))
    assert len(why) < 500 and '"xxx' in why and "...," in why


# what a deployment gives each replica on top of the recipe (deploy/compose/generate.py, the local launcher)
PER_REPLICA = {
    "rollout": ["rollout.device=cuda:1", "rollout.checkpoint=/ckpt/m", "rollout.compile=false",
                "rollout.max_batch_samples=8"],
    "reward": ["reward.pickscore.device=cuda:0", "reward.ocr.judge.base_url=http://judge:8000/v1",
               "reward.pickscore.batch_size=4"],
    "trainer": ["trainer.device=cuda", "trainer.checkpoint=/ckpt/m", "trainer.checkpoint_dir=/runs/x/ckpt",
                "trainer.compile=true", "trainer.async_save=true"],
}  # fmt: skip


@pytest.mark.parametrize("role", sorted(PER_REPLICA))
def test_what_may_differ_per_replica_is_not_compared(role: str) -> None:
    config = role_config(load_run_config(RECIPE, CHECKPOINT), role)
    assert role_settings(role, apply_overrides(config, PER_REPLICA[role])) == role_settings(role, config)


@pytest.mark.parametrize(
    ("role", "override", "key"),
    [
        ("trainer", "trainer.algorithm=diffusion_nft", "trainer.algorithm.name"),  # before its section's keys
        ("trainer", "trainer.loss.clip_eps=0.0001", "trainer.loss.clip_eps"),
        ("trainer", "trainer.optim.betas=[0.9,0.99]", "trainer.optim.betas[1]"),
        ("trainer", "trainer.policy.lora_rank=8", "trainer.policy.lora_rank"),
        ("trainer", "trainer.publish_dtype=bfloat16", "trainer.publish_dtype"),
        ("rollout", "rollout.lora_mode=merge", "rollout.lora_mode"),
        ("rollout", "rollout.dtype=bfloat16", "rollout.dtype"),
        ("reward", "reward.scorers=[{name: jpeg_compressibility, weight: 2.0}]", "reward.scorers[0].weight"),
        ("reward", "reward.compose.score=strict", "reward.compose.score"),
    ],
)
def test_a_setting_that_changes_what_a_role_computes_is_compared(role: str, override: str, key: str) -> None:
    config = role_config(load_run_config(RECIPE, CHECKPOINT), role)
    changed = role_settings(role, apply_overrides(config, [override]))
    assert differing(changed, role_settings(role, config))[0] == key


def test_a_setting_of_the_algorithm_s_own_section_is_compared() -> None:
    config = role_config(load_run_config(RECIPE, [*CHECKPOINT, "trainer.algorithm=diffusion_nft"]), "trainer")
    changed = role_settings("trainer", apply_overrides(config, ["trainer.algorithm.beta=0.1"]))
    assert differing(changed, role_settings("trainer", config)) == ["trainer.algorithm.beta"]
