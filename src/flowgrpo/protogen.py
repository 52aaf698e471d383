"""Regenerate the Python code of the protos: ``python -m flowgrpo.protogen``.

The generated modules (``src/flowgrpo/v1/*_pb2*.py`` and their typed ``.pyi`` stubs) are committed
so that an install needs no protoc. They are reproducible from ``protos/`` with the pinned
grpcio-tools and mypy-protobuf of the ``dev`` extra; ``tests/test_protos.py`` regenerates them
into a temporary folder and fails when the committed files are stale.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = "flowgrpo/v1"  # under protos/ and under src/
SOURCE_ROOT = REPO_ROOT / "src"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    files = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not files:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}: run from a checkout")
    return files


def _plugin(name: str) -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every proto into ``out_dir``; return the files written."""
    from grpc_tools import protoc  # dev extra only

    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_dir / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> None:
    # an argument parser, so that `--help` prints this and writes nothing (it used to regenerate)
    parser = argparse.ArgumentParser(
        prog="python -m flowgrpo.protogen",
        description=f"Regenerate {SOURCE_ROOT / PACKAGE_DIR}/*_pb2*.py(i) from "
        f"{PROTO_ROOT / PACKAGE_DIR}/*.proto (needs the dev extra's grpcio-tools and mypy-protobuf).",
    )
    parser.parse_args(argv)
    target = SOURCE_ROOT / PACKAGE_DIR
    with tempfile.TemporaryDirectory() as tmp:
        written = generate(Path(tmp))
        for old in target.iterdir():
            if old.name.endswith(GENERATED_SUFFIXES):
                old.unlink()
        for path in written:
            shutil.copyfile(path, target / path.name)
    print(f"wrote {len(written)} files to {target}")


if __name__ == "__main__":
    main()
