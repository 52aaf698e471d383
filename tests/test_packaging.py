"""The explicit package list of pyproject.toml covers every package folder (a new folder that is
not listed would be missing from a non-editable install)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    mapping = {ROOT / folder: name for name, folder in setuptools["package-dir"].items()}
    mapping[ROOT / "flowgrpo"] = "flowgrpo"
    found = set()
    for folder, package in mapping.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((package, *relative)))
    assert found == listed, (
        f"add to [tool.setuptools] packages: {sorted(found - listed)}; stale: {sorted(listed - found)}"
    )
