"""Storage-level oracles for the crash and state-machine tests.

They read what is on storage with plain pyarrow IPC, protobuf manifests and pylance, and share no code
with the writer beyond `layout` (paths) and `RegionManifestStore` (as `reference.py` does):

* `durable_rows(table)`: key → row of everything that survives a crash *now*: the base table, every
  region's flushed generations and the WAL entries after `replay_after_wal_entry_position`, all read
  from one manifest version per region (so a MemTable flush running meanwhile cannot tear the view).
* `wal_records(table, region)`: every WAL entry of a region, decoded independently of `memwal_df.format.wal`.
* `check_region(table, region)`: structural invariants of one region (contiguous manifest versions,
  epochs that only step by one, complete referenced generations, contiguous WAL, non-decreasing WAL
  epochs); returns the generation directories no manifest version references (orphans).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import lance
import pyarrow as pa
import pyarrow.ipc as ipc

from memwal_df.errors import NotFoundError
from memwal_df.format import layout, memwal_index
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.wal import CHECKSUM_KEY
from memwal_df.table import Table
from support.optional import not_none

TOMBSTONE = "_tombstone"


@dataclass(frozen=True)
class WalRecord:
    position: int
    writer_epoch: int
    sentinel: bool
    rows: list[dict[str, Any]]  # with `_tombstone`
    batches: int  # non-empty record batches (= MemTable fragments a replay creates)


def read_wal(table: Table, region_id: uuid.UUID, position: int) -> WalRecord | None:
    try:
        data = table.storage.get(layout.wal_path(region_id, position))
    except NotFoundError:
        return None
    reader = ipc.open_stream(pa.py_buffer(data))
    batches = list(reader)
    meta = reader.schema.metadata or {}
    sentinel = meta.get(b"fence_sentinel") == b"true"
    rows = [] if sentinel else pa.Table.from_batches(batches, schema=reader.schema).to_pylist()
    return WalRecord(
        position, int(meta[b"writer_epoch"]), sentinel, rows, sum(1 for b in batches if b.num_rows)
    )


def wal_records(table: Table, region_id: uuid.UUID, start: int = 1) -> list[WalRecord]:
    """Entries from `start` upward until the first missing position."""
    out = []
    position = start
    while (rec := read_wal(table, region_id, position)) is not None:
        out.append(rec)
        position += 1
    return out


def apply_rows(model: dict[Any, dict[str, Any]], rows: list[dict[str, Any]], key: str = "id") -> None:
    for row in rows:
        row = dict(row)
        if row.pop(TOMBSTONE, False):
            model.pop(row[key], None)
        else:
            model[row[key]] = row


@dataclass
class RegionSnapshot:
    manifest: Any
    generation_rows: list[list[dict[str, Any]]] = field(default_factory=list)  # ascending generation
    tail: list[WalRecord] = field(default_factory=list)  # WAL entries after replay_after

    @property
    def tail_rows(self) -> list[dict[str, Any]]:
        return [r for rec in self.tail for r in rec.rows]

    @property
    def tail_has_data(self) -> bool:
        return any(not rec.sentinel for rec in self.tail)


_GENERATIONS: dict[str, list[dict[str, Any]]] = {}


def _generation_rows(uri: str, storage_options: dict[str, str]) -> list[dict[str, Any]]:
    """Rows of a committed generation (immutable once a manifest lists it, so cached by URI)."""
    if uri not in _GENERATIONS:
        if len(_GENERATIONS) > 20_000:
            _GENERATIONS.clear()
        ds = lance.dataset(uri, storage_options=storage_options or None)
        _GENERATIONS[uri] = ds.to_table().to_pylist()
    return _GENERATIONS[uri]


def region_snapshot(table: Table, region_id: uuid.UUID, merged: int = 0) -> RegionSnapshot | None:
    m = RegionManifestStore(table.storage, region_id).latest()
    if m is None:
        return None
    snap = RegionSnapshot(m)
    for sst in sorted(m.sstables, key=lambda s: s.generation):
        if sst.generation <= merged:
            continue
        uri = table.storage.child_uri(layout.generation_path(region_id, sst.path))
        snap.generation_rows.append(_generation_rows(uri, table.storage_options))
    snap.tail = wal_records(table, region_id, m.replay_after_wal_entry_position + 1)
    return snap


def durable_rows(table: Table) -> dict[Any, dict[str, Any]]:
    """What a crash of every writer right now would leave (base + generations + WAL tails)."""
    table.refresh()
    model: dict[Any, dict[str, Any]] = {}
    apply_rows(model, table.dataset.to_table().to_pylist())
    merged = memwal_index.merged_generations(table.details)
    for rid in table.region_ids():
        snap = region_snapshot(table, rid, merged.get(rid, 0))
        if snap is None:
            continue
        for rows in snap.generation_rows:
            apply_rows(model, rows)
        apply_rows(model, snap.tail_rows)
    return model


@dataclass
class RegionCheck:
    versions: int
    epochs: list[int]  # per manifest version, from version 1
    wal: list[WalRecord]
    orphans: set[str]  # generation directories no manifest version references
    referenced: set[str]


def check_region(table: Table, region_id: uuid.UUID) -> RegionCheck:
    """Assert the structural invariants of one region; return what was found."""
    store = RegionManifestStore(table.storage, region_id)
    versions = store.list_versions()
    assert versions == list(range(1, len(versions) + 1)), f"manifest versions not contiguous: {versions}"
    history = [not_none(store.read(v)) for v in versions]
    latest = store.latest()
    assert latest is not None and latest.version == len(versions), "latest() is not the newest version"
    epochs = [m.writer_epoch for m in history]
    assert epochs[0] >= 1 and all(b - a in (0, 1) for a, b in zip(epochs, epochs[1:], strict=False)), (
        f"writer epochs must only step by one per claim: {epochs}"
    )
    referenced: set[str] = set()
    prev_replay = 0
    for m in history:
        gens = [s.generation for s in m.sstables]
        assert gens == sorted(set(gens)), f"v{m.version}: generations not unique and ascending: {gens}"
        assert not gens or m.current_generation == gens[-1] + 1, f"v{m.version}: current_generation"
        assert m.replay_after_wal_entry_position >= prev_replay, "replay_after moved backwards"
        prev_replay = m.replay_after_wal_entry_position
        referenced.update(s.path for s in m.sstables)
    for s in latest.sstables:  # a referenced generation is complete
        rel = layout.generation_path(region_id, s.path)
        assert table.storage.exists(f"{rel}/{layout.BLOOM_FILTER_FILE}"), f"{s.path}: no bloom filter"
        for f in ("page_data.lance", "page_lookup.lance"):
            assert table.storage.exists(f"{rel}/{layout.PK_INDEX_DIR}/{f}"), f"{s.path}: no pk index"
        ds = lance.dataset(table.storage.child_uri(rel), storage_options=table.storage_options or None)
        assert ds.count_rows() == s.physical_rows
    gen_dirs = {
        n for n in table.storage.list_dir(layout.region_dir(region_id)) if layout.parse_generation_dir_name(n)
    }
    assert referenced <= gen_dirs, f"manifests reference missing generations: {referenced - gen_dirs}"
    hint_path = layout.version_hint_path(region_id)
    if table.storage.exists(hint_path):
        hint = json.loads(table.storage.get(hint_path))["version"]
        assert 1 <= hint <= latest.version
    names = table.storage.list_dir(f"{layout.region_dir(region_id)}/{layout.WAL_DIR}")
    positions = sorted(p for n in names if (p := layout.parse_bitrev64_name(n)) is not None)
    assert positions == list(range(1, len(positions) + 1)), f"WAL positions not contiguous: {positions}"
    wal = wal_records(table, region_id)
    assert len(wal) == len(positions)
    wal_epochs = [r.writer_epoch for r in wal]
    assert wal_epochs == sorted(wal_epochs), f"WAL epochs go backwards: {wal_epochs}"
    assert not wal or wal_epochs[-1] <= latest.writer_epoch
    assert latest.replay_after_wal_entry_position <= len(wal)
    return RegionCheck(len(versions), epochs, wal, gen_dirs - referenced, referenced)


def freeze(model: dict[Any, dict[str, Any]]) -> frozenset:
    """A hashable copy of a key -> row model."""
    return frozenset((k, tuple(sorted(v.items()))) for k, v in model.items())


def reachable_states(
    start: dict[Any, dict[str, Any]], history: list[tuple[list[dict[str, Any]], bool]]
) -> set[frozenset]:
    """Every state that applying `history` to `start` in order can leave: each entry is the rows of
    one region write (with `_tombstone`) and whether it was acknowledged. An acknowledged write is
    always applied, whole; one whose call raised or was cut short (unknown outcome) whole or not at all.
    """
    states = {freeze(start)}
    for rows, acked in history:
        applied = set()
        for state in states:
            model = {k: dict(v) for k, v in state}
            apply_rows(model, rows)
            applied.add(freeze(model))
        states = applied if acked else states | applied
    return states


def unchecked(data: bytes) -> bytes:
    """The same entry without the checksum key, as Lance's writer (or an older memwal_df) writes it."""
    reader = ipc.open_stream(data)
    meta = {k: v for k, v in reader.schema.metadata.items() if k != CHECKSUM_KEY}
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, reader.schema.with_metadata(meta)) as w:
        for b in reader:
            w.write_batch(b)
    return sink.getvalue().to_pybytes()
