"""Search planning: `vector_search` and `fts` over every level of a MemWAL table.

One plan per query, on one read snapshot (the table's consistency mode, plus its writer's MemTables):

    TopKExec: k, order_by=[_distance ASC]          TopKExec: k, order_by=[_score DESC]
      FilterStaleExec: newer=[every level]           GlobalBM25Exec: corpus = live rows of every level
        LanceKnnExec: base                             Bm25Exec: base, live = not in [every level]
      FilterStaleExec: newer=[levels above]            Bm25Exec: region r gen g, live = not in [above]
        BruteForceKnnExec: region r gen g              ...
      BruteForceKnnExec: newest level of region r

Region pruning: regions whose values cannot match the `filter` option are not read (the scan
planner's `prune_regions`). Options arrive as a dict (SQL `named_struct`); unknown names, wrong
types and out-of-range values raise `InvalidConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidConfigError
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.expr.predicate import column_predicates
from memwal_df.read.expr.sql_text import parse_filter
from memwal_df.read.lsm.cache import described_indices
from memwal_df.read.lsm.labels import short_id
from memwal_df.read.lsm.levels import GenerationLevel, Level, MemTableLevel
from memwal_df.read.lsm.snapshot import ReadSnapshot, RegionLevels
from memwal_df.read.scan.catchup import index_coverage
from memwal_df.read.scan.planner import key_type, prune_regions
from memwal_df.read.search.filter_stale import FilterStaleExec
from memwal_df.read.search.fts.bm25 import Bm25Exec
from memwal_df.read.search.fts.global_bm25 import GlobalBM25Exec
from memwal_df.read.search.fts.terms import FtsQuery
from memwal_df.read.search.ranked import RankedExec, TopKExec
from memwal_df.read.search.staleness import NewerLevels
from memwal_df.read.search.vector.brute_force_knn import BruteForceKnnExec
from memwal_df.read.search.vector.lance_knn import LanceKnnExec
from memwal_df.read.search.vector.vectors import DISTANCE, METRICS, KnnQuery, ShadowedLevel, query_vector

__all__ = ["SearchOptions", "Searched", "plan_fts", "plan_vector_search"]


class Searched(Protocol):
    """What a search reads: a table's schema, its region specs and a read snapshot of its levels
    (`MemWalTable` is one)."""

    @property
    def schema(self) -> pa.Schema: ...

    @property
    def specs(self) -> dict[int, RegionSpec]: ...

    def read_snapshot(self) -> ReadSnapshot: ...

OVERFETCH = 2
# Generations of at least this many rows are searched through their own vector index (Lance's
# `nearest`, a fixed cost per call), smaller ones by brute force over their in-memory vectors (a
# cost per row): the two cost about the same a little above this size.
INDEXED_GENERATION_ROWS = 500_000


@dataclass(frozen=True)
class SearchOptions:
    """`nprobes`, `refine_factor`, `metric` (vector search only) and `filter` (SQL text, both)."""

    nprobes: int | None = None
    refine_factor: int | None = None
    metric: str | None = None
    filter: str | None = None

    @classmethod
    def parse(
        cls, options: Mapping[str, Any] | None, function: str, allowed: frozenset[str]
    ) -> SearchOptions:
        options = dict(options or {})
        unknown = set(options) - allowed
        if unknown:
            raise InvalidConfigError(
                f"{function}: unknown option(s) {sorted(unknown)}; expected {sorted(allowed)}"
            )
        for f in fields(cls):
            value = options.get(f.name)
            if value is None:
                continue
            if f.name in ("nprobes", "refine_factor"):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidConfigError(
                        f"{function}: {f.name} must be a positive integer, not {value!r}"
                    )
            elif not isinstance(value, str):
                raise InvalidConfigError(f"{function}: {f.name} must be a string, not {value!r}")
        if options.get("metric") is not None and options["metric"].lower() not in METRICS:
            raise InvalidConfigError(
                f"{function}: unknown metric {options['metric']!r}; expected one of {METRICS}"
            )
        return cls(**options)

    def filter_expression(self, schema: pa.Schema) -> pc.Expression | None:
        """The filter as an expression over `schema` (the table's); `InvalidFilterError` (an
        `InvalidConfigError`) when it does not parse, names an unknown column or compares a column
        with a value of another type."""
        return parse_filter(self.filter, schema) if self.filter else None


VECTOR_OPTIONS = frozenset({"nprobes", "refine_factor", "metric", "filter"})
FTS_OPTIONS = frozenset({"filter"})


def _check_k(k: Any, function: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidConfigError(f"{function}: k must be a positive integer, not {k!r}")
    return k


@dataclass
class _Setup:
    snapshot: ReadSnapshot
    regions: list[RegionLevels]
    filter: pc.Expression | None

    def newer(self, levels: Sequence[Level]) -> NewerLevels:
        return NewerLevels(levels, self.snapshot.schema.primary_key, key_type(self.snapshot))

    @property
    def primary_key(self) -> list[str]:
        return list(self.snapshot.schema.primary_key)

    @property
    def every_level(self) -> list[Level]:
        """The levels of the regions read (after pruning)."""
        return [lv for r in self.regions for lv in r.levels]

    @property
    def all_levels(self) -> list[Level]:
        """The levels of every region, pruned or not (raises the error of an unreadable region)."""
        return self.snapshot.levels


def _setup(table: Searched, options: SearchOptions) -> _Setup:
    flt = options.filter_expression(table.schema)
    snapshot = table.read_snapshot()
    regions = list(prune_regions(snapshot, table.specs, column_predicates(flt)))
    return _Setup(snapshot, regions, flt)


def _index_details(base: lance.LanceDataset, column: str, kind: str) -> dict[str, Any] | None:
    """The details of the base's index of `kind` (`vector` / `inverted`) on `column`, if any."""
    for index in described_indices(base):
        if list(index.field_names) != [column]:
            continue
        is_vector = "VectorIndexDetails" in index.type_url
        if (kind == "vector") == is_vector and (is_vector or index.index_type.lower() == kind):
            return dict(index.details or {})
    return None


def _stale_filtered(arm: RankedExec, newer: NewerLevels) -> RankedExec:
    return FilterStaleExec(arm, newer, OVERFETCH) if newer.levels else arm


def plan_vector_search(
    table: Searched,
    column: str,
    query: Any,
    k: int,
    options: Mapping[str, Any] | None = None,
    *,
    indexed_generation_rows: int = INDEXED_GENERATION_ROWS,
) -> ExecNode:
    """The plan of `vector_search`: the `k` rows nearest to `query` among the live, newest rows that
    match the filter, with the table's columns and `_distance`, nearest first.

    Exact on every level but the base and the generations of at least `indexed_generation_rows`
    rows that have the maintained vector index, whose candidates are Lance's (IVF with `nprobes`);
    with an index the distances are refined (`refine_factor`, default 1) so that distances are
    exact and comparable across levels. When the base index is behind on catch-up and
    `memwal_df.read.scan.catchup` proves the plan exact, the base is searched over the fragments its index
    covers only and the gap generations (merged since the index was built) stand in for the others,
    searched like unmerged generations."""
    opts = SearchOptions.parse(options, "vector_search", VECTOR_OPTIONS)
    k = _check_k(k, "vector_search")
    schema = table.schema
    q = query_vector(schema, column, query)
    s = _setup(table, opts)
    base = s.snapshot.base
    index = _index_details(base, column, "vector")
    metric = (opts.metric or (index or {}).get("metric_type") or "l2").lower()
    refine = opts.refine_factor if opts.refine_factor is not None else (1 if index else None)
    coverage = index_coverage(s.snapshot, [column], vector=True) if index else None
    gap = coverage.plan.gap if coverage is not None and coverage.plan is not None else {}
    knn = KnnQuery(column, q, metric, k, s.filter, schema, tuple(s.primary_key))

    def indexed_knn(level: Level, ds: lance.LanceDataset, merged: bool) -> RankedExec:
        where = f"generation {level.generation} of region {short_id(level.region_id)}"
        where = f"merged {where}" if merged else where
        return LanceKnnExec(ds, knn, opts.nprobes, refine or 1, where)

    arms: list[RankedExec] = []
    if base.get_fragments():
        catchup = coverage.note if coverage is not None else None
        arm = LanceKnnExec(base, knn, opts.nprobes, refine, catchup=catchup, indexed_only=bool(gap))
        arms.append(_stale_filtered(arm, s.newer(s.every_level)))
    # The generations searched by brute force, of every region read, as one arm: the rows a newer
    # generation of the region replaces are masked, the MemTables are checked by FilterStaleExec.
    generations: list[ShadowedLevel] = []
    memtables: list[Level] = []
    for region in s.regions:
        # Newest first: the region's unmerged levels, then its gap generations (merged, not indexed).
        levels = region.levels + gap.get(region.region_id, [])
        for i, lv in enumerate(levels):
            merged = i >= len(region.levels)
            if isinstance(lv, MemTableLevel):
                memtables.append(lv)
                arms.append(_stale_filtered(BruteForceKnnExec([ShadowedLevel(lv)], knn), s.newer(levels[:i])))
            elif (ds := _indexed_generation(lv, column, metric, indexed_generation_rows)) is not None:
                arms.append(_stale_filtered(indexed_knn(lv, ds, merged), s.newer(levels[:i])))
            else:
                newer = [g for g in levels[:i] if isinstance(g, GenerationLevel)]
                generations.append(ShadowedLevel(lv, s.newer(newer), merged))
    if generations:
        arms.append(_stale_filtered(BruteForceKnnExec(generations, knn), s.newer(memtables)))
    return TopKExec(arms, k, DISTANCE, knn.schema)


def _indexed_generation(level: Level, column: str, metric: str, min_rows: int) -> lance.LanceDataset | None:
    """The generation's dataset when it is searched through its own vector index: it has one on
    `column` with `metric` and at least `min_rows` rows (below that, brute force over its vectors,
    kept in memory, is both faster and exact)."""
    if not isinstance(level, GenerationLevel):
        return None
    ds = level.dataset()
    if ds is None or level.cached("num-rows", ds.count_rows) < min_rows:
        return None
    details = _index_details(ds, column, "vector")
    if details is None or str(details.get("metric_type", "")).lower() != metric:
        return None
    return ds


def plan_fts(
    table: Searched, column: str, query: str, k: int, options: Mapping[str, Any] | None = None
) -> ExecNode:
    """The plan of `fts`: the `k` live, newest rows matching the filter with the highest BM25 score for
    `query` (any of its terms), scored with the statistics of the whole deduplicated table; the
    table's columns and `_score`, best first."""
    opts = SearchOptions.parse(options, "fts", FTS_OPTIONS)
    k = _check_k(k, "fts")
    schema = table.schema
    if column not in schema.names or not (
        pa.types.is_string(schema.field(column).type) or pa.types.is_large_string(schema.field(column).type)
    ):
        raise InvalidConfigError(f"fts: {column!r} is not a string column of the table")
    if not isinstance(query, str):
        raise InvalidConfigError(f"fts: the query must be a string, not {query!r}")
    s = _setup(table, opts)
    base = s.snapshot.base
    tokenizer = Tokenizer.from_index_details(_index_details(base, column, "inverted"))
    terms = tokenizer.terms(query)
    fts_query = FtsQuery(column, tokenizer, tuple(terms), k, s.filter, schema)
    arms = []
    if base.get_fragments():
        arms.append(Bm25Exec.for_base(base, s.snapshot.storage, fts_query, s.newer(s.all_levels)))
    searched = {id(r) for r in s.regions}
    s.snapshot.require_readable(s.snapshot.unreadable)
    for region in s.snapshot.regions:  # pruned regions too: the statistics cover the whole table
        for i, level in enumerate(region.levels):
            newer = s.newer(region.levels[:i])
            arms.append(Bm25Exec.for_level(level, fts_query, newer, searchable=id(region) in searched))
    return GlobalBM25Exec(arms, terms, k, fts_query.schema)
