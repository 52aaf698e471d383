"""What a run was: ``<run_dir>/sessions.jsonl`` (one ``start`` and one ``end`` line per process that
trained in the folder: the command, the flowgrpo version, the git commit of the code, host,
Python, times and how it ended) and ``<run_dir>/recipe.yaml`` (the recipe as it resolved without
the command's overrides: what the report diffs the run's ``config.yaml`` against).

The command is kept with every override whose key names a secret emptied (the lock file keeps no
argv for that reason; here only the ``flowgrpo train`` command's own arguments are written).
Torch-free; read by ``flowgrpo report``."""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo import __version__
from flowgrpo.config import SECRET_FIELDS, dump_yaml

SESSIONS_FILE = "sessions.jsonl"
RECIPE_FILE = "recipe.yaml"


@dataclass(frozen=True)
class Invocation:
    """How ``flowgrpo train`` was called: the recipe file and the overrides after it."""

    recipe: str
    overrides: tuple[str, ...] = ()
    recipe_config: Any = None  # the recipe resolved without the overrides (a RunConfig)

    def command(self) -> str:
        return shlex.join(["flowgrpo", "train", self.recipe, *(redact_override(o) for o in self.overrides)])


@dataclass
class RunSession:
    """One process's life in a run folder (a resume is a new session)."""

    id: str
    command: str = ""
    version: str = ""
    git_commit: str = ""  # "": the code was no tracked file of a git checkout (an installed wheel)
    git_dirty: bool = False
    host: str = ""
    python: str = ""
    pid: int = 0
    started: float = 0.0
    ended: float | None = None  # None: still running, or killed before it could say
    status: str = ""  # success | interrupted | failed, or "" while unknown

    @property
    def wall_s(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


def redact_override(override: str) -> str:
    """``a.b.token=xyz`` -> ``a.b.token=***``: a secret never reaches a file."""
    key, sep, _ = override.partition("=")
    return f"{key}=***" if sep and key.rsplit(".", 1)[-1] in SECRET_FIELDS else override


def start_session(run_dir: str | Path, invocation: Invocation | None) -> RunSession:
    """Appends this process's ``start`` line (and writes ``recipe.yaml``); returns the session."""
    run_dir = Path(run_dir)
    commit, dirty = git_state(Path(__file__).resolve().parent)
    session = RunSession(
        id=uuid.uuid4().hex[:12],
        command=invocation.command() if invocation is not None else "",
        version=__version__,
        git_commit=commit,
        git_dirty=dirty,
        host=socket.gethostname(),
        python=platform.python_version(),
        pid=os.getpid(),
        started=time.time(),
    )
    if invocation is not None and invocation.recipe_config is not None:
        dump_yaml(invocation.recipe_config, run_dir / RECIPE_FILE)  # secrets emptied
    record = {"event": "start", **{k: v for k, v in vars(session).items() if k not in ("ended", "status")}}
    _append(run_dir, record)
    return session


def end_session(run_dir: str | Path, session: RunSession, status: str) -> None:
    session.ended, session.status = time.time(), status
    _append(Path(run_dir), {"event": "end", "id": session.id, "ended": session.ended, "status": status})


def read_sessions(run_dir: str | Path) -> list[RunSession]:
    """The folder's sessions in order of start; an unreadable line is skipped (a crash mid-write)."""
    path = Path(run_dir) / SESSIONS_FILE
    sessions: dict[str, RunSession] = {}
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == "start":
            known = {k: v for k, v in record.items() if k in RunSession.__dataclass_fields__}
            sessions[record["id"]] = RunSession(**known)
        elif record.get("event") == "end" and record.get("id") in sessions:
            sessions[record["id"]].ended = float(record["ended"])
            sessions[record["id"]].status = str(record["status"])
    return sorted(sessions.values(), key=lambda s: s.started)


def git_state(folder: Path) -> tuple[str, bool]:
    """(commit, has uncommitted changes) of the git checkout holding ``folder``; ("", False) when it
    is not in one (an installed wheel) or git is missing."""
    try:
        _git(folder, "ls-files", "--error-unmatch", Path(__file__).name)  # this code, not a venv inside
        commit = _git(folder, "rev-parse", "HEAD")
        dirty = bool(_git(folder, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "", False
    return commit, dirty


def _git(folder: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise subprocess.SubprocessError(done.stderr)
    return done.stdout.strip()


def _append(run_dir: Path, record: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / SESSIONS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
