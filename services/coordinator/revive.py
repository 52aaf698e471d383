"""The run's trainer as the run loop calls it, and what happens when it dies.

Every call to the trainer (a step, a save) goes through :class:`TrainerKeeper`. A call that fails
because the trainer is gone (its process died, or it stopped answering) brings a trainer back
instead of ending the run: the launcher starts it again (``local``) or the run waits for one to
register (``remote``), at most ``launch.trainer_restarts`` times in a run (``launch.py``). The new
trainer resumes from its newest complete checkpoint; the keeper trains it again on the steps
trained since, from the very requests it sent the first time (the same samples and advantages,
still in the rollouts' stores), and only then answers the call that failed. The run loop sees
the call answered as if nothing had happened: the rollouts keep the weights they hold (the
steps trained again give the same version, bitwise in deterministic mode), nothing is sampled
or scored again, and every step is logged once.

Why train the kept requests again rather than rewind the run and sample the steps again: a
rollout refuses a policy version older than the one it holds (the weights it would have to go
back to), sampling again costs the rollouts and rewards a whole step each, and the kept requests
are references only. What it costs: the steps trained since the newest complete checkpoint keep
their trajectories in the rollouts' stores until a checkpoint covers them, at most
``launch.trainer_replay_steps`` of them (the oldest is released past that, and a death then ends
the run as before: resume with the same command). ``schedule.save_every=1`` with
``trainer.async_save`` keeps it at one or two steps. Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from flowgrpo.configs.run import LaunchConfig
from flowgrpo.services.coordinator.handles import Replica, ReplicaError
from flowgrpo.services.coordinator.pool import ReplicaPool, RunError, TrainerGone
from flowgrpo.v1 import common_pb2, trainer_pb2

log = logging.getLogger(__name__)

STATE_TIMEOUT_S = 60.0  # the State call of a trainer that has just started
T = TypeVar("T")


class TrainerSource(Protocol):
    """How a launcher brings a trainer back (``launch.py``: a process started again, or a
    registration waited for)."""

    restarts: int  # made so far in this run
    limit: int  # launch.trainer_restarts

    async def gone(self, replica: Replica) -> bool:
        """Whether the trainer behind ``replica`` is dead or does not answer (not merely failing)."""
        ...

    def ended(self) -> str:
        """How the last trainer ended, for the console ("killed by SIGKILL")."""
        ...

    async def revive(self, failed: Replica) -> Replica:
        """A trainer that answered the READY handshake; :class:`RunError` when none can be had
        (restarts used up, every start failed, none registered in time)."""
        ...

    async def close(self) -> None:
        """Close the channels to the trainers it brought back."""
        ...


class TrainerKeeper:
    """The trainer's calls, the steps it may have to train again, and its restarts."""

    def __init__(
        self,
        pool: ReplicaPool,
        launch: LaunchConfig,
        source: TrainerSource | None,
        say: Callable[[str], None],
        release: Callable[[int], Awaitable[None]],
    ) -> None:
        self.pool = pool
        self.launch = launch
        self.source = source if launch.trainer_restarts > 0 else None  # None: a death ends the run
        self._say = say
        self._release = release  # lets the rollouts drop a step's data
        # the requests of the steps trained since the newest complete checkpoint (what a new
        # trainer trains again), with the policy version each produced
        self.kept: dict[int, tuple[trainer_pb2.TrainStepRequest, int]] = {}
        self.trained = 0  # the newest step the trainer has trained
        self.complete: tuple[int, str] = (0, "")  # the newest complete checkpoint: (step, path)
        self.on_complete: Callable[[int, str], None] = lambda step, path: None

    @property
    def restarts(self) -> int:
        return self.source.restarts if self.source is not None else 0

    def started_at(self, step: int, complete: trainer_pb2.SavedCheckpoint) -> None:
        """The trainer the run started with is at ``step`` (its checkpoint, or 0)."""
        self.trained = step
        if complete.path:
            self.complete = (complete.step, complete.path)

    # --- the calls ---------------------------------------------------------------------------

    async def train(self, request: trainer_pb2.TrainStepRequest) -> trainer_pb2.TrainStepResponse:
        response = await self._call(
            lambda trainer: trainer.train_step(request, self.launch.request_timeout_s),
            f"training step {request.step}",
        )
        self.trained = request.step
        if self.source is not None:
            self.kept[request.step] = (request, response.update.policy_version)
        await self.completed(response.complete)
        return response

    async def save(self, step: int, complete: bool) -> trainer_pb2.SaveCheckpointResponse:
        request = trainer_pb2.SaveCheckpointRequest(step=step, complete=complete)
        response = await self._call(
            lambda trainer: trainer.save_checkpoint(request, self.launch.request_timeout_s),
            f"saving step {step}",
        )
        await self.completed(response.complete)
        return response

    async def kept_data(self, step: int) -> None:
        """``step`` is trained and its weights are loaded: its data is released, unless a
        restarted trainer may have to train it again (kept until a complete checkpoint covers
        it, ``launch.trainer_replay_steps`` steps at most)."""
        if step not in self.kept or step <= self.complete[0]:
            self.kept.pop(step, None)
            await self._release(step)
            return
        while len(self.kept) > self.launch.trainer_replay_steps:  # a death now ends the run
            oldest = min(self.kept)
            del self.kept[oldest]
            await self._release(oldest)

    async def completed(self, saved: trainer_pb2.SavedCheckpoint) -> None:
        """The trainer reports ``saved`` whole on disk: the run state may name it, and the steps
        it covers need not be kept any longer."""
        if not saved.path or saved.step <= self.complete[0]:
            return
        self.complete = (saved.step, saved.path)
        self.on_complete(saved.step, saved.path)
        for step in sorted(s for s in self.kept if s <= saved.step):
            del self.kept[step]
            await self._release(step)

    async def publisher_gone(self) -> bool:
        """Whether the trainer that published the weights being loaded has died."""
        return self.source is not None and await self.source.gone(self.pool.trainer)

    async def _call(self, call: Callable[[Replica], Awaitable[T]], doing: str) -> T:
        """``call`` on the trainer; when the trainer is gone, on the one brought back."""
        while True:
            try:
                return await call(self.pool.trainer)
            except ReplicaError as error:
                await self.bring_back(error, doing)

    # --- a death -----------------------------------------------------------------------------

    async def bring_back(self, error: ReplicaError | TrainerGone, doing: str) -> common_pb2.WeightUpdate:
        """A trainer at the step the run has trained, after ``error`` (a failed call, or a weight
        load the trainer's death failed): raises :class:`RunError` when the trainer is not gone
        (the failure is another one) or cannot be brought back. Returns the new trainer's
        publication of the current version."""
        refused = isinstance(error, ReplicaError) and not error.retryable
        if refused or self.source is None or not await self.source.gone(self.pool.trainer):
            raise RunError(
                f"the trainer failed while {doing}: {error}; resume from the last checkpoint"
            ) from error
        while True:
            ended = self.source.ended()
            replica = await self._revive(doing, ended)
            try:
                return await self._catch_up(replica, doing, ended)
            except ReplicaError as again:  # died again while catching up
                if not again.retryable or not await self.source.gone(replica):
                    raise RunError(
                        f"the restarted trainer failed while catching up with step {self.trained}: {again}; "
                        "resume from the last checkpoint"
                    ) from again

    async def _revive(self, doing: str, ended: str) -> Replica:
        assert self.source is not None
        try:
            return await self.source.revive(self.pool.trainer)
        except RunError as error:
            raise RunError(
                f"the trainer died while {doing} ({ended}) and did not come back: {error}; run the same "
                f"command to resume from {_checkpoint(self.complete[0])}"
            ) from None

    async def _catch_up(self, replica: Replica, doing: str, ended: str) -> common_pb2.WeightUpdate:
        """Take ``replica`` as the run's trainer and train it again up to :attr:`trained`."""
        state = await replica.state(STATE_TIMEOUT_S)
        again = list(range(state.step + 1, self.trained + 1))
        missing = [s for s in again if s not in self.kept]
        if state.step > self.trained or missing:
            raise RunError(self._cannot_catch_up(state.step, missing, doing, ended))
        self.pool.trainer = replica
        assert self.source is not None
        self._say(
            f"the trainer died while {doing} ({ended}); restart {self.source.restarts} of "
            f"launch.trainer_restarts={self.source.limit} resumed from {_checkpoint(state.step)}"
            + (f" and trains {_steps(again)} again from the kept samples" if again else "")
            + "; nothing is sampled again"
        )
        update = state.current
        for step in again:
            request, version = self.kept[step]
            response = await replica.train_step(request, self.launch.request_timeout_s)
            if response.update.policy_version != version:
                raise RunError(
                    f"step {step} trained again gave policy version {response.update.policy_version}, "
                    f"not {version} as the first time: resume from the last checkpoint"
                )
            update = response.update
        await self.pool.trainer_replaced(replica, update)
        await self.completed(state.complete)
        return update

    def _cannot_catch_up(self, resumed: int, missing: list[int], doing: str, ended: str) -> str:
        why = (
            f"it resumed at step {resumed}, past the run's step {self.trained} (is trainer.checkpoint_dir "
            "another run's?)"
            if resumed > self.trained
            else f"it resumed from {_checkpoint(resumed)} and the samples of {_steps(missing)} are no longer "
            f"kept (launch.trainer_replay_steps={self.launch.trainer_replay_steps}; save more often, e.g. "
            "schedule.save_every=1 trainer.async_save=true, to make a trainer's death free)"
        )
        return (
            f"the trainer died while {doing} ({ended}); the restarted one cannot catch up: {why}; run the "
            f"same command to resume from {_checkpoint(self.complete[0])}"
        )


def _checkpoint(step: int) -> str:
    return f"the checkpoint of step {step}" if step else "the start (no checkpoint yet)"


def _steps(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {steps[0]}-{steps[-1]}"
