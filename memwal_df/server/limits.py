"""The server's limits (`Limits`) and the bounded slots queries and writes run in.

Each Flight call runs on a gRPC thread; a query holds one of `max_concurrent_queries` slots from its
planning to the end of its stream, a write one of `max_concurrent_writes` while it is applied. A call
that finds no free slot within `queue_timeout_s` gets UNAVAILABLE and may retry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from memwal_df.errors import InvalidConfigError
from memwal_df.server.status import Busy, TimedOut

__all__ = ["Deadline", "Limits", "Slots"]


@dataclass(frozen=True)
class Limits:
    """What one request may take. Sizes are Arrow bytes in memory."""

    max_result_bytes: int = 1 << 30  # one query's result
    query_timeout_s: float = 300.0  # one query, planning to its last batch (checked per batch)
    max_concurrent_queries: int = 16
    max_concurrent_writes: int = 64
    queue_timeout_s: float = 10.0  # how long a call waits for a free slot
    max_request_bytes: int = 256 << 20  # one ingest or one parameter binding
    max_open_statements: int = 10_000  # prepared statements and query tickets not yet fetched
    statement_ttl_s: float = 900.0  # an unused prepared statement or ticket is dropped after this
    max_parameter_sets: int = 10_000  # rows bound to a statement that runs once per row

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) <= 0:
                raise InvalidConfigError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")


class Slots:
    """At most `size` holders at once; a holder waits up to `wait_s` for a slot."""

    def __init__(self, what: str, size: int, wait_s: float) -> None:
        self._what = what
        self._size = size
        self._wait_s = wait_s
        self._semaphore = threading.BoundedSemaphore(size)

    def acquire(self) -> None:
        if not self._semaphore.acquire(timeout=self._wait_s):
            raise Busy(
                f"server busy: all {self._size} {self._what} slots were in use for {self._wait_s:g} s; retry"
            )

    def release(self) -> None:
        self._semaphore.release()

    @contextmanager
    def held(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()


class Deadline:
    """The end of a query's time: `check()` raises `TimedOut` past it."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._end = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self._end:
            raise TimedOut(f"query ran past the server's query timeout of {self._seconds:g} s")
