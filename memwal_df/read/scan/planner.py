"""The scan planner: from a read snapshot and the pushed filter to one operator tree per partition.

Scan plan (spec "Query Planning"): region pruning from the filter through each region-spec transform's
`project`, then one `DeduplicateExec` per remaining region with levels, and the base table cut into
one `_rowaddr` span per core (a large fragment is split across spans, so one big base fragment is
still read in parallel), each an `AntiJoinScanExec` that drops keys held by any newer level.
The key set of the newer levels is built once per query, on first use, from the same per-region
`LevelKeys` the `DeduplicateExec`s grow, and shared by the partitions.

Indexed read plan (spec "Indexed Read Plan"): when the filter constrains a column that has a base
scalar index and the index is behind the merges, `memwal_df.read.scan.catchup` may prove that the fragments it
does not cover hold exactly the newest rows of the generations merged since; those generations are
then read as the oldest levels of their regions and the fragments are not scanned.

Guarantees: the union of the partitions' outputs is exactly the live newest rows matching the filter,
each key once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from memwal_df.format.regions.spec import RegionSpec
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.union import UnionExec
from memwal_df.read.lsm.base_key_index import indexable
from memwal_df.read.lsm.keys import KeySet
from memwal_df.read.lsm.snapshot import ReadSnapshot, RegionLevels, UnreadableRegion
from memwal_df.read.scan.anti_join_scan import AntiJoinScanExec
from memwal_df.read.scan.catchup import Coverage, index_coverage
from memwal_df.read.scan.dedup import DeduplicateExec, LevelKeys
from memwal_df.read.scan.masked_scan import MaskedScanExec, fragment_rows
from memwal_df.read.scan.region_rows import RegionRowsExec
from memwal_df.read.scan.region_view import ViewShape
from memwal_df.read.scan.spans import BaseSpan, base_spans
from memwal_df.read.scan.state import ScanState, scannable

MakeNode = Callable[[Sequence[str]], ExecNode]

MIN_SPAN_ROWS = 65_536
"""Base partitions are not cut smaller: every Lance scan has a fixed cost to start."""


@dataclass
class Partition:
    """One DataFusion partition: builds its operator tree for the projected columns."""

    label: str
    make: MakeNode


class _SharedKeys:
    """The keys of every level of the given regions, computed once (thread-safe) when first needed."""

    def __init__(self, regions: list[LevelKeys], key_type: Any) -> None:
        self._regions = regions
        self._type = key_type
        self._lock = threading.Lock()
        self._keys: KeySet | None = None

    def __call__(self) -> KeySet:
        with self._lock:
            if self._keys is None:
                self._keys = KeySet.merge([r.all() for r in self._regions], self._type)
            return self._keys


def key_type(snapshot: ReadSnapshot) -> Any:
    """The Arrow type of a key array (the column's type, or binary for composite keys)."""
    pk = snapshot.schema.primary_key
    return snapshot.schema.schema.field(pk[0]).type if len(pk) == 1 else pa.binary()


def prune_regions(
    snapshot: ReadSnapshot, specs: dict[int, RegionSpec], column_predicates: dict[str, list[Any]]
) -> list[RegionLevels]:
    """The regions whose region values may match the predicates (all of them when nothing prunes).
    Raises the `CorruptManifestError` of an unreadable region the predicates do not prune."""
    field_ids = snapshot.schema.field_ids

    def may_match(region: RegionLevels | UnreadableRegion) -> bool:
        spec = specs.get(region.spec_id)
        if not column_predicates or spec is None or region.values is None:
            return True
        return bool(spec.prune([region.values], column_predicates, field_ids))

    snapshot.require_readable([r for r in snapshot.unreadable if may_match(r)])
    return [r for r in snapshot.regions if may_match(r)]


def plan_scan(
    snapshot: ReadSnapshot,
    specs: dict[int, RegionSpec],
    filter: Any,
    column_predicates: dict[str, list[Any]],
    partitions: int | None = None,
    one_region_partition: bool = True,
) -> list[Partition]:
    """Partitions of a scan: the regions with levels to read (one partition for all of them when
    `one_region_partition` and their rows are read from region views, else one each), then up to
    `partitions` (default: one per core) spans of the base table's rows."""
    pk = snapshot.schema.primary_key
    ktype = key_type(snapshot)
    coverage = index_coverage(snapshot, column_predicates) if column_predicates else None
    plan = coverage.plan if coverage is not None else None
    pruned = prune_regions(snapshot, specs, column_predicates)
    if plan is None and all(scannable(r) for r in pruned):
        return _plan_view_scan(snapshot, pruned, filter, partitions, _note(coverage), one_region_partition)
    gap = plan.gap if plan is not None else {}
    regions = [replace(r, levels=[*r.levels, *gap.get(r.region_id, [])]) for r in pruned]
    keys = [LevelKeys(r, pk, ktype) for r in regions if r.levels]
    shadow = _SharedKeys(keys, ktype)
    index = plan.index if plan is not None else ""

    def region_scan(k: LevelKeys) -> MakeNode:
        return lambda cols: DeduplicateExec(
            k, cols, filter, snapshot.schema.schema, len(gap.get(k.region.region_id, [])), index
        )

    out = [Partition(f"region {k.region.region_id}", region_scan(k)) for k in keys]
    scanned = None if plan is None else set(plan.scanned)
    fragments = [
        (f.fragment_id, f.metadata.physical_rows)
        for f in snapshot.base.get_fragments()
        if scanned is None or f.fragment_id in scanned
    ]
    note = _note(coverage)

    def base_scan(span: BaseSpan) -> MakeNode:
        return lambda cols: AntiJoinScanExec(snapshot.base, span, pk, cols, filter, shadow, note)

    for span in base_spans(fragments, partitions or (os.cpu_count() or 1), MIN_SPAN_ROWS):
        out.append(Partition(f"base {span.describe()}", base_scan(span)))
    if not out:  # DataFusion's plans need at least one partition (a sort over none is rejected)
        out.append(Partition("no rows (no base fragment, no unmerged level)", lambda cols: UnionExec([])))
    return out


def _plan_view_scan(
    snapshot: ReadSnapshot,
    regions: list[RegionLevels],
    filter: Any,
    partitions: int | None,
    note: str,
    one_region_partition: bool,
) -> list[Partition]:
    """The scan from region views and the base key index: one `RegionRowsExec` per region with levels,
    then the base cut into spans, each a `MaskedScanExec` (see `memwal_df.read.scan.state`)."""
    shape = ViewShape.of(snapshot.schema.schema, snapshot.schema.primary_key, key_type(snapshot))
    state = ScanState(snapshot, [r for r in regions if r.levels], shape)

    def region_scan(region: RegionLevels, cols: Sequence[str]) -> ExecNode:
        return RegionRowsExec(str(region.region_id), lambda: state.region(region), cols, filter)

    # The regions' rows are in memory: in one process, one partition reads them all (a partition
    # costs DataFusion a round trip into Python; a region's rows take less than that to filter).
    out = []
    if one_region_partition and state.regions:
        label = f"regions {', '.join(str(r.region_id)[:8] for r in state.regions)}"
        out.append(Partition(label, lambda cols: UnionExec([region_scan(r, cols) for r in state.regions])))
    elif state.regions:
        out += [Partition(f"region {r.region_id}", _region_partition(region_scan, r)) for r in state.regions]
    indexed = indexable(snapshot.base)  # else the keys newer levels hold are dropped by comparing keys
    live = indexed and filter is None  # Lance applies offset and limit after a filter: `_rowaddr` then
    fragments = list(fragment_rows(snapshot.base, live).items())
    pk = snapshot.schema.primary_key

    def base_scan(span: BaseSpan, first: bool) -> MakeNode:
        if not indexed:
            return lambda cols: AntiJoinScanExec(
                snapshot.base, span, pk, cols, filter, state.shadow_keys, note
            )
        return lambda cols: MaskedScanExec(
            snapshot.base,
            span,
            cols,
            filter,
            state.shadow,
            live=live,
            counts_all=first,
            note=note,
            storage=snapshot.storage,
        )

    spans = base_spans(fragments, partitions or (os.cpu_count() or 1), MIN_SPAN_ROWS)
    for i, span in enumerate(spans):
        out.append(Partition(f"base {span.describe()}", base_scan(span, i == 0)))
    if not out:
        out.append(Partition("no rows (no base fragment, no unmerged level)", lambda cols: UnionExec([])))
    return out


def _region_partition(
    scan: Callable[[RegionLevels, Sequence[str]], ExecNode], region: RegionLevels
) -> MakeNode:
    return lambda cols: scan(region, cols)


def _note(coverage: Coverage | None) -> str:
    if coverage is None:
        return ""
    if coverage.plan is None:
        return coverage.note
    return f"{coverage.plan.index} covers these; {coverage.note}"
