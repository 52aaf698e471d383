"""A replica's start-up, told to whoever waits for it.

Once ready, its READY handshake answers how it started (``ServiceInfo.startup``: each phase
with its seconds and what it loaded; ``startup_s``: the whole start). While it starts, the
handshake's UNAVAILABLE answer says which phase runs and for how long, in a sentence a person
reads and :func:`starting_phase` parses back (the coordinator prints it while a 7B model loads).
Both sides of that sentence live here, so they cannot drift apart.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flowgrpo.v1 import common_pb2

IMPORTS = "imports"  # the first phase: from the process's start to its port being bound
MOST_PHASES, MOST_CHARS = 8, 120  # what a console line quotes of a replica's words, at most
_STARTING = re.compile(r"not ready: (?P<replica>\S+) is starting \((?P<phase>[^)]*)\)")


def starting_refusal(replica_id: str, phase: str, seconds: float | None) -> str:
    """What a starting replica answers a handshake: ``phase`` ("" before the first) and its
    seconds so far."""
    doing = f"{phase} for {seconds:.0f} s" if phase and seconds is not None else "starting up"
    return f"not ready: {replica_id} is starting ({doing}); retry, or wait for its READY handshake"


def starting_phase(message: str) -> tuple[str, str] | None:
    """(replica id, what it is doing) from a starting replica's refusal (found anywhere in a
    status's details), or None for any other message."""
    found = _STARTING.search(message)
    return (printable(found["replica"]), printable(found["phase"])) if found else None


def process_age_s() -> float | None:
    """Seconds since this process started, from the kernel's record (Linux: ``/proc/self/stat``
    field 22 against ``/proc/uptime``, 10 ms resolution); None where there is no ``/proc``."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22; the fields after the name start at field 3
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def describe_startup(info: common_pb2.ServiceInfo) -> str:
    """``rollout-0 ready in 4.2 s: imports 1.1 s, model 3.1 s (native engine on cpu, float32)``."""
    name = printable(info.replica_id)
    if not info.startup_s:
        return f"{name} ready at {printable(info.grpc_address)}"
    phases = ", ".join(
        f"{printable(p.name)} {p.seconds:.1f} s" + (f" ({printable(p.detail)})" if p.detail else "")
        for p in info.startup[:MOST_PHASES]
    )
    return f"{name} ready in {info.startup_s:.1f} s" + (f": {phases}" if phases else "")


def printable(text: str, most: int = MOST_CHARS) -> str:
    """``text`` as a console line may quote it: printable characters only (no escape sequences
    from a replica's answer), at most ``most`` of them."""
    kept = "".join(c if c.isprintable() else "?" for c in text)
    return kept if len(kept) <= most else kept[: most - 3] + "..."
