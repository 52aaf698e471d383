"""The README as a new user reads it: the two commands first (``.ci/run`` runs the second), every
command of its command-line list current against the CLI itself, every link resolving, and the
benchmark tables in docs/performance.md rather than in the README."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from flowgrpo.services.cli import BENCHMARKS, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PERFORMANCE = ROOT / "docs" / "performance.md"


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def command_list() -> str:
    """The indented block under ``## Command line``."""
    section = README.split("## Command line\n", 1)[1].split("\n## ", 1)[0]
    return section.strip("\n").split("\n\n", 1)[0]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_the_readme_starts_with_its_two_commands() -> None:
    assert README.startswith("# FlowGRPO services\n\n```bash\n")
    first = code_blocks(README)[0].splitlines()
    assert len(first) == 2, first
    assert first[0].endswith(".venv/bin/flowgrpo train examples/tiny_demo.yaml")
    assert first[1].endswith(".venv/bin/python -m pytest")  # what .ci/run extracts and runs


def test_the_bench_list_is_the_clis() -> None:
    [line] = [ln for ln in command_list().splitlines() if ln.strip().startswith("flowgrpo bench ")]
    listed = line.split()[2].split("|")
    assert listed == sorted(BENCHMARKS), (listed, BENCHMARKS)
    bench = subcommands(build_parser())["bench"]
    [target] = [a for a in bench._actions if a.dest == "target"]
    assert list(target.choices or []) == BENCHMARKS


def test_every_command_listed_exists_and_every_command_is_listed() -> None:
    parser = build_parser()
    commands = subcommands(parser)
    listed = re.findall(r"^    flowgrpo ([a-z-]+)(?: ([a-z-]+))?", command_list(), re.MULTILINE)
    names = {name for name, _ in listed}
    assert names - {"--help"} <= set(commands), names - set(commands)
    assert set(commands) <= names, f"not in the README's command list: {set(commands) - names}"
    actions = subcommands(commands["data"])
    for name, action in listed:
        if name == "data":
            assert action in actions, action
    assert {action for name, action in listed if name == "data"} == set(actions)


def test_every_link_resolves() -> None:
    for page in (ROOT / "README.md", PERFORMANCE):
        text = page.read_text()
        for target in re.findall(r"\]\(([^)]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path = target.split("#", 1)[0]
            assert (page.parent / path).exists(), f"{page.name}: broken link {target}"


def test_the_benchmark_tables_live_in_docs_performance() -> None:
    tables = [ln for ln in README.splitlines() if ln.startswith("|")]
    assert len(tables) <= 6, tables  # the services table only
    assert "(docs/performance.md)" in README
    moved = PERFORMANCE.read_text()
    for row in ("| 0 | default | -0.004709 | -0.003730 | -0.004824 | +22.7% | 46 | 30/30 |",
                "| memcpy (baseline) | 6.75 | 1.00 | |",
                "| sync | 0.75 (first call 0.73) | 21.3 s |"):  # fmt: skip
        assert row in moved, row
