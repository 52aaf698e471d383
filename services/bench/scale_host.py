"""A host of simulated replicas for ``flowgrpo bench scale``: one process serving many rollout (or
reward) services, each with its own gRPC server, data-bus store, actor and membership of the run.

Hundreds of replicas do not fit on 2 cores as hundreds of processes (each would import torch), so
a host process serves ``--count`` of them, as a node serves the replicas of its GPUs. Each one is
what ``flowgrpo serve ROLE`` runs (the real service class, a real server on its own port, the
load-test engine or scorer the config names) except for the process around it: ``serve()``
installs signal handlers per server, so this loop owns the signals and drains them all.

    python -m flowgrpo.services.bench.scale_host --role rollout --config R.yaml --count 64 \
        --first 128 --ready /tmp/host2.json

The ready file (JSON: pid, role, addresses) is written once every replica serves and has started
registering with the coordinator its config names; SIGTERM drains every replica and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq

from flowgrpo.config import load_config
from flowgrpo.configs.reward import RewardServiceConfig
from flowgrpo.configs.rollout import RolloutServiceConfig
from flowgrpo.fileio import atomic_write
from flowgrpo.runtime import Service, ServiceServer
from flowgrpo.runtime.actor import Actor
from flowgrpo.runtime.membership import Membership
from flowgrpo.v1 import reward_pb2_grpc, rollout_pb2_grpc

log = logging.getLogger(__name__)

CONFIGS: dict[str, Any] = {"rollout": RolloutServiceConfig, "reward": RewardServiceConfig}


def make_replica(role: str, config: Any) -> tuple[Actor, list[Service]]:
    """The service of ``role`` as its main would build it, with its generated servicer."""
    if role == "rollout":
        from flowgrpo.services.rollout.service import RolloutService

        rollout = RolloutService(config)
        return rollout, [
            Service("flowgrpo.v1.Rollout", rollout, rollout_pb2_grpc.add_RolloutServicer_to_server)
        ]
    from flowgrpo.services.reward.service import RewardService

    reward = RewardService(config)
    return reward, [Service("flowgrpo.v1.Reward", reward, reward_pb2_grpc.add_RewardServicer_to_server)]


async def start_replica(role: str, config: Any) -> ServiceServer:
    """One replica serving and registering with ``config.coordinator``; it leaves on drain."""
    actor, services = make_replica(role, config)
    server = ServiceServer(actor, config.server, services)
    await server.start()
    membership = Membership(actor, config.coordinator)
    membership.start()
    server.on_drain.append(functools.partial(membership.leave, "draining"))
    return server


async def host(role: str, config: Any, count: int, first: int, ready: Path) -> None:
    """Serve ``count`` replicas ``<role>-<first>`` .. until SIGTERM or SIGINT drains them."""
    servers: list[ServiceServer] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    for i in range(count):  # one after another: each start loads a (meta-device) model
        servers.append(await start_replica(role, replace(config, replica_id=f"{role}-{first + i}")))
        if stop.is_set():
            break
    record = {"pid": os.getpid(), "role": role, "addresses": [s.address for s in servers]}
    atomic_write(ready, json.dumps(record))
    await stop.wait()
    for server in servers:
        server.drain(0.0)
    await asyncio.gather(*(s.wait_stopped() for s in servers))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowgrpo.services.bench.scale_host", description=__doc__)
    parser.add_argument("--role", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--config", required=True, help="the service config (YAML) every replica shares")
    parser.add_argument("--count", type=int, required=True, help="replicas this process serves")
    parser.add_argument("--first", type=int, default=0, help="the number of the first replica's id")
    parser.add_argument("--ready", required=True, help="JSON file written once all of them serve")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(CONFIGS[args.role], args.config)
    if not config.coordinator:
        parser.error(f"{args.config} names no coordinator: simulated replicas join a run by registering")
    import torch  # one thread per process: the load-test engine computes nothing worth a pool

    torch.set_num_threads(1)
    # this process stands for `count` processes: libzmq's 1,023 sockets and the soft descriptor
    # limit are per process, so they are raised to what `count` processes would have had
    zmq.Context.instance().set(zmq.MAX_SOCKETS, min(65536, 1024 * args.count))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(host(args.role, config, args.count, args.first, Path(args.ready)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
