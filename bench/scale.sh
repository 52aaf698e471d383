#!/usr/bin/env bash
# The coordinator against the replica count, on this machine's cores (2 are enough): the sweep
# N = 1, 8, 64, 256, 1024 simulated rollout replicas, weights published by the star
# (docs/scaling-sweep.{md,png,json}) and by the relay (docs/scaling-sweep-relay.*), then 10%
# of 256 rollouts SIGKILLed mid-step and mid weight load, star and relay (docs/scaling-kill{,-relay}.json). docs/scaling.md
# explains the figures. Extra arguments go to both runs (e.g. --steps 4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m flowgrpo.services.cli bench scale --replicas 1 8 64 256 1024 --steps 3 --publication star \
    --out docs/scaling-sweep "$@"
"$PY" -m flowgrpo.services.cli bench scale --replicas 1 8 64 256 1024 --steps 3 --publication relay \
    --out docs/scaling-sweep-relay "$@"
for mode in star relay; do
    "$PY" -m flowgrpo.services.cli bench scale --replicas 256 --steps 3 --kill-fraction 0.1 \
        --publication $mode --json "docs/scaling-kill$([[ $mode == relay ]] && echo -relay).json" "$@"
done
