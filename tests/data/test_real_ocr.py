"""Opt-in (``-m slow``): flow_grpo's real OCR test prompts, from the steering repository's shared
folder when it sits beside this clone (a user's clone has no such folder: the test skips)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.data import load_split
from flowgrpo.data.prepare import PrepareOptions, prepare_dataset

REAL_OCR = Path(__file__).resolve().parents[3] / "shared" / "data" / "flow_grpo" / "ocr"


@pytest.mark.slow
@pytest.mark.skipif(not (REAL_OCR / "test.txt").is_file(), reason=f"{REAL_OCR}/test.txt is not here")
def test_flow_grpo_ocr_test_file_prepares_with_the_expected_counts(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    options = PrepareOptions(kind="ocr", splits=("test",), on_bad_line="fail", progress=False)
    meta = prepare_dataset(tiny_checkpoint, REAL_OCR, tmp_path, options)
    counts = meta.splits["test"].counts
    # 1,018 prompts (the file has no final newline), each with one quoted target: nothing dropped;
    # the tiny byte-level tokenizer needs 86-249 tokens per prompt, so none is cut at 256
    assert (counts.read, counts.empty, counts.duplicate, counts.bad, counts.kept) == (1018, 0, 0, 0, 1018)
    assert counts.truncated == 0
    rows = load_split(tmp_path, "test", model_path=tiny_checkpoint)
    assert len({row.ground_truth for row in rows}) == 957  # distinct targets
    assert rows[0].ground_truth == "Spring Collection 2024"
