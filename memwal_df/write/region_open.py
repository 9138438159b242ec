"""Opening region writers from a table handle: an existing region by id, or the region of some
region values (created with its field entries if new).

Both claim the region (`RegionWriter`), so a second writer of the same region fences the first. The
writer gets what it needs from the handle: storage, schema, data storage version, the current region
spec, the region's values, the maintained indexes resolved at open and the current-row lookup of
partial and conditional writes (`memwal_df.write.partial.CurrentRows`, injected by the layer that
opens writers).
"""

from __future__ import annotations

import uuid
from typing import Any

from memwal_df.errors import RegionRoutingError, UnknownRegionError
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.values import encode_non_null_region_value, result_arrow_type
from memwal_df.format.table_handle import TableHandle
from memwal_df.write.partial import CurrentRows
from memwal_df.write.region_writer import RegionContext, RegionWriter
from memwal_df.write.writer_config import WriterConfig


def open_region_writer(
    table: TableHandle, region_id: uuid.UUID, config: WriterConfig, current_rows: CurrentRows | None = None
) -> RegionWriter:
    """Claim the existing region `region_id` and return its writer. On a table without a region
    spec any new `region_id` is a new region; on a table with one, a region id that names no
    existing region raises `UnknownRegionError` (new regions are named by their values)."""
    m = RegionManifestStore(table.storage, region_id).latest()
    if m is None and table.spec is not None:
        raise UnknownRegionError(
            f"region {region_id} does not exist, and a new region of a table with a region spec is "
            "named by its region values, not by an id: use table.writer(), which routes each row "
            "to its region, or table.region_writer(values=(...)) with one value per field of "
            f"the spec {table.spec_text()}"
        )
    return RegionWriter(region_context(table, region_id, m, current_rows), region_id, config)


def region_context(
    table: TableHandle,
    region_id: uuid.UUID,
    m: pb.ShardManifest | None,
    current_rows: CurrentRows | None = None,
) -> RegionContext:
    """What a writer of the region `region_id`, whose latest manifest is `m` (None: a new manual
    region), needs to know about the table."""
    values = table.region_values(m) if m is not None else None
    entries = {e.field_id: e.value for e in m.shard_field_entries} if m is not None and values else {}
    return _context(table, values, entries, current_rows)


def open_routed_writer(
    table: TableHandle,
    values: tuple[Any, ...],
    config: WriterConfig,
    *,
    allow_non_key_region_columns: bool = False,
    current_rows: CurrentRows | None = None,
) -> RegionWriter:
    """Claim the region of `values` (one region value per field of the current spec) and return its
    writer; a new region is created with its field entries. Raises `RegionRoutingError` for values
    that do not fit the spec and `NonKeyRegionColumnError` (see `TableHandle.check_writable`)."""
    table.check_writable(allow_non_key_region_columns)
    spec = table.require_spec()
    if len(values) != len(spec.fields):
        raise RegionRoutingError(
            f"the region spec has {len(spec.fields)} fields "
            f"{[f.field_id for f in spec.fields]}, got {len(values)} region values {list(values)}"
        )
    for f, v in zip(spec.fields, values, strict=True):
        if not f.transform.can_produce(v):
            raise RegionRoutingError(
                f"no row has region value {v!r} for field {f.field_id!r} ({f.transform}): "
                "a region for it would stay empty"
            )
    entries = {
        f.field_id: encode_non_null_region_value(v, result_arrow_type(f.result_type))
        for f, v in zip(spec.fields, values, strict=True)
        if v is not None
    }
    return RegionWriter(_context(table, values, entries, current_rows), table.region_id_for(values), config)


def _context(
    table: TableHandle,
    values: tuple[Any, ...] | None,
    entries: dict[str, bytes],
    current_rows: CurrentRows | None,
) -> RegionContext:
    return RegionContext(
        storage=table.storage,
        schema=table.schema,
        data_storage_version=table.data_storage_version,
        spec=table.spec,
        region_values=values,
        field_entries=entries,
        indexes=table.maintained_indexes(),
        current_rows=current_rows,
    )
