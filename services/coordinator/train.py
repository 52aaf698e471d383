"""``flowgrpo train RECIPE [key=value ...]``: one training run, start to end.

Resolve the model (a tiny random BAGEL is made in ``<run_dir>/model`` when the recipe names no
checkpoint), check the dataset against the checkpoint's tokenizer, write the resolved config,
start the services with the configured launcher, check the pipeline, run the schedule, stop the
services. Torch is never imported here (the tiny model is made by a ``flowgrpo`` subprocess).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from flowgrpo.bus import serve_store
from flowgrpo.bus.config import SECRET_ENV
from flowgrpo.configs.run import RunConfig, with_checkpoint
from flowgrpo.data import DatasetError, PromptSplit, load_split
from flowgrpo.data.prepare import PrepareOptions, prepare_dataset
from flowgrpo.runtime import Service, ServiceServer
from flowgrpo.runtime.credentials import RunCredentials, remove_run_credentials, write_run_credentials
from flowgrpo.runtime.security import TOKEN_ENV, resolve_token
from flowgrpo.runtime.server import REPLY_FLUSH_S
from flowgrpo.services.coordinator.launch import Services, launch, run_settings
from flowgrpo.services.coordinator.lifecycle import RunInterrupted, RunLock, StopSignals, stop_leftovers
from flowgrpo.services.coordinator.outputs import RunOutputs
from flowgrpo.services.coordinator.progress import StartupReport
from flowgrpo.services.coordinator.registry import CoordinatorService, server_concurrency
from flowgrpo.services.coordinator.resume import (
    ResumePlan,
    ResumeRefused,
    plan_resume,
    prepared_data_folder,
    record_resume,
    tiny_model_folder,
)
from flowgrpo.services.coordinator.run import Coordinator, reward_summary
from flowgrpo.services.coordinator.runmeta import Invocation, end_session, start_session
from flowgrpo.services.coordinator.validation import validation_keys
from flowgrpo.telemetry import setup_tracing, shutdown_tracing
from flowgrpo.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)


def prepare_model(cfg: RunConfig) -> RunConfig:
    """``cfg`` with a checkpoint: the recipe's, or a tiny random BAGEL made once per run folder."""
    if cfg.model.checkpoint:
        return with_checkpoint(cfg, cfg.model.checkpoint)
    folder = tiny_model_folder(cfg)
    if not (folder / "ema.safetensors").is_file():
        cmd = [
            sys.executable,
            "-m",
            "flowgrpo.services.cli",
            "make-tiny-bagel",
            str(folder),
            "--seed",
            str(cfg.model.tiny_seed),
        ]
        if cfg.rollout.engine == "vllm_omni":  # vLLM-Omni loads the whole published layout
            cmd.append("--complete")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return with_checkpoint(cfg, str(folder))


def train(
    cfg: RunConfig, progress: Any = sys.stderr, invocation: Invocation | None = None
) -> list[dict[str, float]]:
    return asyncio.run(train_async(cfg, progress, invocation))


def prepare_data(cfg: RunConfig) -> RunConfig:
    """``cfg`` with a prepared dataset: the recipe's, or its prompt files prepared once per run
    folder with the run's tokenizer."""
    if cfg.data.dataset:
        return cfg
    folder = prepared_data_folder(cfg)
    if not (folder / "meta.json").is_file():
        options = PrepareOptions(kind=cfg.data.kind, progress=False)
        prompts = Path(cfg.data.prompts)
        missing = [name for name in ("train.txt", "test.txt") if not (prompts / name).is_file()]
        if missing:  # named by the key the user set (prepare_dataset speaks of its own options)
            raise DatasetError(
                f"data.prompts={cfg.data.prompts}: no {' and no '.join(missing)} there; the folder needs "
                "train.txt and test.txt, one prompt per line"
            )
        prepare_dataset(cfg.model.checkpoint, cfg.data.prompts, folder, options)
    return replace(cfg, data=replace(cfg.data, dataset=str(folder), prompts=""))


async def train_async(
    cfg: RunConfig, progress: Any = sys.stderr, invocation: Invocation | None = None
) -> list[dict[str, float]]:
    """The run, holding its folder's lock throughout (a second run there is refused). A folder
    that holds a run is checked first, before anything is written (:mod:`.resume`): a config it
    cannot resume is refused (:class:`ResumeRefused`), a finished run returns no steps at once.
    ``invocation`` (the command) goes to ``sessions.jsonl`` with this process's times (:mod:`.runmeta`)."""
    plan = plan_resume(cfg)
    if plan is not None and plan.refused:
        raise ResumeRefused(plan.refusal())
    if plan is not None and plan.finished(cfg.schedule.steps):
        _say(progress, plan.finished_line(cfg.schedule.steps))
        return []
    for line in plan.report() if plan is not None else []:
        _say(progress, line)
    lock = RunLock(cfg.run_dir)
    note = lock.acquire()
    try:
        if note:
            log.warning("%s: %s", cfg.run_dir, note)
        if cfg.rollout.engine == "synthetic":
            log.warning(
                "rollout.engine=synthetic: a LOAD TEST; the rollouts compute no model, nothing learns"
            )
        stopped = stop_leftovers(Path(cfg.run_dir) / "services")
        if stopped:
            log.warning("stopped %s, left running by an earlier run of %s", ", ".join(stopped), cfg.run_dir)
        with run_credentials(cfg):
            return await _train_holding_lock(cfg, progress, plan, invocation)
    finally:
        lock.release()


@contextlib.contextmanager
def run_credentials(cfg: RunConfig) -> Iterator[None]:
    """The services this coordinator starts itself (``local``, ``inprocess``) share a token and a
    bus secret of this run's own, made here unless the environment gives them: in the
    environment of this process, so its servers, its clients and the children it starts all have
    them, and on disk only in ``<run_dir>/credentials.json`` (0600, removed when the run ends), for
    ``flowgrpo status`` and ``flowgrpo serve`` of the same user on this host; the config files the
    children read hold no secret. Restored after the run. ``remote``: the operator distributes
    them (docs/security.md)."""
    if cfg.launch.launcher == "remote":
        yield
        return
    missing = [TOKEN_ENV] if not resolve_token(cfg.server.token) else []
    missing += [SECRET_ENV] if cfg.bus.resolve_secret() is None else []
    run_dir = Path(cfg.run_dir)
    remove_run_credentials(run_dir)  # an earlier run's, left by a kill: never read as this run's
    with secrets_in_environment(missing):
        if missing:  # what this run made, for status and serve on this host (0600, removed at the end)
            made = {name: os.environ[name] if name in missing else "" for name in (TOKEN_ENV, SECRET_ENV)}
            write_run_credentials(run_dir, RunCredentials(token=made[TOKEN_ENV], bus_secret=made[SECRET_ENV]))
        try:
            yield
        finally:
            remove_run_credentials(run_dir)


@contextlib.contextmanager
def secrets_in_environment(names: Sequence[str]) -> Iterator[None]:
    """A fresh random secret in each of the environment variables ``names`` while inside (the
    children started inside inherit them); removed after."""
    made = {name: secrets.token_urlsafe(32) for name in names}
    os.environ.update(made)
    try:
        yield
    finally:
        for name in made:
            os.environ.pop(name, None)


def _say(progress: Any, line: str) -> None:
    if progress is not None:
        print(line, file=progress, flush=True)


async def _train_holding_lock(
    cfg: RunConfig, progress: Any, plan: ResumePlan | None, invocation: Invocation | None
) -> list[dict[str, float]]:
    task = asyncio.current_task()
    assert task is not None
    coordinator: Coordinator | None = None
    services: Services | None = None

    def stop() -> None:
        if coordinator is not None:
            coordinator.request_stop()

    def force() -> None:
        if services is not None:
            services.kill()

    signals = StopSignals(task, on_stop=stop, on_force=force)
    try:
        cfg, split, test = _prepare(cfg)
    except asyncio.CancelledError:
        signals.remove()
        raise _interrupted(cfg, None, signals) from None
    outputs = _open_outputs(cfg, progress, plan, len(split))
    session = start_session(cfg.run_dir, invocation)
    store = serve_store(cfg.bus)
    registry, server = _coordinator_server(cfg)
    try:
        outputs.say(
            f"coordinator at {await server.start()} (replicas register here; flowgrpo status reads it)"
        )
        report = StartupReport(outputs.say, cfg.logger.progress_every_s)
        async with report.watching():
            services = await launch(cfg, registry, report)
        try:
            coordinator = Coordinator(cfg, split, services.rollouts, services.rewards, services.trainer,
                                      store.store, outputs, registry, test,
                                      trainer_source=services.trainer_source)  # fmt: skip
            signals.running()
            history = await coordinator.run()
            if summary := reward_summary(history):
                outputs.say(summary)
            return history
        finally:
            await services.shutdown()
    except asyncio.CancelledError:
        if not signals.signals:
            raise
        raise _interrupted(cfg, coordinator, signals) from None
    finally:
        ending = _ending(sys.exc_info()[1])  # for TensorBoard's hparams session
        signals.remove()
        if server.address:
            await server.stop(REPLY_FLUSH_S)  # a goodbye in flight is answered, not cancelled
        store.close()
        outputs.end_session(ending)
        end_session(cfg.run_dir, session, ending)
        outputs.close()
        shutdown_tracing()


def _open_outputs(cfg: RunConfig, progress: Any, plan: ResumePlan | None, prompts: int) -> RunOutputs:
    """The run's outputs, config.yaml (the run as it goes on) and, on a resume with changes, what
    changed at which step (resumes.jsonl); tracing; the run's first line."""
    outputs = RunOutputs(cfg.run_dir, progress, cfg.logger)
    # TensorBoard's HPARAMS tab: the main settings beside the final validation and the last reward
    outputs.write_config(cfg, cfg.name, metrics=[*validation_keys(cfg.reward.scorers), "critic/rewards/mean"])
    if plan is not None:
        record_resume(plan)
    # spans to <run_dir>/traces (and an OTLP collector if set); the services write theirs there too
    setup_tracing("coordinator", replica_id="coordinator", run_dir=str(Path(cfg.run_dir).resolve()))
    outputs.say(f"run {cfg.name}: {prompts} training prompts, {cfg.launch.launcher} launcher, {cfg.run_dir}")
    return outputs


def _coordinator_server(cfg: RunConfig) -> tuple[CoordinatorService, ServiceServer]:
    """The coordinator's registry and the gRPC server it is served by (not started)."""
    registry = CoordinatorService(
        run_id=f"{cfg.name}-{uuid.uuid4().hex[:8]}",
        heartbeat_interval_s=cfg.launch.heartbeat_interval_s,
        lost_after_s=cfg.launch.lost_after_s,
        max_heartbeats_per_s=cfg.launch.max_heartbeats_per_s,
        settings=run_settings(cfg),  # a registrant started with another recipe's is refused
    )
    ready_file = Path(cfg.run_dir).resolve() / "services" / "coordinator.ready.json"
    members = cfg.launch.rollout_replicas + cfg.launch.reward_replicas + 1  # heartbeats: docs/scaling.md
    server_config = replace(
        cfg.server,
        ready_file=str(ready_file),
        concurrency=server_concurrency(cfg.server.concurrency, members),
        # a connection or two from each member (docs/security.md, "Admission")
        max_connections=max(cfg.server.max_connections, 2 * members + 64),
    )
    server = ServiceServer(registry, server_config, [
        Service("flowgrpo.v1.Coordinator", registry, coordinator_pb2_grpc.add_CoordinatorServicer_to_server)
    ])  # fmt: skip
    return registry, server


def _ending(error: BaseException | None) -> str:
    """How the run ends, by what is raised out of it (None: it finished)."""
    if error is None:
        return "success"
    return "interrupted" if isinstance(error, RunInterrupted | asyncio.CancelledError) else "failed"


def _prepare(cfg: RunConfig) -> tuple[RunConfig, PromptSplit, PromptSplit | None]:
    """The model and data of the run (made or checked), its training and validation prompts."""
    cfg = prepare_data(prepare_model(cfg))
    split = load_split(cfg.data.dataset, "train", model_path=cfg.model.checkpoint)
    test = None
    if cfg.schedule.eval_every and cfg.data.val_prompts:
        test = load_split(cfg.data.dataset, "test", model_path=cfg.model.checkpoint)
    return cfg, split, test


def _interrupted(cfg: RunConfig, coordinator: Coordinator | None, signals: StopSignals) -> RunInterrupted:
    """Where a cancelled run stands: the steps trained, and the saved state a resume starts from."""
    saved = RunOutputs.saved_step(cfg.run_dir)
    step = coordinator.state.step if coordinator is not None else saved
    return RunInterrupted(step, saved, forced=signals.forced)
