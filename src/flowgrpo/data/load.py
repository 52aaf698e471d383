"""The one reader of prepared datasets (what the coordinator uses); torch-free (pyarrow, numpy).

``load_split(folder, "train", model_path=checkpoint)`` checks, in order, and fails with a
:class:`DatasetError` that names the file, the column or the key, and the fix:

1. ``meta.json``: present, this format and version, every key of the right type;
2. the tokenizer (when ``model_path`` is given): the checkpoint's ``tokenizer.json`` has the
   sha256 the dataset was prepared with, so the prompt ids fit the model's vocabulary;
3. ``<split>.parquet``: present, every column of :data:`~flowgrpo.data.format.COLUMNS` with its
   type and without nulls, byte for byte the file ``meta.json`` describes (sha256), as many rows
   as counted, every ``prompt_ids`` row ``<|im_start|> ... <|im_end|>`` within ``max_length``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from flowgrpo.config import ConfigError, from_dict
from flowgrpo.data.format import (
    COLUMNS,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_FILE,
    TOKENIZER_FILE,
    DatasetError,
    DatasetMeta,
    SplitMeta,
    file_sha256,
)


@dataclass(frozen=True, eq=False)
class PromptRow:
    """One prompt of a split; ``prompt_ids`` is a read-only int64 array."""

    index: int
    prompt_uid: str
    prompt: str
    prompt_ids: npt.NDArray[np.int64]
    ground_truth: str
    data_source: str
    split: str
    line: int
    truncated: bool


@dataclass(frozen=True, eq=False)
class PromptSplit:
    """One split of a prepared dataset, rows in file order (``index`` = position)."""

    folder: Path
    name: str
    meta: DatasetMeta
    rows: tuple[PromptRow, ...]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self.rows)


def load_split(folder: str | Path, split: str, *, model_path: str | Path | None = None) -> PromptSplit:
    """Read and check one split; with ``model_path``, also check the checkpoint's tokenizer."""
    folder = Path(folder)
    meta = read_meta(folder)
    if model_path is not None:
        check_tokenizer(meta, folder, model_path)
    if split not in meta.splits:
        prepared = ", ".join(meta.splits) or "none"
        raise DatasetError(
            f"{folder} has no {split} split (prepared: {prepared}): {_fix(folder, meta, model_path)}"
        )
    table = _read_table(folder, meta, meta.splits[split], model_path)
    return PromptSplit(folder, split, meta, _rows(table))


def read_meta(folder: str | Path) -> DatasetMeta:
    folder = Path(folder)
    path = folder / META_FILE
    if not path.is_file():
        what = "does not exist" if not folder.exists() else f"has no {META_FILE}"
        raise DatasetError(f"{folder} {what}, so it is not a prepared dataset: {_fix(folder)}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: not valid JSON ({exc}): {_fix(folder)}") from None
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT_NAME:
        raise DatasetError(f"{path}: format {found!r}, expected {FORMAT_NAME!r}: {_fix(folder)}")
    if data.get("format_version") != FORMAT_VERSION:
        raise DatasetError(
            f"{path}: format version {data.get('format_version')!r}, this flowgrpo reads "
            f"{FORMAT_VERSION}: {_fix(folder)} with this version"
        )
    try:
        return from_dict(DatasetMeta, data)
    except ConfigError as exc:
        raise DatasetError(f"{path}: {exc}: {_fix(folder)}") from None


def check_tokenizer(meta: DatasetMeta, folder: str | Path, model_path: str | Path) -> None:
    """Refuse a checkpoint whose ``tokenizer.json`` is not the one the dataset was prepared with."""
    path = Path(model_path) / TOKENIZER_FILE
    if not path.is_file():
        raise DatasetError(
            f"{path} not found: the model folder must hold the tokenizer the dataset {folder} was "
            f"prepared with ({meta.tokenizer.path})"
        )
    digest = file_sha256(path)
    if digest != meta.tokenizer.sha256:
        raise DatasetError(
            f"{folder} was tokenised with {meta.tokenizer.path} (sha256 {meta.tokenizer.sha256[:12]}...), "
            f"not with {path} (sha256 {digest[:12]}...): its prompt ids do not fit this model; "
            f"{_fix(Path(folder), meta, model_path)}"
        )


def _fix(folder: Path, meta: DatasetMeta | None = None, model_path: str | Path | None = None) -> str:
    kind = meta.kind if meta else "pickscore|ocr|compose"
    sources = [Path(s.source).parent for s in meta.splits.values()] if meta else []
    input_dir = sources[0] if sources else "PROMPT_DIR"
    return (
        f"re-run `flowgrpo data prepare {kind} --model-path {model_path or 'CHECKPOINT'} "
        f"--input-dir {input_dir} --output-dir {folder}`"
    )


def _read_table(folder: Path, meta: DatasetMeta, info: SplitMeta, model_path: str | Path | None) -> pa.Table:
    path = folder / info.file
    fix = _fix(folder, meta, model_path)
    if not path.is_file():
        raise DatasetError(f"{path} not found, though {META_FILE} lists it: {fix}")
    try:
        found = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable parquet file ({exc}): {fix}") from None
    _check_schema(path, found, fix)
    digest = file_sha256(path)
    if digest != info.sha256:
        raise DatasetError(
            f"{path} is not the file {META_FILE} describes (sha256 {digest[:12]}..., expected "
            f"{info.sha256[:12]}...): an interrupted or mixed preparation, or an edited file: {fix}"
        )
    table = pq.read_table(path, columns=list(COLUMNS))
    if table.num_rows != info.counts.kept:
        raise DatasetError(f"{path}: {table.num_rows} rows, {META_FILE} counts {info.counts.kept}: {fix}")
    for name in COLUMNS:
        if table.column(name).null_count:
            raise DatasetError(f"{path}: column {name!r} has null values: {fix}")
    _check_prompt_ids(path, table, meta, fix)
    return table


def _check_schema(path: Path, found: pa.Schema, fix: str) -> None:
    problems = []
    for name, (dtype, doc) in COLUMNS.items():
        index = found.get_field_index(name)
        if index < 0:
            problems.append(f"column {name!r} is missing ({_type_name(dtype)}: {doc})")
        elif not found.field(index).type.equals(dtype):  # list item names do not count
            problems.append(
                f"column {name!r} is {_type_name(found.field(index).type)}, expected {_type_name(dtype)}"
            )
    if problems:
        raise DatasetError(f"{path}: {'; '.join(problems)}: not written by `flowgrpo data prepare`: {fix}")


def _type_name(dtype: pa.DataType) -> str:
    return f"list<{dtype.value_type}>" if pa.types.is_list(dtype) else str(dtype)


def _check_prompt_ids(path: Path, table: pa.Table, meta: DatasetMeta, fix: str) -> None:
    values, offsets = _flat_ids(table)
    lengths = np.diff(offsets)
    bad = np.flatnonzero((lengths < 2) | (lengths > meta.max_length))
    if not bad.size:
        starts, ends = values[offsets[:-1]], values[offsets[1:] - 1]
        bad = np.flatnonzero((starts != meta.tokenizer.im_start) | (ends != meta.tokenizer.im_end))
    if bad.size:
        row = int(bad[0])
        raise DatasetError(
            f"{path}: column 'prompt_ids' row {row} is not <|im_start|> ({meta.tokenizer.im_start}) ... "
            f"<|im_end|> ({meta.tokenizer.im_end}) within {meta.max_length} tokens: {fix}"
        )


def _flat_ids(table: pa.Table) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """All prompt ids in one read-only array, and row i's offsets[i]:offsets[i + 1]."""
    column = table.column("prompt_ids").combine_chunks()
    offsets = np.asarray(column.offsets.to_numpy(), dtype=np.int64)
    values = np.asarray(column.flatten().to_numpy(), dtype=np.int64)
    values.flags.writeable = False
    return values, offsets - offsets[0]


def _rows(table: pa.Table) -> tuple[PromptRow, ...]:
    values, offsets = _flat_ids(table)
    cols = {name: table.column(name).to_pylist() for name in COLUMNS if name != "prompt_ids"}
    return tuple(
        PromptRow(
            index=cols["index"][i],
            prompt_uid=cols["prompt_uid"][i],
            prompt=cols["prompt"][i],
            prompt_ids=values[offsets[i] : offsets[i + 1]],
            ground_truth=cols["ground_truth"][i],
            data_source=cols["data_source"][i],
            split=cols["split"][i],
            line=cols["line"][i],
            truncated=cols["truncated"][i],
        )
        for i in range(table.num_rows)
    )
