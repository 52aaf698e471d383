"""The judge client against a real HTTP server speaking the chat-completions API: the request it
sends, retries after a 500, timeouts, a malformed answer, bounded concurrency, per-image errors."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from flowgrpo.rewards import Sample, SampleError, SampleScore
from flowgrpo.rewards.judge import SYSTEM_PROMPT, USER_PROMPT, JudgeClient, JudgeConfig
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
