"""Base table index catch-up (spec "Base Table Index Builder"): indexes cover merged generations.

`catch_up_indexes(table)`, for every maintained index on the base table (all of them when the MemWAL
index says `maintain_all_indexes`, else `maintained_indexes` that exist):
1. **rebuilds** it with Lance's `optimize_indices` when the latest base version has fragments its
   `fragment_bitmap`s (the union over the index's segments) do not cover, or when it has more
   segments than upkeep allows; `memwal_df.jobs.index_upkeep` decides whether that optimize adds a
   delta segment, merges the segments into one or retrains a vector index. Lance 14 records
   `index_catchup` by itself in that commit: the `compacted_sstables` of the version the index was
   built from, never more (a build that Lance rebases over a later merge claims only the older one);
2. **records what is missing**: at the latest base version `V`, an index whose bitmaps cover every
   fragment of `V` covers every row merged so far, so its catch-up may claim the merge progress of
   `V` (`merger.merge_progress`; no earlier version recorded more, see `entry_lease`). Regions whose
   claim exceeds the recorded catch-up are raised through `memwal_index.replace_details` (three-way
   merge: concurrent merge progress, configuration and other indexes' catch-up are kept; a
   concurrent change to the same index's catch-up raises `CommitConflictError`). Lance clamps each
   region to its merged generation.
   This covers the cases Lance leaves behind: merges that added no fragments (tombstones only), an
   index built before the merge progress it covers existed, a catch-up commit that lost a race.

Catch-up is never lowered. A recorded generation above the verified claim (the index lacks fragments
of `V` although catch-up says it covers them) is reported in `IndexCatchUp.unverified` and logged.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import lance
import lance.commit

from memwal_df.errors import CommitConflictError
from memwal_df.format import layout, memwal_index
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.jobs import index_upkeep, merger
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings
from memwal_df.read.lsm.cache import described_indices

if TYPE_CHECKING:
    from memwal_df.format.storage import Storage
    from memwal_df.format.table_handle import TableHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexCatchUp:
    """One maintained index after `catch_up_indexes`."""

    name: str
    rebuilt: bool  # `optimize_indices` ran on it
    covers_latest: bool  # its fragment bitmaps cover every fragment of the latest base version
    caught_up: dict[uuid.UUID, int]  # region -> catch-up recorded afterwards
    raised: dict[uuid.UUID, int] = field(default_factory=dict)  # regions this call raised, new values
    unverified: tuple[uuid.UUID, ...] = ()  # regions whose recorded catch-up exceeds the verified claim
    merged_segments: bool = False  # the rebuild merged the index's segments into one
    retrained: bool = False  # the rebuild retrained the (vector) index


@dataclass(frozen=True)
class CatchUpResult:
    """What one `catch_up_indexes` did; `version` is the base version it verified against."""

    indexes: tuple[IndexCatchUp, ...]
    version: int

    @property
    def caught_up(self) -> dict[str, dict[uuid.UUID, int]]:
        """Index name -> region -> the catch-up recorded for it afterwards."""
        return {i.name: i.caught_up for i in self.indexes}


def maintained_index_names(details: pb.MemWalIndexDetails, present: set[str]) -> set[str]:
    """The names among `present` (index names on the base table) the MemWAL index maintains."""
    present = present - {memwal_index.MEMWAL_INDEX_NAME}
    return present if details.maintain_all_indexes else present & set(details.maintained_indexes)


def coverage(ds: lance.LanceDataset) -> dict[str, set[int]]:
    """Index name -> fragment ids its segments cover (union of their `fragment_bitmap`s)."""
    return {d.name: {f for s in d.segments for f in (s.fragment_ids or ())} for d in ds.describe_indices()}


def catch_up_indexes(
    table: TableHandle, rebuild: bool = True, upkeep: IndexUpkeepSettings | None = None
) -> CatchUpResult:
    """Rebuild lagging maintained indexes (`rebuild`, bounded by `upkeep`) and record their
    catch-up; see the module docstring. Raises `CommitConflictError` when a commit loses a race
    (run it again)."""
    options = table.storage_options or None
    ds = lance.dataset(table.uri, storage_options=options)
    found = memwal_index.read_details(table.uri, options, ds.version)
    names = maintained_index_names(found[0], set(coverage(ds))) if found else set()
    rebuilt: dict[str, index_upkeep.Plan] = {}
    if rebuild and names:
        ds = _rebuild(table, ds, names, upkeep or IndexUpkeepSettings(), rebuilt)
    result = _record(table, ds, names, rebuilt)
    table.refresh()
    return result


def _rebuild(
    table: TableHandle,
    ds: lance.LanceDataset,
    names: set[str],
    upkeep: IndexUpkeepSettings,
    rebuilt: dict[str, index_upkeep.Plan],
) -> lance.LanceDataset:
    """Optimize each index of `names` that lacks fragments of `ds` or has too many segments; the
    latest dataset afterwards. What each optimize did goes into `rebuilt`."""
    options = table.storage_options or None
    rows = {f.fragment_id: f.metadata.num_rows for f in ds.get_fragments()}
    records = index_upkeep.read_records(table.storage)
    changed = False
    for name in sorted(names):
        description = next(d for d in described_indices(ds) if d.name == name)
        covered = {f for s in description.segments for f in (s.fragment_ids or ())}
        new_rows = sum(n for f, n in rows.items() if f not in covered)
        record = records.get(name, {})
        plan = index_upkeep.plan(description, new_rows, record, upkeep)
        if not (set(rows) - covered) and not plan.merges_segments:
            continue
        _optimize(table.storage, ds, name, plan.kwargs)
        rebuilt[name] = plan
        ds = lance.dataset(table.uri, storage_options=options)
        after = next((d for d in described_indices(ds) if d.name == name), None)
        rows_after = after.num_rows_indexed if after is not None else 0
        records[name] = index_upkeep.updated(record, description, new_rows, plan, rows_after)
        changed = True
    if changed:
        index_upkeep.write_records(table.storage, records)
    return ds


def _record(
    table: TableHandle, ds: lance.LanceDataset, names: set[str], rebuilt: dict[str, index_upkeep.Plan]
) -> CatchUpResult:
    """Raise the recorded catch-up of `names` to what `ds` (the latest version) verifies."""
    version = ds.version
    found = memwal_index.read_details(table.uri, table.storage_options or None, version)
    if found is None or not names:
        return CatchUpResult((), version)
    details = found[0]
    recorded = memwal_index.index_catchup(details)
    covered, frags = coverage(ds), _fragment_ids(ds)
    claim = merger.merge_progress(table.storage, version=version)
    out = []
    for name in sorted(names):
        old = recorded.get(name, {})
        full = frags <= covered.get(name, set())
        verified = claim if full else {}
        raised = {r: g for r, g in verified.items() if g > old.get(r, 0)}
        unverified = tuple(sorted(r for r, g in old.items() if full and g > verified.get(r, 0)))
        if unverified:
            log.warning("index %s: recorded catch-up above its coverage for regions %s", name, unverified)
        plan = rebuilt.get(name)
        out.append(
            IndexCatchUp(
                name,
                plan is not None,
                full,
                {**old, **raised},
                raised,
                unverified,
                merged_segments=plan is not None and plan.merges_segments,
                retrained=plan is not None and plan.retrains,
            )
        )
    if any(v.raised for v in out):
        new = pb.MemWalIndexDetails()
        new.CopyFrom(details)
        keep = [p for p in new.index_catchup if p.index_name not in {v.name for v in out if v.raised}]
        new.ClearField("index_catchup")
        new.index_catchup.extend(keep)
        for v in out:
            if v.raised:
                new.index_catchup.append(progress_entry(v.name, v.caught_up))
        version = memwal_index.replace_details(table.uri, new, version, table.storage_options or None)
    return CatchUpResult(tuple(out), version)


def progress_entry(name: str, per_region: dict[uuid.UUID, int]) -> pb.IndexCatchupProgress:
    """An `index_catchup` entry: index `name` covers, per region, the generations up to the value."""
    p = pb.IndexCatchupProgress(index_name=name)
    for region, gen in sorted(per_region.items()):
        p.caught_up_generations.add(shard_id=pb.UUID(uuid=region.bytes), generation=gen)
    return p


def _fragment_ids(ds: lance.LanceDataset) -> set[int]:
    return {f.fragment_id for f in ds.get_fragments()}


def _optimize(storage: Storage, ds: lance.LanceDataset, name: str, kwargs: dict[str, object]) -> None:
    """Lance's `optimize_indices` of one index, durable when it returns."""
    try:
        with storage.synced_changes(skip=layout.NOT_BASE):
            ds.optimize.optimize_indices(index_names=[name], **kwargs)
    except lance.commit.CommitConflictError as e:
        raise CommitConflictError(f"rebuilding index {name} lost a commit race: {e}") from e
    except OSError as e:
        if any(m in str(e) for m in merger.LOST_RACE):
            raise CommitConflictError(f"rebuilding index {name} lost a commit race: {e}") from e
        raise
