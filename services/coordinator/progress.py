"""What the console says while the run would otherwise be silent.

- :class:`StartupReport`: one line per replica as it becomes ready, with how long it took and what
  each part of its start-up loaded (``rollout-0 ready in 4.2 s: imports 1.1 s, model 3.1 s
  (native engine on cpu, float32)``, from its READY handshake); while replicas are still starting,
  a line at most every ``logger.progress_every_s`` naming what each one is doing and for how long
  (a starting replica says it in its handshake's UNAVAILABLE answer).
- :class:`StepProgress`: the work in flight (a step's samples drawn, scored, then its training;
  a validation; a checkpoint being saved), at most one line every ``logger.progress_every_s``,
  and only about work that has run at least that long: a 2-second step of the CPU demo prints
  nothing of it, a 7-minute step of the GPU recipe a line every 30 s (the default).

``logger.progress_every_s=0`` turns both periodic lines off (the ready lines stay).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from flowgrpo.runtime import wait_ready
from flowgrpo.runtime.startup import describe_startup, starting_phase
from flowgrpo.v1 import common_pb2

Say = Callable[[str], None]
Clock = Callable[[], float]
READY_LINES = 16  # replicas said one by one; past them, one line for the rest (64 rollouts: not 64 lines)


def duration(seconds: float) -> str:
    """``45 s``, ``3:07``, ``1:02:03``: short enough for a progress line."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class StartupReport:
    """The services' start-up on the console (see the module's doc)."""

    def __init__(self, say: Say | None, every_s: float, clock: Clock = time.monotonic) -> None:
        self._say, self.every_s, self._clock = say, every_s, clock
        self._began = clock()
        self._waiting: dict[str, str] = {}  # key (replica id or address) -> what it is doing
        self._names: dict[str, str] = {}  # key -> how to name it (its replica id, once it answered)
        self._said: set[str] = set()  # replica ids whose ready line was said (or counted)
        self._unsaid: list[common_pb2.ServiceInfo] = []  # ready past READY_LINES: said together
        self._early: list[asyncio.Task[None]] = []  # handshakes begun by listening()

    def expect(self, replica_ids: Iterable[str], doing: str = "starting its process") -> None:
        """Replicas on their way that cannot be asked yet (processes not yet listening)."""
        for replica_id in replica_ids:
            self._waiting[replica_id] = doing

    def listening(self, replica_id: str, address: str, role: str, timeout_s: float) -> None:
        """``replica_id`` listens at ``address`` now (its ready file is there): it is asked at once,
        so its line comes when it is ready, not when the last process of the run listens. Only
        inside :meth:`watching` (which ends what it began), and only when something is said."""
        if self._say is None:
            return
        self._waiting.pop(replica_id, None)

        async def ask() -> None:
            with contextlib.suppress(Exception):  # the launcher's own wait says what went wrong
                await self.wait_ready(address, role=role, timeout_s=timeout_s)

        self._early.append(asyncio.create_task(ask(), name=f"start-up of {replica_id}"))

    async def wait_ready(self, address: str, *, role: str, timeout_s: float) -> common_pb2.ServiceInfo:
        """:func:`flowgrpo.runtime.wait_ready` for the coordinator: what the replica says while it
        starts is kept for :meth:`line`, and its ready line is printed when it answers."""
        self._waiting[address] = "no answer yet"
        self._names.setdefault(address, f"{role} at {address}")

        def not_ready(details: str) -> None:
            said = starting_phase(details)
            if said is not None and address in self._waiting:
                self._names[address], self._waiting[address] = said

        try:
            info = await wait_ready(address, role=role, timeout_s=timeout_s, client_role="coordinator",
                                    on_not_ready=not_ready)  # fmt: skip
        finally:
            self._waiting.pop(address, None)
        self.ready(info)
        return info

    def ready(self, info: common_pb2.ServiceInfo) -> None:
        """``info``'s replica is ready: its line (how long, what it loaded), once."""
        self._waiting.pop(info.replica_id, None)
        if info.replica_id in self._said:
            return
        self._said.add(info.replica_id)
        if len(self._said) > READY_LINES:
            self._unsaid.append(info)
        elif self._say is not None:
            self._say(describe_startup(info))

    def unsaid(self) -> str | None:
        """One line for the replicas ready past the first :data:`READY_LINES`, naming the slowest."""
        if not self._unsaid:
            return None
        slowest = max(self._unsaid, key=lambda info: info.startup_s)
        return f"... and {len(self._unsaid)} more ready; the slowest: {describe_startup(slowest)}"

    def line(self) -> str | None:
        """Who is still starting and what each is doing, or None once nobody is."""
        if not self._waiting:
            return None
        named = sorted((self._names.get(k, k), what) for k, what in self._waiting.items())
        doing = "; ".join(f"{name} ({what})" for name, what in named)
        return f"  still starting after {duration(self._clock() - self._began)}: {doing}"

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Inside, :meth:`line` is printed every ``every_s`` while somebody is still starting; on
        the way out, :meth:`unsaid`."""
        task = asyncio.create_task(_every(self.every_s, self.line, self._say), name="start-up report")
        try:
            yield
        finally:
            for pending in [task, *self._early]:
                pending.cancel()
            await asyncio.gather(task, *self._early, return_exceptions=True)
            if self._say is not None and (rest := self.unsaid()) is not None:
                self._say(rest)


@dataclass
class _Work:
    name: str  # "step 3/40", "validation at step 10", "checkpoint of step 10"
    samples: int  # to draw and score (0: no samples, e.g. a checkpoint)
    began: float
    drawn: int = 0
    scored: int = 0
    doing: str = ""  # after the samples: "training", "loading weights", "saving"
    doing_since: float = 0.0


class StepProgress:
    """The work in flight, said at most every ``every_s`` (see the module's doc). Keys are the
    caller's: one piece of work per key, from :meth:`begin` to :meth:`end`."""

    def __init__(self, note: Say | None, every_s: float, clock: Clock = time.monotonic) -> None:
        self._note, self.every_s, self._clock = note, every_s, clock
        self._work: dict[str, _Work] = {}

    def begin(self, key: str, name: str, samples: int = 0, doing: str = "") -> None:
        now = self._clock()
        self._work[key] = _Work(name, samples, now, doing=doing, doing_since=now)

    def drawn(self, key: str, samples: int) -> None:
        if (work := self._work.get(key)) is not None:
            work.drawn += samples

    def scored(self, key: str, samples: int) -> None:
        """``samples`` more scored (negative: a reward replica failed, its results are void)."""
        if (work := self._work.get(key)) is not None:
            work.scored += samples

    def doing(self, key: str, what: str) -> None:
        if (work := self._work.get(key)) is not None:
            work.doing, work.doing_since = what, self._clock()

    def end(self, key: str) -> None:
        self._work.pop(key, None)

    def line(self) -> str | None:
        """The work that has run at least ``every_s``, or None when there is none."""
        now = self._clock()
        old = [w for w in self._work.values() if now - w.began >= self.every_s]
        if not old:
            return None
        return "  " + "; ".join(self._describe(w, now) for w in old)

    def _describe(self, work: _Work, now: float) -> str:
        parts = []
        if work.samples:
            parts = [f"drawn {work.drawn}/{work.samples}", f"scored {work.scored}/{work.samples}"]
        if work.doing:
            parts.append(f"{work.doing} for {duration(now - work.doing_since)}")
        said = f"{work.name} ({duration(now - work.began)})"
        return f"{said}: {', '.join(parts)}" if parts else said

    async def run(self) -> None:
        """Say :meth:`line` every ``every_s`` while there is old enough work (until cancelled)."""
        await _every(self.every_s, self.line, self._note)


async def _every(every_s: float, line: Callable[[], str | None], say: Say | None) -> None:
    """``say(line())`` every ``every_s`` seconds when there is a line (never when ``every_s`` is 0)."""
    if not every_s or say is None:
        return
    while True:
        await asyncio.sleep(every_s)
        if (text := line()) is not None:
            say(text)
