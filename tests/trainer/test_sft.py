"""``flowgrpo sft``: flow matching on (prompt, image) pairs, run through its command line (the
CLI's ``main``: in this process for one rank, as a command under torchrun for two).

- it learns: the training loss falls below an lr = 0 control's on the same batches and noise;
- the objective is the one written out here independently (x_t, eps - x0, the text dropout);
- 2 FSDP ranks train as 1 process does; a resumed run as an uninterrupted one, bitwise;
- the written model is the published layout, and sampling it equals sampling the base with the
  run's update applied as a rollout applies it (LoRA merged);
- a bad image folder is one line naming the line of metadata.jsonl, exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from flowgrpo.config import load_config
from flowgrpo.configs.trainer import PolicyConfig
from flowgrpo.image_folder import ImageFolderError, ImageText, read_image_folder, write_image_folder
from flowgrpo.models.bagel.checkpoint import (
    EMA_FILE,
    load_bagel_model,
    load_special_tokens,
    load_vae,
    make_tiny_drawer,
)
from flowgrpo.models.bagel.model import latent_position_ids, patchify
from flowgrpo.prompts import PromptTokenizer
from flowgrpo.services.trainer.sft import batch_rows, sample_draws
from flowgrpo.services.trainer.sft_config import SftConfig

from .inprocess_cli import flowgrpo

ROOT = Path(__file__).resolve().parents[2]
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def squares(count: int, seed: int = 0) -> list[ImageText]:
    """A square of the prompt's colour somewhere on a grey canvas."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(count):
        name = list(COLOURS)[i % len(COLOURS)]
        image = np.full((64, 64, 3), 51, np.uint8)
        x, y = rng.integers(4, 44, size=2)
        image[y : y + 16, x : x + 16] = COLOURS[name]
        pairs.append(ImageText(f"a {name} square", image))
    return pairs


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sft")
    pairs = squares(64)
    write_image_folder(root / "pairs", pairs)
    model = make_tiny_drawer(root / "base", [p.text for p in pairs], seed=0)
    (root / "eval.txt").write_text("".join(f"a {c} square\n" for c in COLOURS))
    return model, root


def sft(root: Path, model: Path, run: str, *options: str, nproc: int = 1) -> list[dict[str, float]]:
    """``flowgrpo sft`` with these options: one process runs the CLI's ``main`` here (what the
    command runs, without starting another interpreter: seconds a run), at one thread as a
    process of its own would with OMP_NUM_THREADS=1; several are the command under torchrun."""
    args = ["sft", "/dev/null", f"run_dir={root / run}", f"model={model}", f"data.images={root / 'pairs'}",
            "batch_size=16", "micro_batch_size=8", "log_every=1", "optim.lr=2e-3", *options]  # fmt: skip
    if nproc == 1:
        flowgrpo(*args, threads=1)
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                   "-m", "flowgrpo.services.cli", *args]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    lines = (root / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(records: list[dict[str, float]]) -> list[float]:
    return [r["sft/loss"] for r in records if "sft/loss" in r]


@pytest.mark.long  # handed out first under xdist (tests/conftest.py)
def test_the_loss_is_flow_matching_written_out_independently(setup: tuple[Path, Path]) -> None:
    """Step 0's loss (lr = 0: nothing changes it) recomputed here with the one-pass forward
    (``BagelModel.forward``: another code path than the run's prefill + query), from the same
    draws: x_t = (1 - t) x0 + t eps, target eps - x0, an empty prompt where dropped."""
    model_dir, root = setup
    records = sft(root, model_dir, "objective", "steps=1", "optim.lr=0", "data.text_dropout=0.5")
    cfg = load_config(SftConfig, None, [f"model={model_dir}", f"data.images={root}", "batch_size=16",
                                        "data.text_dropout=0.5"])  # fmt: skip
    model = load_bagel_model(model_dir, dtype=torch.float32)
    special = load_special_tokens(model_dir)
    tokenizer = PromptTokenizer.from_checkpoint(model_dir)
    vae = load_vae(model_dir)
    pairs = squares(64)
    rows = batch_rows(cfg.seed, 0, 16, len(pairs))
    total, dropped = 0.0, 0
    for place, row in enumerate(rows):
        draw = sample_draws(cfg, 0, place, (16, 64))
        pixels = torch.from_numpy(pairs[row].image).permute(2, 0, 1)[None].float() / 127.5 - 1
        with torch.no_grad():
            x0 = patchify(vae.encode(pixels))
            ids = tokenizer.encode(pairs[row].text).ids if draw.keep_text else []
            dropped += not draw.keep_text
            x_t = (1 - draw.t) * x0 + draw.t * draw.noise[None]
            input_ids = torch.tensor([ids], dtype=torch.long)
            v = model(input_ids, torch.ones_like(input_ids, dtype=torch.bool), x_t, torch.tensor([draw.t]),
                      latent_position_ids(4, 4, model.config.max_latent_size), soi_id=special.vision_start,
                      eoi_id=special.vision_end)  # fmt: skip
        total += float(((v - (draw.noise[None] - x0)) ** 2).mean())
    assert 2 <= dropped <= 14  # the dropout is drawn: about half of 16
    assert losses(records)[0] == pytest.approx(total / 16, rel=1e-5)


def test_sft_learns_against_its_lr0_control(setup: tuple[Path, Path]) -> None:
    model_dir, root = setup
    trained = losses(sft(root, model_dir, "trained", "steps=40", "policy.heads=true"))
    control = losses(sft(root, model_dir, "control", "steps=40", "policy.heads=true", "optim.lr=0"))
    assert trained[0] == control[0]  # the same batch and noise, the same weights: step 0 is equal
    gains = [c - t for c, t in zip(control[-10:], trained[-10:], strict=True)]
    print(f"last 10 steps: trained {np.mean(trained[-10:]):.4f}, control {np.mean(control[-10:]):.4f}")
    assert all(g > 0 for g in gains), gains  # every one of the last 10 batches, paired
    assert np.mean(trained[-10:]) < 0.5 * np.mean(control[-10:])


def test_two_fsdp_ranks_train_as_one_process(setup: tuple[Path, Path]) -> None:
    """The whole model trained (heads and the language half too: the prompt's cache, which
    carries gradients then, is a second forward through every FSDP unit before the backward)."""
    model_dir, root = setup
    everything = ("policy.heads=true", "policy.text=true")
    one = losses(sft(root, model_dir, "one", "steps=4", *everything))
    two = losses(sft(root, model_dir, "two", "steps=4", *everything, nproc=2))
    # FSDP reduces the gradients in another order than one process sums them
    assert two == pytest.approx(one, rel=1e-4)


def test_a_resumed_run_equals_an_uninterrupted_one(setup: tuple[Path, Path]) -> None:
    model_dir, root = setup
    straight = losses(sft(root, model_dir, "straight", "steps=6"))
    sft(root, model_dir, "resumed", "steps=3", "save_every=3")
    resumed = losses(sft(root, model_dir, "resumed", "steps=6", "save_every=3"))
    assert resumed == straight  # bitwise: the optimizer state, data order and draws all resume


def test_the_written_lora_model_samples_as_the_base_with_the_update(setup: tuple[Path, Path]) -> None:
    model_dir, root = setup
    sft(root, model_dir, "lora", "steps=3", "policy.kind=lora", "policy.lora_rank=4")
    written = root / "lora" / "model"
    assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in model_dir.iterdir())
    base = load_bagel_model(model_dir, dtype=torch.float32)
    tuned = load_bagel_model(written, dtype=torch.float32)
    changed = [n for n, p in tuned.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert changed and all("moe_gen" in n for n in changed)  # the adapted gen-path linears, merged
    from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate
    from flowgrpo.services.trainer.checkpoint import latest_checkpoint, read_policy_update

    update = read_policy_update(latest_checkpoint(root / "lora" / "checkpoints"))  # type: ignore[arg-type]
    PolicyApplier(base).apply(
        PolicyUpdate(1, update.kind, update.tensors, update.lora_rank, update.lora_alpha)
    )
    for name, value in tuned.state_dict().items():
        torch.testing.assert_close(value, base.state_dict()[name], rtol=0, atol=1e-7, msg=name)


def bad_folder(tmp_path: Path, line: str) -> Path:
    from PIL import Image

    folder = tmp_path / "pairs"
    folder.mkdir()
    (folder / "metadata.jsonl").write_text('{"file_name": "0.png", "text": "fine"}\n' + line + "\n")
    Image.new("RGB", (64, 64)).save(folder / "0.png")
    return folder


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"file_name": "../x.png", "text": "a"}', "must be a path inside the folder"),
        ('{"file_name": "/etc/passwd", "text": "a"}', "must be a path inside the folder"),
        ('{"file_name": "missing.png", "text": "a"}', "missing.png does not exist"),
        ('{"file_name": "0.png"}', "'text' must be a non-empty string"),
        ('{"file_name": "0.png", "text": "' + "x" * 3000 + '"}', "3000 characters"),
        ("[1, 2]", "not a JSON object"),
        ("{not json", "not a JSON object"),
    ],
)
def test_a_bad_image_folder_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ImageFolderError, match=r"metadata\.jsonl:2") as error:
        read_image_folder(bad_folder(tmp_path, line), 64, 100)
    assert message in str(error.value)


def test_at_the_cli_a_bad_image_folder_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    folder = bad_folder(tmp_path, '{"file_name": "../x.png", "text": "a"}')
    done = subprocess.run(
        [sys.executable, "-m", "flowgrpo.services.cli", "sft", "/dev/null", f"model={tmp_path}",
         f"data.images={folder}", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "metadata.jsonl:2" in lines[0], done.stderr


def test_the_cosine_decay_follows_its_formula_written_out(setup: tuple[Path, Path]) -> None:
    """lr_decay=cosine: the warm-up, then lr * (m + (1 - m) (1 + cos(pi p)) / 2) with p the share
    of the steps after the warm-up done, down to lr * m (m = min_lr_ratio) at the last step."""
    model_dir, root = setup
    records = sft(root, model_dir, "cosine", "steps=12", "warmup_steps=2", "lr_decay=cosine",
                  "min_lr_ratio=0.1", "optim.lr=1e-3")  # fmt: skip
    got = [r["sft/lr"] for r in records if "sft/lr" in r]
    expected = [1e-3 * 0.5, 1e-3] + [
        1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * (step - 2) / 10))) for step in range(2, 12)
    ]
    assert got == pytest.approx(expected, rel=1e-9)
    assert got[-1] < 0.13e-3 and got[2] == pytest.approx(1e-3)  # the floor is neared, the peak kept


def test_policy_text_trains_the_language_half_and_nothing_the_image_never_reads(
    setup: tuple[Path, Path],
) -> None:
    """``policy.text=true``: the token embeddings and the und expert learn from the image loss
    (through the prompt's cache); the und final norm and ``lm_head`` make text logits only, so
    they stay as they were; without it every und tensor stays bitwise the base's."""
    from flowgrpo.models.bagel.config import is_gen_path, is_text_path

    model_dir, root = setup
    with_text = losses(sft(root, model_dir, "text", "steps=3", "policy.heads=true", "policy.text=true"))
    without = losses(sft(root, model_dir, "no-text", "steps=3", "policy.heads=true"))
    assert with_text[0] == without[0]  # the same weights, batch and draws: step 0's loss is equal
    assert with_text[1:] != without[1:]  # the prompt's reading changed what step 1 saw
    base = load_bagel_model(model_dir, dtype=torch.float32).state_dict()
    for run, trains_text in (("text", True), ("no-text", False)):
        tuned = load_bagel_model(root / run / "model", dtype=torch.float32).state_dict()
        changed = {n for n, p in tuned.items() if not torch.equal(p, base[n])}
        und = {n for n in base if is_text_path(n)}
        assert "language_model.model.embed_tokens.weight" in und and not any(is_gen_path(n) for n in und)
        assert any(".self_attn.q_proj.weight" in n for n in und) and any(".mlp.up_proj." in n for n in und)
        # the image reads the last layer's und keys and values, not what that layer computes after
        last = f"language_model.model.layers.{max(int(n.split('.')[3]) for n in und if '.layers.' in n)}."
        unread = ("self_attn.q_", "self_attn.o_proj", "mlp.", "post_attention_layernorm")
        read = {n for n in und if not (n.startswith(last) and n.removeprefix(last).startswith(unread))}
        assert len(read) > len(und) / 2 and last + "self_attn.k_proj.weight" in read
        assert (read <= changed) is trains_text and (not und & changed) is (not trains_text), run
        assert not changed & {"language_model.lm_head.weight", "language_model.model.norm.weight"}
        assert {n for n in changed if is_gen_path(n)}  # the gen path trains either way


def test_bf16_autocast_trains_every_weight_in_fp32_at_bf16_precision(setup: tuple[Path, Path]) -> None:
    """``autocast_bf16=true``, the compose base's GPU setting (everything trains, so no weight may
    be bf16), here on the CPU's autocast (test_sft_gpu.py: CUDA's)."""
    # measured here: step 0 1.170448 and 1.170419, the last 5 steps 0.8428 and 0.8420
    assert_bf16_autocast_learns_as_fp32(*setup, "device=cpu")


def assert_bf16_autocast_learns_as_fp32(model_dir: Path, root: Path, device: str) -> None:
    """Step 0's loss is the fp32 run's to bf16's precision and not bitwise it (the matmuls ran in
    bf16), 20 steps learn as the fp32 run's do, and the written model keeps the base's dtypes."""
    name = device.removeprefix("device=")
    everything = (device, "policy.heads=true", "policy.text=true", "steps=20")
    fp32 = losses(sft(root, model_dir, f"{name}-fp32", *everything))
    bf16 = losses(sft(root, model_dir, f"{name}-bf16", *everything, "autocast_bf16=true"))
    tail = np.mean(fp32[-5:]), np.mean(bf16[-5:])
    print(f"fp32, bf16: step 0 {fp32[0]:.6f}, {bf16[0]:.6f}; the last 5 steps {tail[0]:.4f}, {tail[1]:.4f}")
    assert bf16[0] != fp32[0] and bf16[0] == pytest.approx(fp32[0], rel=1e-2)
    learnt = fp32[0] - tail[0]
    assert learnt > 0.2 * fp32[0]
    assert abs(tail[1] - tail[0]) < 0.1 * learnt
    assert dtypes(root / f"{name}-bf16" / "model" / EMA_FILE) == dtypes(model_dir / EMA_FILE)


def dtypes(path: Path) -> dict[str, str]:
    with safe_open(path, "pt") as tensors:
        return {name: tensors.get_slice(name).get_dtype() for name in tensors.keys()}  # noqa: SIM118


def test_bf16_autocast_is_for_fp32_weights() -> None:
    with pytest.raises(ValueError, match=r"autocast_bf16=true is for dtype=float32"):
        SftConfig(model="m", device="cuda", dtype="bfloat16", autocast_bf16=True).validate()
    with pytest.raises(ValueError, match=r"autocast_bf16=true computes in bf16"):
        SftConfig(
            model="m", device="cuda", dtype="bfloat16", policy=PolicyConfig(kind="full", heads=True)
        ).validate()


def test_policy_text_is_for_sft_alone() -> None:
    from flowgrpo.configs.trainer import TrainerConfig

    with pytest.raises(ValueError, match=r"policy\.text=true is for flowgrpo sft"):
        TrainerConfig(policy=PolicyConfig(kind="full", text=True)).validate()
    with pytest.raises(ValueError, match=r"set policy\.kind=full"):
        PolicyConfig(kind="lora", text=True).validate()
