"""KNN operators: one level's nearest rows to a query vector, best first, with `_distance`.

Distances are Lance's: `l2` is the squared Euclidean distance, `cosine` is 1 - cos(angle), `dot` is
1 - x.q. Rows with a NULL vector and tombstones are never candidates.

* `BruteForceKnnExec` (a generation or an unflushed MemTable): exact distances to every row that
  matches the filter, computed with numpy over the level's vectors (a generation's are read once per
  process). `top(n)` is exactly the level's `n` nearest matching rows.
* `LanceKnnExec` (the base table, or a large generation through its maintained index): Lance's
  `nearest` with `nprobes` / `refine_factor`, the filter's Lance part as a prefilter (applied exactly
  before the search; for a generation with `NOT _tombstone`) and the rest applied to the results
  (fetching more until `n` rows match). With an index, `top(n)` is Lance's approximate answer;
  fragments the index does not cover yet are searched exactly by Lance itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidConfigError
from memwal_df.exec._levels import filter_mask, level_cached, read_level, take_rows
from memwal_df.exec.base import short_id
from memwal_df.exec.ranked import POSITION, RankedExec, grow
from memwal_df.predicate import split_for_lance
from memwal_df.snapshot import Level
from memwal_df.wal import TOMBSTONE

__all__ = ["DISTANCE", "METRICS", "BruteForceKnnExec", "LanceKnnExec", "distances", "query_vector"]

DISTANCE = "_distance"
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


def _matvec(matrix: np.ndarray, q: np.ndarray) -> np.ndarray:
    """matrix @ q as single-threaded BLAS gemvs over blocks of rows: 62 us per 16.7k x 64 float32
    against 146 us for `np.einsum`. One gemv over the whole matrix is multi-threaded in OpenBLAS, and
    its threads spin while Lance's threads hold the cores (measured 650 us per call with a Lance
    search running on another thread)."""
    rows = max(1, _GEMV_ELEMENTS // max(1, matrix.shape[1]))
    full = len(matrix) // rows * rows
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

    def approximate(self, q: np.ndarray, metric: str) -> tuple[np.ndarray, float]:
        """(each row's distance to `q` from one matrix-vector product, a bound on its error): for
        `l2`, |x|^2 - 2 x.q + |q|^2 loses precision when x is near q; the other metrics are exact."""
        if metric != "l2" or len(self.matrix) == 0:
            return distances(self.matrix, q, metric), 0.0
        qq = float(q @ q)
        approx = _matvec(self.matrix, q)
        approx *= -2
        approx += self.sqnorms
        approx += np.float32(qq)
        eps = float(np.finfo(np.float32).eps)
        return approx, 4 * (self.matrix.shape[1] + 2) * eps * (self.max_sqnorm + qq)

    @cached_property
    def max_sqnorm(self) -> float:
        return float(self.sqnorms.max())


def ranked_positions(scores: np.ndarray, n: int) -> np.ndarray:
    """Indices of the `n` smallest scores, smallest first (ties in index order)."""
    if n < len(scores):
        part = np.argpartition(scores, n - 1)[:n]
        return part[np.lexsort((part, scores[part]))]
    return np.argsort(scores, kind="stable")


class BruteForceKnnExec(RankedExec):
    """Exact nearest rows of one generation or MemTable."""

    def __init__(
        self,
        level: Level,
        column: str,
        query: np.ndarray,
        metric: str,
        k: int,
        filter: pc.Expression | None,
        schema: pa.Schema,
        primary_key: Sequence[str],
        merged: bool = False,
    ) -> None:
        """`merged`: the level is a catch-up plan's gap generation (said in `explain`)."""
        self.level = level
        self.merged = merged
        self.primary_key = list(primary_key)
        self.score = DISTANCE
        self.column = column
        self.query = query
        self.metric = metric
        self.k = k
        self.filter = filter
        self.schema = schema.append(pa.field(DISTANCE, pa.float32()))
        self._ranked: tuple[LevelVectors, np.ndarray, int, float] | None = None

    def describe(self) -> str:
        f = "" if self.filter is None else f", filter={self.filter}"
        merged = "merged " if self.merged else ""
        return (
            f"BruteForceKnnExec: {merged}{self.level.kind} {self.level.generation} of region "
            f"{short_id(self.level.region_id)}, column={self.column}, metric={self.metric}{f}"
        )

    def _candidates(self) -> tuple[LevelVectors, np.ndarray, int, float]:
        """(the level's vectors, approximate distances (inf where not a candidate), number of
        candidates, error bound of the approximation), computed once."""
        if self._ranked is None:
            name = f"vectors:{self.column}:{','.join(self.primary_key)}"
            vectors = level_cached(
                self.level, name, lambda: LevelVectors.of_level(self.level, self.column, self.primary_key)
            )
            mask = (
                vectors.usable
                if self.filter is None
                else vectors.usable & filter_mask(self.level, self.filter)
            )
            approx, bound = vectors.approximate(self.query, self.metric)
            approx = np.where(mask, approx, np.inf)
            self._ranked = vectors, approx, int(mask.sum()), bound
        return self._ranked

    def top(self, n: int) -> pa.Table:
        """The `n` nearest candidates by exact distance: those the approximation cannot rule out
        (within its error bound of the n-th), re-ranked with exact distances."""
        vectors, approx, count, bound = self._candidates()
        n = min(n, count)
        if n == 0:
            at = np.zeros(0, np.int64)
            exact = np.zeros(0, np.float32)
        else:
            nth = approx[np.argpartition(approx, n - 1)[n - 1]]
            near = np.flatnonzero(approx <= nth + 2 * bound)
            exact = distances(vectors.matrix[near], self.query, self.metric)
            best = ranked_positions(exact, n)[:n]
            at, exact = near[best], exact[best]
        positions = pa.array(at, pa.int64())
        keys = vectors.keys.take(positions)
        return keys.append_column(POSITION, positions).append_column(DISTANCE, pa.array(exact, pa.float32()))

    def rows(self, positions: np.ndarray) -> pa.Table:
        return take_rows(self.level, positions, self.schema.names[:-1])


class LanceKnnExec(RankedExec):
    """Lance's nearest rows of the base table (through its vector index when it has one)."""

    native = True

    def __init__(
        self,
        base: lance.LanceDataset,
        column: str,
        query: np.ndarray,
        metric: str,
        k: int,
        filter: pc.Expression | None,
        schema: pa.Schema,
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
        self.base = base
        self.label = label
        self.catchup = catchup
        self.indexed_only = indexed_only
        self.score = DISTANCE
        self.column = column
        self.query = query
        self.metric = metric
        self.k = k
        self.filter = filter
        self.table_schema = schema
        self.schema = schema.append(pa.field(DISTANCE, pa.float32()))
        self.nprobes = nprobes
        self.refine_factor = refine_factor
        self._last: pa.Table | None = None  # the rows of the last `top`, by position

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
        if self.label is None:
            sql, residual = split_for_lance(self.filter, self.table_schema)
        else:
            live = ~pc.field(TOMBSTONE)
            flt = live if self.filter is None else self.filter & live
            sql, residual = split_for_lance(flt, self.table_schema.append(pa.field(TOMBSTONE, pa.bool_())))
        columns = [*self.table_schema.names, DISTANCE]

        def fetch(m: int) -> pa.Table:
            nearest: dict[str, Any] = {"column": self.column, "q": self.query, "k": m, "metric": self.metric}
            if self.nprobes is not None:
                nearest["nprobes"] = self.nprobes
            if self.refine_factor is not None:
                nearest["refine_factor"] = self.refine_factor
            rows = self.base.to_table(
                columns=columns,
                nearest=nearest,
                filter=sql,
                prefilter=sql is not None,
                fast_search=self.indexed_only,
            )
            self._last = rows.select(columns).cast(self.schema)
            return self._last.append_column(POSITION, pa.array(np.arange(rows.num_rows, dtype=np.int64)))

        def keep(rows: pa.Table) -> pa.Table:
            return rows if residual is None else rows.filter(residual)

        return grow(fetch, keep, n, n)

    def rows(self, positions: np.ndarray) -> pa.Table:
        assert self._last is not None, "top() first"
        return self._last.take(pa.array(positions)).drop_columns([DISTANCE])
