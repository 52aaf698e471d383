"""Prompt tokenisation, done ONCE (at data preparation, or by ``flowgrpo generate``).

BAGEL's text-to-image prompt is ``[<|im_start|>] + tokens(text) + [<|im_end|>]`` with no chat
template and no other special tokens (as BAGEL's own inference). When a prompt is longer than the
maximum, the body is cut so that both markers stay. The marker ids are read from the
tokenizer, never hard-coded. Rollout and trainer receive these ids on the bus and never
tokenise again (a reference stack tokenised twice, differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MAX_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class EncodedPrompt:
    ids: list[int]
    truncated: bool  # the body was cut to fit max_tokens


class PromptTokenizer:
    """The checkpoint's tokenizer, wrapped to produce BAGEL prompt ids."""

    def __init__(self, tokenizer: Tokenizer, source: str = "") -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.im_start = self._marker(IM_START)
        self.im_end = self._marker(IM_END)

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> PromptTokenizer:
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the checkpoint folder must hold the tokenizer files")
        return cls(Tokenizer.from_file(str(path)), source=str(path))

    def _marker(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"the tokenizer {self.source or ''} has no {token} token: is it a Qwen2.5 tokenizer?"
            )
        return int(token_id)

    def encode(self, text: str, max_tokens: int = MAX_PROMPT_TOKENS) -> EncodedPrompt:
        if max_tokens < 3:
            raise ValueError(f"max_tokens={max_tokens}: a prompt needs room for two markers and a token")
        body = self.tokenizer.encode(text, add_special_tokens=False).ids
        keep = max_tokens - 2
        return EncodedPrompt([self.im_start, *body[:keep], self.im_end], truncated=len(body) > keep)
