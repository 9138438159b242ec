"""BloomFilterGuardExec: ask a level only for the keys its primary-key bloom filter may hold.

Guarantees:

* The child sees exactly the requested keys the level's `bloom_filter.bin` does not rule out (in their
  order); a bloom filter has no false negatives, so no key the level holds is dropped.
* When the filter rules out every key, the child is never built nor executed: the level costs one
  read of its 32 KiB filter and nothing else.
* A level without a bloom filter (an unflushed MemTable, a generation written without one, or one
  garbage-collected since planning) lets every key through; the child decides.
* Keys must have the table's key types: the filter hashes values at their Arrow width
  (`plan_point_lookup` conforms keys to the table's key schema).

The key hashes (SipHash-1-3, the costly part) are computed once per keys table and reused by every
guard that is given the same table, as `CoalesceFirstExec` does while no key is resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from memwal_df.format.bloom import hash_primary_keys
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.lsm.cache import PerObjectCache
from memwal_df.read.lsm.labels import short_id
from memwal_df.read.lsm.levels import Level

__all__ = ["BloomFilterGuardExec"]

_key_hashes: PerObjectCache[pa.Table, dict[tuple[str, ...], np.ndarray]] = PerObjectCache()


def key_hashes(keys: pa.Table, primary_key: Sequence[str]) -> np.ndarray:
    """Lance's primary-key hash of each row of `keys` (memoized per table object)."""
    by_key = _key_hashes.get(keys, dict)
    pk = tuple(primary_key)
    hashes = by_key.get(pk)
    if hashes is None:
        hashes = by_key[pk] = hash_primary_keys([keys.column(c) for c in pk])
    return hashes


class BloomFilterGuardExec(ExecNode):
    """Passes to its child only the keys that may be in the level (the level's bloom_filter.bin);
    skips the child entirely when none may be."""

    def __init__(
        self,
        level: Level,
        keys: pa.Table,
        make_child: Callable[[pa.Table], ExecNode],
        primary_key: Sequence[str],
    ) -> None:
        self.level = level
        self.keys = keys
        self.make_child = make_child
        self.primary_key = list(primary_key)
        self.keys_passed: int | None = None  # known after execute()
        self.has_filter: bool | None = None

    @property
    def children(self) -> list[ExecNode]:
        return [self.make_child(self.keys)]

    def describe(self) -> str:
        line = (
            f"BloomFilterGuardExec: bf[region {short_id(self.level.region_id)}]"
            f"[gen={self.level.generation}], keys={self.keys.num_rows}"
        )
        if self.keys_passed is None:
            return line
        if not self.has_filter:
            return line + ", no bloom filter (every key passes)"
        if self.keys_passed == 0:
            return line + ", passed=0 (child skipped)"
        return line + f", passed={self.keys_passed}"

    def passing_keys(self) -> pa.Table:
        """The keys the level's bloom filter does not rule out."""
        bloom = self.level.bloom() if self.keys.num_rows else None
        self.has_filter = bloom is not None
        if bloom is None:
            return self.keys
        maybe = bloom.contains_hashes(key_hashes(self.keys, self.primary_key))
        if maybe.all():
            return self.keys
        if not maybe.any():
            return self.keys.slice(0, 0)
        return self.keys.filter(pa.array(maybe))

    def execute(self) -> Iterator[pa.RecordBatch]:
        keys = self.passing_keys()
        self.keys_passed = keys.num_rows
        if keys.num_rows == 0:
            return
        yield from self.make_child(keys).execute()
