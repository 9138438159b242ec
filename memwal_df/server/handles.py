"""Server-side state named by opaque handles: prepared statements, query tickets and the plans kept
for a prepared statement's first run.

A handle made here is 16 random bytes (unguessable; every call is still checked against its caller's
own access). The registry holds at most `capacity` entries; an entry unused for `ttl_s` seconds is
dropped. A full registry refuses new entries with UNAVAILABLE, or drops its least recently used
entry instead when it only caches (`evict=True`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import Generic, TypeVar

from memwal_df.server.status import Busy, NotFound

__all__ = ["Handles"]

T = TypeVar("T")


class Handles(Generic[T]):
    def __init__(self, what: str, capacity: int, ttl_s: float, *, evict: bool = False) -> None:
        self._what = what
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._evict = evict
        self._entries: OrderedDict[bytes, tuple[float, T]] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def add(self, value: T) -> bytes:
        """Hold `value` under a new handle: that handle."""
        handle = secrets.token_bytes(16)
        self.put(handle, value)
        return handle

    def put(self, handle: bytes, value: T) -> None:
        """Hold `value` under `handle` (one the caller made, e.g. its statement's)."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            while len(self._entries) >= self._capacity:
                if not self._evict:
                    raise Busy(
                        f"too many open {self._what}s ({self._capacity}): close some, or wait "
                        f"{self._ttl_s:g} s for unused ones to expire"
                    )
                self._entries.popitem(last=False)
            self._entries[handle] = (now, value)

    def get(self, handle: bytes) -> T:
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            entry = self._entries.get(handle)
            if entry is None:
                raise NotFound(f"no such {self._what} (closed, already used, or expired)")
            self._entries[handle] = (now, entry[1])
            self._entries.move_to_end(handle)
            return entry[1]

    def replace(self, handle: bytes, value: T) -> None:
        with self._lock:
            if handle not in self._entries:
                raise NotFound(f"no such {self._what} (closed, already used, or expired)")
            self._entries[handle] = (time.monotonic(), value)
            self._entries.move_to_end(handle)

    def pop(self, handle: bytes) -> T:
        if (value := self.discard(handle)) is None:
            raise NotFound(f"no such {self._what} (closed, already used, or expired)")
        return value

    def discard(self, handle: bytes) -> T | None:
        """Remove and return the entry of `handle`, None when there is none."""
        with self._lock:
            self._expire(time.monotonic())
            entry = self._entries.pop(handle, None)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _expire(self, now: float) -> None:
        while self._entries:
            handle, (used, _) = next(iter(self._entries.items()))
            if now - used <= self._ttl_s:
                return
            del self._entries[handle]
