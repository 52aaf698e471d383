"""Inputs a request needs from the data bus, fetched with typed failures: a producer that is
gone is UNAVAILABLE (the coordinator re-produces and re-dispatches), data that is not there
(released, evicted, never put) is FAILED_PRECONDITION. Nothing is silently skipped."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from flowgrpo.bus import BusClient, BusError, DataLost, Fetched, TensorRef
from flowgrpo.runtime.errors import ServiceError


def fetch_inputs(client: BusClient, refs: Sequence[TensorRef], what: str) -> list[Fetched]:
    try:
        return client.fetch(list(refs))
    except DataLost as error:
        raise ServiceError(f"{what} lost: {error}", grpc.StatusCode.UNAVAILABLE) from None
    except BusError as error:
        raise ServiceError(f"{what} not available on the bus: {error}") from None
