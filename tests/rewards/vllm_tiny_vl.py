"""A tiny random Qwen3-VL (transformers' Qwen3-VL classes) with tokenizer, chat template and
processor, for serving with vLLM on a CPU, and the reference answer transformers itself gives.
Run with the Python of the vLLM environment (vllm_env.sh):

    $FLOWGRPO_VLLM_PYTHON tests/rewards/vllm_tiny_vl.py build OUT_DIR
    $FLOWGRPO_VLLM_PYTHON tests/rewards/vllm_tiny_vl.py answer OUT_DIR REQUESTS.json

``answer`` reads a JSON list of chat-completions bodies (the judge's, images as data URIs), renders
each with the model's chat template, decodes its images, runs ``generate`` greedily and prints a
JSON list of ``{"text": ..., "prompt_tokens": ..., "image_tokens": ...}``: what vLLM must answer
to the same requests if prompt, image and answer survive the trip.

Text head dim 64 (vLLM's CPU attention refuses 16); the interleaved mrope sections fit
head_dim / 2. Vision: patch 16, merge 2 (Qwen3-VL's), 2 blocks with one deepstack merger. The
output head is scaled up so that greedy decoding is not decided by rounding between vLLM's and
transformers' kernels (a random head's logits are all within a few hundredths of each other),
and the rows of special and non-ASCII tokens are zeroed, so that the answer is printable text
that decodes the same token by token (vLLM) and at once (transformers).
"""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

CORPUS = ["hello world the quick brown fox jumps over the lazy dog", "Please output only the text content"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>"]  # fmt: skip
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, MERGE = 16, 2
SIZE = {"shortest_edge": 32 * 32, "longest_edge": 256 * 256}  # pixels: at most 64 image tokens
HEAD_SCALE = 200.0  # logits far apart: greedy decoding is not decided by kernel rounding


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 50, trainer)
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    return fast


def config(ids: dict[str, int]) -> Qwen3VLConfig:
    text = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                                "mrope_interleaved": True},
            "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"]}  # fmt: skip
    vision = {"depth": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2, "patch_size": PATCH,
              "spatial_merge_size": MERGE, "temporal_patch_size": 2, "in_channels": 3, "out_hidden_size": 128,
              "num_position_embeddings": 256, "deepstack_visual_indexes": [0]}  # fmt: skip
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip


def processor(tok: PreTrainedTokenizerFast) -> Qwen3VLProcessor:
    common: dict[str, Any] = {"patch_size": PATCH, "temporal_patch_size": 2, "merge_size": MERGE,
                              "image_mean": [0.5] * 3, "image_std": [0.5] * 3}  # fmt: skip
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=SIZE, **common),
        video_processor=Qwen3VLVideoProcessor(
            size={"shortest_edge": 4 * 32 * 32, "longest_edge": 4 * 256 * 256}, **common
        ),
        tokenizer=tok,
        chat_template=TEMPLATE,
    )


def unprintable(tok: PreTrainedTokenizerFast) -> list[int]:
    """Special tokens, and tokens that decode to anything but printable ASCII (a lone byte of a
    multi-byte character decodes differently token by token and in one go)."""
    return [i for i in range(len(tok)) if i in tok.all_special_ids or not tok.decode([i]).isprintable()
            or not tok.decode([i]).isascii()]  # fmt: skip


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config({t: tok.convert_tokens_to_ids(t) for t in SPECIALS}))
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
        model.lm_head.weight[unprintable(tok)] = 0.0  # logit 0: below the best of the others
    model.save_pretrained(out)
    processor(tok).save_pretrained(out)


def answers(model_dir: Path, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = Qwen3VLProcessor.from_pretrained(model_dir)
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [answer(proc, model, request) for request in requests]


def answer(
    proc: Qwen3VLProcessor, model: Qwen3VLForConditionalGeneration, request: dict[str, Any]
) -> dict[str, Any]:
    images = [
        Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))).convert("RGB")
        for message in request["messages"] if isinstance(message["content"], list)
        for part in message["content"] if part["type"] == "image_url"
    ]  # fmt: skip
    text = proc.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=request["max_tokens"], do_sample=False)
    prompt = inputs["input_ids"][0]
    return {
        "text": proc.tokenizer.decode(out[0, prompt.shape[0] :], skip_special_tokens=True),
        "prompt_tokens": int(prompt.shape[0]),
        "image_tokens": int((prompt == model.config.image_token_id).sum()),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"] and len(sys.argv) == 3:
        build(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["answer"] and len(sys.argv) == 4:
        print(json.dumps(answers(Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()))))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} build OUT_DIR | answer MODEL_DIR REQUESTS.json")
