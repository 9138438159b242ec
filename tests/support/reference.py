"""Test oracles: a dict model of a MemWAL table and a deliberately simple reader of what is stored.

`stored_rows` reads every level with plain row-by-row Python (base table, then each region's flushed
generations in ascending order, then unflushed MemTables), applying upserts and tombstones in order.
It shares no code with the read path under test beyond pylance and the manifest store.
"""

from __future__ import annotations

from typing import Any

import lance
import pyarrow as pa

from memwal_df.format import layout, memwal_index
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.table import Table

TOMBSTONE = "_tombstone"


def _key(row: dict[str, Any], pk: tuple[str, ...]) -> Any:
    return row[pk[0]] if len(pk) == 1 else tuple(row[c] for c in pk)


def _apply(model: dict[Any, dict[str, Any]], rows: list[dict[str, Any]], pk: tuple[str, ...]) -> None:
    for row in rows:
        row = dict(row)
        dead = row.pop(TOMBSTONE, False)
        if dead:
            model.pop(_key(row, pk), None)
        else:
            model[_key(row, pk)] = row


def stored_rows(table: Table, memtables: list[Any] | None = None) -> dict[Any, dict[str, Any]]:
    """Key → row of everything durable in storage (+ the given unflushed MemTables, oldest first)."""
    table.refresh()
    pk = table.schema.primary_key
    model: dict[Any, dict[str, Any]] = {}
    _apply(model, table.dataset.to_table().to_pylist(), pk)
    merged = memwal_index.merged_generations(table.details)
    for region_id in table.region_ids():
        m = RegionManifestStore(table.storage, region_id).latest()
        if m is None:
            continue
        for sst in sorted(m.sstables, key=lambda s: s.generation):
            if sst.generation <= merged.get(region_id, 0):
                continue
            uri = table.storage.child_uri(layout.generation_path(region_id, sst.path))
            ds = lance.dataset(uri, storage_options=table.storage_options or None)
            _apply(model, ds.to_table().to_pylist(), pk)
    for mt in memtables or []:
        _apply(model, mt.to_table().to_pylist(), pk)
    return model


def model_rows(data: pa.Table | list[dict[str, Any]], pk: tuple[str, ...]) -> dict[Any, dict[str, Any]]:
    rows = data.to_pylist() if isinstance(data, pa.Table) else data
    return {_key(r, pk): r for r in rows}
