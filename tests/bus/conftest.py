"""Fixtures of the bus tests: producers in their own processes, ended by their own handles."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from flowgrpo.bus import TensorRef

PRODUCER = Path(__file__).with_name("producer.py")


class Producer:
    """A store served by a child process; commands go over its stdin, answers come back as JSON."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PRODUCER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self._answer(timeout_s=30)
        self.endpoint: str = hello["endpoint"]
        self.store_id: str = hello["store_id"]
        self.pid: int = hello["pid"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def _answer(self, timeout_s: float = 60) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = json.loads(self._lines.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"producer {self.proc.pid} did not answer within {timeout_s} s") from None
        return answer

    def command(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def put_many(self, items: Sequence[dict[str, Any]]) -> list[TensorRef]:
        full = [{"column": "weights", "seed": 0, "policy_version": -1, **item} for item in items]
        answer = self.command(op="put", items=full)
        if "error" in answer:
            raise RuntimeError(f"{answer['error']}: {answer['message']}")
        return [TensorRef.from_dict(ref) for ref in answer["refs"]]

    def put(self, key: str, dtype: str = "float32", shape: Sequence[int] = (4,), **item: Any) -> TensorRef:
        return self.put_many([{"key": key, "dtype": dtype, "shape": list(shape), **item}])[0]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def start_producer() -> Iterator[Any]:
    """Call with BusConfig fields; every producer started is ended after the test."""
    started: list[Producer] = []

    def start(**config: Any) -> Producer:
        started.append(Producer(config))
        return started[-1]

    yield start
    for producer in started:
        producer.close()
