"""The sampler math of FlowGRPO, shared by the rollout engine and the trainer.

Behaviour log-probs (rollout) and training log-probs (trainer) must be the same function, so the
schedule, the CFG combination, the SDE step and its log-prob live here once.
Everything is computed in fp32 whatever the model's dtype. Randomness is a pure function of its
coordinates (run seed, step, prompt uid, sample index; a branched group's initial noise, of the
first three): results never depend on how many replicas there are or which one served a request.

Conventions (BAGEL's): x_t = (1 - t) x0 + t eps, the model predicts v = eps - x0, time runs
from t = 1 (noise) to t = 0 (image), so dt = t_next - t < 0.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flowgrpo.sampler_params import SamplerSettings

# --- schedule ------------------------------------------------------------------------------


def shifted_schedule(num_points: int, shift: float = 3.0) -> Tensor:
    """t = linspace(1, 0, n), then t <- shift t / (1 + (shift - 1) t): n points, n - 1 steps."""
    if num_points < 2:
        raise ValueError(f"num_points={num_points}: a schedule needs at least 2 points (1 step)")
    t = torch.linspace(1.0, 0.0, num_points, dtype=torch.float64)
    return (shift * t / (1.0 + (shift - 1.0) * t)).to(torch.float32)


# --- classifier-free guidance ----------------------------------------------------------------


def cfg_active(t: Tensor, interval: tuple[float, float]) -> Tensor:
    """Per-sample mask [B]: CFG applies where t is inside (lo, hi] (never judged from sample 0)."""
    lo, hi = interval
    return (t > lo) & (t <= hi)


def _norm(v: Tensor, per_token: bool) -> Tensor:
    """L2 norm of each sample [B, 1, 1] or of each token [B, N, 1] of a [B, N, C] tensor."""
    norm: Tensor
    if per_token:
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    else:
        norm = torch.linalg.vector_norm(v.flatten(1), dim=1).view(-1, 1, 1)
    return norm


def _renorm(v: Tensor, v_cond: Tensor, per_token: bool, renorm_min: float) -> Tensor:
    scale = (_norm(v_cond, per_token) / (_norm(v, per_token) + 1e-8)).clamp(min=renorm_min, max=1.0)
    return v * scale


def combine_cfg(
    v_cond: Tensor,
    v_uncond: Tensor,
    t: Tensor,
    params: SamplerSettings,
    v_img_uncond: Tensor | None = None,
) -> Tensor:
    """Combine the CFG branches of velocities [B, N, C] at times t [B] (BAGEL's CFG).

    ``v_img_uncond`` is the image-unconditional branch; for text-to-image it is the conditional
    context, so ``None`` means ``v_cond``. Samples whose t is outside the CFG interval get
    ``v_cond`` unchanged. The renorm never raises a sample's norm above the conditional one.
    """
    v_cond, v_uncond = v_cond.float(), v_uncond.float()
    v_img = v_cond if v_img_uncond is None else v_img_uncond.float()
    s_t, s_i = params.cfg_text_scale, params.cfg_img_scale
    v_text = v_uncond + s_t * (v_cond - v_uncond)
    if params.cfg_renorm_type == "text_channel":
        v_text = _renorm(v_text, v_cond, per_token=True, renorm_min=params.cfg_renorm_min)
        out = v_img + s_i * (v_text - v_img) if s_i > 1.0 else v_text
    else:
        out = v_img + s_i * (v_text - v_img) if s_i > 1.0 else v_text
        per_token = params.cfg_renorm_type == "channel"
        out = _renorm(out, v_cond, per_token=per_token, renorm_min=params.cfg_renorm_min)
    active = cfg_active(t.float(), params.cfg_interval).view(-1, 1, 1)
    return torch.where(active, out, v_cond)


# --- SDE / CPS steps and their log-probs -------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """One denoising step: the next latent, the Gaussian it was drawn from, and its log-prob.

    ``log_prob`` is one scalar per sample: the Gaussian log-density WITHOUT normaliser terms,
    averaged over all latent elements (the BAGEL reference setting). ``std`` is what the KL term
    divides by, per sample (0 for an ODE step): for "sde" the diffusion scale std_t (the step's
    Gaussian has std_t sqrt(-dt), so the KL is the true one times -dt, as in flow_grpo's
    ``kl_loss``); for "cps" the step's own std. Like the log-prob, its scale depends on sde_type.
    """

    x_next: Tensor  # [B, N, C]
    mean: Tensor  # [B, N, C]
    std: Tensor  # [B]
    log_prob: Tensor  # [B]


def _per_sample(value: Tensor | float, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=torch.float32, device=like.device).expand(like.shape[0]).clone()


def sde_std(sigma: Tensor, sigma_after_first: float, noise_level: float) -> Tensor:
    """std_t = a sqrt(sigma / (1 - s)), s = sigma except s = schedule[1] where sigma == 1."""
    s = torch.where(sigma >= 1.0, torch.full_like(sigma, sigma_after_first), sigma)
    return noise_level * torch.sqrt(sigma / (1.0 - s))


def sde_mean(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, std: Tensor) -> Tensor:
    """mean = x (1 + std^2 dt / (2 sigma)) + v (1 + std^2 (1 - sigma) / (2 sigma)) dt."""
    sig, dt, var = sigma.view(-1, 1, 1), (sigma_next - sigma).view(-1, 1, 1), std.view(-1, 1, 1) ** 2
    return x * (1.0 + var * dt / (2.0 * sig)) + v * (1.0 + var * (1.0 - sig) / (2.0 * sig)) * dt


def gaussian_log_prob(x_next: Tensor, mean: Tensor, var: Tensor) -> Tensor:
    """-(x' - mean)^2 / (2 var), averaged per sample; 0 where var is 0 (a deterministic step)."""
    safe = torch.where(var > 0, var, torch.ones_like(var)).view(-1, 1, 1)
    lp = (-((x_next - mean) ** 2) / (2.0 * safe)).flatten(1).mean(dim=1)
    return torch.where(var > 0, lp, torch.zeros_like(lp))


def sde_step(
    x: Tensor,
    v: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    *,
    sigma_after_first: float,
    noise_level: float,
    noise: Tensor | None = None,
    x_next: Tensor | None = None,
) -> StepResult:
    """One FlowGRPO "sde" step from t = sigma to sigma_next, in fp32.

    Sampling: pass ``noise`` (standard normal, like x). Training: pass the stored ``x_next`` to
    get its log-prob under the current velocity. noise_level 0 is the plain Euler ODE.
    """
    x, v = x.float(), v.float()
    sig, sig_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    std = sde_std(sig, sigma_after_first, noise_level)
    mean = sde_mean(x, v, sig, sig_next, std)
    var = std**2 * (sig - sig_next)  # std^2 (-dt)
    if x_next is None:
        if noise is None:
            raise ValueError("sde_step needs `noise` to sample or `x_next` to score")
        x_next = mean + (std * torch.sqrt(sig - sig_next)).view(-1, 1, 1) * noise.float()
    return StepResult(x_next.float(), mean, std, gaussian_log_prob(x_next.float(), mean, var))


def cps_step(
    x: Tensor,
    v: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    *,
    noise_level: float,
    noise: Tensor | None = None,
    x_next: Tensor | None = None,
) -> StepResult:
    """One "cps" step (coefficient-preserving sampling).

    Its log-prob is the references' -mean((x' - mean)^2) with no variance scaling, so its ratio
    scale differs from "sde": choose the clip range per sde_type.
    """
    x, v = x.float(), v.float()
    sig, sig_next = _per_sample(sigma, x).view(-1, 1, 1), _per_sample(sigma_next, x).view(-1, 1, 1)
    s = sig_next * math.sin(noise_level * math.pi / 2)
    x0_hat, x1_hat = x - sig * v, x + (1.0 - sig) * v
    mean = (1.0 - sig_next) * x0_hat + torch.sqrt((sig_next**2 - s**2).clamp(min=0.0)) * x1_hat
    if x_next is None:
        if noise is None:
            raise ValueError("cps_step needs `noise` to sample or `x_next` to score")
        x_next = mean + s * noise.float()
    lp = (-((x_next.float() - mean) ** 2)).flatten(1).mean(dim=1)
    return StepResult(x_next.float(), mean, s.view(-1), lp)


def ode_step(x: Tensor, v: Tensor, sigma: Tensor | float, sigma_next: Tensor | float) -> Tensor:
    """Euler step of the flow ODE: x <- x + v (t_next - t)."""
    x = x.float()
    dt = (_per_sample(sigma_next, x) - _per_sample(sigma, x)).view(-1, 1, 1)
    return x + v.float() * dt


# --- randomness as a pure function of coordinates ------------------------------------------------


def coordinate_seed(*coords: object) -> int:
    """A 63-bit seed that depends only on the coordinates (stable across processes/platforms)."""
    digest = hashlib.blake2b("/".join(map(str, coords)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_noise(
    shape: tuple[int, ...], *, seed: int, step: int, prompt_uid: str, sample_index: int, stream: str
) -> Tensor:
    """Standard-normal fp32 noise for one sample, drawn on the CPU from its coordinates.

    ``stream`` names the draw ("init" or "sde/<denoising step>"), so each draw is independent.
    Drawn on the CPU so the same coordinates give the same noise on every device.
    """
    return _normal(shape, seed, step, prompt_uid, sample_index, stream)


def initial_noise(
    shape: tuple[int, ...], *, seed: int, step: int, prompt_uid: str, sample_index: int, shared: bool
) -> Tensor:
    """A sample's initial noise x_1: its own draw (stream "init"), or with ``shared`` (branched
    rollouts, ``SamplerSettings.branch``) its prompt group's one draw (stream "init/group", not a
    function of ``sample_index``), so the G samples follow one ODE trajectory until their window."""
    if shared:
        return _normal(shape, seed, step, prompt_uid, "init/group")
    return sample_noise(shape, seed=seed, step=step, prompt_uid=prompt_uid, sample_index=sample_index,
                        stream="init")  # fmt: skip


def _normal(shape: tuple[int, ...], *coords: object) -> Tensor:
    gen = torch.Generator(device="cpu").manual_seed(coordinate_seed(*coords))
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def batch_noise(
    shape: tuple[int, ...], seed: int, step: int, keys: list[tuple[str, int]], stream: str
) -> Tensor:
    """Noise [B, *shape] for samples keyed by (prompt_uid, sample_index): batch-composition free."""
    return torch.stack(
        [
            sample_noise(shape, seed=seed, step=step, prompt_uid=uid, sample_index=idx, stream=stream)
            for uid, idx in keys
        ]
    )


# --- the SDE window --------------------------------------------------------------------------


def window_begin(params: SamplerSettings, seed: int, step: int, prompt_uid: str) -> int:
    """First trained step of a prompt group's SDE window: [begin, begin + size).

    Shared by the G samples of a group (per-sample windows collapsed a reference run) and a pure
    function of (run seed, step, prompt uid): never of a GPU rank or replica index.
    """
    lo, hi = params.window_range
    choices = hi - params.window_size - lo + 1
    if choices < 1 or lo < 0 or hi > params.num_steps:  # callers check() first; this names the cause
        raise ValueError(f"window_size={params.window_size} in window_range=[{lo}, {hi}] does not fit "
                         f"a schedule of {params.num_steps} steps")  # fmt: skip
    if params.window_strategy == "fixed":
        return lo + coordinate_seed(seed, "window") % choices
    if params.window_strategy == "progressive":
        return lo + step % choices
    return lo + coordinate_seed(seed, step, prompt_uid, "window") % choices
