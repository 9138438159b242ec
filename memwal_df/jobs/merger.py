"""The merger (spec "MemTable merger" and appendix 2): flushed generations into the base table.

`merge(table)` merges, per region, every flushed generation above the region's merged generation in
ascending order, in runs of up to `generations_per_commit` consecutive generations (with the same
columns). A run is the newest row of each key among its generations, and at most two Lance commits:

1. its tombstones, as `merge_insert(pk).when_matched_delete()` with no conflict retries (Lance 14
   cannot put a delete and an upsert into one commit, and the merge marker can be set only once);
2. its live rows, as `merge_insert(pk).when_matched_update_all().when_not_matched_insert_all()` with
   `mark_sstables_as_compacted([(region, last generation of the run)])`: the data and the progress
   commit atomically (Lance accepts any marker above the recorded one).

A merger that is behind so adds one fragment per run instead of one per generation, and the base sees
the run's net effect: a key put and deleted again within the run is deleted, one deleted and put
again is upserted.

Guarantees:
- A generation is merged only after its files match their checksum sidecar (checked on every read,
  never from a cache; `memwal_df.format.checksums`), or, for a generation without one (Lance's own),
  its row count matches its region manifest entry and no primary key repeats. A corrupt generation
  stops its region's merge with `CorruptGenerationError` (the generations before it are merged);
  the other regions merge.
- Merge progress never goes backwards and no generation is merged twice or after a newer one: each
  pass commits from a pinned base version `R` at which the generation is unmerged, without Lance's
  conflict retries (Lance would re-execute it on a newer version, past that check); pass 2 first waits
  until no MemWAL index-entry writer holds the entry lease (`entry_lease.admit`). Index-entry commits
  then never lower progress (see `memwal_df/format/entry_lease.py`), so progress at `R` is the highest any
  version recorded, and Lance's "Stale SSTable compaction" check (marker not above the newest
  recorded one) makes a marker commit the first and only one for its generation. The merger takes
  "Stale" as "another merger got there first" and goes on; a lost race pins a new version and checks
  again.
- A crash after pass 1 leaves the base without rows whose newest version among the unmerged run is a
  tombstone, which readers hide anyway; the next merge repeats pass 1 (a no-op) and commits pass 2.
  A crash after pass 2 is a completed merge. Pass 1 deletes only rows of `R`, all from generations
  below the run, so it never deletes a key a later generation re-inserted. When another merger has
  merged the first generations of a run meanwhile, the rest are planned again (both passes).
- Regions merge in parallel threads when `parallel` (their keys are disjoint: Lance rebases the
  commits); the generations of one region always merge one after the other. Off by default: the
  commits of concurrent regions conflict and Lance re-executes them, so on few cores parallel
  regions are slower than serial (`bench/merge.py`, docs/performance.md).
"""

from __future__ import annotations

import itertools
import random
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lance
import pyarrow as pa
import pyarrow.compute as pc
from lance.dataset import MergeInsertBuilder
from lance.mem_wal import CompactedSsTable

from memwal_df.errors import (
    CommitConflictError,
    CorruptGenerationError,
    CorruptRegionsError,
    InvalidConfigError,
    MissingGenerationError,
)
from memwal_df.format import checksums, entry_lease, layout, memwal_index
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.storage import Storage
from memwal_df.jobs.repair import each_region
from memwal_df.read.lsm.cache import described_indices
from memwal_df.read.lsm.keys import last_per_key

if TYPE_CHECKING:
    from memwal_df.format.table_handle import TableHandle

MAX_ATTEMPTS = 50  # tries per generation when its commits keep losing races (each loss: another commit)
_BACKOFF = (0.005, 0.5)  # seconds: first and longest cap of the random wait after a lost race
_STALE_MARKER = "Stale SSTable compaction"
LOST_RACE = ("Too many concurrent writers", "onflict")  # Lance's messages for a commit conflict
_PARALLEL_REGIONS = 8
GENERATIONS_PER_COMMIT = 8  # a merger that is behind merges up to this many generations of a region at once


@dataclass(frozen=True)
class RegionMerge:
    """What one `merge` did in one region."""

    region_id: uuid.UUID
    generations: tuple[int, ...]  # merged by this call, ascending
    skipped: tuple[int, ...]  # found merged by another merger while this call worked on them
    rows_upserted: int
    rows_deleted: int  # tombstones applied (whether or not the base held the key)


@dataclass(frozen=True)
class MergeResult:
    """What one `merge` committed; `base_version` is the base table's latest version afterwards."""

    regions: tuple[RegionMerge, ...]
    base_version: int

    @property
    def generations(self) -> dict[uuid.UUID, tuple[int, ...]]:
        """Region -> generations this call merged (regions with none are left out)."""
        return {r.region_id: r.generations for r in self.regions if r.generations}

    @property
    def rows(self) -> int:
        """Source rows merged (upserts + tombstones)."""
        return sum(r.rows_upserted + r.rows_deleted for r in self.regions)


def merge_progress(storage: Storage, version: int | None = None) -> dict[uuid.UUID, int]:
    """Region -> merged generation recorded at base `version` (default: the latest).

    Entry writers never lower it (`entry_lease`), so it is also the highest progress any earlier
    version recorded."""
    found = memwal_index.read_details(storage.uri, storage.storage_options or None, version)
    return memwal_index.merged_generations(found[0]) if found else {}


def merge(
    table: TableHandle,
    regions: Iterable[uuid.UUID | str] | None = None,
    max_generations: int | None = None,
    parallel: bool = False,
    generations_per_commit: int = GENERATIONS_PER_COMMIT,
) -> MergeResult:
    """Merge flushed generations into the base table (see the module docstring).

    `regions`: the regions to merge (default: all); `max_generations`: at most this many generations
    per region, oldest first; `generations_per_commit`: consecutive generations of a region merged
    together, as the newest row of each key among them (one fragment and one commit pair for all).
    Raises `InvalidConfigError` for a bad argument, `MissingGenerationError`
    when an unmerged generation listed in a region manifest is gone, `CommitConflictError` when a
    generation keeps losing commit races, and, after merging every other region,
    `CorruptRegionsError` (`result`: this `MergeResult`) for regions whose manifest cannot be decoded
    or whose next generation is corrupt (`CorruptGenerationError`)."""
    if max_generations is not None and max_generations < 1:
        raise InvalidConfigError(f"max_generations must be >= 1, got {max_generations}")
    if generations_per_commit < 1:
        raise InvalidConfigError(f"generations_per_commit must be >= 1, got {generations_per_commit}")
    try:
        ids = sorted({uuid.UUID(str(r)) for r in regions}) if regions is not None else table.region_ids()
    except ValueError as e:
        raise InvalidConfigError(f"not a region id: {e}") from e
    merger = _Merger(table, max_generations, generations_per_commit)
    if parallel and len(ids) > 1:
        with ThreadPoolExecutor(min(len(ids), _PARALLEL_REGIONS), thread_name_prefix="memwal-merge") as pool:
            done, failed = each_region(merger.region, ids, pool.map)
    else:
        done, failed = each_region(merger.region, ids)
    table.refresh()
    result = MergeResult(tuple(done), table.dataset.version)
    if failed:
        raise CorruptRegionsError("merge", failed, result)
    return result


def _backoff(attempt: int) -> None:
    """Sleep a random time up to an exponentially growing cap: racing mergers spread out."""
    time.sleep(random.uniform(0, min(_BACKOFF[1], _BACKOFF[0] * 2**attempt)))


@dataclass(frozen=True)
class _Merged:
    generations: tuple[int, ...]
    upserted: int
    deleted: int


class _Merger:
    def __init__(self, table: TableHandle, max_generations: int | None, per_commit: int = 1) -> None:
        self.storage = table.storage
        self.uri = table.uri
        self.options = table.storage_options or None
        self.pk = list(table.schema.primary_key)
        self.max_generations = max_generations
        self.per_commit = per_commit

    def region(self, region_id: uuid.UUID) -> RegionMerge:
        manifest = RegionManifestStore(self.storage, region_id).latest()
        listed = sorted((s.generation, s.path) for s in manifest.sstables) if manifest is not None else []
        floor = merge_progress(self.storage).get(region_id, 0)
        todo = [(g, layout.generation_path(region_id, p)) for g, p in listed if g > floor]
        todo = todo[: self.max_generations]
        merged: list[int] = []
        skipped: list[int] = []
        upserted = deleted = 0
        while todo:
            chunk = todo[: self.per_commit]
            done = self._generations(region_id, chunk)
            last = chunk[-1][0] if done is None else done.generations[-1]
            skipped.extend(g for g, _ in chunk if g <= last and (done is None or g not in done.generations))
            todo = [(g, p) for g, p in todo if g > last]
            if done is not None:
                merged.extend(done.generations)
                upserted += done.upserted
                deleted += done.deleted
        return RegionMerge(region_id, tuple(merged), tuple(skipped), upserted, deleted)

    def _merged(self, region_id: uuid.UUID, gen: int, version: int | None = None) -> bool:
        return merge_progress(self.storage, version).get(region_id, 0) >= gen

    def _generations(self, region_id: uuid.UUID, chunk: list[tuple[int, str]]) -> _Merged | None:
        """Merge consecutive generations `chunk` ((generation, path), ascending) of one region in one
        pair of commits, as the newest row of each key among them; None if all were already merged.

        Each pass commits from a pinned base version at which the generations it applies are still
        unmerged, with Lance's conflict retries off; a lost race pins the latest version and checks
        again (another merger may have merged the first generations of `chunk` meanwhile: the rest
        are planned again, tombstone pass included)."""
        rows: dict[int, pa.Table] = {}
        planned: tuple[int, ...] = ()
        combined: tuple[pa.Table, pa.Table] | None = None
        deleted = False
        for attempt in range(MAX_ATTEMPTS):
            ds = self._dataset()
            floor = merge_progress(self.storage, ds.version).get(region_id, 0)
            pending = [(g, p) for g, p in chunk if g > floor]
            if not pending:
                return None
            if pending[0][0] != (planned[0] if planned else None):
                found = self._combined(region_id, pending, rows, ds.schema)
                if found is None:
                    return None  # merged and garbage-collected meanwhile
                planned, combined, deleted = found[0], found[1:], False
            assert combined is not None
            live, dead = combined
            if dead.num_rows and not deleted:
                # At this version no generation of `planned` is merged, so every matched row is older.
                deleted = self._commit(self._builder(ds).when_matched_delete(), dead)
                if deleted:
                    continue  # pass 2 pins a version after our own commit
            elif not entry_lease.admit(self.storage, self.uri, self.options):
                continue  # an index-entry writer was committing: pin a version after it
            else:
                upsert = (
                    self._builder(ds)
                    .when_matched_update_all()
                    .when_not_matched_insert_all()
                    .mark_sstables_as_compacted([CompactedSsTable(str(region_id), planned[-1])])
                )
                try:
                    if self._commit(upsert, live):
                        return _Merged(planned, live.num_rows, dead.num_rows)
                except OSError as e:
                    if _STALE_MARKER in str(e):
                        continue  # another merger recorded some of them: plan the rest again
                    raise
            _backoff(attempt)  # lost a commit race
        raise CommitConflictError(
            f"merging generations {planned} of region {region_id}: lost {MAX_ATTEMPTS} commit races in a row"
        )

    def _combined(
        self, region_id: uuid.UUID, pending: list[tuple[int, str]], rows: dict[int, pa.Table], base: pa.Schema
    ) -> tuple[tuple[int, ...], pa.Table, pa.Table] | None:
        """(generations, live rows, tombstones): the newest row per key among the first generations
        of `pending` that have the same columns (each read once into `rows`); None when the first is
        gone because another merger merged it (and GC removed it)."""
        for gen, path in pending:
            if gen not in rows:
                try:
                    rows[gen] = self._rows(path, base)
                except MissingGenerationError:
                    if self._merged(region_id, gen):
                        return None
                    raise
                except CorruptGenerationError:
                    if gen == pending[0][0]:
                        raise
                    break  # merge the generations before it; the next run stops at it
        columns = rows[pending[0][0]].column_names

        def same(g: int) -> bool:  # read, with the first one's columns
            return g in rows and rows[g].column_names == columns

        gens = tuple(itertools.takewhile(same, (g for g, _ in pending)))
        tables = [rows[g] for g in gens]
        both = tables[0] if len(tables) == 1 else last_per_key(pa.concat_tables(tables), self.pk)
        dead = pc.fill_null(both.column(TOMBSTONE), False)
        both = both.drop_columns([TOMBSTONE])
        return gens, both.filter(pc.invert(dead)), both.filter(dead)

    def _builder(self, ds: lance.LanceDataset) -> MergeInsertBuilder:
        """`merge_insert` on the primary key, joining through Lance's scalar indexes only when every
        key column has one: Lance otherwise gains nothing from the look-up, which logs an ERROR for
        the MemWAL index (an index without fields; see `memwal_df/_lance_log.py`)."""
        indexed = {d.field_names[0] for d in described_indices(ds) if len(d.field_names) == 1}
        return ds.merge_insert(self.pk).use_index(indexed.issuperset(self.pk))

    def _dataset(self) -> lance.LanceDataset:
        return lance.dataset(self.uri, storage_options=self.options)

    def _rows(self, path: str, base: pa.Schema) -> pa.Table:
        """A generation's rows with `_tombstone`, the other columns cast to `base`, read only after
        its files match their checksums (or, without a checksum sidecar, `checksums.check_rows`
        passes); `CorruptGenerationError` otherwise."""
        found = layout.parse_generation_path(path)
        assert found is not None, path
        region_id, gen = found
        outcome = checksums.verify_generation(self.storage, region_id, gen, path)
        try:
            if outcome == checksums.GONE:
                raise ValueError("its directory is gone")
            ds = lance.dataset(self.storage.child_uri(path), storage_options=self.options)
            rows = ds.to_table()
        except (ValueError, OSError) as e:
            raise MissingGenerationError(f"flushed generation {path} cannot be read: {e}") from e
        if outcome == checksums.UNCHECKED:
            m = RegionManifestStore(self.storage, region_id).latest()
            name = path.rsplit("/", 1)[1]
            listed = next((s.physical_rows for s in m.sstables if s.path == name), 0) if m is not None else 0
            physical = sum(f.metadata.physical_rows for f in ds.get_fragments())
            checksums.check_rows(rows, physical, listed, self.pk, region_id, gen, path)
        fields = [base.field(n) if n != TOMBSTONE else rows.schema.field(n) for n in rows.column_names]
        return rows.cast(pa.schema(fields))

    def _read(self, path: str, base: pa.Schema) -> tuple[pa.Table, pa.Table]:
        """(live rows, tombstones) of a generation, cast to `base`, without `_tombstone`."""
        rows = self._rows(path, base)
        dead = pc.fill_null(rows.column(TOMBSTONE), False)
        rows = rows.drop_columns([TOMBSTONE])
        return rows.filter(pc.invert(dead)), rows.filter(dead)

    def _commit(self, builder: MergeInsertBuilder, source: pa.Table) -> bool:
        """Execute a merge_insert from its pinned version without Lance's retries (Lance would
        re-execute it on a newer version, past our checks); False if the commit lost a race. What
        it wrote is durable when it returns."""
        try:
            with self.storage.synced_changes(skip=layout.NOT_BASE):
                builder.conflict_retries(0).execute(source)
        except lance.commit.CommitConflictError:
            return False
        except OSError as e:
            if any(m in str(e) for m in LOST_RACE):
                return False
            raise
        return True
