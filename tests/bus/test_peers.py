"""A client fed by many producers holds at most ``bus.max_peers`` sockets: a trainer or reward
replica fetching from a thousand rollouts otherwise ran past libzmq's sockets per process
(EMFILE, "Too many open files"; docs/scaling.md). And a store counts the bytes it served."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a process of its own: libzmq's socket limit is set before the context's first socket. A
# client's connection to a store is 3 sockets (the socket, its monitor and the monitor's reader):
# 20 stores and a client connected to each need 80 sockets, past the limit of 64 set here; in
# waves of 4 they need 32.
CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import zmq
    from flowgrpo.bus import BusClient, BusConfig, serve_store

    zmq.Context.instance().set(zmq.MAX_SOCKETS, 64)
    config = BusConfig(transport="ipc", shm=False, max_peers=int(sys.argv[1]))
    servers = [serve_store(config) for _ in range(20)]
    refs = [s.store.put(f"t{i}", "rewards", np.array(i, dtype=np.float32)) for i, s in enumerate(servers)]
    with BusClient(config, local_stores=False) as client:
        for _ in range(2):  # again: the sockets of the first call were closed or reused, not leaked
            got = client.fetch(refs, timeout_s=30)
            assert [int(f.array) for f in got] == list(range(20))
        assert len(client._peers) <= config.max_peers
        served = client.stat(servers[0].endpoint, timeout_s=30).served_bytes
    assert served == 2 * 4, served
    for s in servers:
        s.close()
    print("ok")
    """
)


def run_child(max_peers: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, str(max_peers)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_a_fetch_from_more_producers_than_max_peers_goes_in_waves() -> None:
    done = run_child(4)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_one_socket_per_producer_runs_out_of_sockets() -> None:
    """The same fetch with room for a socket per producer fails: the limit is real."""
    done = run_child(64)
    assert done.returncode != 0 and "Too many open files" in done.stderr, done.stderr[-2000:]
