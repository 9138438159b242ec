"""A cache of values computed once per live object, for objects that cannot be dictionary keys."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import lance

__all__ = ["PerObjectCache", "described_indices"]

K = TypeVar("K")
V = TypeVar("V")


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
