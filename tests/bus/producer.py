"""A bus producer in its own process, for tests: serves one store, obeys JSON lines on stdin.

Started as ``python producer.py '<BusConfig fields as JSON>'``; prints the endpoint first, then
one JSON line per command. Ends (closing its store) when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from patterns import pattern

from flowgrpo.bus import BusConfig, TensorStore, serve_store


def handle(store: TensorStore, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd.pop("op")
    if op == "put":
        refs = []
        for item in cmd["items"]:
            data = pattern(item["dtype"], item["shape"], item["seed"])
            extra = {"tag": item.get("tag"), "trace": item.get("trace")}
            refs.append(
                store.put(item["key"], item["column"], data, policy_version=item["policy_version"], **extra)
            )
        return {"refs": [ref.to_dict() for ref in refs]}
    if op == "release":
        return {"released": store.release(cmd.get("keys", ()), tag=cmd.get("tag"), prefix=cmd.get("prefix"))}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    server = serve_store(BusConfig(**json.loads(sys.argv[1])))
    print(
        json.dumps({"endpoint": server.endpoint, "store_id": server.store.store_id, "pid": os.getpid()}),
        flush=True,
    )
    for line in sys.stdin:
        try:
            reply = handle(server.store, json.loads(line))
        except Exception as exc:
            reply = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)
    server.close()


if __name__ == "__main__":
    main()
