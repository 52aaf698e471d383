"""The committed generated code is exactly what the protos produce."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from flowgrpo import protogen
from flowgrpo.v1 import common_pb2, rollout_pb2, trainer_pb2


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    written = protogen.generate(tmp_path)
    committed_dir = protogen.SOURCE_ROOT / protogen.PACKAGE_DIR
    committed = sorted(
        p.name for p in committed_dir.iterdir() if p.name.endswith(protogen.GENERATED_SUFFIXES)
    )
    assert sorted(p.name for p in written) == committed, "generated files differ from the committed set"
    stale = [p.name for p in written if not filecmp.cmp(p, committed_dir / p.name, shallow=False)]
    assert not stale, f"stale generated code {stale}: run `python -m flowgrpo.protogen` and commit"


def test_messages_round_trip() -> None:
    ref = common_pb2.TensorRef(
        endpoint="tcp://127.0.0.1:5555", key="s0/p1/latents", column="latents", dtype="float32",
        shape=[3, 16, 64], nbytes=3 * 16 * 64 * 4, store_id="abc", policy_version=2,
    )  # fmt: skip
    req = trainer_pb2.TrainStepRequest(
        step=1, samples=[trainer_pb2.TrainSample(prompt_uid="p1", advantage=0.5, inputs={"latents": ref})]
    )
    back = trainer_pb2.TrainStepRequest.FromString(req.SerializeToString())
    assert back.samples[0].inputs["latents"] == ref
    assert list(back.samples[0].inputs["latents"].shape) == [3, 16, 64]


def test_every_service_is_generated() -> None:
    services = {
        s.full_name
        for m in (common_pb2, rollout_pb2, trainer_pb2)
        for s in m.DESCRIPTOR.services_by_name.values()
    }
    assert {"flowgrpo.v1.Lifecycle", "flowgrpo.v1.Rollout", "flowgrpo.v1.Trainer"} <= services
    assert Path(protogen.PROTO_ROOT / "flowgrpo/v1/reward.proto").exists()


def test_bus_error_codes_mirror_the_proto_enum() -> None:
    from flowgrpo.bus.errors import ErrorCode

    proto = {n.removeprefix("ERROR_CODE_"): v for n, v in common_pb2.ErrorCode.items()}
    assert {c.name: c.value for c in ErrorCode} == proto


def test_help_prints_and_regenerates_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m flowgrpo.protogen --help` rewrote src/flowgrpo/v1 instead of printing help."""

    def refuse(out: Path) -> list[Path]:
        raise AssertionError(f"--help generated code into {out}")

    monkeypatch.setattr(protogen, "generate", refuse)
    with pytest.raises(SystemExit) as done:
        protogen.main(["--help"])
    assert done.value.code == 0 and "Regenerate" in capsys.readouterr().out
