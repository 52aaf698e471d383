"""Preparation of every kind from small files: counts, bad lines, truncation, duplicates, uids."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flowgrpo.data.format import DatasetError, prompt_uid
from flowgrpo.data.prepare import PrepareOptions, ocr_problem, prepare_dataset
from flowgrpo.prompts import PromptTokenizer


def _prepare(
    model: Path, input_dir: Path, out: Path, **options: object
) -> dict[str, list[dict[str, object]]]:
    prepare_dataset(model, input_dir, out, PrepareOptions(progress=False, **options))
    return {split: pq.read_table(out / f"{split}.parquet").to_pylist() for split in ("train", "test")}


def test_pickscore_counts_duplicates_empty_lines_and_truncation(
    tiny_checkpoint: Path, prompts: Path, tmp_path: Path
) -> None:
    rows = _prepare(tiny_checkpoint, prompts / "pickscore", tmp_path / "out", kind="pickscore")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    train = meta["splits"]["train"]
    assert train["counts"] == {"read": 10, "empty": 2, "duplicate": 2, "bad": 0, "kept": 6, "truncated": 1}
    assert [r["line"] for r in rows["train"]] == [1, 2, 4, 6, 7, 8]  # first of each duplicate kept
    assert [r["index"] for r in rows["train"]] == list(range(6))
    assert rows["train"][3]["prompt"] == "a small boat on a calm sea"  # stripped
    assert all(r["ground_truth"] == r["prompt"] and r["data_source"] == "pickscore" for r in rows["train"])
    assert meta["splits"]["test"]["counts"]["kept"] == 3  # CRLF line ends
    assert rows["test"][0]["prompt"] == "a bowl of fruit on a wooden table"

    tokenizer = PromptTokenizer.from_checkpoint(tiny_checkpoint)
    for row in rows["train"] + rows["test"]:
        assert row["prompt_ids"] == tokenizer.encode(str(row["prompt"])).ids
    long = rows["train"][4]
    assert long["truncated"] and len(long["prompt_ids"]) == 256
    assert long["prompt_ids"][0] == tokenizer.im_start and long["prompt_ids"][-1] == tokenizer.im_end
    assert meta["tokenizer"]["im_start"] == tokenizer.im_start and meta["max_length"] == 256
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "meta.json",
        "test.parquet",
        "train.parquet",
    ]


def test_ocr_bad_lines_are_dropped_and_reported_with_line_numbers(
    tiny_checkpoint: Path, prompts: Path, tmp_path: Path
) -> None:
    rows = _prepare(tiny_checkpoint, prompts / "ocr", tmp_path / "out", kind="ocr")
    train = json.loads((tmp_path / "out" / "meta.json").read_text())["splits"]["train"]
    assert train["counts"] == {"read": 10, "empty": 1, "duplicate": 1, "bad": 5, "kept": 3, "truncated": 0}
    assert [(b["line"], b["reason"]) for b in train["bad_lines"]] == [
        (2, "no double-quoted span"),
        (3, "empty quoted span"),
        (7, 'an opening " without a closing one'),
        (8, "empty quoted span"),
        (9, 'no double-quoted span (only straight " quotes count, not \u201c \u201d)'),
    ]
    assert train["bad_lines"][0]["text"] == "a mug printed with the word MORNING"
    assert [(r["line"], r["ground_truth"]) for r in rows["train"]] == [(1, "OPEN"), (5, "SALE"), (10, "LEFT")]
    assert [r["ground_truth"] for r in rows["test"]] == ["BAKERY", "FRAGILE", "HONEY"]  # no final newline


def test_fail_mode_names_the_bad_lines_and_writes_nothing(
    tiny_checkpoint: Path, prompts: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        DatasetError, match=r"ocr/train.txt: 5 bad lines \(line 2: no double-quoted span; line 3"
    ):
        _prepare(tiny_checkpoint, prompts / "ocr", tmp_path / "out", kind="ocr", on_bad_line="fail")
    assert not (tmp_path / "out").exists()


def test_truncation_keeps_both_markers_at_any_max_length(
    tiny_checkpoint: Path, prompts: Path, tmp_path: Path
) -> None:
    rows = _prepare(tiny_checkpoint, prompts / "ocr", tmp_path / "out", kind="ocr", max_length=8)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    tokenizer = PromptTokenizer.from_checkpoint(tiny_checkpoint)
    for row in rows["train"] + rows["test"]:
        ids = row["prompt_ids"]
        assert isinstance(ids, list) and len(ids) <= 8 and row["truncated"] == (len(ids) == 8)
        assert ids[0] == tokenizer.im_start and ids[-1] == tokenizer.im_end
    assert meta["max_length"] == 8
    assert (
        meta["splits"]["train"]["counts"]["truncated"]
        == sum(bool(r["truncated"]) for r in rows["train"])
        == 3
    )


def test_uids_depend_on_the_text_and_split_only(tiny_checkpoint: Path, prompts: Path, tmp_path: Path) -> None:
    first = _prepare(tiny_checkpoint, prompts / "ocr", tmp_path / "a", kind="ocr")
    moved = prompts / "ocr" / "train.txt"
    moved.write_text(
        'a new first line with "NEW" text\n\n' + "".join(reversed(moved.read_text().splitlines(True)))
    )
    second = _prepare(tiny_checkpoint, prompts / "ocr", tmp_path / "b", kind="ocr", max_length=16)
    uid_a = {r["prompt"]: r["prompt_uid"] for r in first["train"]}
    uid_b = {r["prompt"]: r["prompt_uid"] for r in second["train"]}
    assert all(uid_b[text] == uid for text, uid in uid_a.items())
    assert uid_a['a shop window painted with "SALE"'] == prompt_uid(
        "train", 'a shop window painted with "SALE"'
    )
    assert prompt_uid("test", "x") != prompt_uid("train", "x")


def test_ocr_problem_rules() -> None:
    assert ocr_problem('a sign "OK"') is None
    assert ocr_problem('a sign "A" then ""') is None  # only the first span counts
    assert ocr_problem('a sign "" then "B"') == "empty quoted span"
    assert ocr_problem("no quotes") == "no double-quoted span"


def test_input_errors_name_the_file_and_the_fix(tiny_checkpoint: Path, prompts: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"train.txt not found.*--splits"):
        _prepare(tiny_checkpoint, tmp_path, tmp_path / "out", kind="pickscore")
    with pytest.raises(
        DatasetError, match=r"tokenizer.json not found: the model path must be a BAGEL checkpoint"
    ):
        _prepare(tmp_path, prompts / "ocr", tmp_path / "out", kind="ocr")
    (prompts / "ocr" / "test.txt").write_bytes(b'a "fine" line\na caf\xe9 "sign"\n')
    with pytest.raises(DatasetError, match=r"test.txt:2: not UTF-8 .*save the file as UTF-8"):
        _prepare(tiny_checkpoint, prompts / "ocr", tmp_path / "out", kind="ocr", splits=("test",))
    (prompts / "ocr" / "test.txt").write_text("\n  \nno quotes here\n")
    with pytest.raises(DatasetError, match=r"test.txt: no usable prompt in 3 lines"):
        _prepare(tiny_checkpoint, prompts / "ocr", tmp_path / "out", kind="ocr", splits=("test",))
    with pytest.raises(DatasetError, match=r"max length 2"):
        _prepare(tiny_checkpoint, prompts / "ocr", tmp_path / "out", kind="ocr", max_length=2)
    assert not (tmp_path / "out").exists()


def test_compose_lines_outside_the_grammar_are_bad_and_the_ground_truth_is_canonical(
    tiny_checkpoint: Path, prompts: Path, tmp_path: Path
) -> None:
    rows = _prepare(tiny_checkpoint, prompts / "compose", tmp_path / "out", kind="compose")
    train = json.loads((tmp_path / "out" / "meta.json").read_text())["splits"]["train"]
    assert train["counts"] == {"read": 9, "empty": 1, "duplicate": 1, "bad": 3, "kept": 4, "truncated": 0}
    assert [(b["line"], b["reason"]) for b in train["bad_lines"]] == [
        (2, "not in the compose grammar, word 4, 'in': expected 'and', 'on the', 'at the', 'to the left "
         "of', 'to the right of', 'above' or 'below'"),
        (7, "not in the compose grammar, word 9, 'red': the two blobs need different colours"),
        (8, "not in the compose grammar, word 4, 'at': expected the end of the prompt"),
    ]  # fmt: skip
    assert [(r["line"], r["prompt"], r["ground_truth"]) for r in rows["train"]] == [
        (1, "a red blob", "a red blob"),
        (3, "three green blobs", "three green blobs"),
        (5, "A Big Red blob and a  small BLUE blob", "a big red blob and a small blue blob"),
        (9, "a cyan blob at the bottom", "a cyan blob at the bottom"),
    ]
    assert [r["ground_truth"] for r in rows["test"]] == [
        "a white blob below a blue blob",
        "four yellow blobs",
    ]
    with pytest.raises(DatasetError, match=r"compose/train.txt: 3 bad lines \(line 2: not in the compose"):
        _prepare(tiny_checkpoint, prompts / "compose", tmp_path / "o", kind="compose", on_bad_line="fail")


def test_the_compose_example_prepares_whole(tiny_checkpoint: Path, tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "data" / "compose"
    rows = _prepare(tiny_checkpoint, example, tmp_path / "out", kind="compose", on_bad_line="fail")
    assert len(rows["train"]) + len(rows["test"]) == 357  # every prompt of the grammar, once
    assert all(r["ground_truth"] == r["prompt"] and r["data_source"] == "compose" for r in rows["train"])
