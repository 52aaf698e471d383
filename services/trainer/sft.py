"""``flowgrpo sft``: supervised fine-tuning of BAGEL's gen path with flow matching on (prompt,
image) pairs, on the trainer's own machinery: the policy of ``load.py`` (full gen path or LoRA,
FSDP2 under torchrun; ``policy.heads`` and ``policy.text`` add the heads and the language half
for a model trained from scratch), the AdamW settings of ``trainer.optim``, the velocity the sampler and the
RL trainer compute (a prefilled prompt cache + ``predict_velocity``, under the same autocast),
and the trainer's atomic, verified checkpoints (a run resumes where it stopped).

The objective is BAGEL's pre-training one (SPEC section 2): a clean latent x0 (the image through
the checkpoint's VAE), a time t (``sigmoid(N(0, 1))`` or uniform, shifted), noise eps,
x_t = (1 - t) x0 + t eps, and the model's velocity regressed on eps - x0 (mean squared error
over every latent element). A share ``data.text_dropout`` of the samples is trained with the
empty context, so that classifier-free guidance has a text-unconditional branch to use.

Everything a step draws (t, eps, the dropout) is a function of (seed, step, the sample's place
in the global batch) and the data order one of (seed, epoch): the same run on 1 or N ranks
draws the same numbers. Outputs, in ``run_dir``: ``config.yaml``, ``metrics.jsonl`` (the
training curve and the evaluations), ``checkpoints/step_N`` and, at the end, ``model/``: the
fine-tuned BAGEL folder in the published layout (LoRA merged), ready for ``flowgrpo train``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from flowgrpo.config import dump_yaml
from flowgrpo.configs.trainer import OptimConfig
from flowgrpo.fileio import atomic_output
from flowgrpo.generate import GenerateOptions, load_sampler, sampler_params
from flowgrpo.image_folder import ImageText, read_image_folder
from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.checkpoint import EMA_FILE, load_special_tokens, load_vae
from flowgrpo.models.bagel.config import SpecialTokens
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids, patchify
from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest, compute_autocast, prefill_prompts
from flowgrpo.prompts import PromptTokenizer
from flowgrpo.rewards.base import Sample
from flowgrpo.rewards.build import build_reward
from flowgrpo.rewards.combine import reward_metrics
from flowgrpo.sampler_math import coordinate_seed
from flowgrpo.services.trainer.checkpoint import (
    CheckpointError,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from flowgrpo.services.trainer.distributed import Dist, close_distributed, init_distributed
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.sft_config import SftConfig
from flowgrpo.services.trainer.step import adamw, apply_gradients

ENCODE_BATCH = 64  # images per VAE forward while the dataset is encoded


# --- the data ------------------------------------------------------------------------------


@dataclass
class PairData:
    """The training pairs, encoded once: prompt ids and clean latent tokens."""

    texts: list[str]
    prompt_ids: list[Tensor]  # [L] int64 each: <|im_start|> + tokens + <|im_end|>
    latents: Tensor  # [M, N, 64] fp32, on the training device

    def __len__(self) -> int:
        return len(self.texts)


def encode_pairs(pairs: Sequence[ImageText], checkpoint: str, device: str) -> PairData:
    """Tokenise every prompt with the checkpoint's tokenizer (as data preparation does) and
    encode every image with the checkpoint's VAE (its posterior mean), in fp32."""
    tokenizer = PromptTokenizer.from_checkpoint(checkpoint)
    vae = load_vae(checkpoint, dtype=torch.float32, device=device)
    if vae.encoder is None:
        raise ValueError(f"{checkpoint}: the autoencoder has no encoder weights; sft encodes images")
    latents = []
    with torch.no_grad():
        for start in range(0, len(pairs), ENCODE_BATCH):
            chunk = np.stack([p.image for p in pairs[start : start + ENCODE_BATCH]])
            pixels = torch.from_numpy(chunk).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
            latents.append(patchify(vae.encode(pixels)))
    ids = [torch.tensor(tokenizer.encode(p.text).ids, dtype=torch.long) for p in pairs]
    return PairData([p.text for p in pairs], ids, torch.cat(latents).float())


def batch_rows(seed: int, step: int, batch_size: int, count: int) -> list[int]:
    """The dataset rows of ``step``'s batch: epochs of a permutation drawn from (seed, epoch)."""
    orders: dict[int, list[int]] = {}  # a batch spans one epoch, or two at its boundary
    rows = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, place = divmod(k, count)
        if epoch not in orders:
            generator = torch.Generator().manual_seed(coordinate_seed(seed, "epoch", epoch))
            orders[epoch] = torch.randperm(count, generator=generator).tolist()
        rows.append(orders[epoch][place])
    return rows


@dataclass
class Draws:
    """What one sample of a step draws: its time, its noise, whether it keeps its prompt."""

    t: float
    noise: Tensor  # [N, 64] fp32
    keep_text: bool


def sample_draws(cfg: SftConfig, step: int, place: int, shape: tuple[int, int]) -> Draws:
    """The draws of the ``place``-th sample of ``step``'s global batch (rank-independent)."""
    generator = torch.Generator().manual_seed(coordinate_seed(cfg.seed, step, place, "sft"))
    u = torch.randn((), generator=generator) if cfg.timesteps == "logit_normal" else None
    t = float(torch.sigmoid(u)) if u is not None else float(torch.rand((), generator=generator))
    s = cfg.timestep_shift
    t = s * t / (1.0 + (s - 1.0) * t)
    noise = torch.randn(shape, generator=generator)
    keep = float(torch.rand((), generator=generator)) >= cfg.data.text_dropout
    return Draws(t, noise, keep)


# --- the step ------------------------------------------------------------------------------


class FlowMatchingStep:
    """Owns the optimizer of a supervised fine-tuning run; ``run`` is one optimizer step."""

    def __init__(
        self, policy: TrainablePolicy, special: SpecialTokens, optim: OptimConfig, dist: Dist, cfg: SftConfig
    ) -> None:
        self.policy = policy
        self.special = special
        self.dist = dist
        self.cfg = cfg
        self.optim_config = optim
        self.optimizer = adamw(policy, optim)
        self.version = 0  # optimizer steps taken (the checkpoint's policy version)
        self.steps_done = 0
        self.keeps_old_policy = False

    def run(self, data: PairData, step: int) -> dict[str, float]:
        """One optimizer step on ``step``'s batch; this rank runs its share of the rows."""
        started = time.perf_counter()
        cfg = self.cfg
        rows = batch_rows(cfg.seed, step, cfg.batch_size, len(data))
        self._set_lr(step)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(1, dtype=torch.float64)
        places = self.dist.share(list(range(len(rows))))
        for start in range(0, len(places), cfg.micro_batch_size):
            part = places[start : start + cfg.micro_batch_size]
            shape = (data.latents.shape[1], data.latents.shape[2])
            draws = [sample_draws(cfg, step, place, shape) for place, _ in part]
            losses = self._losses(data, [rows[place] for place, _ in part], draws)
            valid = torch.tensor([v for _, v in part], dtype=losses.dtype, device=losses.device)
            # FSDP averages gradients over ranks: scale by world for the mean over the batch
            torch.autograd.backward((losses * valid).sum() * (self.dist.world / len(rows)))
            total += (losses.detach() * valid).sum().double().cpu()
        norm, skipped = apply_gradients(self.policy, self.optimizer, self.optim_config.grad_clip)
        self.version += 1
        self.steps_done += 1
        return {
            "sft/loss": float(self.dist.sum(total)) / len(rows),
            "sft/grad_norm": norm,
            "sft/lr": float(self.optimizer.param_groups[0]["lr"]),
            "sft/skipped": float(skipped),
            "sft/step_s": time.perf_counter() - started,
        }

    def counters(self) -> dict[str, float]:
        """What a checkpoint keeps besides tensors (the format's counters)."""
        return {"version": self.version, "steps_done": self.steps_done}

    def restore(self, counters: dict[str, float]) -> None:
        self.version, self.steps_done = int(counters["version"]), int(counters["steps_done"])

    def _set_lr(self, step: int) -> None:
        warmup, steps = self.cfg.warmup_steps, self.cfg.steps
        scale = min(1.0, (step + 1) / warmup) if warmup else 1.0
        if self.cfg.lr_decay == "cosine" and step >= warmup and steps > warmup:
            floor = self.cfg.min_lr_ratio
            progress = (step - warmup) / (steps - warmup)
            scale = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim_config.lr * scale

    def _losses(self, data: PairData, rows: list[int], draws: list[Draws]) -> Tensor:
        """Per-sample mean squared error of the velocity [B] (with gradients)."""
        model = self.policy.model
        device = data.latents.device
        # prompts kept first, then the dropped ones: one cache, the empty rows after the prefilled
        order = sorted(range(len(rows)), key=lambda i: not draws[i].keep_text)
        kept = [data.prompt_ids[rows[i]] for i in order if draws[i].keep_text]
        x0 = data.latents[[rows[i] for i in order]]
        noise = torch.stack([draws[i].noise for i in order]).to(device)
        t = torch.tensor([draws[i].t for i in order], dtype=torch.float32, device=device)
        x_t = (1.0 - t[:, None, None]) * x0 + t[:, None, None] * noise
        autocast = self._autocast()
        # the prompt cache: without gradients unless the und path trains too (policy.text)
        with torch.set_grad_enabled(self.policy.config.text), autocast:
            context = self._context(kept, len(rows) - len(kept), autocast)
        side = math.isqrt(x0.shape[1])
        pos_ids = latent_position_ids(side, side, model.config.max_latent_size, device)
        with autocast:
            v = model.predict_velocity(
                context, x_t, t, pos_ids, soi_id=self.special.vision_start, eoi_id=self.special.vision_end
            )
        losses = ((v.float() - (noise - x0)) ** 2).mean(dim=(1, 2))
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return losses[inverse.to(losses.device)]

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        """bf16 autocast of fp32 weights where asked (``autocast_bf16``), else the weights' own."""
        if self.cfg.autocast_bf16:
            return torch.autocast(self.policy.model.vae2llm.weight.device.type, dtype=torch.bfloat16)
        return compute_autocast(self.policy.model)

    def _context(
        self, kept: list[Tensor], dropped: int, autocast: contextlib.AbstractContextManager[object]
    ) -> KVCache:
        model = self.policy.model
        parts = [prefill_prompts(model, kept)] if kept else []
        if dropped:
            device = model.vae2llm.weight.device
            dtype = parts[0].keys[0].dtype if parts else _cache_dtype(model, autocast)
            parts.append(KVCache.empty(model.config, dropped, dtype, device))
        return parts[0] if len(parts) == 1 else KVCache.cat_rows(parts)

    def update(self) -> PolicyUpdate:
        """The trained tensors, whole, as the policy update a sampling model applies (every rank
        calls it: under FSDP each tensor is gathered)."""
        published = {n: t.detach().cpu() for n, t in self.policy.published().items()}
        if self.policy.kind == "lora":
            cfg = self.policy.config
            return PolicyUpdate(self.version + 1, "lora", published, cfg.lora_rank, cfg.lora_alpha)
        return PolicyUpdate(self.version + 1, "gen_path", published)


def _cache_dtype(model: BagelModel, autocast: contextlib.AbstractContextManager[object]) -> torch.dtype:
    """The dtype of a prefilled cache: the autocast's, or the und path's weights'."""
    if isinstance(autocast, torch.autocast):
        return autocast.fast_dtype
    return model.decoder.embed_tokens.weight.dtype


# --- evaluation ----------------------------------------------------------------------------


class Evaluator:
    """Samples the held-out prompts with the ODE (the same noise every time) from a sampling
    model that takes the run's weights as a rollout would, and scores them (rank 0 only)."""

    def __init__(self, cfg: SftConfig) -> None:
        self.cfg = cfg
        ecfg = cfg.eval
        self.prompts = _read_prompts(ecfg.prompts, ecfg.max_prompts)
        self.options = GenerateOptions(
            num_images=ecfg.images_per_prompt,
            num_points=ecfg.num_points,
            cfg_text_scale=ecfg.cfg_text_scale,
            seed=ecfg.seed,
            device=cfg.device,
            dtype=cfg.dtype,
            batch_size=ecfg.batch_size,
            height=cfg.data.resolution,
            width=cfg.data.resolution,
        )
        self.sampler: BagelSampler = load_sampler(cfg.model, self.options, None)
        self.applier = PolicyApplier(self.sampler.model)
        tokenizer = PromptTokenizer.from_checkpoint(cfg.model)
        self.requests = [
            SampleRequest(f"eval-{p}", s, torch.tensor(tokenizer.encode(text).ids))
            for p, text in enumerate(self.prompts)
            for s in range(ecfg.images_per_prompt)
        ]
        self.reward = build_reward(ecfg.reward)

    def __call__(self, update: PolicyUpdate | None) -> tuple[dict[str, float], list[npt.NDArray[np.uint8]]]:
        if update is not None and update.kind == "lora":
            self.applier.apply(replace(update, version=self.applier.version + 1))  # merged, as a rollout does
        elif update is not None:  # the gen path and, with policy.heads, the heads: copied in place
            unknown = self.sampler.model.load_state_dict(update.tensors, strict=False).unexpected_keys
            if unknown:  # the rest of the model is the base's: only unknown names are an error
                raise ValueError(f"the sampling model has no tensors {sorted(unknown)[:5]}")
        params = sampler_params(self.options, self.cfg.data.resolution, self.cfg.data.resolution)
        images: list[npt.NDArray[np.uint8]] = []
        for start in range(0, len(self.requests), self.options.batch_size):
            batch = self.requests[start : start + self.options.batch_size]
            out = self.sampler.generate(batch, params, seed=self.options.seed, step=0).images
            assert out is not None  # the sampler holds the VAE
            images.extend(out.cpu().numpy())
        texts = [self.prompts[int(r.prompt_uid.removeprefix("eval-"))] for r in self.requests]
        samples = [
            Sample(image=image, prompt=text, ground_truth=text)
            for image, text in zip(images, texts, strict=True)
        ]
        scored = self.reward.score(samples).results
        metrics = {f"eval/{k.removeprefix('critic/')}": v for k, v in reward_metrics(scored).items()}
        return metrics, images


def _read_prompts(path: str, most: int) -> list[str]:
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line][:most]
    if not prompts:
        raise ValueError(f"eval.prompts {path} holds no prompt")
    return prompts


# --- the run -------------------------------------------------------------------------------


def run_sft(cfg: SftConfig) -> Path:
    """Train, evaluate, checkpoint; write ``<run_dir>/model``. Every rank calls it."""
    dist = init_distributed(cfg.device)
    try:
        return SftRun(cfg, dist).run()
    finally:
        close_distributed()


class SftRun:
    """One ``flowgrpo sft`` run on this rank: its data, trainer, evaluator and outputs."""

    def __init__(self, cfg: SftConfig, dist: Dist) -> None:
        self.cfg, self.dist = cfg, dist
        self.run_dir = Path(cfg.run_dir)
        if dist.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.run_dir / "config.yaml")
        device = cfg.device
        if device == "cuda" and dist.enabled:  # torchrun: this rank's GPU
            device = f"cuda:{torch.cuda.current_device()}"
        if cfg.dtype == "float32":  # fp32 means fp32: no TF32 matmuls or convs (a GPU run's curve
            torch.backends.cuda.matmul.allow_tf32 = False  # then matches a CPU run's)
            torch.backends.cudnn.allow_tf32 = False
        pairs = read_image_folder(cfg.data.images, cfg.data.resolution, cfg.data.max_images)
        self.data = encode_pairs(pairs, cfg.model, device)
        dtype = getattr(torch, cfg.dtype)
        policy = load_policy(cfg.model, cfg.policy, dist, dtype=dtype, device=device,
                             param_dtype=dtype if device.startswith("cuda") else None)  # fmt: skip
        self.trainer = FlowMatchingStep(policy, load_special_tokens(cfg.model), cfg.optim, dist, cfg)
        self.evaluate = Evaluator(cfg) if cfg.eval.prompts and dist.rank == 0 else None
        self.metrics_file = self.run_dir / "metrics.jsonl"

    def run(self) -> Path:
        cfg, checkpoints = self.cfg, self.run_dir / "checkpoints"
        step = 0
        if (start := self._start(checkpoints)) is not None:
            step = load_checkpoint(start, self.trainer)
            self.say(f"resumed from {start} (step {step})")
        else:
            self.log_eval(step, base=True)
        self.say(
            f"sft {cfg.name}: {len(self.data)} pairs, {cfg.steps} steps of {cfg.batch_size}, {self.run_dir}"
        )
        trained_here = step < cfg.steps
        while step < cfg.steps:
            metrics = self.trainer.run(self.data, step)
            step += 1
            if step % cfg.log_every == 0 or step == cfg.steps:
                self.append({"step": step, "images": step * cfg.batch_size, **metrics})
                self.say(f"step {step}/{cfg.steps}: loss {metrics['sft/loss']:.4f}")
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.steps:
                self.log_eval(step)
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                save_checkpoint(checkpoints, self.trainer, step, cfg.keep_last, base_model=cfg.model)
        update = self.trainer.update()
        if trained_here:  # else this step's evaluation is in metrics.jsonl already
            self.log_eval(step, update=update)
        out = self.run_dir / "model"
        if self.dist.rank == 0:
            export_model(cfg.model, update, out)
            self.say(f"wrote the fine-tuned model to {out}")
        return out

    def _start(self, checkpoints: Path) -> Path | None:
        """The checkpoint to go on from: the newest, or, when the run went past ``steps`` (the
        same recipe run shorter), the one of step ``steps``: every draw and the learning rate
        depend on the step alone, so it is the model a run of ``steps`` steps ends with."""
        saved = checkpoint_steps(checkpoints)
        if not saved or max(saved) <= self.cfg.steps:
            return latest_checkpoint(checkpoints)
        if self.cfg.steps not in saved:
            raise CheckpointError(
                f"{checkpoints} holds steps {sorted(saved)}, past steps={self.cfg.steps} and without it: "
                "set steps to one of them, or another run_dir"
            )
        return saved[self.cfg.steps]

    def log_eval(self, step: int, *, base: bool = False, update: PolicyUpdate | None = None) -> None:
        """Evaluate the base (``base``) or the current weights; every rank calls it (the update
        is gathered under FSDP), rank 0 samples and scores."""
        if not self.cfg.eval.prompts:
            return
        if update is None and not base:
            update = self.trainer.update()
        if self.evaluate is None:
            return
        metrics, images = self.evaluate(None if base else update)
        self.append({"step": step, "images": step * self.cfg.batch_size, **metrics})
        grid = self.run_dir / "eval" / f"step_{step:08d}.png"
        save_grid(images, grid, self.cfg.eval.images_per_prompt)
        shown = {k: round(v, 4) for k, v in metrics.items() if "accuracy" in k or k == "eval/rewards/mean"}
        self.say(f"eval at step {step}: {shown}")

    def append(self, record: dict[str, float | int]) -> None:
        if self.dist.rank == 0:
            with self.metrics_file.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def say(self, line: str) -> None:
        if self.dist.rank == 0:
            print(line, flush=True)


def save_grid(images: list[npt.NDArray[np.uint8]], path: Path, columns: int) -> None:
    """The images as one PNG, ``columns`` to a row (a prompt's samples side by side)."""
    from PIL import Image

    rows = [np.concatenate(images[i : i + columns], axis=1) for i in range(0, len(images), columns)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        Image.fromarray(np.concatenate(rows, axis=0)).save(tmp, format="PNG")


# --- the fine-tuned folder -----------------------------------------------------------------


def export_model(base: str | Path, update: PolicyUpdate, out: str | Path) -> Path:
    """``base``'s folder with ``update`` applied to ``ema.safetensors`` (LoRA merged as a
    rollout merges it: W + alpha / r B A, in fp32 then the file's dtype), every other file
    copied; written into a hidden folder and renamed into place."""
    base, out = Path(base), Path(out)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns(EMA_FILE))
    tensors = _updated_tensors(base / EMA_FILE, update)
    with atomic_output(tmp / EMA_FILE) as path:
        save_file(tensors, path, metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _updated_tensors(path: Path, update: PolicyUpdate) -> dict[str, Tensor]:
    from flowgrpo.models.bagel.policy import LORA_A, LORA_B, merge_lora

    with safe_open(str(path), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    if update.kind == "gen_path":
        for name, value in update.tensors.items():
            tensors[name] = value.to(tensors[name].dtype).contiguous()
        return tensors
    for name, a in update.tensors.items():
        if name.endswith(LORA_A):
            module = name.removesuffix(LORA_A)
            weight = tensors[module + ".weight"]
            b = update.tensors[module + LORA_B]
            tensors[module + ".weight"] = merge_lora(
                weight.float(), a.float(), b.float(), update.lora_scale
            ).to(weight.dtype)
    return tensors
