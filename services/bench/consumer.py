"""The consumer process of the trainer benchmark's publication figures: it takes each weight
update named on its stdin (a file holding a ``WeightUpdate``) onto its GPU (the last one) as a
rollout does before applying it, over the bus (shared memory on this host) or from the CUDA IPC
bucket, and answers one JSON line per update with its seconds. The bus client and torch only: no
peft or trainer imports to wait for.

    python -m flowgrpo.services.bench.consumer TRANSPORT   (started by bench/publication.py)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch

from flowgrpo.v1 import common_pb2


def take(update: common_pb2.WeightUpdate, client: Any, device: torch.device | None) -> dict[str, Any]:
    """Every tensor of ``update`` on ``device`` (the host without one) and the seconds it took;
    ``client``: the process's bus client (the rollout's keeps one too)."""
    out: dict[str, Any] = {}
    begin = time.perf_counter()
    if update.cuda_ipc:
        from flowgrpo.bus.cuda_ipc import open_bucket

        views = [v for b in update.cuda_ipc for v in open_bucket(b).values()]
        out["open_s"] = time.perf_counter() - begin
        tensors = [v.to(device, copy=True) for v in views]
        del views  # they alias the producer's memory
    else:
        from flowgrpo.bus import TensorRef
        from flowgrpo.bus.torch_tensors import to_torch

        tensors = [to_torch(f) for f in client.fetch([TensorRef.from_proto(t.ref) for t in update.tensors])]
        out["fetch_s"] = time.perf_counter() - begin
        if device is not None:
            tensors = [t.to(device) for t in tensors]
    if device is not None:
        torch.cuda.synchronize(device)
    out["total_s"] = time.perf_counter() - begin
    out["bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    out["tensors"] = len(tensors)
    out["device"] = str(device)
    return out


def main(argv: list[str] | None = None) -> int:
    [transport] = argv if argv is not None else sys.argv[1:]
    device = torch.device("cuda", torch.cuda.device_count() - 1) if torch.cuda.is_available() else None
    if device is not None:
        torch.zeros(1, device=device)  # the CUDA context before any clock
    from flowgrpo.bus import BusClient, BusConfig

    transports: dict[str, Literal["tcp", "ipc"]] = {"tcp": "tcp", "ipc": "ipc"}
    with BusClient(BusConfig(transport=transports[transport])) as client:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            update = common_pb2.WeightUpdate.FromString(Path(line.strip()).read_bytes())
            print(json.dumps(take(update, client, device)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
