"""A rehearsal of the compose topology without Docker: the commands and environment of
``deploy/compose`` (2 rollout GPUs, a 1-GPU trainer) taken from ``docker-compose config``, started
as processes on this host with container paths, hosts, ports and devices replaced: a coordinator,
two rollout replicas, a reward replica and a trainer (under torchrun) train a tiny BAGEL. Their
spans go over OTLP to a receiver run by the test; each answers ``flowgrpo probe`` (its
healthcheck) and the shared token guards every call."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.coordinator.outputs import read_metrics
from tests.deploy.test_manifests import COMPOSE_DIR, compose_config, load_generator
from tests.otlp import otlp_receiver

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
STEPS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def on_this_host(argv: list[str], values: dict[str, str]) -> list[str]:
    """A container command as a process here: the interpreter for `flowgrpo` / `torchrun`, and
    each KEY=VALUE whose KEY is in ``values`` (or a container path) replaced."""
    if argv[0] == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run"]
    else:
        assert argv[0] == "flowgrpo", argv
        head = [sys.executable, "-m", "flowgrpo.services.cli"]
    out = []
    for arg in argv[1:]:
        key, is_override, _ = arg.partition("=")
        if is_override and key in values:
            out.append(f"{key}={values[key]}")
        else:
            out.append(values.get(arg, arg))  # whole-word replacements (the recipe path)
    return head + out


@pytest.mark.timeout(600)
def test_the_compose_topology_trains_as_processes_with_otlp_traces_and_probes(  # noqa: PLR0915
    tmp_path: Path, secrets_dir: Path
) -> None:
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text(load_generator().render(2, 1))
    (tmp_path / "otel-collector.yaml").write_text((COMPOSE_DIR / "otel-collector.yaml").read_text())
    config = compose_config(compose_file, [], secrets_dir)
    services: dict[str, Any] = config["services"]
    # the compose secrets, where compose mounts them -> their files here (the services read them
    # through FLOWGRPO_TOKEN_FILE and FLOWGRPO_BUS_SECRET_FILE, as in the containers)
    secret_files = {f"/run/secrets/{name}": secret["file"] for name, secret in config["secrets"].items()}
    assert set(services) == {"coordinator", "rollout-0", "rollout-1", "reward", "trainer"}

    tiny = make_tiny_bagel(tmp_path / "model")
    data = tmp_path / "data"
    prompts = ROOT / "examples" / "data" / "tiny"
    prepare = ["data", "prepare", "pickscore", "--model-path", str(tiny), "--input-dir", str(prompts),
               "--output-dir", str(data)]  # fmt: skip
    subprocess.run([sys.executable, "-m", "flowgrpo.services.cli", *prepare], check=True, capture_output=True)
    ports = {name: free_port() for name in services}
    coordinator = f"127.0.0.1:{ports['coordinator']}"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with otlp_receiver() as (receiver, otlp_port):

        def start(name: str, extra: list[str]) -> None:
            service = services[name]
            here = "127.0.0.1"
            values = {
                "/config/recipe.yaml": str(RECIPE), "coordinator": coordinator, "server.host": here,
                "server.advertise_host": here, "bus.host": here, "bus.advertise_host": here,
                "server.port": str(ports[name]), "run_dir": str(tmp_path / "run"),
                "model.checkpoint": str(tiny), "rollout.checkpoint": str(tiny),
                "trainer.checkpoint": str(tiny), "data.dataset": str(data),
                "rollout.device": "cpu", "reward.pickscore.device": "cpu", "trainer.device": "cpu",
                "trainer.checkpoint_dir": str(tmp_path / "run" / "checkpoints"),
            }  # fmt: skip
            env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
            env = {k: v for k, v in env.items() if not k.startswith("FLOWGRPO_")}
            env |= {
                k: secret_files.get(str(v), str(v)) for k, v in (service.get("environment") or {}).items()
            }
            env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}"}
            assert (
                Path(env["FLOWGRPO_TOKEN_FILE"]).is_file() and Path(env["FLOWGRPO_BUS_SECRET_FILE"]).is_file()
            )
            log = (tmp_path / f"{name}.log").open("wb")
            procs[name] = subprocess.Popen([*on_this_host(service["command"], values), *extra], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip

        def healthy(name: str) -> None:
            """The service's compose healthcheck, pointed at its port here."""
            probe = services[name]["healthcheck"]["test"][1:]
            assert probe[:2] == ["flowgrpo", "probe"]
            deadline = time.monotonic() + 180
            while True:
                cmd = [sys.executable, "-m", "flowgrpo.services.cli", "probe", f"127.0.0.1:{ports[name]}"]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode == 0 and "SERVING" in done.stdout:
                    return
                assert procs[name].poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{name} not healthy: {done.stdout}{done.stderr}"
                time.sleep(0.5)

        try:
            # the demo recipe names prompt files; the compose command a prepared dataset (one of the two)
            short = [
                f"schedule.steps={STEPS}",
                "schedule.eval_every=0",
                "schedule.save_every=0",
                "data.prompts=",
            ]
            start("coordinator", short)
            healthy("coordinator")  # compose: depends_on coordinator service_healthy
            for name in ("rollout-0", "rollout-1", "reward", "trainer"):
                start(name, [])
            for name in ("rollout-0", "rollout-1", "reward", "trainer"):
                healthy(name)
            assert procs["coordinator"].wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[
                -4000:
            ]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # a graceful drain, as `docker compose down`
            codes = {name: proc.wait(timeout=60) for name, proc in procs.items()}
        time.sleep(1.0)  # the last batches reach the receiver
        spans = list(receiver.spans)

    # every service drained on SIGTERM; torchrun itself exits 1 when signalled, after its worker drained
    assert {n: c for n, c in codes.items() if n != "trainer"} == dict.fromkeys(set(procs) - {"trainer"}, 0)
    trainer_log = (tmp_path / "trainer.log").read_text()
    assert "SIGTERM: draining" in trainer_log and "stopped: trainer trainer" in trainer_log
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["trainer/samples"] == 32 and m["coordinator/dropped_groups"] == 0 for m in metrics)
    # every service exported over OTLP; step 2's draw is one trace across all four of them
    assert {s["service.name"] for s in spans} >= {"coordinator", "rollout", "reward", "trainer"}
    instances = {s["resource"].get("service.instance.id") for s in spans if s["service.name"] == "rollout"}
    assert instances == {"rollout-0", "rollout-1"}
    [draw] = [s for s in spans if s["name"] == "coordinator.draw" and s["attributes"].get("step") == 2]
    in_trace = {s["service.name"] for s in spans if s["trace_id"] == draw["trace_id"]}
    assert in_trace >= {"coordinator", "rollout", "reward"}
