"""The read path's caches: values derived from files that never change (`ImmutableCache`, with
`GENERATIONS`, the per-generation state of the process), and values computed once per live object
(`PerObjectCache`), for objects that cannot be dictionary keys."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import lance

__all__ = ["GENERATIONS", "GENERATION_CACHE_BYTES", "ImmutableCache", "PerObjectCache", "described_indices"]

K = TypeVar("K")
V = TypeVar("V")


class ImmutableCache:
    """Values derived from files that never change once written, keyed by (URI, name), least
    recently used dropped beyond `capacity` entries or beyond `max_bytes` of the sizes callers declare
    (`size=`; an entry without one counts 0 bytes). Thread-safe; racing threads may compute a value
    twice.

    `GENERATIONS` holds per-generation state across queries and tables of the process: a generation
    directory never changes once its manifest entry is committed (a retried flush writes a new
    directory), so its opened dataset, bloom filter, `_pk_index` and in-memory rows stay valid until
    it is garbage-collected, which readers detect when a read fails."""

    def __init__(self, capacity: int = 4096, *, max_bytes: int | None = None) -> None:
        self._items: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._bytes = 0

    @property
    def max_bytes(self) -> int | None:
        return self._max_bytes

    @property
    def nbytes(self) -> int:
        """The declared sizes of the entries held."""
        return self._bytes

    def configure(self, *, capacity: int | None = None, max_bytes: int | None = None) -> None:
        """Change the bounds (entries beyond them are dropped at once)."""
        with self._lock:
            if capacity is not None:
                self._capacity = capacity
            if max_bytes is not None:
                self._max_bytes = max_bytes
            self._evict()

    def get(
        self, uri: str, name: str, compute: Callable[[], Any], size: Callable[[Any], int] | None = None
    ) -> Any:
        """The value kept for (uri, name), else `compute()` kept (unless None) with `size(value)` bytes."""
        found = self.peek(uri, name)
        if found is not None:
            return found
        value = compute()
        if value is not None:
            self.put(uri, name, value, 0 if size is None else size(value))
        return value

    def peek(self, uri: str, name: str) -> Any:
        """The value kept for (uri, name) (marked recently used), else None; computes nothing."""
        key = (uri, name)
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                return None
            self._items.move_to_end(key)
            return entry[0]

    def put(self, uri: str, name: str, value: Any, nbytes: int = 0) -> None:
        """Keep `value` for (uri, name), declared as `nbytes` bytes."""
        key = (uri, name)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            self._evict()

    def _evict(self) -> None:
        while len(self._items) > self._capacity or (
            self._max_bytes is not None and self._bytes > self._max_bytes and self._items
        ):
            _, (_, nbytes) = self._items.popitem(last=False)
            self._bytes -= nbytes

    def forget(self, uri: str, names: set[str] | None = None) -> None:
        """Drop the entries of `uri` (only those named in `names` when given)."""
        with self._lock:
            for key in [k for k in self._items if k[0] == uri and (names is None or k[1] in names)]:
                self._bytes -= self._items.pop(key)[1]

    def names(self, uri: str) -> list[str]:
        """The names of the entries held for `uri`."""
        with self._lock:
            return [name for u, name in self._items if u == uri]

    def __len__(self) -> int:
        return len(self._items)


GENERATION_CACHE_BYTES = 256 << 20
"""Default bound of `GENERATIONS`' declared sizes (bloom filters, `_pk_index`es, in-memory rows)."""

GENERATIONS = ImmutableCache(max_bytes=GENERATION_CACHE_BYTES)


class PerObjectCache(Generic[K, V]):
    """Values computed once per live object (by identity); an entry goes when its object is collected.

    For objects that are unhashable (`Level` is a dataclass with `eq=True`) or hash by value
    (`pa.Table`), where a WeakKeyDictionary does not fit. Thread-safe; a value may be computed twice
    by racing threads, and then either result is kept."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[K], V]] = {}
        self._lock = threading.RLock()  # re-entrant: a GC callback may run under it

    def get(self, obj: K, compute: Callable[[], V]) -> V:
        key = id(obj)
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and hit[0]() is obj:
            return hit[1]
        value = compute()
        entries, lock = self._entries, self._lock

        def forget(ref: weakref.ref[K], key: int = key) -> None:
            with lock:
                if (entry := entries.get(key)) is not None and entry[0] is ref:
                    del entries[key]

        with self._lock:
            entries[key] = (weakref.ref(obj, forget), value)
        return value

    def __len__(self) -> int:
        return len(self._entries)


_DESCRIBED: PerObjectCache[Any, dict[int, list[Any]]] = PerObjectCache()


def described_indices(ds: lance.LanceDataset) -> list[Any]:
    """`ds.describe_indices()`, read once per dataset object and version (an index commit through
    the object, e.g. `create_index`, moves the object itself to a new version)."""
    by_version = _DESCRIBED.get(ds, dict)
    version = ds.version
    if version not in by_version:
        by_version[version] = ds.describe_indices()
    return by_version[version]
