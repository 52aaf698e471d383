"""A run's own credentials on its host: ``<run_dir>/credentials.json``.

The ``local`` and ``inprocess`` launchers make a token and a bus secret for their run (unless the
environment gives them). They keep them in this one file of the run folder, mode 0600 (the run
folder itself is 0700), for as long as the run goes, so that other commands of the same user on
the same host can reach the run: ``flowgrpo status RUN_DIR`` (the live view: the coordinator's
RunStatus needs the token) and ``flowgrpo serve ROLE ... run_dir=RUN_DIR`` (a replica that joins
the run: gRPC token and bus secret). ``flowgrpo trace`` reads only the run's trace files and needs
no credential. The file is removed when the run ends; it is never in config.yaml, a log, a
command line or an environment dump. Credentials the operator gave (``FLOWGRPO_TOKEN``, ...) are
not written: the operator has them.

A reader refuses a file that is not a regular file of this user with no group or other
permission bits (a leaked credential), or whose fields are not what a launcher writes.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo.bus.config import SECRET_ENV, SECRET_FILE_ENV
from flowgrpo.runtime.security import TOKEN_ENV, TOKEN_FILE_ENV

log = logging.getLogger(__name__)

FILE_NAME = "credentials.json"
VERSION = 1
MAX_FILE_BYTES = 4096
MIN_SECRET_CHARS, MAX_SECRET_CHARS = 16, 512


class CredentialsFileError(ValueError):
    """The run's credentials file is unsafe or malformed: it names the file and the fix."""


@dataclass(frozen=True)
class RunCredentials:
    """What a launcher made for its run; "" for what it did not make (the operator gave it)."""

    token: str = ""
    bus_secret: str = ""

    def __post_init__(self) -> None:
        for name in ("token", "bus_secret"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise CredentialsFileError(f"{name}: a string expected, got {type(value).__name__}")
            if value and not (MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS):
                raise CredentialsFileError(
                    f"{name}: {len(value)} characters; {MIN_SECRET_CHARS}-{MAX_SECRET_CHARS} expected"
                )
            if value and not all(33 <= ord(c) <= 126 for c in value):
                raise CredentialsFileError(f"{name}: printable ASCII without spaces expected")

    def __repr__(self) -> str:  # never the values, in a log or a traceback
        shown = {name: "<set>" if getattr(self, name) else "" for name in ("token", "bus_secret")}
        return f"RunCredentials(token={shown['token']!r}, bus_secret={shown['bus_secret']!r})"

    def __bool__(self) -> bool:
        return bool(self.token or self.bus_secret)


def credentials_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / FILE_NAME


def write_run_credentials(run_dir: str | Path, credentials: RunCredentials) -> Path:
    """Write ``credentials`` to the run folder, 0600, atomically (a reader sees the old file or
    the whole new one); its path. A file left by an earlier run is replaced."""
    path = credentials_path(run_dir)
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    data = json.dumps({"version": VERSION, "token": credentials.token, "bus_secret": credentials.bus_secret})
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_run_credentials(run_dir: str | Path) -> None:
    credentials_path(run_dir).unlink(missing_ok=True)


def read_run_credentials(run_dir: str | Path) -> RunCredentials | None:
    """The credentials of the run in ``run_dir``; None when it has no such file (not a local run,
    one that has ended, or one whose operator gave the credentials). Raises CredentialsFileError
    for a file that is unsafe to trust or not one a launcher wrote."""
    path = credentials_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:  # ELOOP: a symbolic link
        raise CredentialsFileError(
            f"{path}: cannot open it ({error.strerror}); a launcher writes a regular file"
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CredentialsFileError(f"{path}: not a regular file")
        if info.st_uid != os.geteuid():
            raise CredentialsFileError(
                f"{path}: owned by uid {info.st_uid}, not by this user ({os.geteuid()})"
            )
        if info.st_mode & 0o077:
            raise CredentialsFileError(
                f"{path}: mode {stat.S_IMODE(info.st_mode):04o} lets others read the run's credentials; "
                "consider them leaked: stop the run, delete the file and start it again (new credentials)"
            )
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise CredentialsFileError(f"{path}: more than {MAX_FILE_BYTES} bytes")
    return _parse(path, raw)


def _parse(path: Path, raw: bytes) -> RunCredentials:
    try:
        data: Any = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise CredentialsFileError(f"{path}: not the JSON a launcher writes") from None
    if not isinstance(data, dict) or set(data) != {"version", "token", "bus_secret"}:
        raise CredentialsFileError(f"{path}: keys version, token, bus_secret expected")
    if data["version"] != VERSION:
        raise CredentialsFileError(f"{path}: version {data['version']!r}; this flowgrpo reads {VERSION}")
    try:
        return RunCredentials(token=data["token"], bus_secret=data["bus_secret"])
    except CredentialsFileError as error:
        raise CredentialsFileError(f"{path}: {error}") from None


def token_given() -> bool:
    """Whether the environment already names a token (the operator's, or a launcher's)."""
    return bool(os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV))


def bus_secret_given() -> bool:
    return bool(os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV))


def use_run_credentials(run_dir: str | Path, need_token: bool, need_bus_secret: bool) -> list[str]:
    """Put the run's credentials from its file into this process's environment, for what is
    needed and not already given there (the environment wins); the names set. Nothing when the
    run folder has no credentials file."""
    if not (need_token or need_bus_secret):
        return []
    credentials = read_run_credentials(run_dir)
    if credentials is None:
        return []
    wanted = {TOKEN_ENV: (need_token and not token_given(), credentials.token),
              SECRET_ENV: (need_bus_secret and not bus_secret_given(), credentials.bus_secret)}  # fmt: skip
    names = [name for name, (want, value) in wanted.items() if want and value]
    for name in names:
        os.environ[name] = wanted[name][1]
    if names:
        log.info("%s from the run's credentials file %s", " and ".join(names), credentials_path(run_dir))
    return names
