#!/usr/bin/env bash
# The coordinator against the replica count, on this machine's cores (2 are enough): the sweep
# N = 1, 8, 64, 256, 1024 simulated rollout replicas (docs/scaling-sweep.{md,png,json}), then 10%
# of 256 rollouts SIGKILLed mid-step and mid weight load (docs/scaling-kill.json). docs/scaling.md
# explains the figures. Extra arguments go to both runs (e.g. --steps 4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m flowgrpo.services.cli bench scale --replicas 1 8 64 256 1024 --steps 3 --out docs/scaling-sweep "$@"
"$PY" -m flowgrpo.services.cli bench scale --replicas 256 --steps 3 --kill-fraction 0.1 \
    --json docs/scaling-kill.json "$@"
