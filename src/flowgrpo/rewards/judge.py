"""Transcription by a judge model behind an OpenAI-compatible ``/v1/chat/completions`` server
(vLLM serving Qwen3-VL-8B-Instruct in the recipes).

Each image travels as a PNG data URI with the reference prompt (flow_grpo's), decoded
greedily by default (the reference samples at T 0.7, which makes the reward noisy). Requests
run on a bounded thread pool (``max_concurrency`` in flight at once, shared by every caller),
each with a socket timeout, retried with exponential backoff and jitter on connection errors,
timeouts, 408, 429 and 5xx. What still fails comes back as that image's :class:`SampleError`
(never a silent 0 reward), naming the server, the attempts and the last cause.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image

from flowgrpo.fields import knob
from flowgrpo.rewards.base import ErrorKind, SampleError

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant."
USER_PROMPT = (
    "Please output only the text content from the image without any additional descriptions or formatting."
)
API_KEY_ENV = "FLOWGRPO_JUDGE_API_KEY"
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass
class JudgeConfig:
    base_url: str = "http://127.0.0.1:8000/v1"  # the server's OpenAI API root (vLLM: http://HOST:PORT/v1)
    model: str = "Qwen/Qwen3-VL-8B-Instruct"  # the served model name
    api_key: str = ""  # bearer token; empty: FLOWGRPO_JUDGE_API_KEY (preferred: configs are written out)
    temperature: float = knob(0.0, 0.0, 10.0)  # 0 = greedy decoding
    max_tokens: int = knob(256, 1, 1_000_000)
    timeout_s: float = knob(60.0, 0.001, 86_400.0)  # socket timeout of one attempt (connect, and each read)
    max_concurrency: int = knob(16, 1, 4096)  # requests in flight at once
    max_retries: int = knob(3, 0, 100)  # attempts after the first one
    backoff_s: float = knob(0.5, 0.0, 3600.0)  # first pause; doubles per retry, with jitter
    max_backoff_s: float = knob(8.0, 0.0, 86_400.0)
    image_format: Literal["png", "jpeg"] = "png"  # png: lossless (compression level 1, fast)

    def validate(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge.base_url {self.base_url!r} must start with http:// or https://")
        if self.max_concurrency < 1 or self.max_retries < 0 or self.timeout_s <= 0:
            raise ValueError("judge: max_concurrency >= 1, max_retries >= 0 and timeout_s > 0 are required")
        if self.image_format not in ("png", "jpeg"):
            raise ValueError(f"judge.image_format {self.image_format!r} is not 'png' or 'jpeg'")


class _Failure(Exception):
    """One failed attempt: ``retry`` says whether another attempt may succeed."""

    def __init__(self, kind: ErrorKind, message: str, *, retry: bool, wait_s: float = 0.0) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry = retry
        self.wait_s = wait_s  # the server's Retry-After, when it sent one


def image_data_uri(image: npt.NDArray[np.uint8], image_format: str = "png") -> str:
    buffer = io.BytesIO()
    options = {"compress_level": 1} if image_format == "png" else {"quality": 95}  # PNG: fast, lossless
    Image.fromarray(image, mode="RGB").save(buffer, format=image_format.upper(), **options)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"data:image/{image_format};base64,{encoded}"


def chat_request(config: JudgeConfig, data_uri: str) -> dict[str, Any]:
    """The chat-completions body of one image: the reference system and user prompts."""
    user = [
        {"type": "image_url", "image_url": {"url": data_uri}},
        {"type": "text", "text": USER_PROMPT},
    ]
    return {
        "model": config.model,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
        "temperature": config.temperature,
        "max_tokens": config.max_tokens,
    }


def answer_text(body: bytes) -> str:
    """The assistant text of a chat-completions response; ValueError names what is missing."""
    try:
        data = json.loads(body)
        content = data["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise ValueError(f"not a chat completion ({type(error).__name__}: {error}): {body[:200]!r}") from None
    if not isinstance(content, str):
        raise ValueError(f"the answer's content is {type(content).__name__}, not text: {body[:200]!r}")
    return content


class JudgeClient:
    """A :class:`~flowgrpo.rewards.ocr.Transcriber` backed by a chat-completions server."""

    name = "judge"

    def __init__(self, config: JudgeConfig) -> None:
        config.validate()
        self.config = config
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        self._api_key = config.api_key or os.environ.get(API_KEY_ENV, "")
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="judge")

    def transcribe(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[str | SampleError]:
        return list(self._pool.map(self.transcribe_one, images))

    def transcribe_one(self, image: npt.NDArray[np.uint8]) -> str | SampleError:
        body = json.dumps(chat_request(self.config, image_data_uri(image, self.config.image_format))).encode()
        attempts = self.config.max_retries + 1
        for attempt in range(attempts):
            try:
                return answer_text(self._post(body))
            except _Failure as failure:
                if not failure.retry or attempt + 1 == attempts:
                    return SampleError(failure.kind, self._describe(failure, attempt + 1))
                time.sleep(max(failure.wait_s, self._backoff(attempt)))
            except ValueError as error:  # a 200 whose body is not an answer: the server is broken
                return SampleError("internal", f"judge {self.url} answered malformed JSON: {error}")
        raise AssertionError("unreachable: the last attempt returns")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=body, method="POST", headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                data: bytes = response.read()
                return data
        except urllib.error.HTTPError as error:
            raise _http_failure(error) from None
        except OSError as error:  # URLError, timeouts, resets: the server may come back
            raise self._transport_failure(error) from error

    def _transport_failure(self, error: OSError) -> _Failure:
        cause = error.reason if isinstance(error, urllib.error.URLError) else error
        if isinstance(cause, TimeoutError):
            return _Failure("deadline_exceeded", f"no answer within {self.config.timeout_s:g}s", retry=True)
        return _Failure("unavailable", f"cannot reach the server: {cause}", retry=True)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _backoff(self, attempt: int) -> float:
        pause = min(self.config.backoff_s * 2.0**attempt, self.config.max_backoff_s)
        return pause * (0.5 + random.random() / 2)  # jitter: replicas do not retry in lockstep

    def _describe(self, failure: _Failure, attempts: int) -> str:
        tries = f"after {attempts} attempt(s)" if failure.retry else "(not retried)"
        return f"judge {self.config.model} at {self.url} failed {tries}: {failure}"


def _http_failure(error: urllib.error.HTTPError) -> _Failure:
    detail = error.read()[:200].decode("utf-8", "replace")
    message = f"HTTP {error.code} {error.reason}: {detail}"
    if error.code in (401, 403):
        return _Failure("unauthenticated", message + f" (set judge.api_key or {API_KEY_ENV})", retry=False)
    if error.code in RETRY_STATUS:
        return _Failure("unavailable", message, retry=True, wait_s=_retry_after(error))
    return _Failure("invalid_argument", message, retry=False)


def _retry_after(error: urllib.error.HTTPError) -> float:
    try:
        return min(float(str(error.headers.get("Retry-After", 0))), 60.0)
    except ValueError:  # an HTTP date: use our own backoff
        return 0.0
