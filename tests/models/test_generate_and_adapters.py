"""Prompt tokenisation, PEFT adapter round trip and ``flowgrpo generate`` on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.models.bagel.checkpoint import load_bagel_model, make_tiny_bagel
from flowgrpo.models.bagel.peft_format import load_peft_adapter, save_peft_adapter
from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate, PolicyUpdateError
from flowgrpo.prompts import PromptTokenizer

Q = "language_model.model.layers.0.self_attn.q_proj_moe_gen"


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
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["q_proj_moe_gen"])
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
    assert [r["file"] for r in records] == [
        "prompt0_0.png",
        "prompt0_1.png",
        "prompt1_0.png",
        "prompt1_1.png",
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
