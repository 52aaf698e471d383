"""What ``torch.UntypedStorage._share_cuda_()`` returns, field by field, recorded on a GPU for each
torch version (cuda_ipc_layouts.json beside this file), and buckets built from those records.

CPU tests build their CUDA IPC handles from the records, never by hand, so a check that drifts
from torch's real format fails in CI; the GPU test (tests/bus/test_cuda_ipc.py) compares a live
export with the record of its torch version and fails, printing the entry to add, when the
version is not recorded or its layout changed. To record (on a GPU machine; bench/gpu_check.sh
runs it): ``python tests/bus/cuda_ipc_layouts.py [PATH]`` prints this torch's entry (and writes it
to PATH).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

LAYOUTS_FILE = Path(__file__).with_name("cuda_ipc_layouts.json")
# the tuple's order (torch/csrc/StorageSharing.cpp, THPStorage_shareCuda)
FIELDS = (
    "device",
    "handle",
    "storage_bytes",
    "storage_offset",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def describe(share: tuple[Any, ...]) -> list[dict[str, Any]]:
    """The layout of one ``_share_cuda_()`` result: each field's type; for bytes their length,
    the memory handle's two header bytes, the reference counter's name with digits as '<n>'."""
    if len(share) != len(FIELDS):
        raise ValueError(f"_share_cuda_ returned {len(share)} fields, {len(FIELDS)} known: {FIELDS}")
    out: list[dict[str, Any]] = []
    for name, value in zip(FIELDS, share, strict=True):
        entry: dict[str, Any] = {"field": name, "type": type(value).__name__}
        if isinstance(value, bytes):
            if name == "ref_counter_handle":
                entry["pattern"] = re.sub(r"\d+", "<n>", value.decode("ascii", "replace"))
            else:
                entry["length"] = len(value)
            if name == "handle" and len(value) != 64:
                entry["header"] = [value[0], chr(value[1])]
        out.append(entry)
    return out


def record_this_torch() -> dict[str, Any]:
    """This torch's entry: a fresh caching-allocator block on cuda:0, exported."""
    import torch

    storage = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0").untyped_storage()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0),
        "fields": describe(storage._share_cuda_()),
    }


def recorded() -> dict[str, dict[str, Any]]:
    """torch version (major.minor) -> its recorded entry."""
    layouts: dict[str, dict[str, Any]] = json.loads(LAYOUTS_FILE.read_text())["layouts"]
    return layouts


def torch_minor(version: str) -> str:
    return ".".join(version.split("+", maxsplit=1)[0].split(".")[:2])


def fields_of(layout: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """A ``CudaIpcBucket``'s handle fields shaped as the record says: the recorded lengths and
    header, filler payload (it points at no GPU memory), a counter name of the recorded pattern."""
    spec = {f["field"]: f for f in layout["fields"]}
    handle = spec["handle"]
    header = bytes([handle["header"][0], ord(handle["header"][1])]) if "header" in handle else b""
    payload = bytes((seed + i) % 256 for i in range(handle["length"] - len(header)))
    counter = spec["ref_counter_handle"]["pattern"]
    numbers = iter(("4242", "17", str(seed)))
    name = re.sub("<n>", lambda _: next(numbers, "0"), counter)
    event = spec["event_handle"]
    return {
        "handle": header + payload,
        "ref_counter_handle": name.encode(),
        "event_handle": bytes(event.get("length", 0)),
    }


if __name__ == "__main__":  # python tests/bus/cuda_ipc_layouts.py [PATH]: this torch's entry
    import sys

    entry = json.dumps(record_this_torch(), indent=2)
    print(entry)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(entry + "\n")
