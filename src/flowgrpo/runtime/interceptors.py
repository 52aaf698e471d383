"""Interceptor plumbing for the runtime's policies (token, deadline, error mapping, metadata).

Server side, a policy is a *guard*: an async context manager entered around each call, given
the call's context. It may refuse the call (``await context.abort(...)``) before it runs, and
turn what the handler raised into a status. Client side, a policy rewrites the call details
(deadline, metadata) before the call is made.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from flowgrpo.logs import Throttled

log = logging.getLogger(__name__)

Guard = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]
MethodGuard = Callable[[str, grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]
Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]

_HANDLER_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
)


class GuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Run ``guard(method, context)`` around every call to a method for which ``applies(method)``."""

    def __init__(self, guard: MethodGuard, applies: Callable[[str], bool]) -> None:
        self._guard = guard
        self._applies = applies

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not self._applies(details.method):
            return handler
        return guard_handler(handler, functools.partial(self._guard, details.method))


def guard_handler(handler: grpc.RpcMethodHandler, guard: Guard) -> grpc.RpcMethodHandler:
    """The same handler, its behavior run inside ``guard``. Handlers are coroutines; streamed
    responses are async generators."""
    for kind, factory, streams_responses in _HANDLER_KINDS:
        behavior = getattr(handler, kind)
        if behavior is not None:
            wrap = _guard_stream if streams_responses else _guard_unary
            return factory(
                wrap(behavior, guard),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def _guard_unary(behavior: Behavior, guard: Guard) -> Behavior:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with guard(context):
            return await behavior(request, context)

    return guarded


def _guard_stream(behavior: Behavior, guard: Guard) -> Behavior:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with guard(context):
            async for response in behavior(request, context):
                yield response

    return guarded


@dataclass(frozen=True)
class Unparsable:
    """What a request deserializer of :class:`ParseGuard` returns for bytes that do not parse."""

    error: str


class ParseGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A unary request that does not parse is answered INVALID_ARGUMENT in one line naming the
    method and the parser's message, after the outer interceptors' checks (a caller without the
    token learns nothing of the protocol), and logged at most once per ``log_every_s`` with the
    count since the last line. grpc's own answer is UNKNOWN with a traceback logged for each
    request: a stranger's random bytes would grow the log without bound. Install it last, so
    its deserializer and check sit next to the handler. A streamed request's parse error is
    raised by its iterator inside the handler (the reward's Score answers INVALID_ARGUMENT)."""

    def __init__(self, where: str, log_every_s: float = 10.0) -> None:
        self._where = where
        self._log = Throttled(log, logging.WARNING, log_every_s)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        parse, method = _tolerant(handler.request_deserializer), details.method
        for kind, factory, streams_responses in _HANDLER_KINDS[:2]:  # the unary-request kinds
            behavior = getattr(handler, kind)
            if behavior is not None:
                wrap = _checked_stream if streams_responses else _checked_unary
                return factory(
                    wrap(behavior, functools.partial(self._refuse, method)),
                    request_deserializer=parse,
                    response_serializer=handler.response_serializer,
                )
        return handler

    async def _refuse(self, method: str, request: Unparsable, context: grpc.aio.ServicerContext) -> None:
        message = f"{self._where}: {method}: the request does not parse: {request.error}"
        self._log("%s", message)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # DecodeError, or whatever a parser raises: never a traceback
            return Unparsable(" ".join(str(error).split())[:300] or type(error).__name__)

    return parse


Refuse = Callable[[Unparsable, grpc.aio.ServicerContext], Any]


def _checked_unary(behavior: Behavior, refuse: Refuse) -> Behavior:
    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Unparsable):
            await refuse(request, context)
        return await behavior(request, context)

    return checked


def _checked_stream(behavior: Behavior, refuse: Refuse) -> Behavior:
    async def checked(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Unparsable):
            await refuse(request, context)
        async for response in behavior(request, context):
            yield response

    return checked


Rewrite = Callable[[grpc.aio.ClientCallDetails], grpc.aio.ClientCallDetails]


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, rewrite: Rewrite) -> None:
        self._rewrite = rewrite

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._rewrite(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, rewrite: Rewrite) -> None:
        self._rewrite = rewrite

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._rewrite(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, rewrite: Rewrite) -> None:
        self._rewrite = rewrite

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._rewrite(details), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, rewrite: Rewrite) -> None:
        self._rewrite = rewrite

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._rewrite(details), requests)


def call_details_interceptors(rewrite: Rewrite) -> list[grpc.aio.ClientInterceptor]:
    """Rewrite the details (deadline, metadata) of every call on a channel, whatever its kind.

    One object per kind: grpc.aio files each interceptor under the FIRST kind it is an instance
    of, so a single class implementing all four would only ever see unary-unary calls (the
    streamed Score calls went out without the token or the default deadline)."""
    return [_UnaryUnary(rewrite), _UnaryStream(rewrite), _StreamUnary(rewrite), _StreamStream(rewrite)]


def add_metadata(details: grpc.aio.ClientCallDetails, key: str, value: str) -> grpc.aio.ClientCallDetails:
    """A copy of ``details`` with one more metadata entry (the caller's metadata is not mutated)."""
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
    metadata.add(key, value)
    return details._replace(metadata=metadata)
