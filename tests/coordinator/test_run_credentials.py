"""A local run's own credentials: kept for its user in ``<run_dir>/credentials.json`` (0600) while
it goes, read by ``flowgrpo status RUN_DIR`` (the live view) and ``flowgrpo serve ... run_dir=``
(a replica that joins it); never in config.yaml, a log or any other file; removed at the end.
The file's checks (mode, owner, link, fields) as units; then a real local run of the tiny demo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.runtime.credentials import (
    CredentialsFileError,
    RunCredentials,
    credentials_path,
    read_run_credentials,
    use_run_credentials,
    write_run_credentials,
)
from flowgrpo.services.coordinator.outputs import read_metrics
from flowgrpo.services.coordinator.status import live_status
from flowgrpo.telemetry import read_spans

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
CLI = [sys.executable, "-m", "flowgrpo.services.cli"]
TOKEN, SECRET = "t" * 43, "s" * 43
SECRET_NAMES = ("FLOWGRPO_TOKEN", "FLOWGRPO_TOKEN_FILE", "FLOWGRPO_BUS_SECRET", "FLOWGRPO_BUS_SECRET_FILE")


def no_credentials_env() -> dict[str, str]:
    """This environment without any run credential: a user's fresh shell."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_NAMES}


def test_the_file_is_0600_and_reads_back(tmp_path: Path) -> None:
    path = write_run_credentials(tmp_path, RunCredentials(token=TOKEN, bus_secret=SECRET))
    assert path == tmp_path / "credentials.json" and path.stat().st_mode & 0o777 == 0o600
    assert read_run_credentials(tmp_path) == RunCredentials(token=TOKEN, bus_secret=SECRET)
    assert TOKEN not in repr(read_run_credentials(tmp_path))  # a log line or a traceback shows none
    write_run_credentials(tmp_path, RunCredentials(token=TOKEN))  # replaced whole, still 0600
    assert read_run_credentials(tmp_path) == RunCredentials(token=TOKEN)
    assert path.stat().st_mode & 0o777 == 0o600 and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert read_run_credentials(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = write_run_credentials(tmp_path, RunCredentials(token=TOKEN))
    path.chmod(mode)
    with pytest.raises(CredentialsFileError, match=f"mode {mode:04o} lets others read"):
        read_run_credentials(tmp_path)


def test_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = write_run_credentials(tmp_path, RunCredentials(token=TOKEN)).rename(tmp_path / "other")
    run = tmp_path / "run"
    run.mkdir()
    credentials_path(run).symlink_to(elsewhere)
    with pytest.raises(CredentialsFileError, match="cannot open it"):
        read_run_credentials(run)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not the JSON"),
        ('["a"]', "keys version, token, bus_secret"),
        (json.dumps({"version": 1, "token": TOKEN}), "keys version, token, bus_secret"),
        (json.dumps({"version": 1, "token": TOKEN, "bus_secret": "", "x": 1}), "keys version"),
        (json.dumps({"version": 2, "token": TOKEN, "bus_secret": ""}), "version 2"),
        (json.dumps({"version": 1, "token": 7, "bus_secret": ""}), "a string expected"),
        (json.dumps({"version": 1, "token": "short", "bus_secret": ""}), "5 characters; 16-512"),
        (json.dumps({"version": 1, "token": "x" * 513, "bus_secret": ""}), "513 characters"),
        (json.dumps({"version": 1, "token": TOKEN, "bus_secret": "a b" * 8}), "without spaces"),
        (json.dumps({"version": 1, "token": "é" * 20, "bus_secret": ""}), "not the JSON|ASCII"),
        ("x" * 5000, "more than 4096 bytes"),
    ],
)
def test_a_malformed_file_is_refused_naming_it(tmp_path: Path, content: str, message: str) -> None:
    path = credentials_path(tmp_path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(content)
    with pytest.raises(CredentialsFileError, match=message) as error:
        read_run_credentials(tmp_path)
    assert str(path) in str(error.value)


def test_serve_takes_only_what_the_environment_does_not_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_run_credentials(tmp_path, RunCredentials(token=TOKEN, bus_secret=SECRET))
    for name in SECRET_NAMES:  # set, then removed: monkeypatch restores only what it saw change
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("FLOWGRPO_BUS_SECRET_FILE", str(tmp_path / "mine"))  # the operator's own
    assert use_run_credentials(tmp_path, need_token=True, need_bus_secret=True) == ["FLOWGRPO_TOKEN"]
    assert os.environ["FLOWGRPO_TOKEN"] == TOKEN and "FLOWGRPO_BUS_SECRET" not in os.environ
    monkeypatch.setenv("FLOWGRPO_TOKEN", "given-by-the-operator")
    assert use_run_credentials(tmp_path, need_token=True, need_bus_secret=True) == []
    assert os.environ["FLOWGRPO_TOKEN"] == "given-by-the-operator"
    assert use_run_credentials(tmp_path / "no-run", need_token=True, need_bus_secret=True) == []


# --- a live local run -----------------------------------------------------------------------------


def files_holding(run_dir: Path, *secrets: str) -> list[str]:
    """Every file of the run folder whose bytes contain one of ``secrets``."""
    found = []
    for path in run_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if any(s.encode() in data for s in secrets):
                found.append(str(path.relative_to(run_dir)))
    return found


def wait_until(check: object, what: str, proc: subprocess.Popen[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not callable(check) or not check():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def status_of(run_dir: Path) -> str:
    done = subprocess.run([*CLI, "status", str(run_dir)], capture_output=True, text=True, timeout=60,
                          env=no_credentials_env(), cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_status_shows_a_live_local_run_with_its_own_token_kept_0600_in_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flowgrpo status RUN_DIR`` from a shell with no credential shows the live view of a local
    run that made its own token; ``flowgrpo serve reward ... run_dir=RUN_DIR`` joins it with the
    run's credentials from the same file (its gRPC token and bus secret are checked by the run);
    neither secret is in any other file of the run folder, nor in a log; the file goes at the end."""
    for name in SECRET_NAMES:
        monkeypatch.delenv(name, raising=False)
    tiny = make_tiny_bagel(tmp_path / "model", seed=0)
    run_dir = tmp_path / "run"
    # 2 prompts x 4 samples a step: the run must outlast the joined reward's start (from step 1)
    # and its first scores; on the loaded 2-core machine it was in status 4 s after its start, at
    # step 2 of 10
    cmd = [*CLI, "train", str(RECIPE), f"run_dir={run_dir}", f"model.checkpoint={tiny}", "schedule.steps=10",
           "schedule.save_every=3", "schedule.eval_every=0", "data.group_size=4",
           "launch.launcher=local"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=no_credentials_env(), start_new_session=True)  # fmt: skip
    joined: subprocess.Popen[bytes] | None = None
    try:
        wait_until(lambda: any(r["step"] >= 1 for r in read_metrics(run_dir)), "step 1", proc)
        path = run_dir / "credentials.json"
        assert path.stat().st_mode & 0o777 == 0o600 and run_dir.stat().st_mode & 0o777 == 0o700
        credentials = json.loads(path.read_text())
        token, secret = credentials["token"], credentials["bus_secret"]
        assert len(token) >= 32 and len(secret) >= 32 and token != secret
        address = json.loads((run_dir / "services" / "coordinator.ready.json").read_text())["grpc_address"]
        # a replica that joins the run from this host, given only the run folder (started first: its
        # start overlaps the checks of the live view below)
        serve = [*CLI, "serve", "reward", "--recipe", str(RECIPE), f"coordinator={address}",
                 "replica_id=reward-joined", f"run_dir={run_dir}", "log_format=text"]  # fmt: skip
        log = (tmp_path / "joined.log").open("wb")
        joined = subprocess.Popen(
            serve, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=no_credentials_env()
        )
        joined_at = time.monotonic()
        # without the token the coordinator answers nothing; status finds it in the run folder
        assert "the live view needs the run's token" in live_status(address)
        shown = status_of(run_dir)
        assert f"coordinator at {address}: run tiny-jpeg-" in shown and "step " in shown, shown
        for replica in ("rollout-0", "reward-0", "trainer"):
            assert any(line.split()[:2] == [replica, replica.split("-")[0]] for line in shown.splitlines()), (
                replica,
                shown,
            )
        wait_until(lambda: "reward-joined" in status_of(run_dir), "the joined reward in status", proc, 120)
        print(f"the joined reward was in status {time.monotonic() - joined_at:.1f} s after it was started, "
              f"at step {len(read_metrics(run_dir))} of 10")  # fmt: skip
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if joined is not None:
            joined.terminate()
            joined.wait(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 11))
    joined_log = (tmp_path / "joined.log").read_text()
    assert "FLOWGRPO_TOKEN and FLOWGRPO_BUS_SECRET from the run's credentials file" in joined_log
    # it scored images it fetched from the rollouts' bus stores (CURVE: the run's bus secret)
    spans = read_spans(str(run_dir))
    scored = [s for s in spans if s["resource"].get("service.instance.id") == "reward-joined"
              and s["name"] == "reward.score"]  # fmt: skip
    assert scored, joined_log[-3000:]
    assert not path.exists(), "the credentials outlived the run"
    everything = [stdout, stderr, joined_log]
    assert not any(token in text or secret in text for text in everything)
    assert (run_dir / "config.yaml").is_file() and list((run_dir / "logs").glob("*.log"))
    assert files_holding(run_dir, token, secret) == []
