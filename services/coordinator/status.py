"""``flowgrpo status RUN_DIR``: where a run stands, from its folder alone: the run state, the last
step's key metrics, and each service process of the ``local`` launcher (alive or not)."""

from __future__ import annotations

import json
from pathlib import Path

from flowgrpo.bus.shm import pid_alive
from flowgrpo.services.coordinator.outputs import read_metrics

KEYS = ("critic/rewards/mean", "actor/loss", "actor/pg_clipfrac", "trainer/lag/max", "timing_s/step",
        "coordinator/dropped_groups", "coordinator/retries")  # fmt: skip


def status(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml): give the run_dir of a run")
    lines = [f"run {run_dir}"]
    state_file = run_dir / "run_state.json"
    if state_file.is_file():
        state = json.loads(state_file.read_text())
        lines.append(f"  checkpointed at step {state['step']} (policy v{state['policy_version']}): "
                     f"{state['trainer_checkpoint']}")  # fmt: skip
    train, val = read_metrics(run_dir), read_metrics(run_dir, kind="val")
    if train:
        last = train[-1]
        shown = "  ".join(f"{k} {last[k]:.4g}" for k in KEYS if last.get(k) is not None)
        lines.append(f"  last step {last['step']}: {shown}")
    if val:
        scores = "  ".join(f"{k} {v:.5g}" for k, v in val[-1].items() if k.startswith("val-core"))
        lines.append(f"  last validation (step {val[-1]['step']}): {scores}")
    for ready in sorted((run_dir / "services").glob("*.ready.json")):
        info = json.loads(ready.read_text())
        alive = pid_alive(int(info["pid"]))
        lines.append(f"  {info['replica_id']:<12} {info['grpc_address']:<22} pid {info['pid']:<8} "
                     f"{'running' if alive else 'not running'}")  # fmt: skip
    return "\n".join(lines)
