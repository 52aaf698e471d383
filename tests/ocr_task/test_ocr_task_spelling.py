"""The OCR task's tokenizer spells per character: every test target (unseen words, pseudo-words,
new digits) is a sequence of tokens the training targets hold, encode / decode round-trips, and
the folder layout is the published one. A BPE trained on the task's prompts does not have the
first property (the reason for the choice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from flowgrpo.models.bagel.checkpoint import (
    TOKENIZER_FILE,
    _save_tokenizer,
    build_tiny_tokenizer,
    load_special_tokens,
)
from flowgrpo.models.bagel.config import SpecialTokens, tiny_drawer
from flowgrpo.ocr_task import spelling
from flowgrpo.ocr_task.spelling import ocr_tokenizer, target_tokens
from flowgrpo.ocr_task.split import Target, prompts, split


def test_each_character_is_its_byte_and_test_targets_use_only_training_tokens() -> None:
    tokenizer, specials, letters = ocr_tokenizer()
    train, test = split()["train"], split()["test"]
    seen = {ord(c) for t in train for c in t.text}  # written out: an ASCII character's id is its byte
    for target in train + test:
        assert target_tokens(tokenizer, target.text) == [ord(c) for c in target.text], target
    for target in test:
        assert set(target_tokens(tokenizer, target.text)) <= seen, target
    assert letters == "".join(sorted({c for t in train for c in t.text}))
    assert set(letters) == set(" 0123456789abcdefghijklmnopqrstuvwxyz")
    assert specials == SpecialTokens(im_start=257, im_end=258, vision_start=259, vision_end=260)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 261 <= tiny_drawer().vocab


def test_prompts_round_trip_and_hold_their_target_as_its_characters() -> None:
    tokenizer, _, _ = ocr_tokenizer()
    for name in ("train", "test"):
        for target, prompt in zip(split()[name], prompts(name), strict=True):
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            assert tokenizer.decode(ids) == prompt
            quoted = [ord(c) for c in f'"{target.text}"']
            start = ids.index(ord('"'))
            assert ids[start : start + len(quoted)] == quoted, prompt
    odd = 'Ünïcode, "quotes",\ttabs and  spaces'
    assert tokenizer.decode(tokenizer.encode(odd, add_special_tokens=False).ids) == odd


def test_a_bpe_trained_on_the_prompts_gives_unseen_words_unseen_tokens() -> None:
    """What the character tokenizer avoids: the drawer's tokenizer recipe on the training prompts,
    with a vocabulary large enough that many training words are one token (2,000: 56% of them),
    gives held-out words tokens no training target had (nothing trained their embeddings):
    measured 55 of 149 unseen words, 67 of 100 pseudo-words."""
    bpe = build_tiny_tokenizer(2000, prompts("train"))
    seen = {i for t in split()["train"] for i in target_tokens(bpe, t.text)}
    for tier in ("unseen_word", "pseudo_word"):
        of_tier = [t for t in split()["test"] if t.tier == tier]
        unseen = [t for t in of_tier if set(target_tokens(bpe, t.text)) - seen]
        assert len(unseen) >= len(of_tier) // 4, (tier, len(unseen))


def test_the_folder_layout_is_the_published_one(tmp_path: Path) -> None:
    tokenizer, specials, _ = ocr_tokenizer()
    _save_tokenizer(tokenizer, tmp_path)
    assert load_special_tokens(tmp_path) == specials
    data = json.loads((tmp_path / TOKENIZER_FILE).read_text())
    assert data["model"]["type"] == "BPE" and data["model"]["merges"] == []
    assert data["pre_tokenizer"]["type"] == "ByteLevel" and data["decoder"]["type"] == "ByteLevel"
    assert len(json.loads((tmp_path / "vocab.json").read_text())) == 256
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and config["eos_token"] == "<|im_end|>"


def test_a_test_target_with_a_character_training_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = split()
    odd = {"train": real["train"], "test": (*real["test"], Target("jazz-q", "pseudo_word"))}
    monkeypatch.setattr(spelling, "split", lambda: odd)
    with pytest.raises(ValueError, match=r"test target 'jazz-q' has tokens \[45\]"):
        ocr_tokenizer()
