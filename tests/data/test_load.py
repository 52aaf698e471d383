"""The one loader: round trip of what preparation wrote, and its errors (schema, files, tokenizer)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowgrpo.data import DatasetError, load_split, read_meta
from flowgrpo.data.prepare import PrepareOptions, prepare_dataset
from flowgrpo.prompts import PromptTokenizer


@pytest.fixture
def dataset(tiny_checkpoint: Path, prompts: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ocr-data"
    prepare_dataset(tiny_checkpoint, prompts / "ocr", out, PrepareOptions(kind="ocr", progress=False))
    return out


def test_round_trip_of_what_preparation_wrote(tiny_checkpoint: Path, prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    options = PrepareOptions(kind="pickscore", data_source="tiny-captions", progress=False)
    written = prepare_dataset(tiny_checkpoint, prompts / "pickscore", out, options)
    train = load_split(out, "train", model_path=tiny_checkpoint)
    assert train.meta == written == read_meta(out)
    assert len(train) == 6 and train.name == "train"
    tokenizer = PromptTokenizer.from_checkpoint(tiny_checkpoint)
    lines = (prompts / "pickscore" / "train.txt").read_text().split("\n")
    for i, row in enumerate(train):
        assert row.index == i and row.split == "train" and row.data_source == "tiny-captions"
        assert row.prompt == lines[row.line - 1].strip() == row.ground_truth
        assert row.prompt_ids.dtype == np.int64 and not row.prompt_ids.flags.writeable
        assert row.prompt_ids.tolist() == tokenizer.encode(row.prompt).ids
        assert row.truncated == (row.line == 7)
    assert len({row.prompt_uid for row in train}) == 6
    assert [r.prompt for r in load_split(out, "test")][-1] == "two birds over a green field"


def test_wrong_schema_names_the_file_the_column_and_the_fix(dataset: Path) -> None:
    table = pq.read_table(dataset / "train.parquet")
    index = table.schema.get_field_index("prompt_ids")
    ids = pa.array(table.column("prompt_ids").to_pylist(), type=pa.list_(pa.int32()))
    table = table.set_column(index, "prompt_ids", ids).drop_columns(["ground_truth"])
    pq.write_table(table, dataset / "train.parquet")
    with pytest.raises(DatasetError) as error:
        load_split(dataset, "train")
    message = str(error.value)
    assert f"{dataset / 'train.parquet'}: " in message
    assert "column 'prompt_ids' is list<int32>, expected list<int64>" in message
    assert "column 'ground_truth' is missing" in message
    assert "re-run `flowgrpo data prepare ocr --model-path CHECKPOINT --input-dir " in message
    assert f"--output-dir {dataset}`" in message


def test_a_file_that_is_not_the_one_meta_describes_is_refused(dataset: Path, tmp_path: Path) -> None:
    table = pq.read_table(dataset / "test.parquet")
    pq.write_table(table.slice(0, 2), dataset / "test.parquet")  # right schema, other content
    with pytest.raises(DatasetError, match=r"test.parquet is not the file meta.json describes .*re-run"):
        load_split(dataset, "test")
    (dataset / "test.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"test.parquet: not a readable parquet file"):
        load_split(dataset, "test")
    (dataset / "test.parquet").unlink()
    with pytest.raises(DatasetError, match=r"test.parquet not found, though meta.json lists it"):
        load_split(dataset, "test")


def test_a_different_tokenizer_is_refused(dataset: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    from flowgrpo.models.bagel.checkpoint import build_tiny_tokenizer

    other = Path(shutil.copytree(tiny_checkpoint, tmp_path / "other"))
    (other / "tokenizer.json").write_text(build_tiny_tokenizer(vocab_size=320).to_str())
    with pytest.raises(DatasetError) as error:
        load_split(dataset, "train", model_path=other)
    message = str(error.value)
    assert f"{dataset} was tokenised with {tiny_checkpoint.resolve() / 'tokenizer.json'}" in message
    assert f"not with {other / 'tokenizer.json'}" in message
    assert f"re-run `flowgrpo data prepare ocr --model-path {other} --input-dir " in message
    (other / "tokenizer.json").unlink()
    with pytest.raises(
        DatasetError, match=r"tokenizer.json not found: the model folder must hold the tokenizer"
    ):
        load_split(dataset, "train", model_path=other)


def test_meta_errors(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"does not exist, so it is not a prepared dataset: re-run"):
        load_split(tmp_path / "nowhere", "train")
    with pytest.raises(DatasetError, match=r"has no meta.json"):
        load_split(tmp_path, "train")
    meta = json.loads((dataset / "meta.json").read_text())
    del meta["splits"]["test"]
    meta["max_length"] = "long"
    (dataset / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=r"meta.json: max_length: expected int, got str 'long'"):
        load_split(dataset, "train")
    meta["max_length"] = 256
    (dataset / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        DatasetError, match=r"has no test split \(prepared: train\): re-run `flowgrpo data prepare ocr"
    ):
        load_split(dataset, "test")
    meta["format_version"] = 99
    (dataset / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=r"format version 99, this flowgrpo reads 1"):
        load_split(dataset, "train")


def test_marker_check_catches_ids_without_markers(dataset: Path) -> None:
    meta = json.loads((dataset / "meta.json").read_text())
    meta["tokenizer"]["im_end"] = 7  # as if the ids had been made by another rule
    (dataset / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=r"column 'prompt_ids' row 0 is not <\|im_start\|>"):
        load_split(dataset, "train")


def test_data_package_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import flowgrpo.data, flowgrpo.data.prepare\n"
        "assert sys.modules['torch'] is None\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
