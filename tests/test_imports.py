"""The shared library, protos, configs, bus and runtime import where torch is not installed
(the coordinator's image has no torch)."""

from __future__ import annotations

import subprocess
import sys

BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"
TORCH_FREE = [
    "flowgrpo.services.cli",
    "flowgrpo.config",
    "flowgrpo.columns",
    "flowgrpo.v1.common_pb2_grpc",
    "flowgrpo.v1.rollout_pb2_grpc",
    "flowgrpo.v1.reward_pb2_grpc",
    "flowgrpo.v1.trainer_pb2_grpc",
    "flowgrpo.v1.coordinator_pb2_grpc",
    "flowgrpo.bus",
    "flowgrpo.bus.relay",
    "flowgrpo.runtime",
    "flowgrpo.telemetry",
    "flowgrpo.logs",
    "flowgrpo.configs.rollout",
    "flowgrpo.services.rollout.main",
    "flowgrpo.configs.trainer",
    "flowgrpo.rewards",
    "flowgrpo.rewards.judge",
    "flowgrpo.rewards.plugins",
    "flowgrpo.rewards.compose",
    "flowgrpo.compose.verify",
    "flowgrpo.compose.split",
    "flowgrpo.configs.reward",
    "flowgrpo.services.reward.main",
    "flowgrpo.services.trainer.main",
    "flowgrpo.data",
    "flowgrpo.configs.run",
    "flowgrpo.services.coordinator.launch",
    "flowgrpo.services.coordinator.run",
    "flowgrpo.services.coordinator.train",
    "flowgrpo.services.coordinator.status",
    "flowgrpo.services.coordinator.trace",
    "flowgrpo.services.coordinator.relay",
    "flowgrpo.services.coordinator.report",  # the page: no torch; plotly.js read when it writes
    "flowgrpo.services.coordinator.runmeta",
    "flowgrpo.services.rollout.relay",  # the relay benchmark's replicas run it without torch
    "flowgrpo.services.bench.relay",
]


def test_torch_free_modules_import_without_torch() -> None:
    code = (
        BLOCK_TORCH + "".join(f"import {m}\n" for m in TORCH_FREE) + "assert sys.modules['torch'] is None\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_configs_import_without_the_judge_clients_http_libraries() -> None:
    """The coordinator's image has no httpx or tenacity (the reward extra brings them); it still
    imports the reward configs, the judge's among them."""
    code = (
        "import sys; sys.modules['httpx'] = None; sys.modules['tenacity'] = None\n"
        "import flowgrpo.rewards.judge, flowgrpo.configs.run\n"
        "assert sys.modules['httpx'] is None and sys.modules['tenacity'] is None\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_cli_help_explains_itself() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flowgrpo.services.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "rollout" in out.stdout and "bench" in out.stdout and "examples:" in out.stdout
    assert all(command in out.stdout for command in ("train", "status", "trace", "data"))
