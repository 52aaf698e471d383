"""The prepared-dataset format, shared by the writer (``prepare``) and the one reader (``load``).

A prepared dataset is a folder::

    train.parquet   test.parquet   meta.json

Each ``<split>.parquet`` holds one row per kept prompt, in input-file order, with the columns of
:data:`COLUMNS`. ``meta.json`` (:class:`DatasetMeta`) names the tokenizer (sha256 of the
checkpoint's ``tokenizer.json`` and the marker ids), the maximum length, the per-split counts of
read / empty / duplicate / bad / kept / truncated lines, every bad line with its number, and the
sha256 of each parquet file: a parquet file that does not match its meta.json (a preparation
interrupted half-way, or files of two preparations mixed) is refused by the reader.

Prompt uids are ``<split>-<first 16 hex digits of sha256(prompt text)>``. They depend on the text
only, not on the line number, the tokenizer or the other lines: adding, removing or reordering
prompts keeps every other prompt's uid, and two runs (or two preparations with different
tokenizers or maximum lengths) can be compared prompt by prompt. The sampler seeds its noise
from the uid, so the same prompt draws the same noise in every run with the same seed.
Duplicate lines are dropped at preparation, so a uid is unique within a split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

FORMAT_NAME = "flowgrpo-prompts"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"  # in the checkpoint folder
KINDS = ("pickscore", "ocr", "compose")
SPLITS = ("train", "test")

# column -> (arrow type, meaning); the order is the files' column order
COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "data_source": (pa.string(), "the data set's name (verl's column; metrics are keyed by scorer)"),
    "split": (pa.string(), "train or test"),
    "index": (pa.int64(), "row number within the split, 0..n-1"),
    "line": (pa.int64(), "1-based line number in the input text file"),
    "prompt_uid": (pa.string(), "<split>-<sha256(prompt)[:16]>, stable across preparations"),
    "prompt": (pa.string(), "the prompt text (the input line, whitespace-stripped)"),
    "prompt_ids": (pa.list_(pa.int64()), "<|im_start|> + tokens + <|im_end|>, at most max_length"),
    "truncated": (pa.bool_(), "the prompt body was cut to fit max_length"),
    "ground_truth": (
        pa.string(),
        "reward ground truth: the caption (pickscore), the OCR target, or the canonical compose prompt",
    ),
}


class DatasetError(ValueError):
    """Input that cannot be prepared, or a prepared dataset that cannot be used as it is; the
    message names the file and the fix."""


def schema() -> pa.Schema:
    return pa.schema([pa.field(name, dtype, nullable=False) for name, (dtype, _) in COLUMNS.items()])


def parquet_name(split: str) -> str:
    return f"{split}.parquet"


def prompt_uid(split: str, text: str) -> str:
    return f"{split}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:16]}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenizerInfo:
    sha256: str  # of the checkpoint's tokenizer.json, byte for byte
    path: str  # where it was read at preparation (informative)
    im_start: int
    im_end: int


@dataclass(frozen=True)
class SplitCounts:
    read: int  # lines in the input file
    empty: int  # blank lines, skipped
    duplicate: int  # repeats of an earlier line (after stripping), dropped; the first is kept
    bad: int  # lines that cannot be used (OCR: no usable quoted span; compose: outside the grammar)
    kept: int  # rows written = read - empty - duplicate - bad
    truncated: int  # kept rows whose body was cut to max_length


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str
    text: str  # the start of the line, for the report


@dataclass(frozen=True)
class SplitMeta:
    file: str  # <split>.parquet, in the dataset folder
    sha256: str  # of that file
    source: str  # the input text file
    source_sha256: str
    counts: SplitCounts
    bad_lines: tuple[BadLine, ...] = ()


@dataclass(frozen=True)
class DatasetMeta:
    format: str
    format_version: int
    kind: str  # pickscore | ocr | compose
    data_source: str
    max_length: int
    tokenizer: TokenizerInfo
    splits: dict[str, SplitMeta]
    flowgrpo_version: str
