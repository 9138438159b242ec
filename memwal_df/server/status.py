"""Errors of the Flight SQL server and the Flight status each reaches the client with.

A handler raises a `RequestError` for what the request got wrong; `to_flight` maps those, the
typed errors of `memwal_df.errors` and DataFusion's errors onto pyarrow's Flight errors, which carry
the status code (INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE,
DEADLINE_EXCEEDED, RESOURCE limits as UNAVAILABLE, UNIMPLEMENTED, INTERNAL) and a one-line message.
Unexpected errors are logged here with their traceback and reach the client as INTERNAL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from memwal_df import errors

log = logging.getLogger("memwal_df.server")

__all__ = [
    "Busy",
    "InvalidRequest",
    "NotFound",
    "PermissionDenied",
    "RequestError",
    "TimedOut",
    "TooLarge",
    "Unimplemented",
    "guarded",
    "guarded_stream",
    "to_flight",
]

_MAX_MESSAGE = 2000  # characters of an error message sent to a client


class RequestError(Exception):
    """A request the server refuses; the subclass names the Flight status."""


class InvalidRequest(RequestError):
    """INVALID_ARGUMENT: malformed message, bad SQL, wrong schema, bad parameters."""


class NotFound(RequestError):
    """NOT_FOUND: no such table, statement handle or ticket."""


class Unimplemented(RequestError):
    """UNIMPLEMENTED: a Flight SQL feature this server does not offer."""


class PermissionDenied(RequestError):
    """PERMISSION_DENIED: the caller's token may not do this (a read-only token writing)."""


class Busy(RequestError):
    """UNAVAILABLE: every query slot is taken, or the writer pushes back; retry later."""


class TooLarge(RequestError):
    """UNAVAILABLE with a limit's name: a result or request over the server's limits."""


class TimedOut(RequestError):
    """DEADLINE_EXCEEDED: a query ran past the server's query timeout."""


def _short(text: str) -> str:
    text = " ".join(text.split()) if "\n" in text else text
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " ..."


def to_flight(exc: BaseException) -> Exception:
    """The Flight error that reports `exc` to the client."""
    if isinstance(exc, flight.FlightError):
        return exc
    if isinstance(exc, RequestError):
        message = _short(str(exc))
        if isinstance(exc, InvalidRequest):
            return pa.ArrowInvalid(message)
        if isinstance(exc, NotFound):
            return pa.ArrowKeyError(message)
        if isinstance(exc, Unimplemented):
            return pa.ArrowNotImplementedError(message)
        if isinstance(exc, PermissionDenied):
            return flight.FlightUnauthorizedError(message)
        if isinstance(exc, TimedOut):
            return flight.FlightTimedOutError(message)
        return flight.FlightUnavailableError(message)
    inner = errors.unwrap(exc)
    if isinstance(inner, errors.MemWalError):
        message = _short(f"{type(inner).__name__}: {inner}")
        if isinstance(inner, errors.TableNotFoundError | errors.TableNotRegisteredError):
            return pa.ArrowKeyError(message)
        if isinstance(inner, ValueError):
            return pa.ArrowInvalid(message)
        if isinstance(inner, errors.BackpressureTimeoutError | errors.StorageError):
            return flight.FlightUnavailableError(message)
        log.error("request failed: %s", message)
        return flight.FlightInternalError(message)
    if _is_datafusion_error(exc):  # planning / execution errors of the user's SQL
        return pa.ArrowInvalid(_short(str(exc)))
    log.error("request failed", exc_info=exc)
    return flight.FlightInternalError(_short(f"internal error: {type(exc).__name__}: {exc}"))


def _is_datafusion_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    if module.startswith("datafusion"):
        return True
    # datafusion raises plain Exception / ValueError whose text starts with DataFusion's error kind
    text = str(exc)
    return type(exc) in (Exception, ValueError, RuntimeError) and any(
        text.startswith(kind)
        for kind in (
            "DataFusion error",
            "Error during planning",
            "SQL error",
            "Schema error",
            "Arrow error",
            "Execution error",
            "This feature is not implemented",
            "Invalid argument error",
            "External error",
            "Optimizer rule",
        )
    )


F = TypeVar("F", bound=Callable[..., Any])


def guarded(method: F) -> F:
    """A Flight handler whose every error reaches the client as a Flight status (`to_flight`)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            error = to_flight(e)
        raise error from None

    return wrapper  # type: ignore[return-value]


def guarded_stream(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`batches`, with an error raised while producing them reported like `guarded` does."""
    try:
        yield from batches
    except Exception as e:  # noqa: BLE001
        error = to_flight(e)
    else:
        return
    raise error from None
