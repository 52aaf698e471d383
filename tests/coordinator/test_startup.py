"""The startup check refuses a pipeline whose stages do not fit, naming the missing column, and a
replica whose settings are not the run recipe's, naming the first differing one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowgrpo.columns import PipelineError
from flowgrpo.config import apply_overrides
from flowgrpo.config_digest import MUST_AGREE, digest, role_settings
from flowgrpo.configs.run import load_run_config
from flowgrpo.configs.trainer import TrainerConfig
from flowgrpo.runtime.errors import HandshakeError
from flowgrpo.services.coordinator.launch import (
    Services,
    ServiceStartError,
    all_or_none,
    check_services,
    check_settings,
    run_settings,
    unless_one_exits,
)
from flowgrpo.services.reward.service import STAGE as REWARD
from flowgrpo.services.rollout.service import STAGE as ROLLOUT
from flowgrpo.services.trainer.service import stage
from flowgrpo.v1 import common_pb2

TRAINER = stage(TrainerConfig())
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tiny_jpeg.yaml"


def services(*stages: common_pb2.StageSpec) -> Services:
    infos = [common_pb2.ServiceInfo(role=s.stage, stages=[s]) for s in stages]
    return Services([], [], None, infos)  # type: ignore[arg-type]


def test_the_real_stages_fit() -> None:
    check_services(services(ROLLOUT, REWARD, TRAINER))


def test_a_rollout_that_no_longer_produces_a_column_is_refused_by_name() -> None:
    rollout = common_pb2.StageSpec(stage="rollout", consumes=ROLLOUT.consumes,
                                   produces=[c for c in ROLLOUT.produces if c != "log_probs"])  # fmt: skip
    with pytest.raises(PipelineError, match="log_probs") as error:
        check_services(services(rollout, REWARD, TRAINER))
    assert "trainer" in str(error.value)


@pytest.mark.parametrize("algorithm", ["flow_grpo", "diffusion_nft", "awm", "dgpo"])
def test_each_algorithm_reads_what_the_rollout_produces(algorithm: str) -> None:
    trainer = apply_overrides(TrainerConfig(), [f"algorithm={algorithm}"])
    check_services(services(ROLLOUT, REWARD, stage(trainer)))
    produced = [c for c in ROLLOUT.produces if c != "final_latents"]
    rollout = common_pb2.StageSpec(stage="rollout", consumes=ROLLOUT.consumes, produces=produced)
    if algorithm == "flow_grpo":  # FlowGRPO never reads the clean latent
        check_services(services(rollout, REWARD, stage(trainer)))
    else:
        with pytest.raises(PipelineError, match="final_latents"):
            check_services(services(rollout, REWARD, stage(trainer)))


def test_a_column_nobody_registered_is_refused() -> None:
    trainer = common_pb2.StageSpec(stage="trainer", consumes=[*TRAINER.consumes, "old_logprobs"])
    with pytest.raises(Exception, match="old_logprobs"):
        check_services(services(ROLLOUT, REWARD, trainer))


def _dying(after_s: float, status: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep({after_s}); raise SystemExit({status})"]
    )


async def _refused() -> None:
    raise HandshakeError("trainer at 127.0.0.1:1 refused the handshake: CANCELLED: CANCELLED")


def test_a_handshake_cut_by_a_dying_process_is_that_process_s_start_failure(tmp_path: Path) -> None:
    """A server that stops cancels the handshake in flight a moment before its process can be
    reaped (CI saw CANCELLED instead of the trainer's own last log line): the failed connect is
    the exit's, quoting the log."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer.log").write_text("loading\nstep_00000001 is corrupt\n")
    proc = _dying(0.5, 3)
    with pytest.raises(ServiceStartError) as error:
        asyncio.run(unless_one_exits(_refused(), {"trainer": proc}, tmp_path))
    assert str(error.value).startswith(
        "trainer exited with status 3 while starting; its log ends: step_00000001 is corrupt"
    )


def test_a_refusal_from_a_process_that_lives_on_is_raised_as_it_is(tmp_path: Path) -> None:
    proc = _dying(30, 0)
    try:
        started = time.monotonic()
        with pytest.raises(HandshakeError, match="CANCELLED"):
            asyncio.run(unless_one_exits(_refused(), {"trainer": proc}, tmp_path))
        assert time.monotonic() - started < 5
    finally:
        proc.kill()
        proc.wait()


def test_the_run_s_settings_are_each_role_s_recipe_section() -> None:
    """What the coordinator expects (from the run config) and what a replica started with
    ``flowgrpo serve ROLE --recipe`` sends (from its service config) are one computation."""
    cfg = load_run_config(RECIPE)
    expected = run_settings(cfg)
    assert set(expected) == set(MUST_AGREE) == {"rollout", "reward", "trainer"}
    assert expected["trainer"]["trainer.loss.clip_eps"] == "0.01"  # the recipe's, not the default 1e-05
    assert expected["rollout"] == {
        "rollout.dtype": '"float32"',
        "rollout.engine": '"native"',
        "rollout.lora_mode": '"peft"',
    }
    assert expected["reward"]["reward.scorers[1].name"] == '"image_brightness"'
    for role, settings in expected.items():
        assert role_settings(role, cfg) == settings  # the run config's sections have the same names
        assert all(key.startswith(MUST_AGREE[role]) for key in settings)


def _trainer_info(settings: dict[str, str]) -> common_pb2.ServiceInfo:
    return common_pb2.ServiceInfo(role="trainer", replica_id="trainer-0", grpc_address="10.0.0.2:50051",
                                  settings=settings, settings_digest=digest(settings))  # fmt: skip


def test_a_replica_of_another_recipe_is_a_handshake_refusal() -> None:
    expected = run_settings(load_run_config(RECIPE))
    check_settings(_trainer_info(expected["trainer"]), expected)
    check_settings(common_pb2.ServiceInfo(role="coordinator"), expected)  # a role without settings
    other = {**expected["trainer"], "trainer.algorithm.name": '"diffusion_nft"'}
    with pytest.raises(HandshakeError) as refused:
        check_settings(_trainer_info(other), expected)
    assert str(refused.value) == (
        'trainer trainer-0 at 10.0.0.2:50051 was started with trainer.algorithm.name="diffusion_nft", the '
        "run's recipe has \"flow_grpo\": start it with the run's recipe (the only differing setting)"
    )


def test_all_or_none_raises_the_first_failure_at_once_and_cancels_the_others() -> None:
    cancelled: list[str] = []

    async def slow() -> int:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append("slow")
            raise
        return 1

    async def fast() -> int:
        return 2

    async def refused() -> int:
        await asyncio.sleep(0.05)
        raise HandshakeError("trainer trainer-0 at h:1 was started with ...")

    started = time.monotonic()
    assert asyncio.run(all_or_none([fast(), fast()])) == [2, 2]
    with pytest.raises(HandshakeError, match="was started with"):
        asyncio.run(all_or_none([slow(), fast(), refused()]))
    assert time.monotonic() - started < 5 and cancelled == ["slow"]
