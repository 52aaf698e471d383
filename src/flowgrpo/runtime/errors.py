"""Errors of the runtime, typed by scope.

A handler raises a :class:`ServiceError` for a request that failed for a reason the caller can
act on; the server turns it into that gRPC status with the message as details, and keeps
serving. Any other exception is a bug: it comes back as INTERNAL and its traceback is logged.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """A failed request, returned to the caller as ``code`` with this message as details."""

    code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(ServiceError):
    """The request is wrong; resending it will fail again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unavailable(ServiceError):
    """The service is starting or draining; the caller should try another replica or later."""

    code = grpc.StatusCode.UNAVAILABLE


class Abandoned(ServiceError):
    """The caller gave up (its deadline passed, or it cancelled): the work stopped at a safe point
    (:func:`~flowgrpo.runtime.mailbox.raise_if_abandoned`)."""

    code = grpc.StatusCode.CANCELLED


class NotReadyError(TimeoutError):
    """A service did not answer the READY handshake before the deadline."""


class HandshakeError(RuntimeError):
    """A service answered the handshake, but it is not the one asked for (role, protocol, token)."""
