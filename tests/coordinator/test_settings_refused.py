"""A replica started from another recipe is refused at its READY handshake, end to end: a real
trainer process started as compose or Kubernetes start one (``flowgrpo serve trainer --recipe R
coordinator=HOST:PORT``) but with ``trainer.loss.clip_eps=0.0001``, against a real coordinator of
the same recipe (``flowgrpo train R launch.launcher=remote``, clip_eps 0.01):

- registering (no addresses): it gets no slot, its log says the coordinator refused it and why,
  and the run fails at start-up naming the key and both values;
- at a configured address: the run fails at once, with the same sentence;
- brought back for a dead trainer (``RemoteTrainer.revive``): it is not taken, and the run's
  error says why.

One trainer process serves the three (its start is most of the time).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowgrpo.configs.run import load_run_config
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.runtime import wait_ready
from flowgrpo.services.coordinator.handles import Replica
from flowgrpo.services.coordinator.launch import RemoteTrainer, run_settings
from flowgrpo.services.coordinator.pool import RunError
from flowgrpo.services.coordinator.registry import CoordinatorService

CLI = [sys.executable, "-m", "flowgrpo.services.cli"]  # the flowgrpo command of this interpreter
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"  # trainer.loss.clip_eps: 1.0e-2
OTHER = "trainer.loss.clip_eps=0.0001"
REPLICA = "trainer-other"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def refusal(address: str) -> str:
    """What the coordinator says of the trainer at ``address``."""
    return (
        f"trainer {REPLICA} at {address} was started with trainer.loss.clip_eps=0.0001, the run's recipe "
        "has 0.01: start it with the run's recipe (the only differing setting)"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def other_trainer(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    """The trainer of another clip_eps, ready: its address, the port of the coordinator it
    registers with (none listens there until a test starts one), and its log."""
    folder = tmp_path_factory.mktemp("other-trainer")
    coordinator_port, ready, log_path = free_port(), folder / "ready.json", folder / "trainer.log"
    cmd = [*CLI, "serve", "trainer", "--recipe", str(RECIPE), f"coordinator=127.0.0.1:{coordinator_port}",
           f"replica_id={REPLICA}", f"run_dir={folder}", f"server.ready_file={ready}", "log_format=text",
           f"trainer.checkpoint={tiny}", f"trainer.checkpoint_dir={folder / 'ckpt'}", OTHER]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not ready.is_file():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer wrote no ready file in 120 s"
            time.sleep(0.1)
        address = json.loads(ready.read_text())["grpc_address"]
        asyncio.run(wait_ready(address, role="trainer", timeout_s=120))
        yield address, coordinator_port, log_path
    finally:
        proc.terminate()  # only the process this fixture started
        proc.wait(timeout=60)


def train(run_dir: Path, tiny: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [*CLI, "train", str(RECIPE), f"run_dir={run_dir}", f"model.checkpoint={tiny}",
           "launch.launcher=remote", *overrides]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return done, time.monotonic() - started


@pytest.mark.timeout(300)
def test_a_registering_trainer_of_another_recipe_gets_no_slot_and_the_run_says_why(
    other_trainer: tuple[str, int, Path], tiny: Path, tmp_path: Path
) -> None:
    address, port, log_path = other_trainer
    done, _ = train(tmp_path, tiny, f"server.port={port}", "launch.start_timeout_s=6")
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flowgrpo train: launch.launcher=remote waited launch.start_timeout_s=6 s "), last
    assert f"registered: rollout: none; reward: none; trainer: none; refused: {refusal(address)}. " in last
    # said at once in the coordinator's log, once, although the trainer tries every ~2 s
    assert done.stderr.count(f"refused a registration: {refusal(address)}") == 1, done.stderr[-3000:]
    said = log_path.read_text()
    assert f"the coordinator at 127.0.0.1:{port} refused this replica (INVALID_ARGUMENT: " in said
    assert refusal(address) in said


@pytest.mark.timeout(300)
def test_a_trainer_of_another_recipe_at_the_configured_address_fails_the_start_at_once(
    other_trainer: tuple[str, int, Path], tiny: Path, tmp_path: Path
) -> None:
    """The rollout and reward addresses answer nothing: the trainer's refusal ends the start
    without waiting for them (launch.start_timeout_s=120)."""
    address, _, _ = other_trainer
    nobody = f"127.0.0.1:{free_port()}"
    addresses = [f"launch.trainer_address={address}", f"launch.rollout_addresses=[{nobody}]",
                 f"launch.reward_addresses=[{nobody}]"]  # fmt: skip
    done, wall = train(tmp_path, tiny, *addresses, "launch.start_timeout_s=120")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"flowgrpo train: {refusal(address)}"
    assert wall < 60, f"{wall:.0f} s"


def test_a_trainer_of_another_recipe_is_not_taken_for_a_dead_one(
    other_trainer: tuple[str, int, Path], tiny: Path
) -> None:
    address, _, _ = other_trainer
    overrides = [f"model.checkpoint={tiny}", "launch.launcher=remote", f"launch.trainer_address={address}",
                 "launch.rollout_addresses=[h:1]", "launch.reward_addresses=[h:2]",
                 "launch.trainer_rejoin_timeout_s=3"]  # fmt: skip
    cfg = load_run_config(RECIPE, overrides)

    async def revive() -> None:
        source = RemoteTrainer(cfg, CoordinatorService("run-1", settings=run_settings(cfg)))
        try:
            await source.revive(Replica("trainer", "trainer-0", "127.0.0.1:1", None))
        finally:
            await source.close()

    with pytest.raises(RunError) as error:
        asyncio.run(revive())
    assert str(error.value).startswith("no trainer answered within launch.trainer_rejoin_timeout_s=3 s")
    assert str(error.value).endswith(f"; refused: {refusal(address)}")
