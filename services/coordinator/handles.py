"""How the coordinator reaches a service replica: the same calls over gRPC (``local`` and
``remote`` launchers) or straight into an actor in this process (``inprocess``: the servicer's
methods through its mailbox, no socket). One typed method per RPC the coordinator makes, with its
request and response types (rollout: :meth:`Replica.generate`, :meth:`Replica.load_weights`,
:meth:`Replica.release`; trainer: :meth:`Replica.train_step`, :meth:`Replica.save_checkpoint`,
:meth:`Replica.state`; reward: :meth:`Replica.score`). Every failure comes out as
:class:`ReplicaError`, which says whether another replica may take the work."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import grpc
import grpc.aio

from flowgrpo.v1 import (
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

T = TypeVar("T")

# Statuses after which the same request may succeed on another replica (or later on this one).
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}


class ReplicaError(RuntimeError):
    """A call to a replica failed. ``retryable``: the replica (or the link) failed, not the
    request; the work may go to another replica."""

    def __init__(self, replica: str, what: str, message: str, retryable: bool) -> None:
        super().__init__(f"{replica}: {what} failed: {message}")
        self.replica, self.retryable = replica, retryable


@dataclass
class Replica:
    """One service replica as the coordinator sees it."""

    role: str
    replica_id: str
    address: str  # host:port, or "inprocess"
    target: Any  # a generated stub (gRPC) or the servicer (in process)
    in_process: bool = False
    healthy: bool = True
    busy: int = 0  # calls in flight from the coordinator (load balancing)
    failures: int = 0  # consecutive failed calls (reward replicas: the back-off grows with them)
    retry_at: float = 0.0  # time.monotonic() before which a failed reward replica is not tried
    policy_version: int = -1  # rollouts: the weights it holds, as far as the coordinator knows
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set: its calls end now
    lost_reason: str = ""

    def lose(self, reason: str) -> None:
        """The registry lost it (heartbeats stopped, or it left): its calls in flight fail now as
        retryable, and it gets no more work."""
        self.healthy = False
        self.lost_reason = reason
        self.lost.set()

    async def _unless_lost(self, what: str, call: Awaitable[T]) -> T:
        """``call``, or a retryable :class:`ReplicaError` as soon as the replica is lost."""
        task = asyncio.ensure_future(call)
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            lost.cancel()
        if task.done():
            return task.result()
        task.cancel()
        raise ReplicaError(self.replica_id, what, self.lost_reason, retryable=True)

    # --- the calls: one per RPC, typed ----------------------------------------------------------

    async def generate(
        self, request: rollout_pb2.GenerateRequest, timeout_s: float
    ) -> rollout_pb2.GenerateResponse:
        return cast(rollout_pb2.GenerateResponse, await self._unary("Generate", request, timeout_s))

    async def load_weights(
        self, request: rollout_pb2.LoadWeightsRequest, timeout_s: float
    ) -> rollout_pb2.LoadWeightsResponse:
        return cast(rollout_pb2.LoadWeightsResponse, await self._unary("LoadWeights", request, timeout_s))

    async def release(
        self, request: rollout_pb2.ReleaseRequest, timeout_s: float
    ) -> rollout_pb2.ReleaseResponse:
        return cast(rollout_pb2.ReleaseResponse, await self._unary("Release", request, timeout_s))

    async def train_step(
        self, request: trainer_pb2.TrainStepRequest, timeout_s: float
    ) -> trainer_pb2.TrainStepResponse:
        return cast(trainer_pb2.TrainStepResponse, await self._unary("TrainStep", request, timeout_s))

    async def save_checkpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, timeout_s: float
    ) -> trainer_pb2.SaveCheckpointResponse:
        return cast(
            trainer_pb2.SaveCheckpointResponse, await self._unary("SaveCheckpoint", request, timeout_s)
        )

    async def state(self, timeout_s: float) -> trainer_pb2.TrainerStateResponse:
        request = trainer_pb2.TrainerStateRequest()
        return cast(trainer_pb2.TrainerStateResponse, await self._unary("State", request, timeout_s))

    async def _unary(self, method: str, request: Any, timeout_s: float) -> Any:
        """The stub's (or the in-process servicer's) ``method``: the RPC's name in the proto."""
        try:
            if self.in_process:
                return await getattr(self.target, method)(request, None)
            return await self._unless_lost(method, getattr(self.target, method)(request, timeout=timeout_s))
        except grpc.aio.AioRpcError as error:
            raise ReplicaError(
                self.replica_id, method, f"{error.code().name}: {error.details()}", error.code() in RETRYABLE
            ) from None
        except ReplicaError:
            raise
        except Exception as error:  # in process: the service's own exception
            code = getattr(error, "code", None)
            retryable = code in RETRYABLE if isinstance(code, grpc.StatusCode) else False
            raise ReplicaError(
                self.replica_id, method, f"{type(error).__name__}: {error}", retryable
            ) from error

    async def score(
        self,
        requests: Sequence[reward_pb2.ScoreRequest],
        timeout_s: float,
        on_result: Callable[[], None] | None = None,
    ) -> list[reward_pb2.ScoreResult]:
        """Stream ``requests`` to a reward replica, collect one result per request
        (``on_result`` is called as each arrives)."""

        async def feed() -> AsyncIterator[reward_pb2.ScoreRequest]:
            for request in requests:
                yield request

        async def collect(stream: AsyncIterator[reward_pb2.ScoreResult]) -> list[reward_pb2.ScoreResult]:
            results = []
            async for result in stream:
                results.append(result)
                if on_result is not None:
                    on_result()
            return results

        try:
            if self.in_process:
                return await collect(self.target.Score(feed(), None))
            return await self._unless_lost("Score", collect(self.target.Score(feed(), timeout=timeout_s)))
        except grpc.aio.AioRpcError as error:
            raise ReplicaError(
                self.replica_id, "Score", f"{error.code().name}: {error.details()}", error.code() in RETRYABLE
            ) from None
        except ReplicaError:
            raise
        except Exception as error:
            raise ReplicaError(self.replica_id, "Score", f"{type(error).__name__}: {error}", False) from error


STUBS = {
    "rollout": rollout_pb2_grpc.RolloutStub,
    "reward": reward_pb2_grpc.RewardStub,
    "trainer": trainer_pb2_grpc.TrainerStub,
}
