"""`flowgrpo data prepare` end to end, as a user runs it (a subprocess): help, output, exit status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flowgrpo.data import load_split
from flowgrpo.prompts import MAX_PROMPT_TOKENS
from flowgrpo.services.cli import build_parser


def _flowgrpo(*args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "flowgrpo.services.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_help_explains_the_command() -> None:
    out = _flowgrpo("data", "prepare", "--help")
    assert out.returncode == 0, out.stderr
    for words in ("train.txt", "meta.json", "<|im_start|>", "--max-length", "double quotes", "prompt_uid",
                  "--on-bad-line", "exit status", "examples:"):  # fmt: skip
        assert words in out.stdout, words
    assert "data prepare" in _flowgrpo("--help").stdout


def test_prepare_ocr_end_to_end(tiny_checkpoint: Path, prompts: Path, tmp_path: Path) -> None:
    out = _flowgrpo("data", "prepare", "ocr", "--model-path", tiny_checkpoint, "--input-dir", prompts / "ocr",
                    "--output-dir", tmp_path / "out", "--no-progress")  # fmt: skip
    assert out.returncode == 0, out.stderr
    source = prompts / "ocr" / "train.txt"
    assert f"{source}:2: dropped, no double-quoted span: a mug printed with the word MORNING" in out.stderr
    assert f"{source}:3: dropped, empty quoted span" in out.stderr
    assert (
        "train: kept 3 of 10 lines (dropped 1 empty, 1 duplicate, 5 bad; 0 truncated to 256 tokens)"
        in out.stdout
    )
    rows = load_split(tmp_path / "out", "train", model_path=tiny_checkpoint)
    assert [row.ground_truth for row in rows] == ["OPEN", "SALE", "LEFT"]


def test_bad_input_exits_2_with_one_line(tiny_checkpoint: Path, prompts: Path, tmp_path: Path) -> None:
    cases = [
        (("pickscore", "--input-dir", tmp_path), "train.txt not found"),
        (
            ("ocr", "--input-dir", prompts / "ocr", "--on-bad-line", "fail"),
            "5 bad lines (line 2: no double-quoted",
        ),
        (("ocr", "--input-dir", prompts / "ocr", "--max-length", "2"), "max length 2"),
    ]
    for args, words in cases:
        out = _flowgrpo(
            "data", "prepare", *args, "--model-path", tiny_checkpoint, "--output-dir", tmp_path / "o"
        )
        assert out.returncode == 2, out
        assert out.stderr.startswith("flowgrpo data prepare: ") and words in out.stderr, out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "o").exists()


def test_default_max_length_is_the_prompt_limit() -> None:
    args = build_parser().parse_args(["data", "prepare", "ocr", "--model-path", "m", "--input-dir", "i",
                                      "--output-dir", "o"])  # fmt: skip
    assert args.max_length == MAX_PROMPT_TOKENS and args.splits == ["train", "test"]
