"""KNN operators: one level's nearest rows to a query vector, best first, with `_distance`.

Distances are Lance's: `l2` is the squared Euclidean distance, `cosine` is 1 - cos(angle), `dot` is
1 - x.q. Rows with a NULL vector and tombstones are never candidates.

* `BruteForceKnnExec` (generations and unflushed MemTables, any number of them as one search): exact
  distances to every row that matches the filter, computed with numpy over the levels' vectors (a
  generation's are read once per process), with the rows that a newer generation replaces masked
  (once per process: generations never change). `top(n)` is exactly the `n` nearest matching,
  unmasked rows of all its levels.
* `LanceKnnExec` (the base table, or a large generation through its maintained index): Lance's
  `nearest` with `nprobes` / `refine_factor`, the filter's Lance part as a prefilter (applied exactly
  before the search; for a generation with `NOT _tombstone`) and the rest applied to the results
  (fetching more until `n` rows match). With an index, `top(n)` is Lance's approximate answer;
  fragments the index does not cover yet are searched exactly by Lance itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidConfigError
from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.exec.base import short_id
from memwal_df.read.exec.filter_stale import NewerLevels
from memwal_df.read.exec.ranked import POSITION, RankedExec, grow
from memwal_df.read.exec.take_last import take_addresses
from memwal_df.read.levels import filter_mask, level_cached, read_level, take_rows
from memwal_df.read.predicate import referenced_columns, split_for_lance
from memwal_df.read.snapshot import ImmutableCache, Level
from memwal_df.read.sq8 import Quantized, Sq8Scores

__all__ = [
    "DISTANCE",
    "METRICS",
    "BruteForceKnnExec",
    "KnnQuery",
    "LanceKnnExec",
    "ShadowedLevel",
    "distances",
    "query_vector",
]

DISTANCE = "_distance"
_ROWADDR = "_rowaddr"
METRICS = ("l2", "cosine", "dot")


def query_vector(schema: pa.Schema, column: str, query: Any) -> np.ndarray:
    """The query as float32 of the column's dimension (InvalidConfigError if it does not fit)."""
    if column not in schema.names:
        raise InvalidConfigError(f"vector_search: no column {column!r}")
    t = schema.field(column).type
    if not pa.types.is_fixed_size_list(t) or not pa.types.is_floating(t.value_type):
        raise InvalidConfigError(f"vector_search: column {column!r} is {t}, not a fixed-size list of floats")
    try:
        q = np.asarray(query, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
        raise InvalidConfigError(f"vector_search: the query is not a vector of numbers: {e}") from None
    if len(q) != t.list_size or not np.isfinite(q).all():
        raise InvalidConfigError(f"vector_search: the query needs {t.list_size} finite numbers, got {len(q)}")
    return q


# Below 2304 * 4 elements OpenBLAS runs a gemv on the calling thread (interface/gemv.c).
_GEMV_ELEMENTS = 8192


def _matvec(matrix: np.ndarray, q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """matrix @ q as single-threaded BLAS gemvs over blocks of rows (faster than `np.einsum`). One
    gemv over the whole matrix is multi-threaded in OpenBLAS, and its threads spin while Lance's
    threads hold the cores (a Lance search running on another thread makes it many times slower)."""
    rows = max(1, _GEMV_ELEMENTS // max(1, matrix.shape[1]))
    full = len(matrix) // rows * rows
    if out is None:
        out = np.empty(len(matrix), dtype=np.result_type(matrix, q))
    out[:full] = (matrix[:full].reshape(-1, rows, matrix.shape[1]) @ q).reshape(-1)
    out[full:] = matrix[full:] @ q
    return out


def distances(matrix: np.ndarray, q: np.ndarray, metric: str) -> np.ndarray:
    """Lance's distance of each row of `matrix` to `q` (float32)."""
    if metric == "l2":
        diff = matrix - q
        return np.einsum("ij,ij->i", diff, diff)
    dot = _matvec(matrix, q)
    if metric == "dot":
        return (1 - dot).astype(np.float32)
    if metric == "cosine":
        norms = np.linalg.norm(matrix, axis=1) * np.linalg.norm(q)
        with np.errstate(divide="ignore", invalid="ignore"):
            return (1 - dot / norms).astype(np.float32)
    raise InvalidConfigError(f"vector_search: unknown metric {metric!r}; expected one of {METRICS}")


@dataclass(frozen=True)
class LevelVectors:
    """A level's vectors (float32, one row per position), their squared norms, which positions are
    live rows with a vector, and the key columns."""

    matrix: np.ndarray
    sqnorms: np.ndarray
    usable: np.ndarray
    keys: pa.Table

    @classmethod
    def read(cls, level: Level, column: str, primary_key: Sequence[str]) -> LevelVectors:
        rows = read_level(level, [column, TOMBSTONE, *primary_key])
        vec = rows.column(column).combine_chunks()
        dim = vec.type.list_size
        usable = ~rows.column(TOMBSTONE).to_numpy(zero_copy_only=False).astype(bool)
        if vec.null_count:
            usable &= vec.is_valid().to_numpy(zero_copy_only=False)
            vec = vec.fill_null(pa.scalar([0.0] * dim, vec.type))
        matrix = vec.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim)
        sqnorms = np.einsum("ij,ij->i", matrix, matrix)
        return cls(matrix, sqnorms, usable, rows.select(list(primary_key)).combine_chunks())

    @classmethod
    def of_level(cls, level: Level, column: str, primary_key: Sequence[str]) -> LevelVectors:
        """`read`, or for a MemTable whose writer indexes `column`, the rows of its MemTable index."""
        indexed = level.source.vectors(column) if level.source is not None else None
        if indexed is None:
            return cls.read(level, column, primary_key)
        assert level.source is not None and level.table is not None
        at = level.source.positions
        keys = level.table.select(list(primary_key)).combine_chunks()
        if at is None:  # every row of the MemTable is its key's newest: the index's arrays as they are
            return cls(indexed.matrix, indexed.sqnorms, indexed.usable, keys)
        return cls(indexed.matrix[at], indexed.sqnorms[at], indexed.usable[at], keys)

    def approximate(self, q: np.ndarray, metric: str, out: np.ndarray) -> float:
        """Each row's distance to `q` from one matrix-vector product, into `out`; returns a bound on
        its error: for `l2`, |x|^2 - 2 x.q + |q|^2 loses precision when x is near q; the other
        metrics are exact."""
        if metric != "l2" or len(self.matrix) == 0:
            out[:] = distances(self.matrix, q, metric)
            return 0.0
        qq = float(q @ q)
        _matvec(self.matrix, q, out)
        out *= -2
        out += self.sqnorms
        out += np.float32(qq)
        eps = float(np.finfo(np.float32).eps)
        return 4 * (self.matrix.shape[1] + 2) * eps * (self.max_sqnorm + qq)

    @cached_property
    def max_sqnorm(self) -> float:
        return float(self.sqnorms.max())


def ranked_positions(scores: np.ndarray, n: int) -> np.ndarray:
    """Indices of the `n` smallest scores, smallest first (ties in index order)."""
    if n < len(scores):
        part = np.argpartition(scores, n - 1)[:n]
        return part[np.lexsort((part, scores[part]))]
    return np.argsort(scores, kind="stable")


@dataclass(frozen=True)
class ShadowedLevel:
    """A level searched by brute force, the newer generations whose keys replace some of its rows (a
    generation's rows are masked once per process and set of newer generations: both never change),
    and whether it is a catch-up plan's gap generation (said in `explain`)."""

    level: Level
    newer: NewerLevels | None = None
    merged: bool = False

    def excluded(self, vectors: LevelVectors, column: str) -> np.ndarray:
        """Bool per position: not a candidate (a tombstone, no vector in `column`, or a newer
        generation holds its key); kept with the level (per process for a generation, per query for
        a MemTable)."""
        name = f"excluded:{column}"
        if self.newer is None or not self.newer.levels:
            return level_cached(self.level, name, lambda: ~vectors.usable)
        assert all(lv.kind == "generation" for lv in self.newer.levels), "only generations are masked"
        uris = "\n".join(lv.uri for lv in self.newer.levels)
        name += f":{hashlib.sha256(uris.encode()).hexdigest()}:{','.join(self.newer.primary_key)}"
        newer = self.newer
        return level_cached(self.level, name, lambda: ~vectors.usable | newer.stale(vectors.keys))

    def describe(self) -> str:
        merged = "merged " if self.merged else ""
        return f"{merged}{self.level.kind} {self.level.generation} of region {short_id(self.level.region_id)}"


@dataclass(frozen=True)
class _F32Scores:
    """One query's approximate distances to a level's rows (inf for rows that are not candidates),
    each within `bound` of the exact one."""

    approx: np.ndarray
    bound: float

    def uppers(self, n: int) -> np.ndarray:
        """Upper bounds of the distances of the min(n, candidates) rows with the smallest approximate
        distances."""
        best = np.partition(self.approx, n - 1)[:n] if n < len(self.approx) else self.approx
        return best[np.isfinite(best)].astype(np.float64) + self.bound

    def within(self, limit: float) -> np.ndarray:
        """The rows whose distance may be at most `limit`."""
        return np.flatnonzero(self.approx <= limit + self.bound)


@dataclass(frozen=True)
class _Candidates:
    """Every searched level's vectors, the scores of all their rows (one segment for quantized
    generations, else one per level), where each level's positions start, and the number of
    candidates."""

    vectors: list[LevelVectors]
    segments: list[tuple[int, _F32Scores | Sq8Scores]]  # (first position, scores of its rows)
    offsets: np.ndarray  # the first position of each level, and the total
    count: int

    def level_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, positions, side="right") - 1


_QUANTIZED_SETS = ImmutableCache(capacity=16)  # int8 matrices of sets of generations, by their identity


@dataclass(frozen=True)
class KnnQuery:
    """One vector search: the `k` rows nearest to `query` in `column` by `metric`, among the rows
    that match `filter`, of a table with `table_schema` and `primary_key`."""

    column: str
    query: np.ndarray
    metric: str
    k: int
    filter: pc.Expression | None
    table_schema: pa.Schema
    primary_key: tuple[str, ...]

    @property
    def schema(self) -> pa.Schema:
        """The output schema: the table's columns, then `_distance`."""
        return self.table_schema.append(pa.field(DISTANCE, pa.float32()))


class _KnnExec(RankedExec):
    """A KNN operator: the query's fields as attributes, scored by `_distance`."""

    def __init__(self, knn: KnnQuery) -> None:
        self.score = DISTANCE
        self.column, self.query, self.metric, self.k = knn.column, knn.query, knn.metric, knn.k
        self.filter = knn.filter
        self.table_schema = knn.table_schema
        self.primary_key = list(knn.primary_key)
        self.schema = knn.schema


class BruteForceKnnExec(_KnnExec):
    """Exact nearest live rows of some generations and MemTables, searched as one: each level's rows
    that a newer generation replaces are masked before ranking (`ShadowedLevel`), so `top(n)` is
    exactly the `n` nearest rows of the levels that match the filter and no masked row. Positions
    count through the levels in their order."""

    def __init__(self, levels: Sequence[ShadowedLevel], knn: KnnQuery) -> None:
        super().__init__(knn)
        self.levels = list(levels)
        self._ranked: _Candidates | None = None

    def describe(self) -> str:
        f = "" if self.filter is None else f", filter={self.filter}"
        masked = any(sl.newer is not None and sl.newer.levels for sl in self.levels)
        return (
            f"BruteForceKnnExec: {', '.join(sl.describe() for sl in self.levels)}, column={self.column}, "
            f"metric={self.metric}{f}" + (", rows of newer generations masked" if masked else "")
        )

    def _vectors(self, level: Level) -> LevelVectors:
        name = f"vectors:{self.column}:{','.join(self.primary_key)}"
        return level_cached(level, name, lambda: LevelVectors.of_level(level, self.column, self.primary_key))

    def _quantized(self, vectors: list[LevelVectors]) -> tuple[Quantized, np.ndarray] | None:
        """For an l2 search of generations only: their vectors as one int8 matrix and which of its
        rows are not candidates (before the filter), kept per set of generations and newer
        generations (generations never change); None otherwise (a MemTable's rows change with every
        query)."""
        if self.metric != "l2" or any(sl.level.kind != "generation" for sl in self.levels):
            return None
        identity = "\n".join(
            f"{sl.level.uri}|{','.join(lv.uri for lv in sl.newer.levels) if sl.newer else ''}"
            for sl in self.levels
        )
        name = f"{self.column}:{','.join(self.primary_key)}"

        def build() -> tuple[Quantized, np.ndarray] | None:
            quantized = Quantized.of([v.matrix for v in vectors])
            if quantized is None:
                return None
            excluded = [sl.excluded(v, self.column) for sl, v in zip(self.levels, vectors, strict=True)]
            return quantized, np.concatenate(excluded)

        digest = hashlib.sha256(identity.encode()).hexdigest()
        return _QUANTIZED_SETS.get(digest, name, build)  # type: ignore[no-any-return]

    def _excluded(self, excluded: np.ndarray) -> np.ndarray:
        """`excluded`, plus every row that does not match the filter."""
        if self.filter is None:
            return excluded
        matches = np.concatenate([filter_mask(sl.level, self.filter) for sl in self.levels])
        return excluded | ~matches

    def _candidates(self) -> _Candidates:
        if self._ranked is None:
            vectors = [self._vectors(sl.level) for sl in self.levels]
            offsets = np.cumsum([0] + [len(v.matrix) for v in vectors])
            segments: list[tuple[int, _F32Scores | Sq8Scores]] = []
            quantized = self._quantized(vectors)
            if quantized is not None:
                excluded = self._excluded(quantized[1])
                segments.append((0, quantized[0].scores(self.query, excluded)))  # all levels as one
            else:
                pairs = zip(self.levels, vectors, strict=True)
                excluded = self._excluded(np.concatenate([sl.excluded(v, self.column) for sl, v in pairs]))
                for i, v in enumerate(vectors):
                    approx = np.empty(len(v.matrix), np.float32)
                    bound = v.approximate(self.query, self.metric, approx)
                    np.copyto(approx, np.inf, where=excluded[offsets[i] : offsets[i + 1]])
                    segments.append((int(offsets[i]), _F32Scores(approx, bound)))
            count = len(excluded) - int(np.count_nonzero(excluded))
            self._ranked = _Candidates(vectors, segments, offsets, count)
        return self._ranked

    def top(self, n: int) -> pa.Table:
        """The `n` nearest candidates by exact distance: every row whose distance may be at most the
        n-th smallest upper bound (the others cannot be among the n nearest), re-ranked with exact
        distances."""
        c = self._candidates()
        n = min(n, c.count)
        at = np.zeros(0, np.int64)
        exact = np.zeros(0, np.float32)
        if n > 0:
            uppers = np.concatenate([s.uppers(n) for _, s in c.segments])  # at least n of them
            limit = float(np.partition(uppers, n - 1)[n - 1])
            near = np.concatenate([start + s.within(limit) for start, s in c.segments])
            level = c.level_of(near)
            exact = np.empty(len(near), np.float32)
            for i in np.unique(level):
                mine = level == i
                exact[mine] = distances(
                    c.vectors[i].matrix[near[mine] - c.offsets[i]], self.query, self.metric
                )
            best = ranked_positions(exact, n)[:n]
            at, exact = near[best], exact[best]
        keys = self._take(c, at, lambda i, local: c.vectors[i].keys.take(pa.array(local)))
        positions = pa.array(at, pa.int64())
        return keys.append_column(POSITION, positions).append_column(DISTANCE, pa.array(exact, pa.float32()))

    def rows(self, positions: np.ndarray) -> pa.Table:
        columns = self.schema.names[:-1]
        c = self._candidates()
        return self._take(c, positions, lambda i, local: take_rows(self.levels[i].level, local, columns))

    def _take(
        self, c: _Candidates, positions: np.ndarray, take: Callable[[int, np.ndarray], pa.Table]
    ) -> pa.Table:
        """`take(level, its positions)` for each level that `positions` fall in, as one table in the
        order of `positions`."""
        positions = np.asarray(positions, dtype=np.int64)
        level = c.level_of(positions)
        parts, order = [], []
        for i in np.unique(level) if len(positions) else [0]:
            mine = np.flatnonzero(level == i)
            parts.append(take(int(i), positions[mine] - c.offsets[i]))
            order.append(mine)
        if len(parts) == 1:
            return parts[0]
        rows = pa.concat_tables(parts)
        return rows.take(pa.array(np.argsort(np.concatenate(order))))


class LanceKnnExec(_KnnExec):
    """Lance's nearest rows of the base table (through its vector index when it has one)."""

    native = True

    def __init__(
        self,
        base: lance.LanceDataset,
        knn: KnnQuery,
        nprobes: int | None = None,
        refine_factor: int | None = None,
        label: str | None = None,
        *,
        catchup: str | None = None,
        indexed_only: bool = False,
    ) -> None:
        """`label` names a generation (`base` is then its dataset, whose tombstones are skipped);
        `indexed_only`: search only the fragments the vector index covers (Lance's `fast_search`;
        a catch-up plan's gap generations stand in for the others), `catchup` says why, for
        `explain`."""
        super().__init__(knn)
        self.base = base
        self.label = label
        self.catchup = catchup
        self.indexed_only = indexed_only
        keys = [self.table_schema.field(c) for c in self.primary_key]
        self._top_schema = pa.schema([*keys, pa.field(POSITION, pa.int64()), self.schema.field(DISTANCE)])
        self.nprobes = nprobes
        self.refine_factor = refine_factor
        self._last: pa.Table | None = None  # what the last `top` fetched (with row addresses), by position

    def describe(self) -> str:
        f = "" if self.filter is None else f", prefilter={self.filter}"
        return (
            f"LanceKnnExec: {self.label or 'base'} v{self.base.version}, column={self.column}, "
            f"metric={self.metric}, "
            f"nprobes={self.nprobes}, refine_factor={self.refine_factor}{f}"
            + (", indexed fragments only" if self.indexed_only else "")
            + (f", catch-up: {self.catchup}" if self.catchup else "")
        )

    def top(self, n: int) -> pa.Table:
        """Lance's nearest rows: their keys, the columns of the filter's part that Lance cannot
        apply, `_distance` and row addresses only; `rows` takes the winners' other columns."""
        if self.label is None:
            sql, residual = split_for_lance(self.filter, self.table_schema)
        else:
            live = ~pc.field(TOMBSTONE)
            flt = live if self.filter is None else self.filter & live
            sql, residual = split_for_lance(flt, self.table_schema.append(pa.field(TOMBSTONE, pa.bool_())))
        needed = set(self.primary_key) | (referenced_columns(residual) if residual is not None else set())
        columns = [c for c in [*self.table_schema.names, TOMBSTONE] if c in needed]

        def fetch(m: int) -> pa.Table:
            nearest: dict[str, Any] = {"column": self.column, "q": self.query, "k": m, "metric": self.metric}
            if self.nprobes is not None:
                nearest["nprobes"] = self.nprobes
            if self.refine_factor is not None:
                nearest["refine_factor"] = self.refine_factor
            rows = self.base.to_table(
                columns=[*columns, DISTANCE],
                nearest=nearest,
                filter=sql,
                prefilter=sql is not None,
                fast_search=self.indexed_only,
                with_row_address=True,
            )
            self._last = rows
            return rows.append_column(POSITION, pa.array(np.arange(rows.num_rows, dtype=np.int64)))

        def keep(rows: pa.Table) -> pa.Table:
            return rows if residual is None else rows.filter(residual)

        found = grow(fetch, keep, n, n)
        return found.select([*self.primary_key, POSITION, DISTANCE]).cast(self._top_schema)

    def rows(self, positions: np.ndarray) -> pa.Table:
        assert self._last is not None, "top() first"
        addresses = self._last.column(_ROWADDR).to_numpy()[np.asarray(positions, dtype=np.int64)]
        return take_addresses(self.base, addresses, self.table_schema.names)
