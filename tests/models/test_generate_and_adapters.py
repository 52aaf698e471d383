"""Prompt tokenisation, PEFT adapter round trip and ``flowgrpo generate`` on a tiny checkpoint and
on the checkpoints of real tiny training runs (LoRA and the full gen path)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.generate import prompt_names
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, load_vae, make_tiny_bagel
from flowgrpo.models.bagel.peft_format import load_peft_adapter, save_peft_adapter
from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate, PolicyUpdateError
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.prompts import PromptTokenizer
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.cli import main
from flowgrpo.services.trainer.checkpoint import find_run_checkpoint, read_policy_update

ROOT = Path(__file__).resolve().parents[2]
Q = "language_model.model.layers.0.self_attn.q_proj_moe_gen"
# the CPU demo cut to two steps of 2 prompts x 4 samples, checkpointed after each, no validation
RUN = ["launch.launcher=inprocess", "schedule.steps=2", "schedule.save_every=1", "schedule.eval_every=0",
       "data.group_size=4"]  # fmt: skip
GEN = ["--prompt", "a red fox", "--num-images", "2", "--steps", "6", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


def test_prompt_ids_have_the_markers_and_truncate_the_body(tiny: Path) -> None:
    tok = PromptTokenizer.from_checkpoint(tiny)
    body = tok.tokenizer.encode("a red fox", add_special_tokens=False).ids
    enc = tok.encode("a red fox")
    assert enc.ids == [tok.im_start, *body, tok.im_end] and not enc.truncated
    assert (tok.im_start, tok.im_end) == (384, 385)  # read from the tokenizer, as the tiny factory wrote them
    short = tok.encode("a red fox jumps over the lazy dog", max_tokens=4)
    assert (
        short.truncated
        and len(short.ids) == 4
        and short.ids[0] == tok.im_start
        and short.ids[-1] == tok.im_end
    )
    with pytest.raises(FileNotFoundError, match="must hold the tokenizer files"):
        PromptTokenizer.from_checkpoint(tiny / "nowhere")


def test_peft_adapter_round_trip_and_errors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        Q + ".lora_A.weight": torch.randn(4, 64, generator=g),
        Q + ".lora_B.weight": torch.randn(64, 4, generator=g),
    }
    save_peft_adapter(tmp_path / "adapter", PolicyUpdate(1, "lora", tensors, lora_rank=4, lora_alpha=8.0))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, [Q])  # full names
    back = load_peft_adapter(tmp_path / "adapter", version=3)
    assert back.version == 3 and back.lora_scale == 2.0
    assert back.tensors.keys() == tensors.keys() and all(
        torch.equal(back.tensors[k], tensors[k]) for k in tensors
    )
    with pytest.raises(FileNotFoundError, match="is not a PEFT LoRA adapter folder"):
        load_peft_adapter(tmp_path)
    with pytest.raises(PolicyUpdateError, match="only LoRA updates"):
        save_peft_adapter(tmp_path / "x", PolicyUpdate(1, "gen_path", {}))


def test_generate_cli_writes_images_and_a_lora_changes_them(tiny: Path, tmp_path: Path) -> None:
    base_cmd = [sys.executable, "-m", "flowgrpo.services.cli", "generate", "--checkpoint", str(tiny),
                "--prompt", "a red fox", "--prompt", 'a sign that says "hi"', "--num-images", "2",
                "--height", "32", "--width", "48",
                "--steps", "6", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    out = subprocess.run(
        [*base_cmd, "--out", str(tmp_path / "base")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (tmp_path / "base" / "images.jsonl").read_text().splitlines()]
    assert [r["file"] for r in records] == [  # <prompt>_<sample>.png, the prompt as a slug
        "a-red-fox_0.png",
        "a-red-fox_1.png",
        "a-sign-that-says-hi_0.png",
        "a-sign-that-says-hi_1.png",
    ]
    base = [np.asarray(Image.open(tmp_path / "base" / r["file"])) for r in records]
    assert all(img.shape == (32, 48, 3) and img.dtype == np.uint8 for img in base)

    model = load_bagel_model(tiny, dtype=torch.float32)
    shape = dict(model.named_parameters())[Q + ".weight"].shape
    g = torch.Generator().manual_seed(1)
    lora = {Q + ".lora_A.weight": torch.randn(4, shape[1], generator=g),
            Q + ".lora_B.weight": torch.randn(shape[0], 4, generator=g)}  # fmt: skip
    save_peft_adapter(tmp_path / "adapter", PolicyUpdate(1, "lora", lora, lora_rank=4, lora_alpha=64.0))
    PolicyApplier(model).apply(
        load_peft_adapter(tmp_path / "adapter")
    )  # the CLI's path: it must place every tensor
    out = subprocess.run([*base_cmd, "--out", str(tmp_path / "lora"), "--lora", str(tmp_path / "adapter")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    adapted = [np.asarray(Image.open(tmp_path / "lora" / r["file"])) for r in records]
    assert any(not np.array_equal(a, b) for a, b in zip(base, adapted, strict=True))


@pytest.fixture(scope="module")
def runs(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A real two-step run of each policy kind on the tiny checkpoint: kind -> run folder."""
    folders = {}
    for kind in ("lora", "full"):
        folder = tmp_path_factory.mktemp(f"run-{kind}")
        cmd = [sys.executable, "-m", "flowgrpo.services.cli", "train", "examples/tiny_jpeg.yaml",
               f"run_dir={folder}", f"model.checkpoint={tiny}", f"trainer.policy.kind={kind}",
               *RUN]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        folders[kind] = folder
    return folders


def images(folder: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(folder / f"a-red-fox_{s}.png")) for s in range(2)]


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_generate_from_a_run_checkpoint(
    kind: str, runs: dict[str, Path], tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(runs[kind])
    assert main(["generate", "--run", run, *GEN, "--out", str(tmp_path / "latest")]) == 0
    assert main(["generate", "--run", run, *GEN, "--out", str(tmp_path / "again")]) == 0
    assert main(["generate", "--run", run, "--step", "1", *GEN, "--out", str(tmp_path / "step1")]) == 0
    base_size = ["--height", "64", "--width", "64"]
    assert (
        main(["generate", "--checkpoint", str(tiny), *base_size, *GEN, "--out", str(tmp_path / "base")]) == 0
    )
    policy = "LoRA" if kind == "lora" else "full gen-path"
    assert f"{run}: the {policy} policy of step 2, on {tiny}" in capsys.readouterr().out

    latest = images(tmp_path / "latest")
    assert all(image.shape == (64, 64, 3) for image in latest)  # default: the run's sampling.resolution
    assert all(np.array_equal(a, b) for a, b in zip(latest, images(tmp_path / "again"), strict=True))
    for other in ("base", "step1"):  # the same seed and noise, other weights
        assert not any(np.array_equal(a, b) for a, b in zip(latest, images(tmp_path / other), strict=True))

    # what a rollout samples once the trainer's update of step 2 is applied to the base model
    model = load_bagel_model(tiny, dtype=torch.float32)
    PolicyApplier(model).apply(read_policy_update(find_run_checkpoint(run).path))
    sampler = BagelSampler(model, load_vae(tiny, dtype=torch.float32), load_special_tokens(tiny))
    ids = torch.tensor(PromptTokenizer.from_checkpoint(tiny).encode("a red fox").ids)
    params = SamplerParams(num_points=7, cfg_text_scale=4.0, noise_level=0.0, height=64, width=64,
                           window_size=1, window_range=(0, 1), window_strategy="fixed")  # fmt: skip
    rollout = sampler.generate([SampleRequest("a-red-fox", s, ids) for s in range(2)], params, seed=0, step=0)
    assert rollout.images is not None
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(latest, rollout.images, strict=True))
    if kind == "lora":  # the adapter names the base checkpoint the run trained on
        adapter = find_run_checkpoint(run).path / "adapter" / "adapter_config.json"
        assert json.loads(adapter.read_text())["base_model_name_or_path"] == str(tiny.resolve())


def test_generate_errors_are_one_line(
    runs: dict[str, Path], tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    limit = "px is above this checkpoint's limit of 128 px"
    cases = [
        (["--run", str(tmp_path / "nowhere")], "nowhere is not a run folder (no config.yaml)"),
        (["--run", str(runs["full"]), "--step", "7"], "has no checkpoint of step 7; it has steps 1, 2"),
        (["--run", str(runs["lora"]), "--height", "256"], f"height 256 {limit}"),
        (["--checkpoint", str(tiny), "--width", "144"], f"width 144 {limit}"),
        (["--checkpoint", str(tiny), "--height", "40"], "height 40 px must be a positive multiple of 16"),
        (["--checkpoint", str(tmp_path / "nowhere")], "ema.safetensors does not exist"),
    ]  # fmt: skip
    for args, message in cases:
        assert main(["generate", *args, *GEN, "--out", str(tmp_path / "out")]) == 1, args
        err = capsys.readouterr().err
        assert err.startswith("flowgrpo generate: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_the_default_size_is_the_checkpoints_limit(tiny: Path, tmp_path: Path) -> None:
    args = ["--prompt", "a red fox", "--steps", "2", "--device", "cpu", "--dtype", "float32"]
    assert main(["generate", "--checkpoint", str(tiny), *args, "--out", str(tmp_path)]) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "images.jsonl").read_text().splitlines()]
    assert (record["file"], record["height"], record["width"]) == (
        "a-red-fox_0.png",
        128,
        128,
    )  # 8 tokens x 16 px
    assert np.asarray(Image.open(tmp_path / "a-red-fox_0.png")).shape == (128, 128, 3)


def test_prompt_file_names_are_safe_and_distinct() -> None:
    prompts = ["A red fox!", "a red fox", "Ünïcode/../path", "", "a red fox 2", "a red fox", "x" * 99]
    assert prompt_names(prompts) == [
        "a-red-fox", "a-red-fox-2", "unicode-path", "prompt", "a-red-fox-2-2", "a-red-fox-3", "x" * 60,
    ]  # fmt: skip
