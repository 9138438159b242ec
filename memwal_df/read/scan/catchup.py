"""Index catch-up aware scan planning (spec "Indexed Read Plan" and Appendix 4).

A base scalar index is rebuilt after merges, asynchronously. Until then the base fragments written by
the merges since the index was built are not covered by it, and a filtered scan would read them
without an index. Those fragments hold nothing but the rows of the generations merged in that gap,
which are still on storage (GC keeps them until every maintained index caught up), so a scan can read
those generations, as levels, instead of the fragments: `index_coverage` decides whether that is
exact for one query and returns the plan, or the reason it is not.

Proof, from what Lance records itself, for an index whose segments cover the fragments `C` and were
built from base version `V` (the largest `dataset_version` of its segments), read at base version `B`:

1. The index is maintained (`maintain_all_indexes` or listed in `maintained_indexes`).
2. `index_catchup[index]` equals `compacted_sstables` at `V`, region by region (a missing entry or
   region is generation 0). Lance records exactly that when it commits an index. The gap of region r
   is then `(index_catchup[index][r], compacted_sstables[r] at B]`.
3. Every commit in `(V, B]` is a `CreateIndex`, a `Delete`, or an `Update` in `rewrite_rows` mode
   that modifies no column in place; an `Update` that adds fragments also advances
   `compacted_sstables` (a merge commit: its rows are those of a gap generation).
4. No fragment outside `C` existed at `V`.
5. Every gap generation is listed and on storage, and the live rows of the fragments outside `C`
   (from the manifest's deletion counts) number exactly the keys whose newest gap version is live.

By 3 and 4, the fragments outside `C` received rows only from merges of gap generations (each merge
also deletes the older copy of every key it writes), so they hold at most the newest live gap row of
each key, and deletions are the only way they can hold fewer; 5 rules that out. Deduplication stays
exact: gap generations are older than every unmerged level and newer than what `C` holds.

The plan is used only when every gap generation has a scalar index on the column too (spec: the gap
is read "through the flushed MemTables' pre-built indexes"; both Lance's writer and memwal_df's build
the maintained indexes into a generation, `memwal_df.format.maintained_indexes`): a generation without one
is scanned whole, which costs more than scanning the fragments it stands in for. Even with a btree
in every gap generation a selective filter can cost more than the plain plan: each generation costs
two Lance reads (rows, keys for deduplication), which can be more than the uncovered fragments cost
to scan. The plan pays off when those fragments are large against the number of gap
generations; there is no cost model choosing between the two yet.

Anything else (an index with no recorded catch-up, an append or compaction since the index was built,
a collected gap generation, ...) falls back to the plain plan, and `explain` says why. Proofs are
cached per (base version, index segments): everything they depend on is immutable.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import cast

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import MemWalError
from memwal_df.format import memwal_index
from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.lsm.cache import ImmutableCache, described_indices
from memwal_df.read.lsm.keys import key_array
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.read.lsm.snapshot import ReadSnapshot
from memwal_df.read.scan.spans import id_ranges

__all__ = ["SCALAR_INDEX_TYPES", "CatchupPlan", "Coverage", "index_coverage"]

SCALAR_INDEX_TYPES = frozenset({"BTree", "Bitmap"})
"""Index types (`describe_indices().index_type`) whose coverage decides a filtered scan's plan."""

_DATA_NEUTRAL_OPS = frozenset({"CreateIndex", "Delete"})


@dataclass(frozen=True)
class CatchupPlan:
    """Read the base through `index` on `scanned` only; `gap` (per region, newest first) stands in
    for `skipped`, which holds exactly the newest live rows of those generations."""

    index: str
    scanned: list[int]
    skipped: list[int]
    gap: dict[uuid.UUID, list[GenerationLevel]]


@dataclass(frozen=True)
class Coverage:
    """How a filtered scan reads the base: `plan` when a catch-up plan applies, and a one-line note."""

    plan: CatchupPlan | None
    note: str


@dataclass(frozen=True)
class _Index:
    name: str
    column: str
    covered: frozenset[int]
    built_from: int  # V: the base version the newest segment was built from
    segments: tuple[str, ...]


@dataclass(frozen=True)
class _Proof:
    gap: dict[uuid.UUID, tuple[int, int]] | None  # region -> (caught up, merged); None: not provable
    reason: str


# Keyed by (base URI, what): a base version's commit and what follows from it never change.
_FACTS = ImmutableCache(8192)


def index_coverage(snapshot: ReadSnapshot, columns: Iterable[str], vector: bool = False) -> Coverage | None:
    """The base read for a scan filtered on `columns` (its top-level predicates): a catch-up plan
    when a scalar index on one of them is behind and the plan is provably exact, else the plain plan
    with the reason (None when no scalar index on those columns exists).

    `vector`: the same for a vector search on `columns` through the base's vector index. Its gap
    generations need no index of their own (a search reads them through their vector index or
    exactly, never more than the fragments they stand in for)."""
    wanted = set(columns)
    indexes = [i for i in _indexes(snapshot.base, vector) if i.column in wanted]
    if not indexes:
        return None
    fragments = {f.fragment_id: f for f in snapshot.base.get_fragments()}
    notes = []
    for index in indexes:
        unindexed = sorted(set(fragments) - index.covered)
        if not unindexed:
            return Coverage(None, f"{index.name} covers every base fragment")
        what = f"catch-up proof at v{snapshot.base.version} for {index.segments}"
        proof: _Proof = _FACTS.get(
            snapshot.base.uri, what, partial(_prove_or_explain, snapshot, index, unindexed)
        )
        if proof.gap is None:
            notes.append(f"{index.name} does not cover fragments {id_ranges(unindexed)} ({proof.reason})")
            continue
        gap = _gap_levels(snapshot, proof.gap)
        if (missing := _missing(gap, proof.gap)) is not None:  # collected since the proof was cached
            notes.append(f"{index.name} does not cover fragments {id_ranges(unindexed)} ({missing})")
            continue
        if not vector and (plain := _unindexed(gap, index.column)) is not None:
            notes.append(f"{index.name} does not cover fragments {id_ranges(unindexed)} ({plain})")
            continue
        scanned = sorted(set(fragments) & index.covered)
        plan = CatchupPlan(index.name, scanned, unindexed, gap)
        return Coverage(plan, f"{index.name} is behind: {proof.reason}")
    return Coverage(None, "; ".join(notes) + ": plain plan")


def _indexes(base: lance.LanceDataset, vector: bool) -> list[_Index]:
    """The base's scalar (or vector) indexes on one column, by name (all segments of an index
    together)."""
    out = []
    for d in sorted(described_indices(base), key=lambda d: d.name):
        kind_fits = ("VectorIndexDetails" in d.type_url) if vector else d.index_type in SCALAR_INDEX_TYPES
        if not kind_fits or len(d.field_names) != 1 or not d.segments:
            continue
        covered = frozenset(int(f) for s in d.segments for f in s.fragment_ids)
        built = max(int(s.dataset_version_at_last_update) for s in d.segments)
        uuids = tuple(sorted(str(s.uuid) for s in d.segments))
        out.append(_Index(d.name, d.field_names[0], covered, built, uuids))
    return out


def _prove_or_explain(snapshot: ReadSnapshot, index: _Index, unindexed: list[int]) -> _Proof:
    try:
        return _prove(snapshot, index, unindexed)
    except (MemWalError, OSError, ValueError) as e:  # e.g. versions since the index was built cleaned up
        return _Proof(None, f"the base history since v{index.built_from} cannot be read: {e}")


def _prove(snapshot: ReadSnapshot, index: _Index, unindexed: list[int]) -> _Proof:
    """Steps 1-5 of the module docstring."""
    details = snapshot.details
    if not (details.maintain_all_indexes or index.name in details.maintained_indexes):
        return _Proof(None, "not a maintained index: its gap generations may be collected")
    caught_up = memwal_index.index_catchup(details).get(index.name, {})
    built_from = _merged_at(snapshot, index.built_from)
    if any(caught_up.get(r, 0) != built_from.get(r, 0) for r in {*caught_up, *built_from}):
        return _Proof(None, f"its recorded catch-up is not the merge progress at v{index.built_from}")
    merged = memwal_index.merged_generations(details)
    gap = {r: (caught_up.get(r, 0), g) for r, g in merged.items() if g > caught_up.get(r, 0)}
    if not gap:
        return _Proof(None, "no generation was merged since it was built")
    for version in range(index.built_from + 1, snapshot.base.version + 1):
        problem = _FACTS.get(
            snapshot.base.uri, f"commit v{version}", partial(_check_commit, snapshot, version)
        )
        if problem:
            return _Proof(None, problem)
    at_build = {f.fragment_id for f in snapshot.base.checkout_version(index.built_from).get_fragments()}
    if old := sorted(at_build.intersection(unindexed)):
        return _Proof(None, f"fragments {id_ranges(old)} existed when it was built")
    levels = _gap_levels(snapshot, gap)
    if (missing := _missing(levels, gap)) is not None:
        return _Proof(None, missing)
    # the unindexed ids are fragments of this very dataset version: each one is there
    held = sum(cast(lance.LanceFragment, snapshot.base.get_fragment(i)).count_rows() for i in unindexed)
    counts = [_newest_live(lvs, snapshot.schema.primary_key) for lvs in levels.values()]
    if None in counts:
        return _Proof(None, "a gap generation vanished while the plan was checked")
    live = sum(c for c in counts if c is not None)
    if held != live:
        return _Proof(None, f"they hold {held} live rows, the gap generations {live}")
    spans = ", ".join(f"{str(r)[:8]}\u2026 ({lo}, {hi}]" for r, (lo, hi) in sorted(gap.items()))
    return _Proof(gap, f"generations {spans} read instead of fragments {id_ranges(unindexed)}")


def _merged_at(snapshot: ReadSnapshot, version: int) -> dict[uuid.UUID, int]:
    """`compacted_sstables` at a base version ({} when that version has no MemWAL index)."""
    found = memwal_index.read_details(snapshot.storage.uri, snapshot.storage.storage_options or None, version)
    return {} if found is None else memwal_index.merged_generations(found[0])


def _check_commit(snapshot: ReadSnapshot, version: int) -> str:
    """Why the commit of `version` may have put rows into the base that no gap generation holds
    ("" when it cannot have: step 3)."""
    tx = snapshot.base.read_transaction(version)
    if tx is None:
        return f"v{version} has no transaction file"
    op = tx.operation
    kind = type(op).__name__
    if kind in _DATA_NEUTRAL_OPS:
        return ""
    if kind != "Update":
        return f"v{version} is a {kind} commit"
    op = cast(lance.LanceOperation.Update, op)
    if op.update_mode != "rewrite_rows" or op.fields_modified:
        return f"v{version} rewrites columns in place"
    if not op.new_fragments:
        return ""  # deletions only
    before, after = _merged_at(snapshot, version - 1), _merged_at(snapshot, version)
    if not any(g > before.get(r, 0) for r, g in after.items()):
        return f"v{version} adds rows without merging a generation"
    return ""


def _gap_levels(
    snapshot: ReadSnapshot, gap: dict[uuid.UUID, tuple[int, int]]
) -> dict[uuid.UUID, list[GenerationLevel]]:
    """The snapshot's Level objects of each region's gap generations, newest first."""
    regions = {r.region_id: r for r in snapshot.regions}
    out = {}
    for region_id, (lo, hi) in gap.items():
        region = regions.get(region_id)
        listed = [] if region is None else region.merged
        out[region_id] = [lv for lv in listed if lo < lv.generation <= hi]
    return out


def _missing(
    levels: dict[uuid.UUID, list[GenerationLevel]], gap: dict[uuid.UUID, tuple[int, int]]
) -> str | None:
    """Why some gap generation cannot be read, or None."""
    for region_id, (lo, hi) in gap.items():
        gens = {lv.generation for lv in levels[region_id]}
        if absent := [g for g in range(lo + 1, hi + 1) if g not in gens]:
            return f"generations {absent} of region {str(region_id)[:8]}\u2026 are not listed"
        for lv in levels[region_id]:
            if lv.dataset() is None:
                return f"{lv.name} was garbage-collected"
    return None


def _unindexed(levels: dict[uuid.UUID, list[GenerationLevel]], column: str) -> str | None:
    """Why reading the gap generations would cost more than scanning the fragments they stand in for
    (a generation without a scalar index on `column` is scanned whole, like those fragments, and
    deduplicated on top), or None."""
    for region_levels in levels.values():
        for level in region_levels:
            if column not in level.cached("scalar index columns", partial(_indexed_columns, level)):
                return f"{level.name} has no index on {column}: the fragments are cheaper to scan"
    return None


def _indexed_columns(level: GenerationLevel) -> frozenset[str]:
    ds = level.dataset()
    if ds is None:
        return frozenset()
    return frozenset(
        d.field_names[0]
        for d in ds.describe_indices()
        if d.index_type in SCALAR_INDEX_TYPES and len(d.field_names) == 1
    )


def _newest_live(levels: list[GenerationLevel], primary_key: Sequence[str]) -> int | None:
    """How many keys have a live newest version among `levels` (newest first); None if one is gone.
    Records each level's key set on the level, for the scan that follows. A level's keys and
    tombstone flags are read once per process (a generation never changes), and the newest version
    of each key is found in one hash aggregation over all the levels."""
    name = f"keys and tombstones:{','.join(primary_key)}"
    keys, live = [], []
    for level in levels:
        rows = level.cached(name, partial(level.to_table, [*primary_key, TOMBSTONE]), _nbytes)
        if rows is None:
            return None
        level_keys = key_array([rows.column(c) for c in primary_key])
        level.set_keys(level_keys)
        keys.append(level_keys)
        live.append(~pc.fill_null(rows.column(TOMBSTONE), False).to_numpy(zero_copy_only=False).astype(bool))
    total = sum(len(k) for k in keys)
    if total == 0:
        return 0
    at = pa.table({"key": pa.chunked_array(keys), "at": np.arange(total, dtype=np.int64)})
    newest = at.group_by("key", use_threads=False).aggregate([("at", "min")]).column("at_min").to_numpy()
    return int(np.count_nonzero(np.concatenate(live)[newest]))


def _nbytes(rows: pa.Table | None) -> int:
    return 0 if rows is None else rows.nbytes
