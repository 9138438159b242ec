"""Who may call the server: bearer tokens read from files, each read-write or read-only, checked
on every call in constant time before any handler runs. A token is never logged or echoed.

Clients send `authorization: Bearer <token>` (ADBC's Flight SQL driver:
`adbc.flight.sql.authorization_header`). Without tokens (a loopback server started without
`--auth-token-file`) every caller may read and write. A call may also name how its writes apply
(`x-memwal-write-mode`, `memwal_df.server.ingest.WRITE_MODES`).
"""

from __future__ import annotations

import enum
import hmac
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import pyarrow.flight as flight

from memwal_df.errors import InvalidConfigError

log = logging.getLogger("memwal_df.server")

__all__ = ["MIDDLEWARE_KEY", "WRITE_MODE_HEADER", "Access", "Auth", "Caller", "read_token_file"]

MIDDLEWARE_KEY = "memwal-auth"
WRITE_MODE_HEADER = "x-memwal-write-mode"
MIN_TOKEN_LENGTH = 16


class Access(enum.Enum):
    READ_ONLY = "read-only"
    READ_WRITE = "read-write"


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file (its first line, whitespace stripped): refused if the file is missing,
    empty or shorter than 16 characters; a warning if every user may read the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        mode = p.stat().st_mode
    except OSError as e:
        raise InvalidConfigError(f"cannot read token file {str(p)!r}: {e.strerror}") from None
    if mode & stat.S_IROTH:
        log.warning("token file %r is readable by every user: chmod 600 it", str(p))
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < MIN_TOKEN_LENGTH:
        raise InvalidConfigError(
            f"token file {str(p)!r} holds no token of at least {MIN_TOKEN_LENGTH} characters "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    if any(c.isspace() for c in token):
        raise InvalidConfigError(f"token file {str(p)!r}: a token has no whitespace")
    return token


@dataclass(frozen=True)
class Caller:
    """What one call may do, and its write mode header (None when it sent none)."""

    access: Access
    write_mode: str | None = None

    @property
    def can_write(self) -> bool:
        return self.access is Access.READ_WRITE


class _CallerMiddleware(flight.ServerMiddleware):
    def __init__(self, caller: Caller) -> None:
        self.caller = caller


class Auth(flight.ServerMiddlewareFactory):
    """The middleware that admits a call: its bearer token against every configured token (all
    compared, in constant time), else UNAUTHENTICATED."""

    def __init__(self, read_write: list[str], read_only: list[str]) -> None:
        super().__init__()
        self._tokens = [(t.encode(), Access.READ_WRITE) for t in read_write] + [
            (t.encode(), Access.READ_ONLY) for t in read_only
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def access_of(self, header: str | None) -> Access | None:
        """The access a `Bearer` authorization header grants, None if it grants none."""
        if header is None:
            return None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        granted = None
        for expected, access in self._tokens:  # every token compared: no early exit
            if hmac.compare_digest(given, expected) and granted is None:
                granted = access
        return granted

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> _CallerMiddleware:
        mode = _first(headers, WRITE_MODE_HEADER)
        if not self.enabled:
            return _CallerMiddleware(Caller(Access.READ_WRITE, mode))
        access = self.access_of(_first(headers, "authorization"))
        if access is None:
            raise flight.FlightUnauthenticatedError(
                "this server needs a bearer token: send the header `authorization: Bearer <token>`"
                " with a token the server was started with"
            )
        return _CallerMiddleware(Caller(access, mode))


def _first(headers: dict[str, list[str]], name: str) -> str | None:
    for key, values in headers.items():
        if key.lower() == name and values:
            value = values[0]
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


def caller_of(context: flight.ServerCallContext) -> Caller:
    """The caller of a call the middleware admitted."""
    middleware = context.get_middleware(MIDDLEWARE_KEY)
    if middleware is None:  # the middleware runs on every call; a missing one is a server bug
        raise flight.FlightUnauthenticatedError("call not authenticated")
    caller: Caller = middleware.caller
    return caller
