"""The package as users install it: a wheel (not the editable install the tests run from) holds
the library and every service, imports from the repository root without the checkout shadowing
it, and the library never imports a service."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "src" / "flowgrpo"


def library_modules() -> list[Path]:
    """The library's own files (src/flowgrpo/services is the link to services/: not the library)."""
    return [p for p in LIBRARY.rglob("*.py") if "services" not in p.relative_to(LIBRARY).parts[:1]]


def test_the_services_link_is_the_services_folder() -> None:
    link = LIBRARY / "services"
    assert link.is_symlink() and link.resolve() == (ROOT / "services").resolve(), (
        "src/flowgrpo/services must be the link ../../services (git keeps it as a symlink)"
    )


def test_the_library_imports_no_service() -> None:
    offenders = []
    for path in library_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if node.value.startswith("flowgrpo.services.") else []
            if any(n == "flowgrpo.services" or n.startswith("flowgrpo.services.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(library_modules()) > 30
    assert not offenders, f"the library (src/flowgrpo) imports a service: {offenders}"


def test_the_coordinator_imports_no_other_service_but_in_its_in_process_launcher() -> None:
    """The run's config is the library's (flowgrpo.configs): the coordinator's image needs no
    rollout, reward or trainer module; only ``_launch_inprocess`` starts them in its own process."""
    others = ("flowgrpo.services.rollout", "flowgrpo.services.reward", "flowgrpo.services.trainer")
    offenders, allowed = [], 0
    for path in sorted((ROOT / "services" / "coordinator").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        inprocess = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, ast.AsyncFunctionDef) and f.name == "_launch_inprocess"
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            if any(n == o or n.startswith(o + ".") for n in names for o in others):
                if id(node) in inprocess:
                    allowed += 1
                else:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert allowed == 3  # the in-process launcher's three services: the check sees imports
    assert not offenders, f"the coordinator imports another service's module: {offenders}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    [built] = out.glob("flowgrpo-*.whl")
    return built


def test_the_wheel_holds_every_package_of_the_checkout(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"flowgrpo/{p.relative_to(LIBRARY).as_posix()}" for p in library_modules()}
    wanted |= {f"flowgrpo/services/{p.relative_to(ROOT / 'services').as_posix()}"
               for p in (ROOT / "services").rglob("*.py")}  # fmt: skip
    assert wanted - names == set(), f"missing from the wheel: {sorted(wanted - names)[:10]}"
    assert {"flowgrpo/py.typed", "flowgrpo/v1/common_pb2.pyi"} <= names
    stray = {n for n in names if not n.startswith(("flowgrpo/", "flowgrpo-"))}
    assert not stray, f"the wheel claims other top-level names: {sorted(stray)}"


def test_the_installed_wheel_runs_from_the_repository_root(wheel: Path, tmp_path: Path) -> None:
    """`python -m` puts the working directory first on sys.path: from the checkout's root, the
    installed package must still be the one imported, the services included."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    code = (
        "import sys, flowgrpo, flowgrpo.services.cli, flowgrpo.services.coordinator.train\n"
        "import flowgrpo.services.rollout.engine, flowgrpo.services.trainer.service\n"
        "mods = [m for n, m in sys.modules.items() if n.startswith('flowgrpo') and m.__file__]\n"
        f"outside = [m.__name__ for m in mods if not m.__file__.startswith({str(target)!r})]\n"
        "assert len(mods) > 20 and not outside, outside\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}  # before the editable install's path
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    cli = subprocess.run([sys.executable, "-m", "flowgrpo.services.cli", "--version"], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert cli.returncode == 0 and cli.stdout.strip(), cli.stderr[-3000:]
