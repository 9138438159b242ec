"""TakeLastExec: the newest row of each requested key within one level of the LSM tree.

Guarantees:

* At most one row per requested key: the newest one the level holds, never an older duplicate. A
  tombstone is a row like any other (`_tombstone = true`); a key the level does not hold has no row.
* Output columns: the requested columns, then the key columns not requested, then `_tombstone`.
  Base-table rows get `_tombstone = false` (the base table holds live rows only).
* A generation that was garbage-collected (its directory is gone, before or while it is read) holds
  nothing; that is not an error (spec: its rows are in the base table already). Readers kept open
  from an earlier lookup (see `fragments.fragment_take`), or its in-memory copy, may still serve a collected
  generation: they return its rows, which is what the snapshot that lists the generation holds.

How each level is read:

* flushed generation: the generation's `_pk_index` (sorted keys with the row offset of every row in
  fragment 0, dedup-deleted rows included) gives the newest offset per key. Without a deletion
  vector (memwal_df's generations) offsets are visible offsets and the rows are taken from the
  generation's in-memory copy once it is loaded (`generation_copies`: small generations, loaded in the
  background after the first lookup), else through a kept `FragmentSession`; with one (native
  generations) by row address (`LanceDataset._take_rows`, which takes physical offsets in fragment 0
  and drops rows a deletion vector hides; `take()` and `LanceFragment.take()` count only visible
  rows, so they cannot be fed index offsets). The index is read once per process
  (`cache.GENERATIONS`). A generation without a usable index (none, or not one fragment 0 of the
  indexed size) is scanned with a key filter instead and the row with the
  largest row address per key is kept.
* unflushed MemTable: vectorized membership test on the key columns (the copy is newest-per-key).
* base table of at most `MAX_INDEXED_BASE_ROWS` rows: the base key index of the pinned version
  (`memwal_df.read.lsm.base_key_index`: sorted runs of keys with each live row's address, read whole on the
  table's first use in the process, then patched from version to version by reading only the
  fragments each one adds and its new deletion files; the index scans use too) finds the rows, taken
  through kept `FragmentSession`s by visible offset; the rows taken must carry the keys asked for.
  Absent keys cost no read at all.
* any other base table: a scan with `key IN (...)` pushed into Lance, which answers it from a scalar
  index on the key (btree, bitmap) when there is one; the scan stops once every key is found (the
  base holds each key once).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import NotFoundError
from memwal_df.format import pk_index
from memwal_df.format.storage import Storage
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.batches import projected_schema
from memwal_df.read.lookup import generation_copies
from memwal_df.read.lsm.base_key_index import base_key_index, indexable
from memwal_df.read.lsm.cache import described_indices
from memwal_df.read.lsm.fragments import fragment_take
from memwal_df.read.lsm.keys import (
    TOMBSTONE,
    encode_keys,
    key_filter,
    last_per_key,
    member_mask,
    output_columns,
)
from memwal_df.read.lsm.levels import GenerationLevel, Level, MemTableLevel

__all__ = ["TakeLastExec", "with_live_flag"]

_ROWADDR = "_rowaddr"


@dataclass(frozen=True)
class _PkIndex:
    values: pa.Array  # sorted keys (composite keys encoded)
    ids: np.ndarray  # uint64 row offsets in fragment 0, aligned with values
    visible_is_physical: bool  # fragment 0 has no deletion vector: offsets are `take` offsets


def _load_pk_index(level: GenerationLevel, ds: lance.LanceDataset) -> _PkIndex | None:
    """The generation's `_pk_index`, or None when it has none or it cannot address the rows."""
    fragments = ds.get_fragments()
    if len(fragments) != 1 or fragments[0].fragment_id != 0:
        return None
    try:
        values, ids = pk_index.read_pk_index(level.uri, level.storage.storage_options or None)
    except NotFoundError:
        return None
    physical_rows = fragments[0].metadata.physical_rows
    if len(ids) != physical_rows or (len(ids) and int(ids.max()) >= physical_rows):
        return None  # not this fragment's index
    return _PkIndex(values, ids, fragments[0].metadata.deletion_file is None)


def _pk_index_bytes(index: _PkIndex | None) -> int:
    return 0 if index is None else index.values.nbytes + index.ids.nbytes


def _generation_gone(level: GenerationLevel) -> bool:
    try:
        return not level.storage.list_dir(f"{level.path}/_versions")
    except NotFoundError:
        return True


def _index_on_key(ds: lance.LanceDataset, primary_key: Sequence[str]) -> str | None:
    """`btree index id_idx on id` for the first scalar index on a key column, else None."""
    try:
        indices = described_indices(ds)
    except (OSError, ValueError):
        return None
    for d in indices:
        names = list(d.field_names)
        kind = d.type_url.rsplit(".", 1)[-1].removesuffix("IndexDetails")
        if len(names) == 1 and names[0] in primary_key and kind.lower() not in ("inverted", "vector"):
            return f"{kind.lower()} index {d.name} on {names[0]}"
    return None


class TakeLastExec(ExecNode):
    """The newest row of each requested key within ONE level (tombstones included, as rows with
    _tombstone=True), columns = requested + key columns + _tombstone."""

    def __init__(
        self,
        source: Level | lance.LanceDataset,
        keys: pa.Table,
        columns: Sequence[str],
        primary_key: Sequence[str],
        storage: Storage | None = None,
    ) -> None:
        self.source = source
        self.storage = storage  # the base table's, for its deletion files (None: Lance reads them)
        self.primary_key = list(primary_key)
        self.keys = keys.select(self.primary_key)
        self.columns = output_columns(columns, self.primary_key)
        self.method: str | None = None  # how the level was read, once known
        self.rows_out = 0

    # ------------------------------------------------------------------ description

    @property
    def source_label(self) -> str:
        if isinstance(self.source, Level):
            return self.source.label
        return f"base table v{self.source.version}"

    def describe(self) -> str:
        if self.method is None:
            if isinstance(self.source, Level):
                self.method = "_pk_index" if isinstance(self.source, GenerationLevel) else "key hash match"
            else:
                self.method = _base_method(self.source, self.primary_key)
        return f"TakeLastExec: {self.source_label}, via {self.method}, keys={self.keys.num_rows}"

    # ------------------------------------------------------------------ execution

    def execute(self) -> Iterator[pa.RecordBatch]:
        if self.keys.num_rows == 0:
            return
        if isinstance(self.source, Level):
            if isinstance(self.source, MemTableLevel):
                result = self._memtable(self.source)
            else:
                assert isinstance(self.source, GenerationLevel)
                result = self._generation(self.source)
            if result is not None and result.num_rows:
                self.rows_out += result.num_rows
                yield from (b for b in result.to_batches() if b.num_rows)
            return
        yield from self._base(self.source)

    def _memtable(self, level: MemTableLevel) -> pa.Table:
        """The newest rows of the keys, taken by position: the snapshot's keys are matched, and only
        the matching rows are copied."""
        self.method = "key hash match"
        snapshot = level.source
        return snapshot.take(snapshot.positions_of(encode_keys(self.keys, self.primary_key)), self.columns)

    def _generation(self, level: GenerationLevel) -> pa.Table | None:
        ds = level.dataset()
        if ds is None:
            self.method = "nothing (generation garbage-collected)"
            return None
        try:
            index = level.cached("pk_index", lambda: _load_pk_index(level, ds), _pk_index_bytes)
            if index is not None:
                self.method = "_pk_index"
                taken = self._take_by_index(level, ds, index)
                if taken is not None:
                    return taken
                self.method = "filtered scan (the _pk_index does not match the visible rows)"
            else:
                self.method = "filtered scan (no _pk_index)"
            return self._scan_last(ds)
        except (OSError, ValueError, NotFoundError):
            if _generation_gone(level):  # collected while we read it
                level.missing = True
                self.method = "nothing (generation garbage-collected)"
                return None
            raise

    def _take_by_index(
        self, level: GenerationLevel, ds: lance.LanceDataset, index: _PkIndex
    ) -> pa.Table | None:
        """The newest rows by `_pk_index` offsets (from the in-memory copy when there is one); None if
        the index disagrees with the visible rows."""
        encoded = encode_keys(self.keys, self.primary_key)
        rows = pk_index.lookup(index.values, index.ids, encoded)
        offsets = np.unique(rows[rows >= 0])
        columns = [*self.columns, TOMBSTONE]
        if len(offsets) == 0:
            return pa.Table.from_batches([], schema=projected_schema(ds.schema, columns))
        if index.visible_is_physical:
            copy = generation_copies.cached_rows(level, ds, index.values, index.ids, self.primary_key)
            if copy is not None:  # checked against the index when it was loaded
                self.method = "_pk_index, in-memory rows"
                return generation_copies.take(copy, offsets, columns)
            taken = fragment_take(ds, 0, offsets, columns)
        else:  # fragment 0, no stable row ids: a row address is the physical offset
            taken = ds._take_rows(pa.array(offsets, pa.uint64()), columns=columns)
        if taken.num_rows != len(offsets) or not member_mask(taken, self.primary_key, encoded).all():
            return None  # a newest row is hidden by a deletion vector, or the index is not this data's
        return taken

    def _scan_last(self, ds: lance.LanceDataset) -> pa.Table:
        encoded = encode_keys(self.keys, self.primary_key)
        table = ds.to_table(
            columns=[*self.columns, TOMBSTONE],
            filter=key_filter(self.keys, self.primary_key),
            with_row_address=True,
        )
        table = table.filter(member_mask(table, self.primary_key, encoded))
        order = table.column(_ROWADDR).to_numpy()
        return last_per_key(table, self.primary_key, order).drop_columns([_ROWADDR])

    def _base(self, ds: lance.LanceDataset) -> Iterator[pa.RecordBatch]:
        if indexable(ds):
            taken = self._take_indexed(ds)
            if taken is not None:
                self.method = "key index"
                if taken.num_rows:
                    self.rows_out += taken.num_rows
                    yield from (b for b in with_live_flag(taken).to_batches() if b.num_rows)
                return
            self.method = "filtered scan (the key index does not apply to these keys)"
        yield from self._scan_base(ds)

    def _take_indexed(self, ds: lance.LanceDataset) -> pa.Table | None:
        """The base rows of the keys through the base key index; None when the keys cannot be
        compared with the index's (another type) or the rows taken do not carry them."""
        asked = encode_keys(self.keys, self.primary_key)
        asked = asked.filter(pc.is_valid(asked))
        index = base_key_index(str(ds.uri), ds, self.storage, self.primary_key)
        try:
            taken = index.take(ds, self.storage, asked, self.columns)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError, ValueError, OverflowError):
            return None
        got = encode_keys(taken, self.primary_key)
        if taken.num_rows and not pc.all(pc.is_in(got, value_set=asked.cast(got.type))).as_py():
            return None
        return taken

    def _scan_base(self, ds: lance.LanceDataset) -> Iterator[pa.RecordBatch]:
        unfound = encode_keys(self.keys, self.primary_key)
        scanner = ds.scanner(columns=self.columns, filter=key_filter(self.keys, self.primary_key))
        for batch in scanner.to_batches():
            if batch.num_rows == 0:
                continue
            hit = member_mask(batch, self.primary_key, unfound)
            if not hit.any():
                continue
            rows = pa.Table.from_batches([batch]).filter(hit)
            rows = _first_per_key(rows, self.primary_key)
            found = encode_keys(rows, self.primary_key).cast(unfound.type)
            unfound = unfound.filter(pc.invert(pc.is_in(unfound, value_set=found)))
            out = with_live_flag(rows)
            self.rows_out += out.num_rows
            yield from (b for b in out.to_batches() if b.num_rows)
            if len(unfound) == 0:
                return  # every key found: the base holds each key once


def with_live_flag(rows: pa.Table) -> pa.Table:
    """Base-table rows with `_tombstone = false` appended."""
    flag = pa.array(np.zeros(rows.num_rows, dtype=bool), pa.bool_())
    return rows.append_column(pa.field(TOMBSTONE, pa.bool_(), nullable=False), flag)


def _base_method(ds: lance.LanceDataset, primary_key: Sequence[str]) -> str:
    """How a lookup in this base table runs, as `describe()` names it."""
    if indexable(ds):
        return "key index"
    index = _index_on_key(ds, primary_key)
    return index if index is not None else "filtered scan"


def _first_per_key(table: pa.Table, primary_key: Sequence[str]) -> pa.Table:
    """One row per key, the first (the base holds each key once; this only guards against a stray copy)."""
    n = table.num_rows
    if n <= 1:
        return table
    return last_per_key(table, primary_key, order=np.arange(n, 0, -1))
