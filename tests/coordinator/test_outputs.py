"""The run's progress on the terminal: a bar with the key metrics, or one line per step."""

from __future__ import annotations

import io
from pathlib import Path

from flowgrpo.services.coordinator.config import LoggerConfig
from flowgrpo.services.coordinator.outputs import RunOutputs


def progress(tmp_path: Path, mode: str, stream: io.StringIO) -> str:
    outputs = RunOutputs(tmp_path, stream, LoggerConfig(progress=mode))  # type: ignore[arg-type]
    outputs.start_progress(done=1, total=3)  # resumed after step 1
    for step in (2, 3):
        outputs.step_done(f"step {step}/3  reward +0.5", {"reward": f"+0.{step}", "lag": "0"})
    outputs.say("  validation: val-core/x/reward/mean@1 +0.9")
    outputs.close()
    return stream.getvalue()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_with_the_key_metrics(tmp_path: Path) -> None:
    shown = progress(tmp_path, "auto", Terminal())
    assert "3/3" in shown and "reward=+0.3" in shown and "lag=0" in shown
    assert "  validation: val-core/x/reward/mean@1 +0.9" in shown  # printed above the bar
    assert "step 2/3" not in shown


def test_a_log_file_gets_one_line_per_step(tmp_path: Path) -> None:
    shown = progress(tmp_path, "auto", io.StringIO())
    assert shown.splitlines() == ["step 2/3  reward +0.5", "step 3/3  reward +0.5",
                                  "  validation: val-core/x/reward/mean@1 +0.9"]  # fmt: skip
    assert progress(tmp_path, "bar", io.StringIO()).count("reward=+0.") >= 2  # asked for: a bar anyway
    assert progress(tmp_path, "none", Terminal()) == ""
