"""A `Storage` that injects faults into a real one (local directory or S3), on a seeded schedule.

`FaultyStorage(inner, plan)` is a real `memwal_df.format.storage.Storage` subclass: every call goes to
`inner` (the table's own `LocalStorage` / `ObjectStorage`), after the plan decided what happens to it:

* `fail`        — the call raises `StorageError` and does nothing (a refused request);
* `lost_answer` — a write is carried out, then `StorageError` is raised (the answer was lost: a
                  timeout after the PUT landed, a failed fsync after the link);
* `delay`       — the call sleeps `delay_s` first (a slow store; widens race windows);
* `partial`     — a write stores only the first half of its bytes (put-if-not-exists keeps its
                  condition), then raises: a torn object, which no atomic store produces, so the only
                  promise is that readers raise a typed error naming it instead of using it.

Reads (`get`, `head`, `list`, `list_dir`) can `fail` or `delay`. The plan decides from the operation
and the path; `plan.injected` counts the faults injected by kind. Nothing is mocked: the bytes that
land are stored by the real backend.
"""

from __future__ import annotations

import builtins
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from memwal_df.errors import StorageError
from memwal_df.format.storage import Blob, Storage

WRITES = frozenset({"put", "create", "delete", "delete_prefix"})
READS = frozenset({"get", "head", "list", "list_dir"})
KINDS = ("fail", "lost_answer", "delay", "partial")


class FaultPlan:
    """Which call gets which fault: random with fixed `rates` (kind -> probability per matching call,
    from a seeded RNG), unless a fault was `force`d for the next matching call. `match(op, path)`
    selects the calls that can be hit. Thread-safe."""

    def __init__(
        self,
        seed: int = 0,
        rates: dict[str, float] | None = None,
        match: Callable[[str, str], bool] = lambda op, path: True,
        delay_s: float = 0.01,
    ) -> None:
        unknown = set(rates or {}) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}")
        self.rng = random.Random(seed)
        self.rates = dict(rates or {})
        self.match = match
        self.delay_s = delay_s
        self.enabled = True
        self.injected: Counter[str] = Counter()
        self._forced: list[tuple[str, Callable[[str, str], bool]]] = []
        self._lock = threading.Lock()

    def force(self, kind: str, match: Callable[[str, str], bool]) -> None:
        """The next call that `match`es gets `kind` (whatever the rates say)."""
        with self._lock:
            self._forced.append((kind, match))

    def decide(self, op: str, path: str) -> str | None:
        with self._lock:
            if not self.enabled:
                return None
            for i, (kind, match) in enumerate(self._forced):
                if match(op, path) and _applies(kind, op):
                    del self._forced[i]
                    self.injected[kind] += 1
                    return kind
            if not self.match(op, path):
                return None
            roll = self.rng.random()
            for kind, rate in self.rates.items():
                if roll < rate and _applies(kind, op):
                    self.injected[kind] += 1
                    return kind
                roll -= rate
            return None


def _applies(kind: str, op: str) -> bool:
    if kind in ("lost_answer", "partial"):
        return op in ("put", "create")
    return True


class FaultyStorage(Storage):
    """`inner` with the faults `plan` decides (see the module docstring)."""

    def __init__(self, inner: Storage, plan: FaultPlan) -> None:
        super().__init__(inner.uri, inner.storage_options)
        self.inner = inner
        self.plan = plan

    def _before(self, op: str, path: str) -> str | None:
        kind = self.plan.decide(op, path)
        if kind == "delay":
            time.sleep(self.plan.delay_s)
            return None
        if kind == "fail":
            raise StorageError(f"{op} {path!r} in {self.uri}: injected failure")
        return kind

    def _write(self, op: str, path: str, data: Blob, real: Callable[[str, Blob], object]) -> object:
        kind = self._before(op, path)
        if kind == "partial":
            torn = bytes(data)[: len(data) // 2]
            if op == "create":
                self.inner.put_if_not_exists(path, torn)
            else:
                self.inner.put(path, torn)
            raise StorageError(f"{op} {path!r} in {self.uri}: injected torn write")
        result = real(path, data)
        if kind == "lost_answer":
            raise StorageError(f"{op} {path!r} in {self.uri}: injected lost answer (the write landed)")
        return result

    def put_if_not_exists(self, path: str, data: Blob) -> bool:
        return self._write("create", path, data, self.inner.put_if_not_exists)  # type: ignore[return-value]

    def create(self, path: str, data: Blob) -> str:
        return self._write("create", path, data, self.inner.create)  # type: ignore[return-value]

    def put(self, path: str, data: Blob) -> None:
        self._write("put", path, data, self.inner.put)

    def get(self, path: str) -> bytes:
        self._before("get", path)
        return self.inner.get(path)

    def head(self, path: str) -> int | None:
        self._before("head", path)
        return self.inner.head(path)

    def list(self, prefix: str) -> list[str]:
        self._before("list", prefix)
        return self.inner.list(prefix)

    def list_dir(self, prefix: str) -> builtins.list[str]:
        self._before("list_dir", prefix)
        return self.inner.list_dir(prefix)

    def delete(self, path: str) -> None:
        self._before("delete", path)
        self.inner.delete(path)

    def delete_prefix(self, prefix: str) -> int:
        self._before("delete_prefix", prefix)
        return self.inner.delete_prefix(prefix)

    def child_uri(self, path: str) -> str:
        return self.inner.child_uri(path)

    def sync_tree(self, prefix: str, skip: Collection[str] = ()) -> None:
        self._before("sync_tree", prefix)
        self.inner.sync_tree(prefix, skip)

    @contextmanager
    def synced_changes(self, prefix: str = "", skip: Collection[str] = ()) -> Iterator[None]:
        with self.inner.synced_changes(prefix, skip):
            yield
