"""Opt-in (``-m slow``, outside .ci/run): the judge client against a real vLLM server on this CPU,
serving a tiny random Qwen3-VL built here with transformers' Qwen3-VL classes (vllm_tiny_vl.py).
Needs a separate environment with vLLM (vllm_env.sh beside this file), named by
FLOWGRPO_VLLM_PYTHON; the server starts in a minute or two on 2 cores.

A random model reads nothing, but it answers deterministically, and its answer depends on the
image and on the prompt. transformers' own ``generate`` on the judge's request (its chat template
rendered, its data URI decoded) is the reference: vLLM answering the judge the same text, from a
prompt of the same length, says the prompt, the PNG data URI and the answer's parsing survive the
trip."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from flowgrpo.rewards import Sample, SampleScore
from flowgrpo.rewards.judge import JudgeClient, JudgeConfig, chat_request, image_data_uri
from flowgrpo.rewards.ocr import OcrScorer

VLLM_PYTHON = os.environ.get("FLOWGRPO_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="set FLOWGRPO_VLLM_PYTHON to a Python with vLLM (vllm_env.sh)"
    ),
]
HERE = Path(__file__).resolve().parent
TINY_VL = str(HERE / "vllm_tiny_vl.py")


def image(kind: str) -> npt.NDArray[np.uint8]:
    pixels = np.zeros((112, 112, 3), dtype=np.uint8)  # resized to 128 x 128: 4 x 4 merged patches
    if kind == "red":
        pixels[..., 0] = 255
    elif kind == "blue":
        pixels[..., 2] = 255
    elif kind == "bars":
        pixels[:, ::16] = 255
    elif kind == "gradient":
        pixels[:] = np.linspace(0, 255, 112, dtype=np.uint8)[None, :, None]
    return pixels


IMAGES = [image(kind) for kind in ("red", "blue", "bars", "gradient")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("vllm") / "tiny-qwen3-vl"
    subprocess.run([VLLM_PYTHON, TINY_VL, "build", str(model)], check=True, timeout=300)
    return model


@pytest.fixture(scope="module")
def vllm_url(model_dir: Path) -> Iterator[str]:
    port, log = free_port(), (model_dir.parent / "vllm.log").open("w")
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "1024", "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    # its own process group: the engine's worker processes end with it
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_models(f"http://127.0.0.1:{port}/v1/models", proc, timeout_s=900)
        print(f"vLLM answered after {time.monotonic() - start:.0f} s of start-up")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def wait_for_models(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vLLM exited with {proc.returncode}; see vllm.log beside the model"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"vLLM did not answer {url} within {timeout_s:g}s")


def reference(model_dir: Path, requests: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    """transformers' greedy answers to these chat-completions bodies (vllm_tiny_vl.py answer)."""
    path = tmp_path / "requests.json"
    path.write_text(json.dumps(requests))
    cmd = [VLLM_PYTHON, TINY_VL, "answer", str(model_dir), str(path)]
    out = subprocess.run(cmd, check=True, timeout=600, capture_output=True, text=True)
    answers: list[dict[str, Any]] = json.loads(out.stdout)
    return answers


def test_vllm_answers_the_judge_what_transformers_answers_its_request(
    vllm_url: str, model_dir: Path, tmp_path: Path
) -> None:
    config = JudgeConfig(base_url=vllm_url, model="tiny", max_tokens=8, timeout_s=120)
    judge = JudgeClient(config)
    texts = judge.transcribe(IMAGES)

    requests = [chat_request(config, image_data_uri(pixels)) for pixels in IMAGES]
    assert all(r["messages"][1]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
               for r in requests)  # fmt: skip
    other_system = copy.deepcopy(requests[0])
    other_system["messages"][0]["content"] = "You are a judge."
    *expected, other = reference(model_dir, [*requests, other_system], tmp_path)
    wanted = [e["text"] for e in expected]
    assert len(set(wanted)) == len(wanted), f"the answer must depend on the image: {wanted}"
    assert other["text"] != wanted[0], "the answer must depend on the system prompt"
    assert [e["image_tokens"] for e in expected] == [16] * len(IMAGES)

    assert texts == wanted, "vLLM's answer to the judge differs from transformers' to the same request"
    usage = httpx.post(f"{vllm_url}/chat/completions", json=requests[0], timeout=120).json()["usage"]
    assert usage["prompt_tokens"] == expected[0]["prompt_tokens"], "the prompt vLLM rendered differs"

    # the OCR reward over the judge: each answer, quoted in its own prompt, is read in full;
    # the red image's answer is not what the others read
    assert all('"' not in text and text.strip() for text in wanted), wanted
    scorer = OcrScorer(judge)
    own = scorer.score(
        [Sample(pixels, prompt=f'a sign "{text}"') for pixels, text in zip(IMAGES, wanted, strict=True)]
    )
    assert own == [SampleScore(1.0)] * len(IMAGES)
    swapped = scorer.score([Sample(pixels, prompt=f'"{wanted[0]}"') for pixels in IMAGES[1:]])
    assert all(isinstance(o, SampleScore) and o.value < 1.0 for o in swapped), swapped
    scorer.close()
