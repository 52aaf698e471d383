"""Opt-in (``-m slow``, outside .ci/run): the judge client against a real vLLM server on this CPU,
serving a tiny random Qwen2-VL built here. Needs a separate environment with vLLM (see
vllm_env.sh beside this file), named by FLOWGRPO_VLLM_PYTHON; start-up takes minutes on 2 cores.
A random model reads nothing: the test checks the protocol (image in, text out, no error)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from flowgrpo.rewards import Sample, SampleScore
from flowgrpo.rewards.judge import JudgeClient, JudgeConfig
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tmp_path_factory.mktemp("vllm") / "tiny-qwen2-vl"
    subprocess.run([VLLM_PYTHON, str(HERE / "vllm_tiny_vl.py"), str(model)], check=True, timeout=300)
    port, log = free_port(), (model.parent / "vllm.log").open("w")
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "1024", "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    # its own process group: the engine's worker processes end with it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_models(f"http://127.0.0.1:{port}/v1/models", proc, timeout_s=900)
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


def test_the_judge_client_gets_a_transcription_from_vllm(vllm_url: str) -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (112, 112, 3), dtype=np.uint8) for _ in range(3)]
    judge = JudgeClient(JudgeConfig(base_url=vllm_url, model="tiny", max_tokens=8, timeout_s=120))
    texts = judge.transcribe(images)
    assert all(isinstance(t, str) for t in texts), texts
    outcomes = OcrScorer(judge).score([Sample(image, prompt='"hello"') for image in images])
    assert all(isinstance(o, SampleScore) and 0.0 <= o.value <= 1.0 for o in outcomes), outcomes
    judge.close()
