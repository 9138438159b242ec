"""Point-lookup planning: `pk = x` / `pk IN (...)` over a read snapshot (spec "Point Lookups").

```
UnionExec                                            one input per key group, none overlapping
  CoalesceFirstExec: region 1a2b3c4d… (bucket=2)     keys routed to that region
    TakeLastExec: memtable 5 of region 1a2b3c4d…     unflushed MemTables, newest first
    BloomFilterGuardExec: bf[region 1a2b3c4d…][gen=4]
      TakeLastExec: generation 4 of region 1a2b3c4d…, via _pk_index
    …older generations…
    TakeLastExec: base table v7                      the base table last
  CoalesceFirstExec: keys without unmerged levels    keys routed to no region, or to one without levels
    TakeLastExec: base table v7
```

Guarantees:

* Keys are conformed to the table's key types (`SchemaMismatchError` if they cannot be), keys with a
  NULL column are dropped (no row has one) and each key is answered once, however often it is asked.
* Region routing: when the region spec reads key columns only, each key goes to the region whose
  values it evaluates to (regions whose values are unknown, or recorded under another spec, get every
  key as well); otherwise every region gets every key. Within a key group the levels are asked newest
  first, region after region (a key lives in one region only), then the base table.
* Keys routed to no region with unmerged levels are looked up in the base table in one go.
* A point-lookup snapshot (`take_snapshot(keys=...)`) answers only the keys it was taken for; other
  keys raise `RegionRoutingError` (their regions may be missing from it).
* The result: one live row per key that exists, columns as requested, in the table's types; deleted
  and absent keys return nothing. Nothing is read before `execute()`.
* Unflushed MemTables are not bloom-guarded (`Level.bloom()` has no filter for them; their lookup
  is an in-memory membership test, cheaper than a filter check).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from memwal_df.errors import RegionRoutingError, SchemaMismatchError
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.schema import TableSchema, conform
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.union import UnionExec
from memwal_df.read.lookup.bloom_guard import BloomFilterGuardExec
from memwal_df.read.lookup.coalesce_first import CoalesceFirstExec
from memwal_df.read.lookup.take_last import TakeLastExec
from memwal_df.read.lsm.keys import TOMBSTONE, distinct_keys, encode_keys, member_mask
from memwal_df.read.lsm.labels import short_id
from memwal_df.read.lsm.levels import GenerationLevel, Level
from memwal_df.read.lsm.snapshot import ReadSnapshot, RegionLevels, key_region_values, may_hold

__all__ = ["plan_point_lookup"]

NO_LEVELS_LABEL = "keys without unmerged levels"


def plan_point_lookup(
    snapshot: ReadSnapshot,
    spec: RegionSpec | None,
    field_ids: Mapping[str, int],
    keys: pa.Table,
    columns: Sequence[str] | None,
) -> ExecNode:
    """The operator tree answering a lookup of `keys` (a table of the key columns) in `snapshot`.

    `columns` are the output columns (None: every column of the table); `spec` is the table's current
    region spec and `field_ids` its column name → Lance field id map (`Table.spec`,
    `Table.schema.field_ids`).
    """
    ts = snapshot.schema
    pk = list(ts.primary_key)
    out_columns = _output_columns(ts, columns)
    out_schema = pa.schema([ts.schema.field(c) for c in out_columns])
    if keys is not snapshot.lookup_keys:  # the snapshot's own keys are conformed and distinct already
        keys = _conform_keys(ts, keys)
        if snapshot.lookup_keys is not None and keys.num_rows:
            held = encode_keys(snapshot.lookup_keys, pk)
            if not member_mask(keys, pk, held).all():
                raise RegionRoutingError(
                    "lookup of keys the snapshot was not taken for: a point-lookup snapshot holds only "
                    "the regions its keys route to (take_snapshot(keys=...))"
                )
    snapshot.require_readable(snapshot.unreadable)  # (a point-lookup snapshot holds none)
    base = snapshot.base

    def take_base(k: pa.Table) -> ExecNode:
        return TakeLastExec(base, k, out_columns, pk, snapshot.storage)

    # A lookup snapshot of one key holds just the regions that key may live in: nothing to route.
    routed = snapshot.lookup_keys is not None and keys.num_rows == 1
    groups, base_only = _route(snapshot.regions, None if routed else spec, field_ids, keys, pk)
    nodes: list[ExecNode] = []
    for regions, rows in groups:
        inputs = [_level_input(lv, out_columns, pk) for r in regions for lv in r.levels]
        nodes.append(
            CoalesceFirstExec(
                _rows(keys, rows),
                [*inputs, take_base],
                pk,
                out_columns,
                label=_regions_label(regions, spec, snapshot.schema.names_by_id),
                schema=out_schema,
            )
        )
    if base_only:
        nodes.append(
            CoalesceFirstExec(
                _rows(keys, base_only),
                [take_base],
                pk,
                out_columns,
                label=NO_LEVELS_LABEL,
                schema=out_schema,
            )
        )
    return UnionExec(nodes, schema=out_schema)


def _rows(keys: pa.Table, rows: list[int]) -> pa.Table:
    """The key rows at `rows` (ascending); `keys` itself when that is all of them."""
    return keys if len(rows) == keys.num_rows else keys.take(pa.array(rows))


def _output_columns(ts: TableSchema, columns: Sequence[str] | None) -> list[str]:
    if columns is None:
        return list(ts.schema.names)
    if isinstance(columns, str):
        raise TypeError("columns must be a sequence of column names, not a string")
    out = list(dict.fromkeys(columns))
    unknown = [c for c in out if c not in ts.schema.names]
    if unknown:
        hint = " (_tombstone is internal)" if TOMBSTONE in unknown else ""
        raise SchemaMismatchError(f"unknown columns {unknown}{hint}; the table has {ts.schema.names}")
    return out


def _conform_keys(ts: TableSchema, keys: pa.Table | pa.RecordBatch) -> pa.Table:
    if isinstance(keys, pa.RecordBatch):
        keys = pa.Table.from_batches([keys])
    missing = [c for c in ts.primary_key if c not in keys.column_names]
    if missing:
        raise SchemaMismatchError(f"lookup keys lack the primary-key columns {missing}")
    keys = distinct_keys(keys, ts.primary_key)  # drops NULL keys, which no row has
    return conform(keys, ts.key_schema, what="lookup keys")


def _route(
    regions: Sequence[RegionLevels],
    spec: RegionSpec | None,
    field_ids: Mapping[str, int],
    keys: pa.Table,
    primary_key: Sequence[str],
) -> tuple[list[tuple[list[RegionLevels], list[int]]], list[int]]:
    """([(regions to ask, key rows)], key rows for the base table only)."""
    every = list(range(keys.num_rows))
    with_levels = [r for r in regions if r.levels]
    if not every:
        return [], []
    if not with_levels:
        return [], every
    routes = key_region_values(spec, field_ids, primary_key, keys)
    if routes is None:
        return [(with_levels, every)], []
    assert spec is not None
    rows_by_value: dict[tuple[Any, ...], list[int]] = {}
    for row, value in enumerate(routes):
        rows_by_value.setdefault(value, []).append(row)
    by_regions: dict[tuple[int, ...], list[int]] = {}
    for value, rows in rows_by_value.items():
        targets = tuple(i for i, r in enumerate(with_levels) if may_hold(spec, (value,), r.spec_id, r.values))
        by_regions.setdefault(targets, []).extend(rows)
    groups = [
        ([with_levels[i] for i in targets], sorted(rows)) for targets, rows in by_regions.items() if targets
    ]
    return groups, sorted(by_regions.get((), []))


def _level_input(level: Level, columns: list[str], primary_key: list[str]) -> Callable[[pa.Table], ExecNode]:
    """The CoalesceFirstExec input for one level: a take, bloom-guarded for a generation."""

    def take(k: pa.Table) -> ExecNode:
        return TakeLastExec(level, k, columns, primary_key)

    if not isinstance(level, GenerationLevel):
        return take

    def guarded(k: pa.Table) -> ExecNode:
        return BloomFilterGuardExec(level, k, take, primary_key)

    return guarded


def _regions_label(regions: Sequence[RegionLevels], spec: RegionSpec | None, names: Mapping[int, str]) -> str:
    parts = []
    for r in regions:
        text = f"region {short_id(r.region_id)}"
        if r.values is not None and spec is not None and r.spec_id == spec.spec_id:
            text += f" ({spec.value_text(r.values, names)})"
        parts.append(text)
    return ", ".join(parts)
