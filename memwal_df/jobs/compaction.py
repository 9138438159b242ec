"""Base table compaction: rewrite the small fragments merges leave behind and the fragments whose rows
merges have mostly deleted, so the base stays a few large fragments however many rounds ran.

Every merge adds a fragment per region (its upserted rows) and a deletion file to each older fragment
holding a key it updated. `compact(table)` measures that debt on the latest base version and, when
it passes the thresholds of `CompactionSettings`, runs Lance's `compact_files` over the candidate
fragments only:
- a fragment is a **candidate** when it is small (fewer physical rows than `small_fragment_rows`) or
  when at least `max_deleted_share` of its rows are deleted; every other fragment is excluded, so a
  large, mostly live fragment is never rewritten just because small ones sit next to it;
- compaction runs when there are at least `min_small_fragments` small fragments, or any fragment
  passes `max_deleted_share`. Lance merges adjacent candidates into fragments of up to
  `target_rows_per_fragment` rows and drops deleted rows.

Guarantees:
- The MemWAL index is untouched: a compaction is a Lance `Rewrite`, whose commit carries the index
  section of the version it lands on (merge progress, index catch-up and region snapshots of the
  newest version, also when Lance rebases it over a merge or an index commit), so merge progress
  never goes back.
- Index catch-up stays true: indexes are remapped in the same commit (`defer_index_remap=False`);
  Lance never compacts fragments with different index coverage together, so a rewritten fragment is
  in an index's `fragment_bitmap` exactly when all of its source fragments were. Deferred remapping
  would leave the bitmaps naming retired fragments until the next index optimize, and the catch-up
  claim (a region's merged rows sit in covered fragments) could not be verified from them meanwhile.
- Lance resets the `index_catchup` of every index its `Rewrite` remaps (they get new uuids) although
  the remapped bitmaps cover what the old ones did; `compact` commits the catch-up of the version it
  compacted back on top (`_restore_catchup`: never lowering a value recorded meanwhile), so GC and
  readers keep trusting it without waiting for the next index catch-up.
- A compaction that loses a commit race is planned again on the latest version (at most
  `MAX_ATTEMPTS` times, then `CommitConflictError`); a killed compaction leaves only unreferenced
  data files (Lance's version cleanup removes them) and the base as it was.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lance
import lance.commit
import numpy as np

from memwal_df.errors import CommitConflictError, InvalidConfigError
from memwal_df.format import layout, memwal_index
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.jobs.index_catchup import progress_entry
from memwal_df.jobs.merger import LOST_RACE

if TYPE_CHECKING:
    from memwal_df.format.table_handle import TableHandle

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class CompactionSettings:
    """When and how the base is compacted (defaults in the field comments)."""

    target_rows_per_fragment: int = 1_048_576  # rows per rewritten fragment (Lance's default)
    small_fragment_rows: int = 65_536  # a fragment with fewer physical rows is small
    min_small_fragments: int = 16  # compact once this many fragments are small
    max_deleted_share: float = 0.1  # rewrite a fragment once this share of its rows is deleted

    def __post_init__(self) -> None:
        # a target below `small_fragment_rows` would write small fragments again: due every run
        if (
            self.small_fragment_rows < 1
            or self.target_rows_per_fragment < self.small_fragment_rows
            or self.min_small_fragments < 2
        ):
            raise InvalidConfigError(
                "need small_fragment_rows >= 1, target_rows_per_fragment >= small_fragment_rows, "
                f"min_small_fragments >= 2; got {self.target_rows_per_fragment}, {self.small_fragment_rows}, "
                f"{self.min_small_fragments}"
            )
        if not 0 < self.max_deleted_share <= 1:
            raise InvalidConfigError(f"max_deleted_share must be in (0, 1], got {self.max_deleted_share}")


DEFAULT_SETTINGS = CompactionSettings()


@dataclass(frozen=True)
class FragmentStats:
    """One base fragment's size, from its manifest entry (no I/O)."""

    fragment_id: int
    physical_rows: int
    deleted_rows: int

    @property
    def deleted_share(self) -> float:
        return self.deleted_rows / self.physical_rows if self.physical_rows else 0.0


@dataclass(frozen=True)
class CompactionDebt:
    """The base's fragments measured against `CompactionSettings`: what a compaction would rewrite."""

    fragments: int
    with_deletions: int
    physical_rows: int
    deleted_rows: int
    small: tuple[int, ...]  # fragment ids of small fragments
    mostly_deleted: tuple[int, ...]  # fragment ids at or past `max_deleted_share`
    due: bool  # the thresholds are passed: `compact` would run
    fragment_ids: tuple[int, ...] = ()  # every fragment, in order

    @property
    def deleted_share(self) -> float:
        return self.deleted_rows / self.physical_rows if self.physical_rows else 0.0

    @property
    def candidates(self) -> set[int]:
        return set(self.small) | set(self.mostly_deleted)


@dataclass(frozen=True)
class CompactionResult:
    """What one `compact` did: the debt it found, the rewrite (zeros when not due) and the base
    version afterwards."""

    debt: CompactionDebt
    fragments_removed: int
    fragments_added: int
    files_removed: int
    files_added: int
    version: int

    @property
    def compacted(self) -> bool:
        """Whether any fragment was rewritten."""
        return self.fragments_removed > 0


def fragment_stats(ds: lance.LanceDataset) -> list[FragmentStats]:
    """Every fragment of `ds` with its physical and deleted row counts, in fragment order."""
    out = []
    for f in ds.get_fragments():
        m = f.metadata
        deleted = m.deletion_file.num_deleted_rows if m.deletion_file is not None else 0
        out.append(FragmentStats(m.id, m.physical_rows or 0, deleted or 0))
    return out


def debt(ds: lance.LanceDataset, settings: CompactionSettings) -> CompactionDebt:
    """The compaction debt of `ds` (one manifest read, no data I/O)."""
    stats = fragment_stats(ds)
    small = tuple(s.fragment_id for s in stats if s.physical_rows < settings.small_fragment_rows)
    dead = tuple(
        s.fragment_id for s in stats if s.deleted_rows and s.deleted_share >= settings.max_deleted_share
    )
    return CompactionDebt(
        fragments=len(stats),
        with_deletions=sum(1 for s in stats if s.deleted_rows),
        physical_rows=sum(s.physical_rows for s in stats),
        deleted_rows=sum(s.deleted_rows for s in stats),
        small=small,
        mostly_deleted=dead,
        due=_mergeable(stats, set(small), set(dead)) >= settings.min_small_fragments or bool(dead),
        fragment_ids=tuple(s.fragment_id for s in stats),
    )


def _mergeable(stats: list[FragmentStats], small: set[int], dead: set[int]) -> int:
    """How many small fragments Lance can merge: those next to another candidate (Lance compacts runs
    of adjacent candidates only; a lone small fragment between large live ones stays as it is)."""
    candidates = small | dead
    ids = [s.fragment_id for s in stats]
    runs = [list(g) for k, g in itertools.groupby(ids, key=candidates.__contains__) if k]
    return sum(1 for run in runs if len(run) > 1 for f in run if f in small)


def _lance_threshold(share: float) -> float:
    """Lance rewrites a fragment whose deleted share, as float32, is strictly above its threshold; the
    next float32 below `share` makes that "at least `share`", as `debt` counts it."""
    return float(np.nextafter(np.float32(share), np.float32(0)))


def compact(table: TableHandle, settings: CompactionSettings | None = None) -> CompactionResult:
    """Compact the base when its debt is due (see the module docstring). Raises
    `CommitConflictError` when every attempt lost a commit race (run it again)."""
    settings = settings or CompactionSettings()
    options = table.storage_options or None
    for attempt in range(MAX_ATTEMPTS):
        ds = lance.dataset(table.uri, storage_options=options)
        found = debt(ds, settings)
        if not found.due:
            return CompactionResult(found, 0, 0, 0, 0, ds.version)
        before = _catchup(table, ds.version)
        keep = [f for f in found.fragment_ids if f not in found.candidates]
        try:
            with table.storage.synced_changes(skip=layout.NOT_BASE):
                metrics = ds.optimize.compact_files(
                    target_rows_per_fragment=settings.target_rows_per_fragment,
                    materialize_deletions=True,
                    materialize_deletions_threshold=_lance_threshold(settings.max_deleted_share),
                    defer_index_remap=False,
                    excluded_fragment_ids=keep,
                )
        except lance.commit.CommitConflictError as e:
            log.info("compaction lost a commit race (attempt %d): %s", attempt + 1, e)
        except OSError as e:
            if not any(m in str(e) for m in LOST_RACE):
                raise
            log.info("compaction lost a commit race (attempt %d): %s", attempt + 1, e)
        else:
            _restore_catchup(table, before, ds.version)
            table.refresh()
            return CompactionResult(
                found,
                metrics.fragments_removed,
                metrics.fragments_added,
                metrics.files_removed,
                metrics.files_added,
                table.dataset.version,
            )
        time.sleep(random.uniform(0, min(0.5, 0.01 * 2**attempt)))
    raise CommitConflictError(f"compacting {table.uri}: lost {MAX_ATTEMPTS} commit races in a row")


def _catchup(table: TableHandle, version: int) -> dict[str, dict]:
    found = memwal_index.read_details(table.uri, table.storage_options or None, version)
    return memwal_index.index_catchup(found[0]) if found else {}


def _restore_catchup(table: TableHandle, before: dict[str, dict], committed: int) -> None:
    """Raise each index's catch-up back to `before` (what the compacted version recorded) where the
    compaction commit `committed` or anything since left it lower. A remapped fragment is covered by
    an index exactly when its source fragments were, so those claims still hold. A race with another
    entry writer is retried; one lost `MAX_ATTEMPTS` times leaves the rest to the next catch-up."""
    options = table.storage_options or None
    for attempt in range(MAX_ATTEMPTS):
        ds = lance.dataset(table.uri, storage_options=options)
        found = memwal_index.read_details(table.uri, options, ds.version)
        if found is None:
            return
        details, present = found[0], {d.name for d in ds.describe_indices()}
        now = memwal_index.index_catchup(details)
        lost = {
            name: {r: g for r, g in claim.items() if g > now.get(name, {}).get(r, 0)}
            for name, claim in before.items()
            if name in present
        }
        lost = {name: regions for name, regions in lost.items() if regions}
        if not lost:
            return
        new = pb.MemWalIndexDetails()
        new.CopyFrom(details)
        keep = [p for p in new.index_catchup if p.index_name not in lost]
        new.ClearField("index_catchup")
        new.index_catchup.extend(keep)
        for name, regions in sorted(lost.items()):
            new.index_catchup.append(progress_entry(name, {**now.get(name, {}), **regions}))
        try:
            memwal_index.replace_details(table.uri, new, ds.version, options)
            return
        except CommitConflictError as e:
            log.info("restoring index catch-up after compaction %d lost a race: %s", committed, e)
        time.sleep(random.uniform(0, min(0.5, 0.01 * 2**attempt)))
    log.warning("index catch-up after compaction %d not restored; the next catch-up records it", committed)
