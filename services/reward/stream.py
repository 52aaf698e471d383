"""Streams as queues: a :class:`Pump` reads an async iterator in its own task into a bounded
queue, so a consumer can take what is waiting without blocking (:func:`take_batch`) while the
producer keeps going. The source's end and its error reach the consumer in order, after the
items that came before them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _End:
    error: BaseException | None = None


class Pump(Generic[T]):
    """Iterates ``source`` in a task, at most ``depth`` items ahead of the consumer."""

    def __init__(self, source: AsyncIterator[T], depth: int, name: str = "pump") -> None:
        self._queue: asyncio.Queue[T | _End] = asyncio.Queue(depth)
        self._end: _End | None = None
        self._task = asyncio.create_task(self._run(source), name=name)

    async def _run(self, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                await self._queue.put(item)
        except Exception as error:  # delivered to the consumer after the items before it
            await self._queue.put(_End(error))
        else:
            await self._queue.put(_End())

    async def get(self, timeout_s: float | None = None) -> T | None:
        """The next item; None at the end of the source, or when nothing came within ``timeout_s``
        (0: only what is already waiting). The source's error is raised by the call after the one
        that returned None for it, so a batch being assembled is not lost."""
        if self._end is not None:
            if self._end.error is not None:
                error, self._end = self._end.error, _End()
                raise error
            return None
        try:
            if timeout_s is None:
                item = await self._queue.get()
            elif timeout_s <= 0:
                item = self._queue.get_nowait()
            else:
                item = await asyncio.wait_for(self._queue.get(), timeout_s)
        except (TimeoutError, asyncio.QueueEmpty):
            return None
        if isinstance(item, _End):
            self._end = item  # an error is raised by the next call: the caller keeps what it took
            return None
        return item

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def take_batch(pump: Pump[T], max_items: int, max_wait_s: float = 0.0) -> list[T]:
    """Wait for one item, then add what is waiting (or arrives within ``max_wait_s``), up to
    ``max_items``. An empty list means the source ended; a source that failed raises its error
    (here, or from the next call when a batch was being assembled), never ends quietly."""
    first = await pump.get()
    if first is None:
        await pump.get()  # raises the source's error, if that is how it ended
        return []
    batch = [first]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_wait_s
    while len(batch) < max_items:
        item = await pump.get(timeout_s=max(deadline - loop.time(), 0.0))
        if item is None:
            break
        batch.append(item)
    return batch
