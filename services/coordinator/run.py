"""The coordinator's run loop (torch-free): prompt groups -> rollout replicas -> reward replicas
(each rollout answer is scored as soon as it arrives) -> group advantages -> a trainer step ->
the new weights on every rollout replica -> the next step.

One step's work is keyed by prompt group; the replicas it goes to are a :class:`ReplicaPool`
(failures, back-off, weight loads, the registry's events). No group is lost or counted twice,
because a group's samples are only used once all of them are back and scored, and a regenerated
group replaces the failed attempt (noise is a function of (seed, step, uid, index), so any
replica draws the same samples). A trainer that dies is brought back and caught up by
``revive.py`` (``launch.trainer_restarts``); any other trainer failure stops the run, which resumes
from its last checkpoint (``run_state.json`` + the trainer's).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np
from opentelemetry import trace

from flowgrpo.algorithms import algorithm_of
from flowgrpo.bus import BusClient, BusError, TensorRef, TensorStore
from flowgrpo.configs.run import RunConfig
from flowgrpo.data import PromptRow, PromptSplit
from flowgrpo.services.coordinator.advantages import group_advantages
from flowgrpo.services.coordinator.handles import Replica
from flowgrpo.services.coordinator.lifecycle import RunInterrupted
from flowgrpo.services.coordinator.outputs import RunOutputs, RunState, evenly_spaced, read_metrics
from flowgrpo.services.coordinator.pool import ReplicaPool, RunError, TrainerGone
from flowgrpo.services.coordinator.progress import StepProgress
from flowgrpo.services.coordinator.registry import CoordinatorService
from flowgrpo.services.coordinator.revive import TrainerKeeper, TrainerSource
from flowgrpo.services.coordinator.validation import validation_metrics
from flowgrpo.v1 import common_pb2, reward_pb2, rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
tracer = trace.get_tracer(__name__)

VALIDATION_SHARE = 0.2  # a warning when validation takes more of the run's time than this
STORE_STATS_TIMEOUT_S = 2.0  # reading the trainer store's counters (publication/trainer_bytes_sent)
TRAIN_GRID_PROMPTS = 16  # a step's grid: its first groups' first samples
VAL_GRID_PROMPTS = 24  # a validation's grid: prompts evenly spaced over the validation set


class PromptOrder:
    """The training order, ``per_step`` prompts a step: epoch e is a permutation of the split
    drawn from (seed, e) alone, cut into ``size // per_step`` steps' batches, so the prompts of
    any step are known without replaying the run. The ``size % per_step`` prompts left at an
    epoch's end are not drawn in it (other ones each epoch, as a DataLoader's ``drop_last``): a
    batch that ran on into the next epoch could hold a prompt twice, which a rollout refuses
    (two groups would be one (prompt, sample index))."""

    def __init__(self, size: int, seed: int, per_step: int) -> None:
        if not 1 <= per_step <= size:
            raise ValueError(
                f"data.prompts_per_step={per_step} with {size} training prompts: a step draws each "
                f"prompt at most once, so at most {size}"
            )
        self.size, self.seed, self.per_step = size, seed, per_step
        self._epoch, self._perm = -1, np.arange(0)

    def batch(self, step: int) -> list[int]:
        """The rows of step ``step``'s prompts (steps count from 1)."""
        epoch, place = divmod(step - 1, self.size // self.per_step)
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return [int(row) for row in self._perm[place * self.per_step : (place + 1) * self.per_step]]


@dataclass
class Group:
    """One prompt's G samples through one step."""

    row: PromptRow
    ids_ref: common_pb2.TensorRef
    samples: list[rollout_pb2.Sample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    scores: list[dict[str, float]] = field(default_factory=list)


class Coordinator:
    """Owns the run: the replicas it drives, the dataset order, the run state and outputs."""

    def __init__(  # noqa: PLR0917 (the run's parts, each named)
        self,
        config: RunConfig,
        train: PromptSplit,
        rollouts: Sequence[Replica],
        rewards: Sequence[Replica],
        trainer: Replica,
        store: TensorStore,
        outputs: RunOutputs,
        registry: CoordinatorService,
        test: PromptSplit | None = None,
        trainer_source: TrainerSource | None = None,
    ) -> None:
        self.config = config
        self.train = train
        # validation: a fixed subset (the first val_prompts of the test split), ODE, fixed noise
        self.val_rows = list(test.rows[: config.data.val_prompts]) if test is not None else []
        self.order = PromptOrder(len(train), config.schedule.seed, config.data.prompts_per_step)
        self.pool = ReplicaPool(config.launch, list(rollouts), list(rewards), trainer, outputs.say,
                                publication=config.publication)  # fmt: skip
        self.store = store  # prompt ids, put once per prompt, fetched by rollouts and the trainer
        self.outputs = outputs
        self.progress = StepProgress(outputs.note, config.logger.progress_every_s)  # within a long step
        self.client = BusClient(config.bus)  # sampled images for the outputs' grids
        # the trainer store's bytes sent per version: a metric, never worth a long wait
        self.pool.store_stats = functools.partial(self.client.stat, timeout_s=STORE_STATS_TIMEOUT_S)
        self.state = RunState()
        self.registry = registry  # replicas register, beat and leave there; the pool follows it
        self.counters = {"dropped_groups": 0, "stale_groups": 0}
        self._zero_std = 0.0
        self._last_step_end = self._started = time.perf_counter()
        self._testing_s = 0.0  # validation time so far (its share of the run is logged and bounded)
        self._prompt_refs: dict[str, common_pb2.TensorRef] = {}
        self._stopping = asyncio.Event()  # a signal asked the run to stop after the step it trains
        self._saved_step = 0  # the step of the run state on disk: where a resume starts
        # the trainer's calls, kept steps and restarts; the run state of a save is written once
        # the trainer reports that checkpoint complete (trainer.async_save: a step or so later)
        self.trainer = TrainerKeeper(self.pool, config.launch, trainer_source, outputs.say, self._release)
        self.trainer.on_complete = self._checkpoint_complete
        self._saving: dict[int, RunState] = {}  # step -> its run state, while its checkpoint is written

    # --- the run -----------------------------------------------------------------------------

    async def run(self) -> list[dict[str, float]]:
        """Train ``schedule.steps`` steps (from the resumed state); returns each step's metrics.

        One step code for both schedules; only admission differs. ``sync``: the samples of step
        k are drawn after the weights of step k - 1 are loaded (lag 0). ``async``: the samples of
        steps k + 1 .. k + eta are drawn while step k trains, with whatever weights the rollouts
        hold (lag <= eta; a group above it is dropped and counted). eta = 0 is sync exactly."""
        await self._resume()
        history = []
        sched = self.config.schedule
        self.registry.steps, self.registry.schedule = sched.steps, sched.mode
        self.outputs.start_progress(self.state.step, sched.steps)
        self.registry.report(self.state.step, self.state.policy_version, {})
        follow = asyncio.create_task(self.pool.follow(self.registry), name="registry events")
        notes = asyncio.create_task(self.progress.run(), name="progress notes")
        self._last_step_end = time.perf_counter()
        ahead = sched.staleness if sched.mode == "async" else 0
        drawing: dict[int, asyncio.Task[tuple[list[Group], dict[str, float]]]] = {}
        try:
            if self.val_rows and sched.eval_every and self.state.step == 0:
                await self._unless_stopping(self.validate())  # the "before" of every later validation
            while self.state.step < sched.steps and not self._stopping.is_set():
                step = self.state.step + 1
                for k in range(step, min(step + ahead, sched.steps) + 1):
                    if k not in drawing:
                        drawing[k] = asyncio.create_task(self._draw(k))
                drawn = await self._unless_stopping(drawing.pop(step))
                if drawn is None:
                    break  # stopping while drawing: the draw is abandoned (it changed nothing)
                history.append(await self._train_on(step, *drawn))  # a step in training finishes
                last = self.state.step == sched.steps
                val = self.val_rows and sched.eval_every and (last or self.state.step % sched.eval_every == 0)
                if val and not self._stopping.is_set():
                    await self._unless_stopping(self.validate())
                if last or (sched.save_every and self.state.step % sched.save_every == 0):
                    await self.save(complete=last)
            if self._stopping.is_set():
                if self.state.step > self._saved_step:
                    await self.save(complete=True)
                raise RunInterrupted(self.state.step, self._saved_step)
        finally:
            for task in [*drawing.values(), follow, notes]:
                task.cancel()
            await asyncio.gather(follow, notes, return_exceptions=True)
            await self.pool.close()
            self.client.close()
        return history

    def request_stop(self) -> None:
        """Stop after the step being trained (a draw in flight is abandoned), save, and raise
        :class:`RunInterrupted` from :meth:`run`."""
        self._stopping.set()

    async def _unless_stopping(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None (``work`` cancelled) when a stop is requested first."""
        task = asyncio.ensure_future(work)
        stop = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None

    async def validate(self) -> dict[str, float]:
        """Sample the fixed validation prompts ``data.val_samples`` times each with the ODE (noise
        0, ``eval_num_points``) and the same noise every time, score them, log ``val-core/...``
        (at step 0, before any update, then every ``eval_every`` steps and at the last)."""
        with tracer.start_as_current_span("coordinator.validate", attributes={"step": self.state.step}):
            count = len(self.val_rows) * self.config.data.val_samples
            self.progress.begin("val", f"validation at step {self.state.step}", count)
            try:
                return await self._validate_now()
            finally:
                self.progress.end("val")

    async def _validate_now(self) -> dict[str, float]:
        started = time.perf_counter()
        groups = [self._group_of(row) for row in self.val_rows]
        tag = f"val{self.state.step}"
        per_prompt = self.config.data.val_samples
        requests = [
            rollout_pb2.GenerateRequest(
                step=0,  # fixed noise coordinates: every validation draws the same initial noise
                seed=self.config.schedule.seed,
                groups=[
                    rollout_pb2.PromptGroup(
                        # sample k's noise is a function of (seed, 0, prompt, k) alone: sample 0 is
                        # the same image whatever val_samples is
                        prompt_uid=g.row.prompt_uid,
                        prompt_ids=g.ids_ref,
                        sample_indices=list(range(per_prompt)),
                    )
                    for g in chunk
                ],
                params=self.config.sampling.params(evaluation=True).to_proto(),
                min_policy_version=self.state.policy_version,
                release_tag=tag,
            )
            for chunk in _requests(
                groups,
                len(self.pool.healthy_rollouts()),
                self.config.rollout.max_request_samples // per_prompt,
            )
        ]
        answers = await asyncio.gather(*(self._generate("val", r) for r in requests))
        by_uid = {g.row.prompt_uid: g for g in groups}
        for answer in answers:
            for sample in answer.samples:
                by_uid[sample.prompt_uid].samples.append(sample)
        await self._score(groups, "val")
        # evenly spread over the list (a task's prompts come grouped by category): each one shown
        await self._log_images("val", self.state.step, evenly_spaced(groups, VAL_GRID_PROMPTS))
        await self.pool.release(tag)
        testing = time.perf_counter() - started
        self._testing_s += testing
        share = self._testing_s / max(time.perf_counter() - self._started, 1e-9)
        metrics: dict[str, float] = {"timing_s/testing": testing, "perf/testing_share": share}
        if share > VALIDATION_SHARE and self.state.step > 0:  # at step 0 validation is all the run did
            log.warning(
                "validation has taken %.0f%% of the run's time so far; raise schedule.eval_every, or lower "
                "data.val_prompts or sampling.eval_num_points", 100 * share,
            )  # fmt: skip
        metrics.update(validation_metrics(groups, self.config.reward.scorers, per_prompt))
        self.outputs.log("val", self.state.step, metrics)
        shown = "  ".join(f"{k} {v:+.5f}" for k, v in metrics.items() if k.startswith("val-core"))
        self.outputs.say(f"  validation: {shown}")
        return metrics

    async def _draw(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The prompt groups of ``step``, generated and scored (its batch of the training order)."""
        with tracer.start_as_current_span("coordinator.draw", attributes={"step": step}):
            samples = self.config.data.prompts_per_step * self.config.data.group_size
            self.progress.begin(f"step{step}", f"step {step}/{self.config.schedule.steps}", samples)
            try:
                return await self._draw_now(step)
            except BaseException:  # the step's note ends here; else with its training (_train_on)
                self.progress.end(f"step{step}")
                raise

    async def _draw_now(self, step: int) -> tuple[list[Group], dict[str, float]]:
        started = time.perf_counter()
        groups = [self._group(row) for row in self.order.batch(step)]
        timing: dict[str, float] = {"timestamp_s/drawn_from": started}
        groups = await self._rollout_and_score(step, groups, timing)
        timing["timestamp_s/drawn_until"] = time.perf_counter()
        return groups, timing

    async def _train_on(self, step: int, groups: list[Group], timing: dict[str, float]) -> dict[str, float]:
        with tracer.start_as_current_span("coordinator.train", attributes={"step": step}):
            try:
                return await self._train_on_now(step, groups, timing)
            finally:
                self.progress.end(f"step{step}")

    async def _train_on_now(
        self, step: int, groups: list[Group], timing: dict[str, float]
    ) -> dict[str, float]:
        started = time.perf_counter()
        groups = self._admit(step, groups)
        self.progress.doing(f"step{step}", "training")
        response = await self._train(step, groups)
        trained = time.perf_counter()
        self.progress.doing(f"step{step}", "loading the weights")
        timing.update(await self._load_weights(step, response.update))
        timing["timing_s/load_weights"] = time.perf_counter() - trained
        timing["timing_s/train"] = trained - started
        timing["timestamp_s/trained_from"], timing["timestamp_s/trained_until"] = started, trained
        await self._log_images("train", step, groups[:TRAIN_GRID_PROMPTS])
        await self.trainer.kept_data(step)  # released, or kept for a restarted trainer
        self.state.step, self.state.cursor = step, step * self.config.data.prompts_per_step
        self.state.policy_version = response.update.policy_version
        metrics = self._step_metrics(groups, response, timing, self._since_last_step())
        self.registry.report(step, self.state.policy_version, metrics)
        self.outputs.log("train", step, metrics)
        self.outputs.step_done(_progress_line(step, self.config.schedule.steps, metrics), _postfix(metrics))
        return metrics

    async def _log_images(self, tag: str, step: int, groups: list[Group]) -> None:
        """The first sample of each group, as a grid in the run's outputs, with each cell's prompt
        and reward."""
        shown = [g for g in groups if g.samples]
        if shown:
            refs = [TensorRef.from_proto(g.samples[0].outputs["images"]) for g in shown]
            # a replica that died after its samples were trained on takes its images with it:
            # the grid shows the others (the step is trained; a picture is not worth failing it)
            got = await asyncio.to_thread(self.client.fetch, refs, timeout_s=10.0, errors="return")
            kept = [(g, f) for g, f in zip(shown, got, strict=True) if not isinstance(f, BusError)]
            lost = [f for f in got if isinstance(f, BusError)]
            if lost:
                log.warning("%s grid of step %d: %d of %d images are gone with their replica (%s)",
                            tag, step, len(lost), len(shown), lost[0])  # fmt: skip
            captions = [
                {"prompt": g.row.prompt, "reward": g.rewards[0] if g.rewards else math.nan} for g, _ in kept
            ]
            if kept:
                self.outputs.images(tag, step, [f.array for _, f in kept], captions)

    def _since_last_step(self) -> float:
        """Wall time per step: from the end of the previous one (async overlaps the next draw)."""
        now = time.perf_counter()
        wall, self._last_step_end = now - self._last_step_end, now
        return wall

    def _admit(self, step: int, groups: list[Group]) -> list[Group]:
        """Drop groups drawn with weights more than eta versions behind the trainer's."""
        eta = self.config.schedule.staleness if self.config.schedule.mode == "async" else 0
        version = self.state.policy_version
        fresh = [g for g in groups if all(version - s.policy_version <= eta for s in g.samples)]
        self.counters["stale_groups"] += len(groups) - len(fresh)
        return fresh

    async def save(self, complete: bool = False) -> None:
        """A trainer checkpoint, then the run state that matches it (written atomically last),
        once the trainer reports the checkpoint complete: at once, or with ``trainer.async_save``
        when a later answer says so (``complete``: wait for it: a run's last save)."""
        self._saving[self.state.step] = replace(self.state)
        self.progress.begin("save", f"saving the checkpoint of step {self.state.step}")
        try:
            await self.trainer.save(self.state.step, complete)
        finally:
            self.progress.end("save")

    def _checkpoint_complete(self, step: int, path: str) -> None:
        """The trainer's checkpoint of ``step`` is whole: the run state saved with it is written
        (never before: a resume must find both)."""
        state = self._saving.pop(step, None)
        for older in [s for s in self._saving if s < step]:
            del self._saving[older]  # superseded (a save a dead trainer never finished)
        if state is None or step <= self._saved_step:
            return
        state.trainer_checkpoint = path
        self.outputs.save_state(state)
        self._saved_step = step

    async def _release(self, step: int) -> None:
        await self.pool.release(f"step{step}")

    async def _load_weights(self, step: int, update: common_pb2.WeightUpdate) -> dict[str, float]:
        """``update`` on the rollouts; when the trainer died while they fetched it, on the ones
        still without it, from the trainer brought back."""
        while True:
            try:
                return await self.pool.load_weights(update, self.trainer.publisher_gone)
            except TrainerGone as error:
                update = await self.trainer.bring_back(error, f"publishing step {step}'s weights")

    # --- rollout and reward --------------------------------------------------------------------

    async def _rollout_and_score(
        self, step: int, groups: list[Group], timing: dict[str, float]
    ) -> list[Group]:
        """Every group generated and scored; groups that failed for good are dropped (counted)."""
        begin = time.perf_counter()
        per_request = self.config.rollout.max_request_samples // self.config.data.group_size
        chunks = _requests(groups, len(self.pool.healthy_rollouts()), per_request)
        phases: dict[str, list[tuple[float, float]]] = {"gen": [], "reward": []}
        done = await asyncio.gather(*(self._generate_and_score(step, chunk, phases) for chunk in chunks))
        timing["timing_s/gen_and_reward"] = time.perf_counter() - begin
        for phase, spans in phases.items():  # from the first start to the last end (they overlap)
            timing[f"timing_s/{phase}"] = (
                max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
            )
        kept = [g for chunk in done for g in chunk]
        self.counters["dropped_groups"] += len(groups) - len(kept)
        return kept

    async def _generate_and_score(
        self, step: int, chunk: list[Group], phases: dict[str, list[tuple[float, float]]]
    ) -> list[Group]:
        request = rollout_pb2.GenerateRequest(
            step=step,
            seed=self.config.schedule.seed,
            groups=[
                rollout_pb2.PromptGroup(
                    prompt_uid=g.row.prompt_uid,
                    prompt_ids=g.ids_ref,
                    sample_indices=range(self.config.data.group_size),
                )
                for g in chunk
            ],
            params=self.config.sampling.params().to_proto(),
            min_policy_version=self.state.policy_version,
            release_tag=f"step{step}",
        )
        started = time.perf_counter()
        response = await self._generate(f"step{step}", request)
        phases["gen"].append((started, time.perf_counter()))
        by_uid = {g.row.prompt_uid: g for g in chunk}
        for sample in response.samples:
            by_uid[sample.prompt_uid].samples.append(sample)
        failed = [g for g in chunk if any(s.HasField("error") for s in g.samples)]
        for group in failed:
            log.warning("group %s: a sample failed in rollout (%s); dropped", group.row.prompt_uid,
                        next(s.error.message for s in group.samples if s.HasField("error")))  # fmt: skip
        ok = [g for g in chunk if g not in failed]
        started = time.perf_counter()
        await self._score(ok, f"step{step}")
        phases["reward"].append((started, time.perf_counter()))
        return [g for g in ok if len(g.rewards) == len(g.samples) == self.config.data.group_size]

    async def _generate(self, key: str, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        """``request`` on a rollout replica; its samples are counted as drawn for ``key``'s note."""
        response = await self.pool.generate(request)
        self.progress.drawn(key, len(response.samples))
        return response

    async def _score(self, groups: list[Group], key: str) -> None:
        requests = [
            reward_pb2.ScoreRequest(
                sample_id=f"{g.row.prompt_uid}/{s.sample_index}",
                image=s.outputs["images"],
                prompt=g.row.prompt,
                ground_truth=g.row.ground_truth,
            )
            for g in groups
            for s in g.samples
        ]
        if not requests:
            return
        results = await self.pool.score(requests, functools.partial(self.progress.scored, key))
        by_id = {r.sample_id: r for r in results}
        for group in groups:
            for sample in sorted(group.samples, key=lambda s: s.sample_index):
                result = by_id.get(f"{group.row.prompt_uid}/{sample.sample_index}")
                if result is None or result.HasField("error"):
                    why = result.error.message if result is not None else "no result"
                    log.warning("sample %s/%d: no reward (%s); group dropped", group.row.prompt_uid,
                                sample.sample_index, why)  # fmt: skip
                    group.rewards.clear()
                    break
                group.rewards.append(result.reward)
                group.scores.append(dict(result.scores))
            group.samples.sort(key=lambda s: s.sample_index)

    # --- training and weights ------------------------------------------------------------------

    async def _train(self, step: int, groups: list[Group]) -> trainer_pb2.TrainStepResponse:
        if not groups:
            raise RunError(f"step {step}: every prompt group failed; nothing to train on")
        advantages, self._zero_std = group_advantages(
            {g.row.prompt_uid: g.rewards for g in groups}, self.config.advantages
        )
        algorithm = algorithm_of(self.config.trainer)
        targets = algorithm.targets(advantages, self.config.trainer)
        columns = [c for c in algorithm.columns if c != "prompt_ids"]
        samples = [
            trainer_pb2.TrainSample(
                prompt_uid=g.row.prompt_uid,
                sample_index=s.sample_index,
                policy_version=s.policy_version,
                advantage=a,
                inputs={"prompt_ids": g.ids_ref, **{c: s.outputs[c] for c in columns}},
                precision=s.precision,
            )
            for g in groups
            for s, a in zip(g.samples, targets[g.row.prompt_uid], strict=True)
        ]
        request = trainer_pb2.TrainStepRequest(
            step=step,
            samples=samples,
            params=self.config.sampling.params().to_proto(),
            seed=self.config.schedule.seed,
        )
        return await self.trainer.train(request)

    async def _resume(self) -> None:
        state = self.outputs.load_state()
        trainer = await self.pool.trainer.state(60.0)
        if state is None:
            if trainer.current.HasField("base"):  # the rollouts map the trainer's base before sampling
                await self.pool.load_weights(trainer.current)
            if trainer.step:
                raise RunError(
                    f"the trainer resumed at step {trainer.step} but {self.outputs.dir} has no run state: "
                    "point trainer.checkpoint_dir at this run's checkpoints or use a fresh run_dir"
                )
            self.outputs.rewind(0)  # what a run that saved nothing logged is trained again
            self.trainer.started_at(0, trainer.complete)
            return
        if trainer.step > state.step:
            state = self._ahead_state(state, trainer)
        elif trainer.step != state.step:
            state = self._fallen_back_state(state, trainer.step)
        self.trainer.started_at(state.step, trainer.complete)
        self.state, self._saved_step = state, state.step
        self.outputs.rewind(state.step)  # the steps after the checkpoint are trained again: logged once
        if trainer.current.policy_version or trainer.current.HasField("base"):  # base: trainer.share_base
            await self.pool.load_weights(trainer.current)
        self.outputs.say(f"resumed at step {state.step} (policy version {state.policy_version})")

    def _ahead_state(self, state: RunState, trainer: trainer_pb2.TrainerStateResponse) -> RunState:
        """The run state of the trainer's checkpoint, when that checkpoint was completed after
        the run state on disk was written: the coordinator died before it heard (an asynchronous
        save ends a step or so after it began). A run state is a function of the step (the
        cursor moves by data.prompts_per_step, a FIXED key) and the trainer's version, and this
        run logged that step; any other trainer ahead of the run state is refused."""
        step = trainer.step
        if not any(r["step"] == step for r in read_metrics(self.outputs.dir)) or not trainer.complete.path:
            raise RunError(
                f"run state at step {state.step} but the trainer resumed at step {step}, which this run "
                f"did not train: both must come from the same run (see {state.trainer_checkpoint})"
            )
        ahead = RunState(step, step * self.config.data.prompts_per_step, trainer.policy_version,
                         trainer.complete.path)  # fmt: skip
        self.outputs.save_state(ahead)
        self.outputs.say(
            f"the trainer's checkpoint of step {step} ({trainer.complete.path}) was completed after the run "
            f"state of step {state.step} was written; resuming at step {step}"
        )
        return ahead

    def _fallen_back_state(self, state: RunState, trainer_step: int) -> RunState:
        """The run state saved with the trainer's checkpoint, when the trainer resumed from an
        earlier one than the latest run state's (it skips a damaged checkpoint, saying so in its
        log); a trainer ahead of the run state, or a step whose state was not kept, is refused."""
        earlier = self.outputs.load_state(trainer_step) if 0 < trainer_step < state.step else None
        if earlier is None:
            raise RunError(
                f"run state at step {state.step} but the trainer resumed at step {trainer_step}: "
                f"both must come from the same save (see {state.trainer_checkpoint})"
            )
        self.outputs.say(
            f"the trainer could not load its checkpoint of step {state.step} ({state.trainer_checkpoint}: "
            f"damaged: its log names the file) and took the previous intact one, "
            f"{earlier.trainer_checkpoint}: {_steps(trainer_step + 1, state.step)} trained again"
        )
        return earlier

    # --- bookkeeping ---------------------------------------------------------------------------

    def _group(self, index: int) -> Group:
        return self._group_of(self.train[index])

    def _group_of(self, row: PromptRow) -> Group:
        if row.prompt_uid not in self._prompt_refs:  # put once, kept for the run (a few KB each)
            ref = self.store.put(f"prompts/{row.prompt_uid}", "prompt_ids", row.prompt_ids)
            self._prompt_refs[row.prompt_uid] = ref.to_proto()
        return Group(row, self._prompt_refs[row.prompt_uid])

    def _step_metrics(
        self,
        groups: list[Group],
        response: trainer_pb2.TrainStepResponse,
        timing: dict[str, float],
        wall: float,
    ) -> dict[str, float]:
        rewards = np.array([r for g in groups for r in g.rewards])
        metrics = dict(response.metrics.values)
        metrics |= {
            # verl's score is the reward function's value, its rewards that minus an in-reward KL
            # penalty; FlowGRPO puts KL in the loss (actor/kl_loss), so the two are equal here
            "critic/score/mean": float(rewards.mean()),
            "critic/score/max": float(rewards.max()),
            "critic/score/min": float(rewards.min()),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/rewards/max": float(rewards.max()),
            "critic/rewards/min": float(rewards.min()),
            "critic/rewards/zero_std_ratio": self._zero_std,
            "coordinator/dropped_groups": float(self.counters["dropped_groups"]),
            "coordinator/retries": float(self.pool.retries),
            "coordinator/rejoins": float(self.pool.rejoins),
            "coordinator/trainer_restarts": float(self.trainer.restarts),
            "coordinator/stale_groups": float(self.counters["stale_groups"]),
            "training/global_step": float(self.state.step),
            "training/policy_version": float(response.update.policy_version),
            "timing_s/step": wall,
            "perf/time_per_step": wall,
            "perf/throughput": len(rewards) / wall,  # images per second (verl: tokens per second)
            **timing,
        }
        names = {n for g in groups for s in g.scores for n in s}
        for name in sorted(names):
            values = [s[name] for g in groups for s in g.scores if name in s]
            metrics[f"critic/score/{name}/mean"] = float(np.mean(values))  # each scorer, unweighted
        return metrics


def _requests(groups: list[Group], replicas: int, most: int) -> list[list[Group]]:
    """The groups of one draw as Generate requests: one share per replica, each share cut into
    requests of at most ``most`` groups (``rollout.max_request_samples``: the replica refuses
    more, and a request that size is what one deadline covers)."""
    return [share[i : i + most] for share in _split(groups, replicas) for i in range(0, len(share), most)]


def _split(groups: list[Group], parts: int) -> list[list[Group]]:
    """Contiguous, near-equal chunks (empty chunks dropped); one chunk when ``parts`` is 0."""
    size = -(-len(groups) // max(parts, 1))
    return [groups[i : i + size] for i in range(0, len(groups), size)]


def _progress_line(step: int, steps: int, m: dict[str, float]) -> str:
    fields = "  ".join(f"{k} {v}" for k, v in _postfix(m).items() if k != "v")
    return f"step {step}/{steps}  {fields}  v{int(m['training/policy_version'])}  {m['timing_s/step']:.1f} s"


def _postfix(m: dict[str, float]) -> dict[str, str]:
    """The progress bar's key metrics (the clip fraction where the algorithm clips: FlowGRPO)."""
    shown = {
        "reward": f"{m['critic/rewards/mean']:+.6f}",
        "loss": f"{m.get('actor/pg_loss', math.nan):+.5f}",
    }
    if "actor/pg_clipfrac" in m:
        shown["clipfrac"] = f"{m['actor/pg_clipfrac']:.2f}"
    return {**shown, "lag": f"{m.get('trainer/lag/max', 0):.0f}", "v": f"{int(m['training/policy_version'])}"}


def reward_summary(history: list[dict[str, float]], window: int = 4) -> str:
    """The mean reward of the first and of the last ``window`` steps of a run."""
    rewards = [m["critic/rewards/mean"] for m in history]
    if len(rewards) < 2 * window:
        return ""
    first, last = float(np.mean(rewards[:window])), float(np.mean(rewards[-window:]))
    change = (last - first) / abs(first) * 100 if first else math.nan
    return (
        f"mean reward of the first {window} steps {first:+.6f}, "
        f"of the last {window} {last:+.6f} ({change:+.1f}%)"
    )


def _steps(first: int, last: int) -> str:
    return f"step {first} is" if first == last else f"steps {first}-{last} are"
