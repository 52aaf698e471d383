"""A rehearsal of the Kubernetes topology without a cluster: the commands, arguments and
environment of ``deploy/k8s/overlays/multinode`` as ``kubectl kustomize`` renders them, started as
processes on this host with the pod-level values replaced (``$(POD_IP)``, ``$(POD_NAME)``, the
mounted recipe, Secret and volumes, devices): the coordinator, one rollout pod (its rollout and its
reward) and the trainer as two StatefulSet pods, each a torchrun agent with one CPU rank, joined by
the manifest's c10d rendezvous. They train a tiny BAGEL with the credentials read from files, as
from the mounted Secret; the trainer is stopped the documented way (Drain: rank 0 sends STOP, both
agents exit 0)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.runtime import ClientConfig, open_channel
from flowgrpo.services.coordinator.outputs import read_metrics
from flowgrpo.v1 import common_pb2, common_pb2_grpc
from tests.deploy.test_manifests import K8S_OVERLAYS, env_of, kustomize
from tests.deploy.test_rehearsal import free_port

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
STEPS = 2
NODES = 2


def here(argv: list[str], values: dict[str, str], placeholders: dict[str, str]) -> list[str]:
    """``argv`` on this host: KEY=VALUE overrides whose KEY is in ``values`` replaced, whole words
    too (paths), ``$(VAR)`` as Kubernetes expands it from ``placeholders``."""
    out = []
    for arg in argv:
        key, is_override, _ = arg.partition("=")
        local = f"{key}={values[key]}" if is_override and key in values else values.get(arg, arg)
        out.append(re.sub(r"\$\((\w+)\)", lambda m: placeholders[m[1]], local))
    return out


def container_env(
    container: dict[str, Any], files: dict[str, str], placeholders: dict[str, str]
) -> dict[str, str]:
    """The container's environment here: its values (fieldRefs from ``placeholders``), the
    mounted Secret's paths mapped to files of this test, HOME in the test's folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWGRPO_", "OTEL_"))}
    for item in container["env"]:
        if "valueFrom" in item:
            env[item["name"]] = placeholders[item["name"]]
        else:
            env[item["name"]] = files.get(item["value"], item["value"])
    return env


@pytest.mark.timeout(600)
def test_the_multinode_kubernetes_topology_trains_as_processes(tmp_path: Path) -> None:  # noqa: PLR0915
    docs = kustomize(K8S_OVERLAYS["multinode"])
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    [trainer_set] = [d for d in docs if d["kind"] == "StatefulSet"]
    assert trainer_set["spec"]["replicas"] == NODES

    tiny = make_tiny_bagel(tmp_path / "model")
    data = tmp_path / "data"
    prepare = ["data", "prepare", "pickscore", "--model-path", str(tiny), "--input-dir",
               str(ROOT / "examples" / "data" / "tiny"), "--output-dir", str(data)]  # fmt: skip
    subprocess.run([sys.executable, "-m", "flowgrpo.services.cli", *prepare], check=True, capture_output=True)
    secret = tmp_path / "secret"  # what the Secret flowgrpo-credentials mounts
    secret.mkdir(mode=0o700)
    for name, value in (
        ("token", "k8s-rehearsal-token-0123456789"),
        ("bus-secret", "k8s-rehearsal-bus-0123456789"),
    ):
        (secret / name).write_text(value)
    mounted = "/var/run/flowgrpo"
    files = {f"{mounted}/token": str(secret / "token"), f"{mounted}/bus-secret": str(secret / "bus-secret"),
             "/tmp": str(tmp_path)}  # fmt: skip
    ports = {
        "coordinator": free_port(),
        "rollout": free_port(),
        "reward": free_port(),
        "trainer": free_port(),
    }
    coordinator = f"127.0.0.1:{ports['coordinator']}"
    run_dir = tmp_path / "run"
    values = {
        "/config/recipe.yaml": str(RECIPE), "coordinator": coordinator, "server.host": "127.0.0.1",
        "bus.host": "127.0.0.1", "server.advertise_host": "127.0.0.1", "run_dir": str(run_dir),
        "model.checkpoint": str(tiny), "rollout.checkpoint": str(tiny), "trainer.checkpoint": str(tiny),
        "data.dataset": str(data), "rollout.device": "cpu", "reward.pickscore.device": "cpu",
        "trainer.device": "cpu", "trainer.checkpoint_dir": str(run_dir / "checkpoints"),
        "launch.rollout_replicas": "1", "launch.reward_replicas": "1",  # one rollout pod
    }  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, container: dict[str, Any], pod: str, extra: list[str]) -> None:
        placeholders = {"POD_IP": "127.0.0.1", "POD_NAME": pod}
        env = container_env(container, files, placeholders)
        placeholders |= {k: v for k, v in env.items() if k == "TRAINER_NODES"}
        argv = here([*container["command"], *container.get("args", [])], values, placeholders)
        assert argv[:2] == ["tini", "--"]
        argv = argv[2:]
        if argv[0] == "torchrun":  # this torch's torchrun; one CPU rank per pod (2 cores here)
            env["LOGLEVEL"] = "INFO"  # the agent logs the rendezvous it completed
            argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
            argv = [re.sub(r"^--nproc_per_node=\d+$", "--nproc_per_node=1", a) for a in argv]
            argv = [
                re.sub(r"^--rdzv_endpoint=.*", f"--rdzv_endpoint=127.0.0.1:{rendezvous}", a) for a in argv
            ]
        else:
            assert argv[0] == "flowgrpo"
            argv = [sys.executable, "-m", "flowgrpo.services.cli", *argv[1:]]
        log = (tmp_path / f"{name}.log").open("wb")
        procs[name] = subprocess.Popen([*argv, *extra], env=env, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=ROOT, start_new_session=True)  # fmt: skip

    def wait_file(path: Path, who: str) -> dict[str, Any]:
        deadline = time.monotonic() + 240
        while not path.is_file():
            assert procs[who].poll() is None, (tmp_path / f"{who}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {path.name}"
            time.sleep(0.2)
        info: dict[str, Any] = json.loads(path.read_text())
        return info

    rendezvous = free_port()
    trainer_ready = tmp_path / "trainer.ready.json"
    try:
        short = [f"schedule.steps={STEPS}", "schedule.eval_every=0", "schedule.save_every=0", "data.prompts="]
        [coordinator_container] = pods["flowgrpo-coordinator"]["containers"]
        values["server.port"] = str(ports["coordinator"])
        start("coordinator", coordinator_container, "flowgrpo-coordinator-x", short)
        wait_file(run_dir / "services" / "coordinator.ready.json", "coordinator")
        for container in pods["flowgrpo-rollout"]["containers"]:  # one pod: the rollout and its reward
            values["server.port"] = str(ports[container["name"]])
            start(container["name"], container, "flowgrpo-rollout-abc", [])
        values["server.port"] = str(ports["trainer"])
        [trainer] = pods["flowgrpo-trainer"]["containers"]
        for node in range(NODES):  # the StatefulSet's pods: the same command, joined by the rendezvous
            start(
                f"trainer-{node}", trainer, f"flowgrpo-trainer-{node}", [f"server.ready_file={trainer_ready}"]
            )
        assert procs["coordinator"].wait(timeout=420) == 0, (tmp_path / "coordinator.log").read_text()[-4000:]
        address = json.loads(trainer_ready.read_text())["grpc_address"]
        if procs["trainer-0"].poll() is None or procs["trainer-1"].poll() is None:
            asyncio.run(drain(address, (secret / "token").read_text()))  # rank 0 stops every rank
        codes = {name: procs[name].wait(timeout=120) for name in ("trainer-0", "trainer-1")}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"{name} ignored SIGTERM") from None
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
    assert codes == {"trainer-0": 0, "trainer-1": 0}, {n: logs[n][-2000:] for n in codes}
    group_ranks = set()
    for name in ("trainer-0", "trainer-1"):  # one job: both agents rendezvoused as 2 nodes of 1 rank
        [done] = re.findall(
            r"Rendezvous complete for workers. Result:.*?global_world_sizes=\[\d+\]", logs[name], re.S
        )
        assert "group_world_size=2" in done and "global_world_sizes=[2]" in done, done
        assert "master_addr=127.0.0.1" in done, done  # --local_addr=$(POD_IP): the pod's address
        group_ranks.add(re.findall(r"group_rank=(\d)", done)[0])
    assert group_ranks == {"0", "1"}
    assert "stopped: trainer flowgrpo-trainer" in logs["trainer-0"] + logs["trainer-1"]
    assert {name: procs[name].returncode for name in ("rollout", "reward")} == {"rollout": 0, "reward": 0}
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["trainer/samples"] == 32 and m["coordinator/dropped_groups"] == 0 for m in metrics)


async def drain(address: str, token: str) -> None:
    """Lifecycle.Drain with the run's token: how a torchrun trainer stops cleanly."""
    async with open_channel(address, ClientConfig(token=token)) as channel:
        await common_pb2_grpc.LifecycleStub(channel).Drain(common_pb2.DrainRequest(grace_s=30), timeout=60)


def test_the_rehearsal_replaces_every_placeholder() -> None:
    """Nothing of the pods' own ($(...) references, container paths) is left in a command."""
    [statefulset] = [d for d in kustomize(K8S_OVERLAYS["multinode"]) if d["kind"] == "StatefulSet"]
    [trainer] = statefulset["spec"]["template"]["spec"]["containers"]
    placeholders = {"POD_IP": "10.0.0.7", "TRAINER_NODES": env_of(trainer)["TRAINER_NODES"]}
    argv = here([*trainer["command"], *trainer["args"]], {}, placeholders)
    assert "--nnodes=2" in argv and "--local_addr=10.0.0.7" in argv and not any("$(" in a for a in argv)
