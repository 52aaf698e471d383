"""Shared-memory segments: files under /dev/shm that a producer writes and a consumer maps.

Why files and not ``multiprocessing.shared_memory``: its resource tracker unlinks segments
when the *consumer* exits, taking data from under other consumers. Here only the producing
store unlinks (on release, evict or close); a mapping outlives the unlink, so a consumer's view
stays valid after the producer released the data.

Segments are created with ``os.open`` (mode 0600) + ``posix_fallocate`` + ``mmap``.
``posix_fallocate`` reserves the pages up front: a plain ``ftruncate`` on a full tmpfs lets
the first write die of SIGBUS instead of failing cleanly.

Names are ``flowgrpo-bus-<pid namespace>-<pid>-<random>``, so a new store can remove the files
of dead processes of its own pid namespace (a crash skips cleanup) without touching files of a
container that shares /dev/shm but not the pid numbering. A server's ipc socket folder is named
the same way, for the same reason (a killed server leaves its folder in /tmp).

Same-host detection: a store writes a probe file holding a random token; a client that reads
the same token from its own shm folder shares the producer's /dev/shm (same host, same IPC
namespace) and may map segments; otherwise it uses the socket.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

PREFIX = "flowgrpo-bus-"
PROBE_SUFFIX = ".probe"
IPC_SOCKET = "store.sock"  # the one file in a server's ipc folder
_NAME = re.compile(r"flowgrpo-bus-\d+-\d+-[0-9a-f]+(\.probe)?")


def _namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def new_name(suffix: str = "") -> str:
    return f"{PREFIX}{_namespace()}-{os.getpid()}-{secrets.token_hex(8)}{suffix}"


def valid_name(name: str) -> bool:
    """True for names this module makes: a peer cannot point a consumer at other files."""
    return _NAME.fullmatch(name) is not None


def create(folder: str, nbytes: int) -> tuple[str, npt.NDArray[np.uint8]]:
    """A new segment of ``nbytes`` (> 0): its name and a writable flat uint8 view of it.

    Raises OSError (ENOSPC when the folder is full); nothing is left behind then.
    """
    name = new_name()
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        unlink(folder, name)
        raise
    finally:
        os.close(fd)
    return name, np.frombuffer(mapping, dtype=np.uint8, count=nbytes)


def open_private(folder: str, name: str, nbytes: int) -> npt.NDArray[np.uint8]:
    """Map segment ``name`` copy-on-write: a writable view, private to this process, no copy.

    The mapping is unmapped when the last array viewing it is gone.
    """
    if not valid_name(name):
        raise ValueError(f"refusing to map {name!r}: not a bus segment name")
    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"segment {name} is smaller than the {nbytes} bytes announced")
        mapping = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)


def unlink(folder: str, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, name))


def write_probe(folder: str) -> tuple[str, str]:
    """Write a probe file with a random token; returns (name, token)."""
    name, token = new_name(PROBE_SUFFIX), secrets.token_hex(16)
    fd = os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return name, token


def probe_matches(folder: str, name: str, token: str) -> bool:
    """True when ``folder/name`` holds ``token``: this process sees the producer's /dev/shm."""
    if not valid_name(name):
        return False
    try:
        found = Path(folder, name).read_bytes()
    except OSError:
        return False
    return hmac.compare_digest(found, token.encode())


def remove_stale(folder: str) -> int:
    """Remove what dead processes of this pid namespace left in ``folder``: segments, probes and
    ipc socket folders (only those of this user: a stranger's folder is not ours to empty).
    Returns how many."""
    mine = f"{PREFIX}{_namespace()}-"
    try:
        names = [n for n in os.listdir(folder) if n.startswith(mine) and valid_name(n)]
    except OSError:
        return 0
    removed = 0
    for name in names:
        pid = int(name[len(mine) :].split("-", 1)[0])
        if not pid_alive(pid):
            with contextlib.suppress(OSError):
                _remove(os.path.join(folder, name))
                removed += 1
    if removed:
        log.info("removed %d stale bus files of dead processes from %s", removed, folder)
    return removed


def _remove(path: str) -> None:
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode):
        os.unlink(path)
        return
    if found.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {found.st_uid}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, IPC_SOCKET))
    os.rmdir(path)  # fails, leaving it, if anything else lies there


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (signal 0 delivers nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
