"""The arguments of Lance's `LanceDataset.initialize_mem_wal` that write given MemWAL details.

Native Lance can write only some details (bucket / identity / unsharded / no sharding, a maintained
set or "all", writer defaults as native materialises them); `native_init_kwargs` translates those and
says None for any other, which `memwal_index.initialize` then commits itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from memwal_df.format.proto import memwal_pb2 as pb

__all__ = ["native_init_kwargs"]

# Native writer-config defaults, materialised as a whole when any writer kwarg is given.
_WRITER_INT_KEYS = (
    "max_wal_buffer_size",
    "max_wal_flush_interval_ms",
    "max_memtable_size",
    "max_memtable_rows",
    "max_memtable_batches",
    "max_unflushed_memtable_bytes",
    "manifest_scan_batch_size",
    "backpressure_log_interval_ms",
    "stats_log_interval_ms",
)
_WRITER_FIXED = {
    "max_wal_persist_retries": "3",
    "wal_persist_retry_base_delay_ms": "50",
    "enable_memtable": "true",
}
_HNSW_KEYS = ("num_edges", "ef_construction", "max_level")
_BOOL_TEXT = {"true": True, "false": False}

# Native bucket sharding accepts these Arrow types; identity sharding these, with this result type.
_BUCKET_TYPES: tuple[Callable[[pa.DataType], bool], ...] = (
    pa.types.is_boolean,
    pa.types.is_integer,
    pa.types.is_float32,
    pa.types.is_float64,
    pa.types.is_date32,
    pa.types.is_time32,
    pa.types.is_time64,
    pa.types.is_timestamp,
    pa.types.is_string,
    pa.types.is_large_string,
)
_IDENTITY_RESULT_TYPES = {
    pa.int8(): "int8",
    pa.int16(): "int16",
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.uint8(): "uint8",
    pa.uint16(): "uint16",
    pa.uint32(): "uint32",
    pa.uint64(): "uint64",
    pa.string(): "utf8",
    pa.large_string(): "large_utf8",
    pa.bool_(): "boolean",
}


def _canonical_uint(text: str) -> int | None:
    return int(text) if re.fullmatch(r"0|[1-9][0-9]{0,18}", text) and int(text) < 1 << 63 else None


def _native_writer_kwargs(defaults: dict[str, str]) -> dict[str, Any] | None:
    """Writer kwargs of `initialize_mem_wal` that materialise exactly `defaults`, or None."""
    if not defaults:
        return {}
    kwargs: dict[str, Any] = {}
    rest = dict(defaults)
    for key, fixed in _WRITER_FIXED.items():
        if rest.pop(key, None) != fixed:
            return None
    durable = _BOOL_TEXT.get(rest.pop("durable_write", ""))
    if durable is None:
        return None
    kwargs["durable_write"] = durable
    for key in _WRITER_INT_KEYS:
        text = rest.pop(key, None)
        if text is None:
            if key != "stats_log_interval_ms":  # native stores a 0 interval as an absent key
                return None
            kwargs[key] = 0
            continue
        value = _canonical_uint(text)
        if value is None or (key == "stats_log_interval_ms" and value == 0):
            return None
        kwargs[key] = value
    hnsw: dict[str, dict[str, int]] = {}
    for key, text in rest.items():
        if not key.startswith("hnsw."):
            return None
        index_name, _, param = key[len("hnsw.") :].rpartition(".")
        value = _canonical_uint(text)
        if not index_name or param not in _HNSW_KEYS or value is None:
            return None
        hnsw.setdefault(index_name, {})[param] = value
    if any(len(params) != len(_HNSW_KEYS) for params in hnsw.values()):
        return None
    if hnsw:
        kwargs["hnsw_params"] = hnsw
    return kwargs


def native_init_kwargs(
    details: pb.MemWalIndexDetails, schema: pa.Schema, ids: dict[int, str]
) -> dict[str, Any] | None:
    """Arguments of `LanceDataset.initialize_mem_wal` that write exactly `details`, or None when
    native cannot express them. `ids` maps top-level Lance field ids to column names."""
    if (
        details.snapshot_ts_millis
        or details.HasField("inline_snapshots")
        or details.compacted_sstables
        or details.index_catchup
        or not details.HasField("maintain_all_indexes")
    ):
        return None
    kwargs: dict[str, Any] = {}
    if details.maintain_all_indexes:
        if details.maintained_indexes:
            return None
    else:
        kwargs["maintained_indexes"] = list(details.maintained_indexes)

    specs = details.sharding_specs
    if not specs:
        if details.num_shards:
            return None
    else:
        if len(specs) != 1 or specs[0].spec_id != 1 or len(specs[0].fields) != 1:
            return None
        f = specs[0].fields[0]
        if f.field_id != "bucket" or f.HasField("expression") or not f.HasField("transform"):
            return None
        params = dict(f.parameters)
        column = ids.get(f.source_ids[0]) if len(f.source_ids) == 1 else None
        ctype = schema.field(column).type if column is not None else None
        if f.transform == "unsharded":
            if f.source_ids or params or f.result_type != "int32" or details.num_shards != 1:
                return None
            kwargs["unsharded"] = True
        elif f.transform == "bucket":
            n = _canonical_uint(params.get("num_buckets", ""))
            if (
                ctype is None
                or not any(ok(ctype) for ok in _BUCKET_TYPES)
                or set(params) != {"num_buckets"}
                or n is None
                or not 1 <= n <= 1024
                or f.result_type != "int32"
                or details.num_shards != n
            ):
                return None
            kwargs["bucket_column"], kwargs["num_buckets"] = column, n
        elif f.transform == "identity":
            if (
                ctype is None
                or params
                or details.num_shards
                or f.result_type != _IDENTITY_RESULT_TYPES.get(ctype)
            ):
                return None
            kwargs["identity_column"] = column
        else:
            return None

    writer = _native_writer_kwargs(dict(details.writer_config_defaults))
    if writer is None:
        return None
    return kwargs | writer
