"""The startup check refuses a pipeline whose stages do not fit, naming the missing column."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowgrpo.columns import PipelineError
from flowgrpo.runtime.errors import HandshakeError
from flowgrpo.services.coordinator.launch import Services, ServiceStartError, check_services, unless_one_exits
from flowgrpo.services.reward.service import STAGE as REWARD
from flowgrpo.services.rollout.service import STAGE as ROLLOUT
from flowgrpo.services.trainer.config import Algorithm, TrainerConfig
from flowgrpo.services.trainer.service import stage
from flowgrpo.v1 import common_pb2

TRAINER = stage(TrainerConfig())


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


@pytest.mark.parametrize("algorithm", ["flow_grpo", "diffusion_nft", "dgpo"])
def test_each_algorithm_reads_what_the_rollout_produces(algorithm: Algorithm) -> None:
    check_services(services(ROLLOUT, REWARD, stage(TrainerConfig(algorithm=algorithm))))
    produced = [c for c in ROLLOUT.produces if c != "final_latents"]
    rollout = common_pb2.StageSpec(stage="rollout", consumes=ROLLOUT.consumes, produces=produced)
    if algorithm == "flow_grpo":  # FlowGRPO never reads the clean latent
        check_services(services(rollout, REWARD, stage(TrainerConfig(algorithm=algorithm))))
    else:
        with pytest.raises(PipelineError, match="final_latents"):
            check_services(services(rollout, REWARD, stage(TrainerConfig(algorithm=algorithm))))


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
