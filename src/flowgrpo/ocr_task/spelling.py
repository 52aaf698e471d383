"""How the tiny models spell words they never saw: the prompt is tokenised per character.

A word-level or BPE vocabulary gives a held-out word tokens (or merges) no training target had,
whose embeddings training never moved: the model cannot spell it. With a byte-level BPE that has
no merges (:func:`flowgrpo.models.bagel.checkpoint.build_character_tokenizer`: token id = byte,
then ``<|endoftext|>`` and the four Qwen markers, the published ``tokenizer.json`` layout), each
character of the task is one token, so every test target (a new pair, an unseen word, a
pseudo-word, new digits) is a new sequence of tokens that training targets hold: spelling is
learned per character and composes. The prompts' template words are spelled the same way (a
prompt is 30-50 tokens; the tiny models' sequences are short either way).

:func:`ocr_tokenizer` builds it and checks the split against it (one-line ValueError otherwise):
every character of every prompt is one token, and every token of a test target occurs in the
training targets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from flowgrpo.ocr_task.split import prompts, split

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from flowgrpo.models.bagel.config import SpecialTokens


def alphabet(texts: Iterable[str]) -> str:
    """The distinct characters of ``texts``, sorted."""
    return "".join(sorted({c for text in texts for c in text}))


def target_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of ``text`` as it stands inside a prompt (no special tokens added)."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def ocr_tokenizer() -> tuple[Tokenizer, SpecialTokens, str]:
    """The character tokenizer, its marker ids and the training targets' alphabet, after checking
    the task's split against it (module doc)."""
    from flowgrpo.models.bagel.checkpoint import build_character_tokenizer
    from flowgrpo.models.bagel.config import SPECIAL_TOKEN_NAMES, SpecialTokens

    tokenizer = build_character_tokenizer()
    for text in prompts("train") + prompts("test"):
        for char in set(text):
            if len(target_tokens(tokenizer, char)) != 1:
                raise ValueError(f"OCR tokenizer: {char!r} (in {text!r}) is not one token")
    train = split()["train"]
    seen = {token for t in train for token in target_tokens(tokenizer, t.text)}
    for target in split()["test"]:
        unseen = set(target_tokens(tokenizer, target.text)) - seen
        if unseen:
            raise ValueError(
                f"OCR tokenizer: test target {target.text!r} has tokens {sorted(unseen)} "
                "no training target has"
            )
    ids = {field: _token_id(tokenizer, name) for field, name in SPECIAL_TOKEN_NAMES.items()}
    return (
        tokenizer,
        SpecialTokens(**ids),
        alphabet(t.text for t in train),
    )


def _token_id(tokenizer: Tokenizer, name: str) -> int:
    token_id = tokenizer.token_to_id(name)
    if token_id is None:
        raise ValueError(f"OCR tokenizer: the marker {name} is missing")
    return int(token_id)
