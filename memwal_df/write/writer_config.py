"""`WriterConfig`: the settings of a region writer, read by each of its parts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class WriterConfig:
    """Writer settings; names and defaults follow Lance's `writer_config_defaults`.

    `durable_write`: a write returns after its WAL entry is stored; otherwise entries are batched by
    size (`max_wal_buffer_size`), count (`max_wal_buffer_batches`) and age (`max_wal_flush_interval_ms`).
    `indexed_write`: a write returns after the MemTable's vector and full-text indexes (of the
    maintained indexes, `memwal_df.format.maintained_indexes`) include its rows; otherwise a background
    thread indexes them, and a search indexes what that thread has not reached yet, so searches see
    every write either way. The key index and bloom filter catch up whenever they are read, in both
    modes. `lease_ttl_s`: the writer renews its region's writer lease every third of it; once a lease
    is that old unrenewed, the maintain loop takes the writer for gone and recovers the region
    (`memwal_df.write.writer_lease`).
    """

    durable_write: bool = True
    indexed_write: bool = True
    max_wal_buffer_size: int = 10 * 1024 * 1024
    max_wal_buffer_batches: int = 1024
    max_wal_flush_interval_ms: int = 100
    max_memtable_size: int = 256 * 1024 * 1024
    max_memtable_rows: int = 100_000
    max_memtable_batches: int = 8000
    max_unflushed_memtable_bytes: int = 1024 * 1024 * 1024
    manifest_scan_batch_size: int = 2
    backpressure_timeout_s: float = 120.0
    max_flush_retries: int = 3
    lease_ttl_s: float = 30.0

    @classmethod
    def from_defaults(cls, defaults: Mapping[str, str], **overrides: Any) -> WriterConfig:
        """Config from a MemWAL index's `writer_config_defaults` map, then explicit overrides."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in defaults:
                raw, default = defaults[f.name], getattr(cls, f.name)
                values[f.name] = raw.lower() == "true" if isinstance(default, bool) else type(default)(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown writer settings: {sorted(unknown)}")
        return replace(cls(), **values)
