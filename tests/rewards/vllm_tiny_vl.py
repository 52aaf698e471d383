"""Write a tiny random Qwen2-VL (vision-language) model, with tokenizer, chat template and image
processor config, for serving with vLLM on a CPU. Run with the Python of the vLLM environment:

    $FLOWGRPO_VLLM_PYTHON tests/rewards/vllm_tiny_vl.py OUT_DIR

Head dim 64 (vLLM's CPU attention refuses 16); mrope sections sum to head_dim / 2. The
processor files are written by hand: constructing a Qwen2VLProcessor needs the video processor,
which needs torchvision's compiled ops.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration

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
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


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


def config(ids: dict[str, int]) -> Qwen2VLConfig:
    text = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}, "rope_theta": 10000.0,
            "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"]}  # fmt: skip
    vision = {"depth": 2, "embed_dim": 128, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}  # fmt: skip
    return Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False,
    )  # fmt: skip


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(
        config({t: tok.convert_tokens_to_ids(t) for t in SPECIALS})
    ).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
                 "min_pixels": 56 * 56, "max_pixels": 224 * 224, "patch_size": 14, "temporal_patch_size": 2,
                 "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_resize": True,
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                 "do_convert_rgb": True}  # fmt: skip
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
