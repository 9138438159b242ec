"""The query planner: from a read snapshot and the pushed filter to one operator tree per partition.

Scan plan (spec "Query Planning"): region pruning from the filter through each region-spec transform's
`project`, then one `DeduplicateExec` per remaining region with levels, and the base table split into
partitions of Lance fragments, each an `AntiJoinScanExec` that drops keys held by any newer level.
The key set of the newer levels is built once per query, on first use, and shared by the partitions.

Guarantees: the union of the partitions' outputs is exactly the live newest rows matching the filter,
each key once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from memwal_df.exec.base import ExecNode
from memwal_df.exec.dedup import AntiJoinScanExec, DeduplicateExec
from memwal_df.exec.keyset import KeySet
from memwal_df.exec.union import UnionExec
from memwal_df.region_spec import RegionSpec
from memwal_df.snapshot import ReadSnapshot, RegionLevels

MakeNode = Callable[[Sequence[str]], ExecNode]


@dataclass
class Partition:
    """One DataFusion partition: builds its operator tree for the projected columns."""

    label: str
    make: MakeNode


class _SharedKeys:
    """The keys of every level of the given regions, computed once (thread-safe) when first needed."""

    def __init__(self, regions: list[RegionLevels], primary_key: Sequence[str], key_type: Any) -> None:
        self._regions = regions
        self._pk = list(primary_key)
        self._type = key_type
        self._lock = threading.Lock()
        self._keys: KeySet | None = None

    def __call__(self) -> KeySet:
        with self._lock:
            if self._keys is None:
                parts = [k for r in self._regions for lv in r.levels if (k := lv.keys(self._pk)) is not None]
                self._keys = KeySet.union(parts, self._type)
            return self._keys


def key_type(snapshot: ReadSnapshot) -> Any:
    """The Arrow type of a key array (the column's type, or binary for composite keys)."""
    pk = snapshot.schema.primary_key
    return snapshot.schema.schema.field(pk[0]).type if len(pk) == 1 else pa.binary()


def prune_regions(
    snapshot: ReadSnapshot, specs: dict[int, RegionSpec], column_predicates: dict[str, list[Any]]
) -> list[RegionLevels]:
    """The regions whose region values may match the predicates (all of them when nothing prunes)."""
    if not column_predicates:
        return list(snapshot.regions)
    kept = []
    field_ids = snapshot.schema.field_ids
    for region in snapshot.regions:
        spec = specs.get(region.spec_id)
        if spec is None or region.values is None:
            kept.append(region)
            continue
        if spec.prune([region.values], column_predicates, field_ids):
            kept.append(region)
    return kept


def plan_scan(
    snapshot: ReadSnapshot,
    specs: dict[int, RegionSpec],
    filter: Any,
    column_predicates: dict[str, list[Any]],
    partitions: int | None = None,
) -> list[Partition]:
    """Partitions of a scan: one per region with unmerged levels, then the base table's fragments."""
    pk = snapshot.schema.primary_key
    ktype = key_type(snapshot)
    regions = [r for r in prune_regions(snapshot, specs, column_predicates) if r.levels]
    shadow = _SharedKeys(regions, pk, ktype)
    out = [
        Partition(
            f"region {r.region_id}",
            lambda cols, r=r: DeduplicateExec(r, pk, ktype, cols, filter, snapshot.schema.schema),
        )
        for r in regions
    ]
    fragment_ids = [f.fragment_id for f in snapshot.base.get_fragments()]
    n = max(1, min(len(fragment_ids), partitions or (os.cpu_count() or 1)))
    for i in range(n):
        ids = fragment_ids[i::n]
        if ids:
            out.append(
                Partition(
                    f"base fragments {ids}",
                    lambda cols, ids=ids: AntiJoinScanExec(snapshot.base, ids, pk, cols, filter, shadow),
                )
            )
    if not out:  # DataFusion's plans need at least one partition (a sort over none is rejected)
        out.append(Partition("no rows (no base fragment, no unmerged level)", lambda cols: UnionExec([])))
    return out
