"""A real HTTP server speaking the OpenAI chat-completions API, for judge-client tests.

Each test scripts the answers: a queue of behaviours ("ok", "500", "429", "slow", "malformed", "401"),
consumed one per request; when the queue is empty the server answers "ok" with the text set
in ``text``; a "429" carries ``retry_after`` as its Retry-After header when set. It records every
request body, its headers and arrival time, and the highest number of requests in flight.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ChatStub:
    def __init__(self) -> None:
        self.script: list[str] = []
        self.text = "HELLO"
        self.slow_s = 1.0
        self.retry_after = ""  # the Retry-After header of a "429"; none when empty
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.arrivals: list[float] = []  # time.monotonic() of each request
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold_s = 0.0  # every answer waits this long (to observe concurrency)
        self.lock = threading.Lock()

    def next_behaviour(self) -> str:
        with self.lock:
            return self.script.pop(0) if self.script else "ok"

    def enter(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        with self.lock:
            self.arrivals.append(time.monotonic())
            self.bodies.append(body)
            self.headers.append(headers)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


def _handler(stub: ChatStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length))
            stub.enter(body, dict(self.headers))
            try:
                status, payload, headers = self._answer(stub.next_behaviour(), body)
            finally:
                # left before the answer is written: once the client reads it, it may send its
                # next request at once, which must not find this one still counted in flight
                stub.leave()
            self._send(status, payload, headers)

        def _answer(self, behaviour: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
            time.sleep(stub.hold_s)
            if behaviour == "slow":
                time.sleep(stub.slow_s)
            if behaviour == "429":
                headers = {"Retry-After": stub.retry_after} if stub.retry_after else {}
                return 429, {"error": {"message": "scripted 429"}}, headers
            if behaviour in ("500", "401"):
                return int(behaviour), {"error": {"message": f"scripted {behaviour}"}}, {}
            if behaviour == "malformed":
                return 200, {"choices": []}, {}
            choice = {"index": 0, "message": {"role": "assistant", "content": stub.text}}
            return 200, {"object": "chat.completion", "model": body["model"], "choices": [choice]}, {}

        def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                pass

    return Handler


@contextmanager
def serve_chat() -> Iterator[tuple[str, ChatStub]]:
    """``(base_url, stub)`` of a server on a free loopback port; shut down on exit."""
    stub = ChatStub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(stub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), name="chat-stub", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", stub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
