"""``flowgrpo report`` on run folders made here (the demo's metric names and scales, no training):
what each panel holds, what is folded, the metadata and the config diff; and the page in a real
headless browser (Debian's chromium): it renders, logs no error, and the panels are drawn.
The report of a real run is checked in test_train.py."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from flowgrpo.services.coordinator.report import render, write_report
from flowgrpo.services.coordinator.report_data import (
    accuracy_panels,
    config_diff,
    grid_cells,
    grids,
    headline,
    load_runs,
    metadata_rows,
    paired_gain,
    scorer_panels,
    sections,
)
from flowgrpo.services.coordinator.runmeta import Invocation, end_session, read_sessions, start_session

CLI = [sys.executable, "-m", "flowgrpo.services.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
WEIGHTS = {"jpeg_compressibility": 1.0, "image_brightness": 0.0}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def config(lr: float, steps: int = STEPS) -> dict[str, Any]:
    return {
        "name": "tiny-demo",
        "schedule": {"mode": "sync", "steps": steps, "seed": 0},
        "trainer": {"optim": {"lr": lr}},
        "reward": {"scorers": [{"name": n, "weight": w} for n, w in WEIGHTS.items()]},
    }


def make_run(folder: Path, lr: float = 0.1) -> Path:
    """A finished run's folder as the coordinator leaves it: the reward (JPEG, about -0.0047 to
    -0.0037) rising unless lr = 0, brightness (about 0.6) watched at weight 0, a sync run's gap
    and lag at 0, grids with their captions, its session and its recipe."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config(lr)))
    (folder / "recipe.yaml").write_text(yaml.safe_dump(config(0.1, steps=40)))
    learnt = 1.0 if lr else 0.0
    lines = []
    for step in range(1, STEPS + 1):
        reward = -0.0047 + learnt * 0.001 * (step - 1) / (STEPS - 1)
        lines.append({"kind": "train", "step": step, "time": 1.8e9 + step,
                      "critic/rewards/mean": reward, "critic/rewards/min": reward - 2e-4,
                      "critic/rewards/max": reward + 2e-4, "critic/score/jpeg_compressibility/mean": reward,
                      "critic/score/image_brightness/mean": 0.6 * (1 + learnt * 0.25 * step / STEPS),
                      "actor/pg_loss": math.sin(step) * 1e-4, "actor/lr": lr,
                      "actor/rollout_logp_gap/mean": 0.0, "trainer/lag/max": 0.0,
                      "timing_s/step": 2.0 + 0.1 * step})  # fmt: skip
    for step in (0, STEPS):
        value = -0.00467 + learnt * 0.0012 * step / STEPS
        lines.append({"kind": "val", "step": step, "time": 1.8e9 + step,
                      "val-core/jpeg_compressibility/reward/mean@1": value,
                      "val-core/total/reward/mean@1": value,
                      "val-core/image_brightness/reward/mean@1": 0.7,
                      # a verifiable task's accuracy (the compose scorer's names) beside it
                      "val-aux/compose/accuracy/mean@1": 0.25 + learnt * 0.25 * step / STEPS,
                      "val-aux/compose/accuracy/two_object/mean@1": 0.5 + learnt * 0.5 * step / STEPS,
                      "val-aux/compose/met/count/mean@1": 0.9})  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    images = folder / "images"
    images.mkdir()
    for tag, step in [("val", 0), ("val", STEPS), *(("train", s) for s in range(1, STEPS + 1))]:
        pixels = np.full((16, 32, 3), (step * 30) % 256, dtype=np.uint8)
        pixels[:, 16:] = (step * 30 + 100) % 256  # the second cell differs from the first
        Image.fromarray(pixels).save(images / f"{tag}_{step:06d}.png")
        cells = [{"prompt": f"a <b>{tag}</b> prompt {i}", "reward": -0.0047 + step * 1e-5} for i in range(2)]
        (images / f"{tag}_{step:06d}.json").write_text(json.dumps({"columns": 2, "cells": cells}))
    invocation = Invocation("examples/tiny_jpeg.yaml", (f"trainer.optim.lr={lr}", "server.token=hunter2"))
    end_session(folder, start_session(folder, invocation), "success")
    return folder


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    return make_run(tmp_path / "trained")


@pytest.fixture
def control(tmp_path: Path) -> Path:
    return make_run(tmp_path / "control", lr=0.0)


def test_the_optimised_reward_has_its_own_panel_with_the_control(trained: Path, control: Path) -> None:
    runs = load_runs([trained, control])
    panel = headline(runs)
    assert panel["y"] == "reward"
    names = [t["name"] for t in panel["traces"]]
    assert names == [
        "trained",
        "trained: validation",
        "control (control, lr=0)",
        "control (control, lr=0): validation",
    ]
    # nothing of another scale shares its axis (brightness is 0.6: it would flatten the reward)
    assert all(v < 0 for t in panel["traces"] for v in t["y"] if v is not None)
    gain = paired_gain(runs)
    assert gain is not None
    [line] = gain["traces"]
    assert line["y"][0] == pytest.approx(0.0) and line["y"][-1] == pytest.approx(0.001 / 0.0047 * 100)
    assert paired_gain(load_runs([trained])) is None  # no control, no gain panel


def test_each_scorer_is_a_percent_change_on_its_own_axis(trained: Path) -> None:
    panels = {p["title"]: p for p in scorer_panels(load_runs([trained]))}
    assert set(panels) == {"jpeg_compressibility (optimised)",
                           "image_brightness (weight 0: watched, not optimised)"}  # fmt: skip
    brightness = panels["image_brightness (weight 0: watched, not optimised)"]["traces"][0]
    first, last = 0.6 * (1 + 0.25 / STEPS), 0.6 * 1.25
    assert brightness["y"][0] == 0.0 and brightness["y"][-1] == pytest.approx((last - first) / first * 100)


def test_every_metric_is_reachable_and_the_flat_ones_are_folded(trained: Path, control: Path) -> None:
    found = sections(load_runs([trained, control]))
    plotted = {p["title"] for s in found for p in s.panels}
    flat = dict(item for s in found for item in s.flat)
    keys = {k for line in (trained / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    assert keys - {"kind", "step", "time"} == plotted | set(flat)
    assert flat == {"actor/rollout_logp_gap/mean": "0 throughout", "trainer/lag/max": "0 throughout",
                    "val-core/image_brightness/reward/mean@1": "0.7 throughout",
                    "val-aux/compose/met/count/mean@1": "0.9 throughout"}  # fmt: skip
    assert "actor/lr" in plotted  # 0.1 in one run and 0 in the other: that says something
    assert [s.name for s in found][:2] == ["critic", "actor"]
    alone = {item[0] for s in sections(load_runs([trained])) for item in s.flat}
    assert "actor/lr" in alone  # one run: flat at 0.1


def test_held_out_accuracy_per_category_and_each_prompt_above_its_images(
    trained: Path, control: Path
) -> None:
    runs = load_runs([trained, control])
    panels = {p["title"]: p for p in accuracy_panels(runs)}
    assert set(panels) == {"compose: all categories", "compose: two object"}  # met/... is not accuracy
    trained_line, control_line = panels["compose: two object"]["traces"]
    assert trained_line["x"] == [0, STEPS] and trained_line["y"] == [50.0, 100.0]  # in %
    assert control_line["name"] == "control (control, lr=0)" and control_line["y"] == [50.0, 50.0]
    assert control_line["dash"] == "dash" and "dash" not in trained_line
    assert accuracy_panels(load_runs([trained]))[0]["traces"][0]["y"] == [25.0, 50.0]
    # the grid's cells cut out again: the first validation's two prompts, each its own image
    first, last = grids(runs[0], "val")
    for grid in (first, last):
        cells = [np.asarray(Image.open(io.BytesIO(base64.b64decode(c)))) for c in grid_cells(grid)]
        assert [c.shape for c in cells] == [(16, 16, 3)] * 2
        assert [int(c.mean()) for c in cells] == [(grid.step * 30) % 256, (grid.step * 30 + 100) % 256]
    page = render(runs)
    # each prompt above its two images (step 0 and the last), then its rewards
    card = re.search(r"<figure class='cell'><figcaption>a &lt;b&gt;val&lt;/b&gt; prompt 1</figcaption>"
                     r"<div><img alt='step 0' src='data:image/png;base64,([^']+)'>"
                     rf"<img alt='step {STEPS}' src='data:image/png;base64,([^']+)'></div>",
                     page)  # fmt: skip
    assert card is not None
    assert card.groups() == (grid_cells(first)[1], grid_cells(last)[1])
    assert "Held-out accuracy, by category" in page


def test_the_metadata_and_the_config_against_its_recipe(trained: Path) -> None:
    [session] = read_sessions(trained)
    assert session.command == (
        "flowgrpo train examples/tiny_jpeg.yaml trainer.optim.lr=0.1 'server.token=***'"
    )  # the secret never reaches the file
    assert "hunter2" not in (trained / "sessions.jsonl").read_text()
    assert session.status == "success" and session.wall_s is not None and session.wall_s >= 0
    rows = dict(metadata_rows(load_runs([trained])))
    assert rows["command"] == [session.command] and rows["sessions"] == ["success"]
    assert rows["host"][0] and rows["version"] == ["0.1.0"]
    code = "services/coordinator/runmeta.py"
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--error-unmatch", code],
                             capture_output=True).returncode == 0  # fmt: skip
    if tracked:  # a checkout (CI's clone): the commit the code is at; an installed wheel has none
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert rows["git commit"][0].split()[0] == head.stdout.strip()
    run = load_runs([trained])[0]
    assert run.recipe is not None
    assert config_diff(run.recipe, run.config) == [("schedule.steps", "40", "8")]


def test_the_page_is_self_contained_and_overlays_runs(trained: Path, control: Path, tmp_path: Path) -> None:
    out = tmp_path / "both.html"
    done = subprocess.run([*CLI, "report", str(trained), str(control), "--out", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=['"]?(https?:)?//""", page)  # nothing fetched
    assert "Plotly.react" in page and "plotly.js v" in page  # the library is inside
    assert "<b>val</b>" not in page and "a &lt;b&gt;val&lt;/b&gt; prompt 0" in page  # prompts escaped
    assert "trained against control" in page
    assert "<h3>control against trained</h3>" in page and "trainer.optim.lr" in page
    assert write_report(trained) == trained / "report.html"  # one run: into its own folder


def browse(page: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
               "--virtual-time-budget=20000", *flags, page.as_uri()]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)")
def test_the_page_renders_in_a_headless_browser(trained: Path, control: Path, tmp_path: Path) -> None:
    runs = load_runs([trained, control])
    page = tmp_path / "report.html"
    page.write_text(render(runs))
    dom = browse(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    [body] = re.findall(r"<body([^>]*)>", dom.stdout)
    errors = re.search(r'data-errors="([^"]*)"', body)
    assert errors is not None, f"the page's script did not finish: {body}"
    assert json.loads(errors.group(1).replace("&quot;", '"')) == []
    assert not re.findall(r"CONSOLE.*(Uncaught|Error)", dom.stderr), dom.stderr[-2000:]
    # every panel of an open section is drawn (the folded ones are drawn when opened)
    drawn = int(re.search(r'data-drawn="(\d+)"', body).group(1))  # type: ignore[union-attr]
    visible = 2 + len(accuracy_panels(runs)) + len(scorer_panels(runs))
    visible += sum(len(s.panels) for s in sections(runs))
    assert drawn == visible and drawn >= 8
    assert len(re.findall(r"class=\"main-svg\"", dom.stdout)) >= 2 * drawn  # plotly's svg layers
    assert "Optimised reward (critic/rewards/mean)" in dom.stdout
    # the training grids' slider has filled its image and its captions
    assert (
        re.search(r"<b class=\"step\">step 8</b>", dom.stdout)
        and "a &lt;b&gt;train&lt;/b&gt; prompt 1" in dom.stdout
    )
    shot = tmp_path / "report.png"
    done = browse(page, "--hide-scrollbars", "--window-size=1300,1400", f"--screenshot={shot}")
    assert done.returncode == 0 and shot.is_file()
    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.std() > 10  # not a blank page


def test_a_run_from_before_sessions_and_recipe_still_reports(trained: Path) -> None:
    (trained / "sessions.jsonl").unlink()
    (trained / "recipe.yaml").unlink()
    runs = load_runs([trained])
    rows = dict(metadata_rows(runs))
    assert rows["sessions"] == ["not recorded (a run from before sessions.jsonl)"]
    assert rows["wall time"] == [
        f"{STEPS - 1 + 2.1:.0f} s of steps"
    ]  # the first step's start to the last's end
    assert "no recipe.yaml in the folder" in render(runs)
