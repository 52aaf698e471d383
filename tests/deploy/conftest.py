from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

GENERATOR = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "generate.py"


@pytest.fixture(scope="session")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's secret files of a compose stack, as `generate.py --secrets DIR` makes them."""
    folder = tmp_path_factory.mktemp("compose") / "secrets"
    done = subprocess.run([sys.executable, str(GENERATOR), "--secrets", str(folder)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout == f"FLOWGRPO_SECRETS={folder}\n"
    return folder
