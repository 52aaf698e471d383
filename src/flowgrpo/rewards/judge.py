"""Transcription by a judge model behind an OpenAI-compatible ``/v1/chat/completions`` server
(vLLM serving Qwen3-VL-8B-Instruct in the recipes).

Each image travels as a PNG data URI with the reference prompt (flow_grpo's), decoded
greedily by default (the reference samples at T 0.7, which makes the reward noisy). Requests
run on a bounded thread pool (``max_concurrency`` in flight at once, shared by every caller),
each attempt with its own timeout, retried with exponential backoff and jitter on connection
errors, timeouts, 408, 429 and 5xx, waiting at least what the server's Retry-After asks. What
still fails comes back as that image's :class:`SampleError` (never a silent 0 reward), naming
the server, the attempts and the last cause.

The HTTP side is httpx (a pooled client that threads share, per-phase timeouts) and the retry
policy tenacity (stop after N attempts, exponential wait with jitter, a retry predicate). The
``openai`` client, built on httpx, was the other choice; it was not taken because its backoff is
fixed (0.5 s doubling to 8 s, not settable per client, so ``backoff_s`` and ``max_backoff_s``
would become dead knobs), it reports neither the number of attempts nor which attempt failed,
it insists on an API key (a local vLLM has none) and it brings pydantic and its own response
models, where the judge reads one field. httpx and tenacity are imported when a client is made:
the configs import this module where neither is installed (the coordinator's image).
"""

from __future__ import annotations

import base64
import email.utils
import io
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image

from flowgrpo.fields import knob
from flowgrpo.rewards.base import ErrorKind, SampleError

if TYPE_CHECKING:
    import httpx
    import tenacity

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant."
USER_PROMPT = (
    "Please output only the text content from the image without any additional descriptions or formatting."
)
API_KEY_ENV = "FLOWGRPO_JUDGE_API_KEY"
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0  # a longer Retry-After is capped: the step should not stall for minutes


@dataclass
class JudgeConfig:
    base_url: str = "http://127.0.0.1:8000/v1"  # the server's OpenAI API root (vLLM: http://HOST:PORT/v1)
    model: str = "Qwen/Qwen3-VL-8B-Instruct"  # the served model name
    api_key: str = ""  # bearer token; empty: FLOWGRPO_JUDGE_API_KEY (preferred: configs are written out)
    temperature: float = knob(0.0, 0.0, 10.0)  # 0 = greedy decoding
    max_tokens: int = knob(256, 1, 1_000_000)
    timeout_s: float = knob(60.0, 0.001, 86_400.0)  # timeout of one attempt's connect, and of each read
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


def retry_policy(config: JudgeConfig) -> tenacity.Retrying:
    """Up to ``max_retries`` more attempts after a retryable failure; the pause before retry n
    (0-based) is ``backoff_s * 2**n`` capped at ``max_backoff_s``, jittered to 50-100% of that
    so replicas do not retry in lockstep, and never shorter than the server's Retry-After."""
    import tenacity

    base, cap = config.backoff_s / 2, config.max_backoff_s / 2
    steady = tenacity.wait_exponential(multiplier=base, max=cap)  # half the pause
    jitter = tenacity.wait_random_exponential(multiplier=base, max=cap)  # 0 to the other half
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(config.max_retries + 1),
        wait=_AtLeastRetryAfter(steady + jitter),
        retry=tenacity.retry_if_exception(lambda error: isinstance(error, _Failure) and error.retry),
        reraise=True,  # the last attempt's _Failure, not tenacity's RetryError
    )


@dataclass(frozen=True)
class _AtLeastRetryAfter:
    """A tenacity wait: the backoff's pause, or the failed attempt's Retry-After when longer."""

    backoff: Callable[[tenacity.RetryCallState], float]

    def __call__(self, state: tenacity.RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        asked = error.wait_s if isinstance(error, _Failure) else 0.0
        return max(asked, self.backoff(state))


class JudgeClient:
    """A :class:`~flowgrpo.rewards.ocr.Transcriber` backed by a chat-completions server."""

    name = "judge"

    def __init__(self, config: JudgeConfig) -> None:
        import httpx

        config.validate()
        self.config = config
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        api_key = config.api_key or os.environ.get(API_KEY_ENV, "")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(
            max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency
        )
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(config.timeout_s), limits=limits)
        self._retrying = retry_policy(config)
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="judge")

    def transcribe(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[str | SampleError]:
        return list(self._pool.map(self.transcribe_one, images))

    def transcribe_one(self, image: npt.NDArray[np.uint8]) -> str | SampleError:
        body = json.dumps(chat_request(self.config, image_data_uri(image, self.config.image_format))).encode()
        retrying = self._retrying.copy()  # its statistics (the attempt count) are this call's
        try:
            return answer_text(retrying(self._post, body))
        except _Failure as failure:
            return SampleError(failure.kind, self._describe(failure, retrying.statistics["attempt_number"]))
        except ValueError as error:  # a 200 whose body is not an answer: the server is broken
            return SampleError("internal", f"judge {self.url} answered malformed JSON: {error}")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _post(self, body: bytes) -> bytes:
        """One attempt: the response body of a 2xx, else the attempt's :class:`_Failure`."""
        import httpx

        try:
            response = self._http.post(self.url, content=body, headers={"Content-Type": "application/json"})
        except httpx.TimeoutException:
            raise _Failure(
                "deadline_exceeded", f"no answer within {self.config.timeout_s:g}s", retry=True
            ) from None
        except httpx.TransportError as error:  # refused, reset, closed early: the server may come back
            raise _Failure("unavailable", f"cannot reach the server: {error}", retry=True) from error
        except httpx.HTTPError as error:  # an undecodable body, a redirect loop: retrying will not help
            raise _Failure("internal", f"{type(error).__name__}: {error}", retry=False) from error
        if response.is_success:
            return response.content
        raise _http_failure(response)

    def _describe(self, failure: _Failure, attempts: int) -> str:
        tries = f"after {attempts} attempt(s)" if failure.retry else "(not retried)"
        return f"judge {self.config.model} at {self.url} failed {tries}: {failure}"


def _http_failure(response: httpx.Response) -> _Failure:
    detail = response.content[:200].decode("utf-8", "replace")
    message = f"HTTP {response.status_code} {response.reason_phrase}: {detail}"
    if response.status_code in (401, 403):
        return _Failure("unauthenticated", message + f" (set judge.api_key or {API_KEY_ENV})", retry=False)
    if response.status_code in RETRY_STATUS:
        return _Failure(
            "unavailable", message, retry=True, wait_s=retry_after_s(response.headers.get("Retry-After"))
        )
    return _Failure("invalid_argument", message, retry=False)


def retry_after_s(value: str | None) -> float:
    """Seconds a Retry-After header asks for (delay seconds or an HTTP date), capped at
    ``MAX_RETRY_AFTER_S``; 0 when absent or unreadable (the backoff alone then decides)."""
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return 0.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else 0.0
