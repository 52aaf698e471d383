"""Data preparation: flow_grpo-style prompt files -> a prepared dataset (:mod:`.format`).

Input: ``<input-dir>/train.txt`` and ``<input-dir>/test.txt``, UTF-8, one prompt per line
(flow_grpo's ``dataset/pickscore`` and ``dataset/ocr``; ``flowgrpo data compose-prompts`` for
``compose``). Each line is stripped of surrounding whitespace, then, in this order:

1. an empty line is skipped (counted as ``empty``);
2. a bad line is dropped and reported with its line number (``on_bad_line="drop"``, counted as
   ``bad``) or the whole preparation fails (``"fail"``): for ``ocr``, a line without a
   double-quoted span, or whose first span is empty or blank; for ``compose``, a line the
   grammar (:func:`flowgrpo.compose.grammar.parse`) cannot read, with the parser's reason. It
   is never kept: its reward would be undefined;
3. a line equal to an earlier kept line is dropped (counted as ``duplicate``); the first one is
   kept, so rows follow the file's order;
4. the rest is tokenised once with the checkpoint's tokenizer as the sampler expects,
   ``[<|im_start|>] + tokens + [<|im_end|>]``, cut to ``max_length`` with both markers kept
   (counted as ``truncated``).

The ground truth is the prompt itself for ``pickscore`` (the caption PickScore compares the
image with), the first double-quoted span for ``ocr`` (the reward's own extractor), and for
``compose`` the canonical prompt of the line's spec, ``prompt_of(parse(line))``: the grammar is
the one format of a spec (no second, JSON form to keep in step with it), the compose reward
parses it again, and a line written with other case or spacing scores as its canonical form. Nothing
is written until every split has been read and checked; then each ``<split>.parquet`` and last
``meta.json`` are written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import codecs
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from flowgrpo import __version__
from flowgrpo.compose.grammar import PromptError, parse, prompt_of
from flowgrpo.config import to_dict
from flowgrpo.data.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    KINDS,
    META_FILE,
    SPLITS,
    TOKENIZER_FILE,
    BadLine,
    DatasetError,
    DatasetMeta,
    SplitCounts,
    SplitMeta,
    TokenizerInfo,
    file_sha256,
    parquet_name,
    prompt_uid,
    schema,
)
from flowgrpo.fileio import atomic_output, atomic_write
from flowgrpo.prompts import MAX_PROMPT_TOKENS, PromptTokenizer
from flowgrpo.rewards.ocr import extract_target


@dataclass(frozen=True)
class PrepareOptions:
    kind: Literal["pickscore", "ocr", "compose"]
    max_length: int = MAX_PROMPT_TOKENS  # tokens per prompt, both markers included
    splits: tuple[str, ...] = SPLITS  # which <split>.txt files to read; each must exist
    on_bad_line: Literal["drop", "fail"] = "drop"
    data_source: str = ""  # the data set's name in every row; empty: the kind
    progress: bool = True  # a progress bar on stderr (shown only on a terminal)


@dataclass(frozen=True)
class _Line:
    number: int
    text: str
    ground_truth: str


@dataclass(frozen=True)
class _Split:  # read, checked and tokenised; not written yet
    name: str
    source: Path
    source_sha256: str
    table: pa.Table
    counts: SplitCounts
    bad_lines: tuple[BadLine, ...]


def prepare_dataset(
    model_path: str | Path, input_dir: str | Path, output_dir: str | Path, options: PrepareOptions
) -> DatasetMeta:
    """Prepare every split of ``options.splits``; return the meta written to ``meta.json``.
    Raises :class:`DatasetError` (naming the file and the fix) before writing anything."""
    _check_options(options)
    tokenizer, info = _load_tokenizer(Path(model_path))
    splits = [_prepare_split(Path(input_dir), name, tokenizer, options) for name in options.splits]
    return _write(Path(output_dir), splits, info, options)


def ocr_problem(text: str) -> str | None:
    """Why ``text`` cannot be an OCR prompt, or None when its first quoted span is usable."""
    target = extract_target(text)
    if target is None:
        if text.count('"') == 1:
            return 'an opening " without a closing one'
        if "\u201c" in text or "\u201d" in text:
            return 'no double-quoted span (only straight " quotes count, not \u201c \u201d)'
        return "no double-quoted span"
    if not target.strip():
        return "empty quoted span"
    return None


def compose_problem(text: str) -> str | None:
    """Why ``text`` is not a prompt of the compose grammar, or None when it is."""
    try:
        parse(text)
    except PromptError as error:
        return f"not in the compose grammar, {error.reason}"
    return None


def line_problem(kind: str, text: str) -> str | None:
    """Why a (stripped, non-empty) line cannot be a prompt of ``kind``, or None."""
    if kind == "ocr":
        return ocr_problem(text)
    if kind == "compose":
        return compose_problem(text)
    return None


def ground_truth(kind: str, text: str) -> str:
    """What the reward compares an image of a usable line with (see the module doc)."""
    if kind == "ocr":
        return extract_target(text) or ""
    if kind == "compose":
        return prompt_of(parse(text))
    return text


def report(meta: DatasetMeta, output_dir: str | Path, shown: int = 10) -> tuple[list[str], list[str]]:
    """(warnings: the bad lines, ``shown`` per split; summary: one line per split)."""
    warnings, summary = [], []
    for name, split in meta.splits.items():
        c = split.counts
        for bad in split.bad_lines[:shown]:
            warnings.append(f"{split.source}:{bad.line}: dropped, {bad.reason}: {bad.text}")
        if len(split.bad_lines) > shown:
            more = len(split.bad_lines) - shown
            warnings.append(f"{split.source}: ... {more} more bad lines, all listed in {META_FILE}")
        summary.append(
            f"{name}: kept {c.kept} of {c.read} lines (dropped {c.empty} empty, {c.duplicate} duplicate, "
            f"{c.bad} bad; {c.truncated} truncated to {meta.max_length} tokens) -> "
            f"{Path(output_dir) / split.file}"
        )
    return warnings, summary


def _check_options(options: PrepareOptions) -> None:
    if options.kind not in KINDS:
        raise DatasetError(f"unknown dataset kind {options.kind!r}: use one of {', '.join(KINDS)}")
    if options.max_length < 3:
        raise DatasetError(f"max length {options.max_length}: a prompt needs two markers and a token (>= 3)")
    unknown = [s for s in options.splits if s not in SPLITS]
    if unknown or not options.splits or len(set(options.splits)) != len(options.splits):
        raise DatasetError(f"splits {list(options.splits)}: give each of {', '.join(SPLITS)} at most once")
    if options.on_bad_line not in ("drop", "fail"):
        raise DatasetError(f"on_bad_line {options.on_bad_line!r}: use drop or fail")
    source = options.data_source
    if source and not all(ch.isalnum() or ch in "._-" for ch in source):
        raise DatasetError(f"data source {source!r}: use letters, digits and . _ - (it names metrics)")


def _load_tokenizer(model_path: Path) -> tuple[PromptTokenizer, TokenizerInfo]:
    path = model_path / TOKENIZER_FILE
    if not path.is_file():
        raise DatasetError(
            f"{path} not found: the model path must be a BAGEL checkpoint folder with its tokenizer"
        )
    try:
        tokenizer = PromptTokenizer.from_checkpoint(model_path)
    except Exception as exc:  # tokenizers raises plain Exception on a malformed file
        raise DatasetError(f"{path}: cannot use this tokenizer: {exc}") from None
    info = TokenizerInfo(file_sha256(path), str(path.resolve()), tokenizer.im_start, tokenizer.im_end)
    return tokenizer, info


def _read_lines(path: Path) -> tuple[list[str], str]:
    """(the lines of a UTF-8 text file, numbered as an editor numbers them; the file's sha256)."""
    if not path.is_file():
        raise DatasetError(
            f"{path} not found: the input folder needs one prompt file per split "
            f"(or choose the splits that exist with --splits)"
        )
    data = path.read_bytes()
    raw = data.removeprefix(codecs.BOM_UTF8).split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()  # the newline that ends the last line
    lines = []
    for number, chunk in enumerate(raw, 1):
        try:
            lines.append(chunk.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not UTF-8 ({exc.reason}): save the file as UTF-8") from None
    return lines, hashlib.sha256(data).hexdigest()


def _select(lines: list[str], kind: str) -> tuple[list[_Line], int, int, list[BadLine]]:
    """(kept lines, empty count, duplicate count, bad lines), by the rules of the module doc."""
    kept: list[_Line] = []
    seen: set[str] = set()
    empty = duplicate = 0
    bad: list[BadLine] = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            empty += 1
            continue
        problem = line_problem(kind, text)
        if problem is not None:
            bad.append(BadLine(number, problem, text if len(text) <= 80 else text[:77] + "..."))
            continue
        if text in seen:
            duplicate += 1
            continue
        seen.add(text)
        kept.append(_Line(number, text, ground_truth(kind, text)))
    return kept, empty, duplicate, bad


def _prepare_split(input_dir: Path, name: str, tokenizer: PromptTokenizer, options: PrepareOptions) -> _Split:
    source = input_dir / f"{name}.txt"
    lines, source_sha256 = _read_lines(source)
    kept, empty, duplicate, bad = _select(lines, options.kind)
    if bad and options.on_bad_line == "fail":
        listed = "; ".join(f"line {b.line}: {b.reason}" for b in bad[:5])
        more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise DatasetError(
            f"{source}: {len(bad)} bad lines ({listed}{more}); fix them, or drop them with --on-bad-line drop"
        )
    if not kept:
        raise DatasetError(f"{source}: no usable prompt in {len(lines)} lines")
    ids, truncated = [], []
    for line in tqdm(kept, desc=f"{name}.txt", unit="prompt", disable=None if options.progress else True):
        encoded = tokenizer.encode(line.text, options.max_length)
        ids.append(encoded.ids)
        truncated.append(encoded.truncated)
    uids = [prompt_uid(name, line.text) for line in kept]
    if len(set(uids)) != len(uids):  # 64-bit prefixes of sha256: never seen, but never silent
        raise DatasetError(f"{source}: two different prompts share a uid (a sha256 prefix collision)")
    table = pa.table(
        {
            "data_source": [options.data_source or options.kind] * len(kept),
            "split": [name] * len(kept),
            "index": list(range(len(kept))),
            "line": [line.number for line in kept],
            "prompt_uid": uids,
            "prompt": [line.text for line in kept],
            "prompt_ids": ids,
            "truncated": truncated,
            "ground_truth": [line.ground_truth for line in kept],
        },
        schema=schema(),
    )
    counts = SplitCounts(len(lines), empty, duplicate, len(bad), len(kept), sum(truncated))
    return _Split(name, source, source_sha256, table, counts, tuple(bad))


def _write(
    output_dir: Path, splits: list[_Split], info: TokenizerInfo, options: PrepareOptions
) -> DatasetMeta:
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in splits:
        with atomic_output(output_dir / parquet_name(split.name)) as tmp:
            pq.write_table(split.table, tmp)
            digest = file_sha256(tmp)
        written[split.name] = SplitMeta(
            file=parquet_name(split.name),
            sha256=digest,
            source=str(split.source.resolve()),
            source_sha256=split.source_sha256,
            counts=split.counts,
            bad_lines=split.bad_lines,
        )
    meta = DatasetMeta(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        kind=options.kind,
        data_source=options.data_source or options.kind,
        max_length=options.max_length,
        tokenizer=info,
        splits=written,
        flowgrpo_version=__version__,
    )
    atomic_write(output_dir / META_FILE, json.dumps(to_dict(meta), indent=2) + "\n")
    return meta
