"""The startup check refuses a pipeline whose stages do not fit, naming the missing column."""

from __future__ import annotations

import pytest

from flowgrpo.columns import PipelineError
from flowgrpo.services.coordinator.launch import Services, check_services
from flowgrpo.services.reward.service import STAGE as REWARD
from flowgrpo.services.rollout.service import STAGE as ROLLOUT
from flowgrpo.services.trainer.service import stage
from flowgrpo.v1 import common_pb2

TRAINER = stage("flow_grpo")


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


@pytest.mark.parametrize("algorithm", ["flow_grpo", "diffusion_nft"])
def test_each_algorithm_reads_what_the_rollout_produces(algorithm: str) -> None:
    check_services(services(ROLLOUT, REWARD, stage(algorithm)))
    produced = [c for c in ROLLOUT.produces if c != "final_latents"]
    rollout = common_pb2.StageSpec(stage="rollout", consumes=ROLLOUT.consumes, produces=produced)
    if algorithm == "flow_grpo":  # FlowGRPO never reads the clean latent
        check_services(services(rollout, REWARD, stage(algorithm)))
    else:
        with pytest.raises(PipelineError, match="final_latents"):
            check_services(services(rollout, REWARD, stage(algorithm)))


def test_a_column_nobody_registered_is_refused() -> None:
    trainer = common_pb2.StageSpec(stage="trainer", consumes=[*TRAINER.consumes, "old_logprobs"])
    with pytest.raises(Exception, match="old_logprobs"):
        check_services(services(ROLLOUT, REWARD, trainer))
