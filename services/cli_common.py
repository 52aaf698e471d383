"""What every part of the ``flowgrpo`` command line shares: the usage error, ``--debug`` after a
subcommand, a prompt file's lines."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """What the user gave (a recipe, an override, a file) cannot be used: exit status 2."""


DEBUG_HELP = "on an error, print its traceback before the one-line message"


def add_debug(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after the subcommand too (``flowgrpo train R --debug``); SUPPRESS keeps the
    main parser's value when it is not given here."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


def read_prompt_file(path: str | None) -> list[str]:
    if path is None:
        return []
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]
