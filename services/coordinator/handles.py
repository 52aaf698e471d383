"""How the coordinator reaches a service replica: the same four calls over gRPC (``local`` and
``remote`` launchers) or straight into an actor in this process (``inprocess``: the servicer's
methods through its mailbox, no socket). Every failure comes out as :class:`ReplicaError`, which
says whether another replica may take the work."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from flowgrpo.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2_grpc, trainer_pb2_grpc

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

    async def unary(self, method: str, request: Any, timeout_s: float) -> Any:
        try:
            if self.in_process:
                return await getattr(self.target, method)(request, None)
            return await getattr(self.target, method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise ReplicaError(
                self.replica_id, method, f"{error.code().name}: {error.details()}", error.code() in RETRYABLE
            ) from None
        except Exception as error:  # in process: the service's own exception
            code = getattr(error, "code", None)
            retryable = code in RETRYABLE if isinstance(code, grpc.StatusCode) else False
            raise ReplicaError(
                self.replica_id, method, f"{type(error).__name__}: {error}", retryable
            ) from error

    async def score(
        self, requests: Sequence[reward_pb2.ScoreRequest], timeout_s: float
    ) -> list[reward_pb2.ScoreResult]:
        """Stream ``requests`` to a reward replica, collect one result per request."""

        async def feed() -> AsyncIterator[reward_pb2.ScoreRequest]:
            for request in requests:
                yield request

        try:
            if self.in_process:
                return [r async for r in self.target.Score(feed(), None)]
            call = self.target.Score(feed(), timeout=timeout_s)
            return [r async for r in call]
        except grpc.aio.AioRpcError as error:
            raise ReplicaError(
                self.replica_id, "Score", f"{error.code().name}: {error.details()}", error.code() in RETRYABLE
            ) from None
        except Exception as error:
            raise ReplicaError(self.replica_id, "Score", f"{type(error).__name__}: {error}", False) from error


STUBS = {
    "rollout": rollout_pb2_grpc.RolloutStub,
    "reward": reward_pb2_grpc.RewardStub,
    "trainer": trainer_pb2_grpc.TrainerStub,
}
