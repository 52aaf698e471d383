"""What the rollout and trainer benchmarks share: the 7B / tiny special tokens, SPEC-7 FLOPs,
benchmark prompts, models with random weights, device helpers and the measured matmul peak."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from flowgrpo.models.bagel.config import BagelConfig, SpecialTokens, VAEConfig
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.sampling import SampleRequest
from flowgrpo.models.bagel.vae import AutoEncoder
from flowgrpo.services.bench.stats import Figure, timed

GiB = 1 << 30
GROUP = 16  # samples per prompt (FlowGRPO's G): a batch holds ceil(batch / 16) distinct prompts
# The 7B's special-token ids (SPEC section 1); no tokenizer is loaded here.
SPECIAL_7B = SpecialTokens(im_start=151644, im_end=151645, vision_start=151652, vision_end=151653)
SPECIAL_TINY = SpecialTokens(im_start=384, im_end=385, vision_start=386, vision_end=387)  # make_tiny_bagel's
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# --- FLOPs (SPEC section 7) -----------------------------------------------------------------------


def gen_matmul_params(cfg: BagelConfig) -> int:
    """Matmul parameters of the generation expert's layers (6.525e9 for the 7B)."""
    q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = 2 * cfg.hidden * q_dim + 2 * cfg.hidden * kv_dim + 3 * cfg.hidden * cfg.intermediate
    return cfg.layers * per_layer


def spec_step_flops(cfg: BagelConfig, latent_tokens: int, context_lengths: list[int]) -> float:
    """Forward FLOPs of one denoising step: per row (every CFG branch of every sample is a row)
    2 x gen matmul params x T + 4 x T x K x head_dim x heads x layers, with T = N + 2 query tokens
    and K = the row's context length + T keys."""
    t = latent_tokens + 2
    attn = 4 * t * cfg.head_dim * cfg.heads * cfg.layers
    return float(sum(2 * gen_matmul_params(cfg) * t + attn * (length + t) for length in context_lengths))


# --- inputs and models ------------------------------------------------------------------------------


def make_requests(
    batch: int, prompt_len: int, special: SpecialTokens, *, group: int = GROUP, seed: int = 0
) -> list[SampleRequest]:
    """``batch`` samples of ceil(batch / group) prompts [im_start, body, im_end]; prompt j has
    prompt_len + 8 j tokens, so the conditional rows of several prompts differ in length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(math.ceil(batch / group)):
        body = torch.randint(0, special.im_start, (prompt_len + 8 * j - 2,), generator=g)
        ids = torch.cat([torch.tensor([special.im_start]), body, torch.tensor([special.im_end])])
        out += [SampleRequest(f"p{j}", s, ids) for s in range(min(group, batch - j * group))]
    return out


def random_bagel(cfg: BagelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> BagelModel:
    """Built on the meta device (no host copy of 28 GB), then materialised and initialised."""
    with torch.device("meta"):
        model = BagelModel(cfg).to(dtype)
    model.to_empty(device=device)
    model.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    return model.eval()


def random_vae(cfg: VAEConfig, dtype: torch.dtype, device: torch.device) -> AutoEncoder:
    """The decoder only, with PyTorch's default initialisation."""
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoEncoder(replace(cfg, has_encoder=False))
    return vae.to(dtype).eval()


# --- devices ---------------------------------------------------------------------------------------


def open_device(name: str, command: str) -> torch.device | None:
    """The device to measure on (a CUDA name becomes the current CUDA device), or None with the
    reason printed when CUDA is asked for and absent. TF32 off: fp32 matmuls stay fp32."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(
                f"flowgrpo bench {command} needs a CUDA device (or --model tiny --device cpu: a smoke test)"
            )
            return None
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return device


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def peak_memory(device: torch.device, into: dict[str, float], key: str) -> Iterator[None]:
    """Record the peak allocated device memory (GiB) of the block under ``into[key]``."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    yield
    if device.type == "cuda":
        into[key] = torch.cuda.max_memory_allocated(device) / GiB


class Stopwatch:
    """Marks inside a timed call, read afterwards: CUDA events on the device's current stream
    (no synchronisation while marking), the wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if name in self.marks:
            return
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float:
        a, b = self.marks[start], self.marks[end]
        if self.device.type == "cuda":
            b.synchronize()
            return float(a.elapsed_time(b)) / 1e3
        return float(b - a)


# --- the MFU denominator ------------------------------------------------------------------------------


WARM_UP_S = 0.5  # of back-to-back products before the peak is timed: idle clocks ramp up


def matmul_tflops(device: torch.device, size: int) -> Figure:
    """bf16 matmul rate on random data (SPEC section 7's MFU denominator): products back to back
    for WARM_UP_S (at least 3), then the median of 10 timed ones, as TFLOP/s."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    begin, done = time.perf_counter(), 0
    while done < 3 or time.perf_counter() - begin < WARM_UP_S:
        a @ b
        sync(device)
        done += 1
    seconds = timed(lambda: a @ b, device=device, warmup=1, repeats=10)
    return seconds.per(2 * size**3 / 1e12, "TFLOP/s")


@dataclass
class MatmulPeak:
    """The matmul peak measured before the timed sections and again after them."""

    size: int
    before: Figure
    after: Figure | None = None

    @property
    def used(self) -> float:
        """TFLOP/s every MFU of the report divides by: the larger of the two medians. A peak
        taken while the clocks still ramp up from idle, or while they are held down by the heat
        of a long section, understates what the chip can do and so overstates MFU; the larger
        of the two is the better estimate of the limit and the lower (conservative) MFU."""
        return max(self.before.median, self.after.median if self.after else -math.inf)

    @classmethod
    def measure(cls, device: torch.device) -> MatmulPeak:
        # a CPU (the smoke runs): 256, whose bf16 products run at 512's rate (0.4-0.5 GFLOP/s
        # both on a 2-core Xeon, whose bf16 matmul has no native kernel) in an eighth of the time:
        # 512's 28 products of a run's two peaks took 6-15 s of its CPU
        size = 8192 if device.type == "cuda" else 256
        return cls(size, matmul_tflops(device, size))

    def measure_after(self, device: torch.device) -> None:
        self.after = matmul_tflops(device, self.size)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "before": self.before.to_json()}
        if self.after is not None:
            out["after"] = self.after.to_json()
            out["used_tflops"] = self.used
            out["used"] = "the larger median of before and after"
        return out

    def line(self) -> str:
        after = f", after {self.after:.4g}" if self.after else ""
        return f"bf16 matmul peak {self.size}^3: before {self.before:.4g}{after}"


def mfu(flops: float, seconds: Figure, peak_tflops: float) -> Figure:
    """Model FLOPs utilisation of ``flops`` done in ``seconds`` against ``peak_tflops``."""
    return seconds.per(flops / (peak_tflops * 1e12), "MFU")
