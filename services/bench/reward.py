"""Reward scorers' throughput in images per second (``flowgrpo bench reward``), CPU by default.

Each scorer is built once (``once_s.load``, a one-off reported apart), then scores ``--images``
images of ``--size`` px in batches of ``--batch-size``: once as a warm-up, then ``--repeats``
(>= 3) timed times; the median with its range is reported (services/bench/stats.py). The images
are smooth gradients with noise and one rendered word, so JPEG sizes and OCR work are those of
real pictures, not of flat or random ones.

Rows:
- ``jpeg_compressibility``: PIL JPEG at quality 95;
- ``plugin``: a numpy plug-in (mean brightness) through the plug-in loader and its checks;
- ``ocr_offline``: RapidOCR (onnxruntime, CPU) transcribing, then the OCR reward;
- ``judge``: the chat-completions client against a local server that answers at once: the
  client's own cost (PNG encoding, base64, HTTP), not the VLM's;
- ``pickscore``: a random CLIP of ``--pickscore-geometry`` (``vit-h-14`` is PickScore_v1's
  shape) on ``--device`` in ``--dtype``, the processor's CPU preprocessing included;
  ``pickscore_model`` times the same model alone, on already preprocessed pixels and tokens.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from flowgrpo.rewards import Sample, SampleError, Scorer
from flowgrpo.services.bench.stats import MIN_REPEATS, Figure, repeats_arg, timed, write_json

SCORERS = ("jpeg_compressibility", "plugin", "ocr_offline", "judge", "pickscore")
WORD = "FlowGRPO"


@dataclass
class Row:
    scorer: str
    images: int
    batch: int
    seconds: Figure  # all images, over the repeats
    images_per_s: Figure  # images / seconds
    once_s: dict[str, float]  # "load": building the scorer, once


def bench_images(count: int, size: int, seed: int = 0) -> list[npt.NDArray[np.uint8]]:
    """Gradients with noise and a rendered word: realistic JPEG sizes and some text to read."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, size, dtype=np.float32)
    font = ImageFont.load_default(size=max(size // 10, 10))
    images = []
    for _ in range(count):
        color = rng.uniform(60, 255, 3).astype(np.float32)
        base = ramp[:, None, None] * color + rng.normal(0, 12, (size, size, 3))
        image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
        ImageDraw.Draw(image).text((size // 10, size // 2), WORD, fill="white", font=font)
        images.append(np.asarray(image))
    return images


def mean_brightness(
    images: list[npt.NDArray[np.uint8]],
    prompts: list[str],
    ground_truths: list[str],
    metadata: list[dict[str, str]],
) -> list[float]:
    """The plug-in this benchmark loads (``flowgrpo.services.bench.reward:mean_brightness``)."""
    return [float(image.mean()) / 255 for image in images]


def time_scorer(
    name: str, make: Callable[[], Scorer], samples: Sequence[Sample], batch: int, repeats: int
) -> Row:
    started = time.perf_counter()
    scorer = make()
    load_s = time.perf_counter() - started
    try:
        return time_built(name, scorer, samples, batch, repeats, load_s=load_s)
    finally:
        scorer.close()


def time_built(
    name: str, scorer: Scorer, samples: Sequence[Sample], batch: int, repeats: int, *, load_s: float
) -> Row:
    # the warm-up run: lazy initialisation, the first kernels
    seconds = timed(lambda: _score_all(scorer, samples, batch), repeats=repeats, warmup=1)
    return _row(name, len(samples), batch, seconds, load_s)


def _row(name: str, images: int, batch: int, seconds: Figure, load_s: float) -> Row:
    return Row(name, images, batch, seconds, seconds.per(images, "images/s"), {"load": load_s})


def _score_all(scorer: Scorer, samples: Sequence[Sample], batch: int) -> None:
    for start in range(0, len(samples), batch):
        for outcome in scorer.score(samples[start : start + batch]):
            if isinstance(outcome, SampleError):
                raise RuntimeError(f"{scorer.name} failed during the benchmark: {outcome.message}")


# --- scorers under test --------------------------------------------------------------------------


def make_plugin() -> Scorer:
    from flowgrpo.rewards.plugins import PluginScorer

    return PluginScorer.load("plugin", "flowgrpo.services.bench.reward:mean_brightness")


def make_jpeg() -> Scorer:
    from flowgrpo.rewards.jpeg import JpegScorer

    return JpegScorer()


def make_offline_ocr() -> Scorer:
    from flowgrpo.rewards.ocr import OcrScorer
    from flowgrpo.rewards.offline_ocr import RapidOcrTranscriber

    return OcrScorer(RapidOcrTranscriber(), name="ocr_offline")


def make_judge(base_url: str) -> Callable[[], Scorer]:
    def make() -> Scorer:
        from flowgrpo.rewards.judge import JudgeClient, JudgeConfig
        from flowgrpo.rewards.ocr import OcrScorer

        return OcrScorer(JudgeClient(JudgeConfig(base_url=base_url, model="stub")), name="judge")

    return make


class _InstantChat(BaseHTTPRequestHandler):
    """Answers every chat completion at once with the word."""

    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": WORD}}]}).encode()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve_instant_chat(ports: Any) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _InstantChat)
    server.daemon_threads = True
    ports.put(server.server_address[1])
    server.serve_forever()


@contextmanager
def instant_chat_server() -> Iterator[str]:
    """A loopback chat-completions server in a child process (so its work is not timed as the
    client's), answering at once; ended when the block exits."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    child = context.Process(target=_serve_instant_chat, args=(ports,), daemon=True)
    child.start()
    try:
        yield f"http://127.0.0.1:{ports.get(timeout=60)}/v1"
    finally:
        child.terminate()
        child.join(timeout=10)


def pickscore_rows(args: argparse.Namespace, samples: Sequence[Sample]) -> list[Row]:
    """The ``pickscore`` row (preprocessing included) and the ``pickscore_model`` row."""
    from flowgrpo.rewards.pickscore import PickScorer, load_processor
    from flowgrpo.rewards.tiny_clip import GEOMETRIES, random_clip, save_processor

    geometry = GEOMETRIES[args.pickscore_geometry]
    with tempfile.TemporaryDirectory() as folder:
        save_processor(Path(folder), geometry.image_size)
        tokenizer, image_processor = load_processor(folder)

    started = time.perf_counter()
    model = random_clip(geometry, device=args.device).to(dtype=_torch_dtype(args.dtype))
    scorer = PickScorer(model, tokenizer, image_processor, batch_size=args.batch_size)
    load_s = time.perf_counter() - started  # a random init, not a checkpoint read
    name = f"pickscore[{args.pickscore_geometry},{args.device},{args.dtype}]"
    try:
        full = time_built(name, scorer, samples, args.batch_size, args.repeats, load_s=load_s)
        return [full, _model_only_row(name, scorer, samples, args)]
    finally:
        scorer.close()


def _model_only_row(name: str, scorer: Any, samples: Sequence[Sample], args: argparse.Namespace) -> Row:
    import torch

    batch = samples[: args.batch_size]
    pixels = scorer.preprocess([s.image for s in batch])
    tokens = scorer.tokenize([s.prompt for s in batch])

    def run() -> None:
        with torch.inference_mode():
            scorer.image_features(pixels)
            scorer.text_features(tokens)

    batches = max(len(samples) // args.batch_size, 1)
    device = pixels.device

    def all_batches() -> None:
        for _ in range(batches):
            run()

    seconds = timed(all_batches, repeats=args.repeats, device=device)
    count = batches * args.batch_size
    return _row(name.replace("pickscore", "pickscore_model"), count, args.batch_size, seconds, 0.0)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# --- entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flowgrpo bench reward", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument(
        "--scorers", default=",".join(SCORERS), help=f"comma-separated, of {', '.join(SCORERS)}"
    )
    parser.add_argument("--images", type=int, default=32, help="images scored per repeat")
    parser.add_argument("--size", type=int, default=512, help="image side in pixels")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--repeats", type=repeats_arg, default=MIN_REPEATS, help="timed runs, after a warm-up"
    )
    parser.add_argument("--pickscore-geometry", choices=["tiny", "vit-h-14"], default="tiny")
    parser.add_argument("--device", default="cpu", help="pickscore's device: cpu, cuda, cuda:1")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    unknown = set(args.scorers.split(",")) - set(SCORERS)
    if unknown:
        parser.error(f"unknown scorer(s) {', '.join(sorted(unknown))}; choose from {', '.join(SCORERS)}")
    return args


def run_rows(args: argparse.Namespace) -> list[Row]:
    chosen = args.scorers.split(",")
    samples = [
        Sample(image, prompt=f'a sign that says "{WORD}"') for image in bench_images(args.images, args.size)
    ]
    rows = []
    simple = {"jpeg_compressibility": make_jpeg, "plugin": make_plugin, "ocr_offline": make_offline_ocr}
    for name, make in simple.items():
        if name in chosen:
            rows.append(time_scorer(name, make, samples, args.batch_size, args.repeats))
    if "judge" in chosen:
        with instant_chat_server() as url:
            rows.append(time_scorer("judge", make_judge(url), samples, args.batch_size, args.repeats))
    if "pickscore" in chosen:
        rows.extend(pickscore_rows(args, samples))
    return rows


def print_rows(rows: Sequence[Row], args: argparse.Namespace) -> None:
    print(f"reward scorers, {args.size}x{args.size} images, median (min-max) of {args.repeats} runs "
          "after a warm-up; load: once")  # fmt: skip
    print(f"{'scorer':<40} {'images':>6} {'batch':>5} {'load s':>7} {'seconds':>21} {'images/s':>21}")
    for r in rows:
        timing = f"{r.once_s['load']:>7.2f} {r.seconds.brief('.3f'):>21} {r.images_per_s.brief('.1f'):>21}"
        print(f"{r.scorer:<40} {r.images:>6} {r.batch:>5} {timing}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run_rows(args)
    print_rows(rows, args)
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
