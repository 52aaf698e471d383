"""The judge client against a real HTTP server speaking the chat-completions API: the request it
sends, retries after a 500, Retry-After, the backoff's growth and jitter, timeouts, a malformed
answer, bounded concurrency, per-image errors, the API key from the environment."""

from __future__ import annotations

import base64
import email.utils
import io
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tenacity
from PIL import Image

from flowgrpo.rewards import Sample, SampleError, SampleScore
from flowgrpo.rewards.judge import (
    API_KEY_ENV,
    SYSTEM_PROMPT,
    USER_PROMPT,
    JudgeClient,
    JudgeConfig,
    _Failure,
    retry_after_s,
    retry_policy,
)
from flowgrpo.rewards.ocr import OcrScorer

from .openai_stub import ChatStub, serve_chat

IMAGE = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)


@pytest.fixture
def chat() -> Iterator[tuple[str, ChatStub]]:
    with serve_chat() as served:
        yield served


def client(base_url: str, **overrides: object) -> JudgeClient:
    settings: dict[str, object] = {"model": "judge-vl", "timeout_s": 2.0, "backoff_s": 0.01, "max_retries": 2}
    return JudgeClient(JudgeConfig(base_url=base_url, **{**settings, **overrides}))  # type: ignore[arg-type]


def test_success_sends_the_reference_prompt_greedy_with_the_image_as_data_uri(
    chat: tuple[str, ChatStub],
) -> None:
    url, stub = chat
    judge = client(url, api_key="sekret")
    assert judge.transcribe([IMAGE]) == ["HELLO"]
    [body] = stub.bodies
    assert body["model"] == "judge-vl" and body["temperature"] == 0.0
    system, user = body["messages"]
    assert system == {"role": "system", "content": SYSTEM_PROMPT}
    image_part, text_part = user["content"]
    assert text_part == {"type": "text", "text": USER_PROMPT}
    prefix = "data:image/png;base64,"
    assert image_part["image_url"]["url"].startswith(prefix)
    png = base64.b64decode(image_part["image_url"]["url"][len(prefix) :])
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), IMAGE), "lossless, same pixels"
    assert stub.headers[0]["Authorization"] == "Bearer sekret"
    judge.close()


def test_a_500_is_retried_and_the_retry_succeeds(chat: tuple[str, ChatStub]) -> None:
    url, stub = chat
    stub.script = ["500", "500"]
    assert client(url).transcribe([IMAGE]) == ["HELLO"]
    assert len(stub.bodies) == 3


def test_persistent_500s_give_a_per_image_error_naming_the_attempts(chat: tuple[str, ChatStub]) -> None:
    url, stub = chat
    stub.script = ["500"] * 3
    [error] = client(url).transcribe([IMAGE])
    assert isinstance(error, SampleError) and error.kind == "unavailable"
    assert "after 3 attempt(s)" in error.message and "HTTP 500" in error.message and url in error.message


def test_retry_after_is_waited_for_even_when_the_backoff_is_shorter(chat: tuple[str, ChatStub]) -> None:
    url, stub = chat
    stub.script, stub.retry_after = ["429"], "1"
    assert client(url).transcribe([IMAGE]) == ["HELLO"]  # backoff_s 0.01: only Retry-After waits 1 s
    first, retry = stub.arrivals
    assert 0.95 <= retry - first < 10.0, retry - first
    stub.script, stub.retry_after = ["429"], ""
    assert client(url).transcribe([IMAGE]) == ["HELLO"]
    assert stub.arrivals[3] - stub.arrivals[2] < 0.9, "without Retry-After, the 10 ms backoff"


def test_retry_after_reads_seconds_and_dates_capped_at_a_minute() -> None:
    assert retry_after_s("2") == 2.0 and retry_after_s("3600") == 60.0
    assert retry_after_s(None) == 0.0 and retry_after_s("soon") == 0.0 and retry_after_s("-5") == 0.0
    assert retry_after_s("nan") == 0.0 and retry_after_s("inf") == 0.0
    in_30_s = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25.0 <= retry_after_s(in_30_s) <= 30.0
    assert retry_after_s(email.utils.formatdate(time.time() - 30, usegmt=True)) == 0.0


def pause(config: JudgeConfig, attempt: int, failure: Exception) -> float:
    """The wait the retry policy picks after the ``attempt``-th attempt (1-based) failed so."""
    policy = retry_policy(config)
    state = tenacity.RetryCallState(policy, fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    state.set_exception((type(failure), failure, None))
    return float(policy.wait(state))


def test_the_backoff_doubles_is_capped_and_jittered() -> None:
    config = JudgeConfig(backoff_s=1.0, max_backoff_s=5.0)
    failure = _Failure("unavailable", "HTTP 503", retry=True)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (8, 5.0)]:
        pauses = [pause(config, attempt, failure) for _ in range(200)]
        assert base / 2 <= min(pauses) and max(pauses) <= base, (attempt, min(pauses), max(pauses))
        assert max(pauses) - min(pauses) > base / 4, "jittered: replicas do not retry in lockstep"
    asked = _Failure("unavailable", "HTTP 429", retry=True, wait_s=30.0)
    assert pause(config, 1, asked) == 30.0, "the server's Retry-After beats a shorter backoff"


def test_the_api_key_comes_from_the_environment(
    chat: tuple[str, ChatStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, stub = chat
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert client(url).transcribe([IMAGE]) == ["HELLO"]
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert client(url).transcribe([IMAGE]) == ["HELLO"]
    assert client(url, api_key="from-config").transcribe([IMAGE]) == ["HELLO"]
    sent = [headers.get("Authorization") for headers in stub.headers]
    assert sent == [None, "Bearer from-env", "Bearer from-config"]


def test_a_timeout_is_retried_then_reported_as_deadline_exceeded(chat: tuple[str, ChatStub]) -> None:
    url, stub = chat
    stub.script, stub.slow_s = ["slow"], 1.0
    assert client(url, timeout_s=0.3).transcribe([IMAGE]) == ["HELLO"], "the retry answers in time"
    stub.script = ["slow", "slow"]
    [error] = client(url, timeout_s=0.3, max_retries=1).transcribe([IMAGE])
    assert isinstance(error, SampleError) and error.kind == "deadline_exceeded"
    assert "no answer within 0.3s" in error.message


def test_a_malformed_answer_is_an_error_not_a_zero(chat: tuple[str, ChatStub]) -> None:
    url, stub = chat
    stub.script = ["malformed"]
    [error] = client(url).transcribe([IMAGE])
    assert isinstance(error, SampleError) and error.kind == "internal"
    assert "not a chat completion" in error.message and "IndexError" in error.message


def test_401_is_not_retried(chat: tuple[str, ChatStub]) -> None:
    url, stub = chat
    stub.script = ["401"]
    [error] = client(url).transcribe([IMAGE])
    assert isinstance(error, SampleError) and error.kind == "unauthenticated"
    assert len(stub.bodies) == 1 and "judge.api_key" in error.message


def test_no_server_is_unavailable() -> None:
    with serve_chat() as (url, _):
        pass  # the port is free again: nothing listens there
    [error] = client(url, max_retries=1).transcribe([IMAGE])
    assert isinstance(error, SampleError) and error.kind == "unavailable"
    assert "cannot reach the server" in error.message


def test_concurrency_is_bounded_and_errors_stay_per_image(chat: tuple[str, ChatStub]) -> None:
    url, stub = chat
    stub.hold_s = 0.2
    stub.script = ["ok", "401"]  # one image of eight fails, the others are read
    results = client(url, max_concurrency=3).transcribe([IMAGE] * 8)
    assert 2 <= stub.max_in_flight <= 3
    assert sum(isinstance(r, SampleError) for r in results) == 1
    assert results.count("HELLO") == 7


def test_ocr_scorer_over_the_judge(chat: tuple[str, ChatStub]) -> None:
    url, stub = chat
    stub.text = "Hello\nWorld"
    scorer = OcrScorer(client(url))
    outcomes = scorer.score(
        [Sample(IMAGE, prompt='a sign "hello world"'), Sample(IMAGE, prompt='"HELLO WORLD!"')]
    )
    assert outcomes == [SampleScore(1.0), SampleScore(1.0 - 1 / 11)]
    scorer.close()
