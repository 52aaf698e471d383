"""No traceback at the CLI boundary: each failure a user meets at start-up, provoked for real
(a port held by another socket, a plug-in file that does not exist, a checkpoint folder that does
not exist, a launched service that dies while starting), prints one line and an exit status;
``--debug`` prints the traceback first, then the same line."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services import cli

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "flowgrpo.services.cli"]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
MISSING_PLUGIN = "reward.scorers=[{name: mine, plugin: /no/such/dir/reward.py:score}]"


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("model"), seed=0)


def flowgrpo(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def error_lines(stderr: str) -> list[str]:
    """stderr without the services' own JSON log lines (they log as they start)."""
    return [line for line in stderr.splitlines() if line and not line.startswith('{"time"')]


def test_a_port_in_use_is_one_line(held_port: int) -> None:
    done = flowgrpo("serve", "reward", f"server.port={held_port}")
    assert done.returncode == 1
    assert error_lines(done.stderr) == [
        f"flowgrpo serve reward: cannot bind reward to 127.0.0.1:{held_port}: Address already in use "
        "(another process holds it: choose another server.port, or 0 for a free one)"
    ]


def test_debug_prints_the_traceback_then_the_same_line(held_port: int) -> None:
    for argv in (["--debug", "serve", "reward"], ["serve", "reward", "--debug"]):
        done = flowgrpo(*argv, f"server.port={held_port}")
        lines = error_lines(done.stderr)
        assert done.returncode == 1
        assert lines[0] == "Traceback (most recent call last):" and "OSError: cannot bind reward" in lines[-2]
        assert lines[-1].startswith(f"flowgrpo serve reward: cannot bind reward to 127.0.0.1:{held_port}")


def test_the_coordinators_port_in_use_is_one_line(held_port: int, tiny: Path, tmp_path: Path) -> None:
    done = flowgrpo("train", str(RECIPE), f"run_dir={tmp_path / 'run'}", f"model.checkpoint={tiny}",
                    f"server.port={held_port}")  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert error_lines(done.stderr)[-1] == (
        f"flowgrpo train: cannot bind coordinator to 127.0.0.1:{held_port}: Address already in use "
        "(another process holds it: choose another server.port, or 0 for a free one)"
    )


def test_a_missing_plugin_file_is_one_line(tmp_path: Path) -> None:
    done = flowgrpo("serve", "reward", MISSING_PLUGIN, cwd=tmp_path)
    assert done.returncode == 2  # the input is wrong
    assert error_lines(done.stderr) == [
        f"flowgrpo serve reward: plug-in file /no/such/dir/reward.py does not exist (cwd {tmp_path})"
    ]


def test_a_launched_service_that_dies_starting_is_quoted_from_its_log(tiny: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = flowgrpo("train", str(RECIPE), f"run_dir={run_dir}", f"model.checkpoint={tiny}", MISSING_PLUGIN)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert error_lines(done.stderr)[-1] == (
        "flowgrpo train: reward-0 exited with status 2 while starting; its log ends: flowgrpo serve "
        f"reward: plug-in file /no/such/dir/reward.py does not exist (cwd {ROOT}) "
        f"(all of it: {run_dir / 'logs' / 'reward-0.log'})"
    )
    assert "Traceback" in (run_dir / "logs" / "reward-0.log").read_text()  # the launcher runs it --debug


def test_a_missing_checkpoint_is_one_line(tmp_path: Path) -> None:
    done = flowgrpo("serve", "trainer", f"trainer.checkpoint={tmp_path / 'none'}")
    assert done.returncode == 1
    assert error_lines(done.stderr) == [
        f"flowgrpo serve trainer: {tmp_path / 'none'}/ema.safetensors does not exist"
    ]


def test_an_unexpected_error_names_its_type_and_the_debug_flag(capsys: pytest.CaptureFixture[str]) -> None:
    def broken(_: argparse.Namespace) -> int:
        return {}["missing"]  # type: ignore[no-any-return]

    args = argparse.Namespace(fn=broken, command="status", debug=False)
    assert cli._at_the_boundary(args) == 1
    assert capsys.readouterr().err == (
        "flowgrpo status: KeyError: 'missing' (an unexpected error: --debug shows the traceback)\n"
    )


def test_a_long_message_stays_one_bounded_line() -> None:
    line = cli.error_line(OSError("cannot read\n" + "x" * 10_000))
    assert "\n" not in line and len(line) <= 2000 and line.startswith("cannot read xxx")


def test_a_missing_prompt_folder_names_the_key(tiny: Path, tmp_path: Path) -> None:
    done = flowgrpo("train", str(RECIPE), f"run_dir={tmp_path / 'run'}", f"model.checkpoint={tiny}",
                    f"data.prompts={tmp_path / 'none'}")  # fmt: skip
    assert done.returncode == 1
    assert error_lines(done.stderr)[-1] == (
        f"flowgrpo train: data.prompts={tmp_path / 'none'}: no train.txt and no test.txt there; the "
        "folder needs train.txt and test.txt, one prompt per line"
    )


def test_every_command_prints_its_help() -> None:
    """argparse formats help text with %: a bare percent sign in one (`50%/90%`) made
    `flowgrpo bench --help` a traceback."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "bench" in commands.choices
    for name, command in commands.choices.items():
        assert name in command.format_help(), name
    parser.format_help()
