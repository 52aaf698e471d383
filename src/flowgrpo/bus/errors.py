"""Typed bus errors: every failure carries an :class:`ErrorCode` of ``flowgrpo.v1.ErrorCode``.

A failed key comes back from the producer as a per-key error and the store keeps serving; the
client turns it into the matching :class:`BusError` subclass, so callers branch on the type (or
on ``code``) instead of parsing messages. A producer that does not answer is :class:`DataLost`:
the data must be produced again, never skipped.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowgrpo.v1 import common_pb2


class ErrorCode(enum.IntEnum):
    """Mirror of ``flowgrpo.v1.ErrorCode`` without the ``ERROR_CODE_`` prefix (same numbers)."""

    UNSPECIFIED = 0
    INVALID_ARGUMENT = 1
    SCHEMA_VIOLATION = 2
    NOT_FOUND = 3
    RELEASED = 4
    EVICTED = 5
    DATA_LOST = 6
    UNAVAILABLE = 7
    DEADLINE_EXCEEDED = 8
    UNAUTHENTICATED = 9
    INTERNAL = 10

    @classmethod
    def parse(cls, name: str) -> ErrorCode:
        """The code named ``name``; an unknown name (a newer peer) reads as UNSPECIFIED."""
        return cls.__members__.get(name, cls.UNSPECIFIED)


class BusError(Exception):
    """A bus operation failed; ``code`` says how, ``key``/``endpoint`` say where."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, *, key: str = "", endpoint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.endpoint = endpoint

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, key={self.key!r}, {self.message!r})"

    def to_proto(self) -> common_pb2.Error:
        """The ``flowgrpo.v1.Error`` a service returns for this failure."""
        from flowgrpo.v1 import common_pb2

        where = " ".join(part for part in (self.endpoint, self.key) if part)
        code = common_pb2.ErrorCode.Value(f"ERROR_CODE_{self.code.name}")
        return common_pb2.Error(code=code, message=self.message, where=where)


class InvalidRequest(BusError):
    """The request is wrong (malformed frames, bad header, ref that does not match the data)."""

    code = ErrorCode.INVALID_ARGUMENT


class NotFound(BusError):
    """The store never held this key (the message lists close matches)."""

    code = ErrorCode.NOT_FOUND


class Released(BusError):
    """The data was released on command before it was fetched."""

    code = ErrorCode.RELEASED


class Evicted(BusError):
    """The bounded store dropped the data to make room (``when_full="evict_oldest"``)."""

    code = ErrorCode.EVICTED


class DataLost(BusError):
    """The producer did not answer in time, or restarted: the data must be produced again."""

    code = ErrorCode.DATA_LOST


class StoreFull(BusError):
    """A put found no room before its deadline; the message names capacity and the oldest keys."""

    code = ErrorCode.UNAVAILABLE


class Unauthenticated(BusError):
    """The store refused this process at the handshake: another bus secret, or only one of the
    two has a secret (the message names which and the fix)."""

    code = ErrorCode.UNAUTHENTICATED


class Internal(BusError):
    """A bug on the producer (it logged the traceback) or a reply that breaks the protocol."""

    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[BusError]] = {
    cls.code: cls
    for cls in (InvalidRequest, NotFound, Released, Evicted, DataLost, StoreFull, Unauthenticated, Internal)
}


def error_for(code: ErrorCode, message: str, *, key: str = "", endpoint: str = "") -> BusError:
    """The :class:`BusError` subclass for ``code`` (plain :class:`BusError` for other codes)."""
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(message, key=key, endpoint=endpoint)
    err = BusError(message, key=key, endpoint=endpoint)
    err.code = code
    return err
