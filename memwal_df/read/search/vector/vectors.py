"""Vector search machinery: query vectors, Lance's distances, a level's vectors, the float32 first
pass of exact brute force, and the query and level descriptions the KNN operators take.

Distances are Lance's: `l2` is the squared Euclidean distance, `cosine` is 1 - cos(angle), `dot` is
1 - x.q. Rows with a NULL vector and tombstones are never candidates.

Guarantees: `distances` is Lance's distance in float32; `F32Scores` bound the exact distances of
`distances` (`uppers` never below, rows `within` leaves out always above), as `sq8.Sq8Scores` do for
the int8 first pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidConfigError
from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.lsm.levels import GenerationLevel, Level, MemTableLevel
from memwal_df.read.search.staleness import NewerLevels

__all__ = [
    "DISTANCE",
    "METRICS",
    "F32Scores",
    "KnnQuery",
    "LevelVectors",
    "ShadowedLevel",
    "distances",
    "query_vector",
    "ranked_positions",
]

DISTANCE = "_distance"
METRICS = ("l2", "cosine", "dot")


def query_vector(schema: pa.Schema, column: str, query: Any) -> np.ndarray:
    """The query as float32 of the column's dimension (InvalidConfigError if it does not fit)."""
    if column not in schema.names:
        raise InvalidConfigError(f"vector_search: no column {column!r}")
    t = schema.field(column).type
    if not pa.types.is_fixed_size_list(t) or not pa.types.is_floating(t.value_type):
        raise InvalidConfigError(f"vector_search: column {column!r} is {t}, not a fixed-size list of floats")
    if query is None or isinstance(query, str | bytes | int | float):
        raise InvalidConfigError(f"vector_search: the query must be a list of numbers, not {query!r}")
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
        rows = level.read([column, TOMBSTONE, *primary_key])
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
        source = level.source if isinstance(level, MemTableLevel) else None
        indexed = source.vectors(column) if source is not None else None
        if indexed is None:
            return cls.read(level, column, primary_key)
        assert isinstance(level, MemTableLevel) and source is not None
        at = source.positions
        keys = level.read(list(primary_key)).combine_chunks()
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

    @property
    def newer_generations(self) -> list[GenerationLevel]:
        """The newer levels whose keys mask this level's rows: generations only (a MemTable's keys
        change with every query; its rows are checked by `FilterStaleExec` instead)."""
        if self.newer is None:
            return []
        generations = [lv for lv in self.newer.levels if isinstance(lv, GenerationLevel)]
        assert len(generations) == len(self.newer.levels), "only generations are masked"
        return generations

    def excluded(self, vectors: LevelVectors, column: str) -> np.ndarray:
        """Bool per position: not a candidate (a tombstone, no vector in `column`, or a newer
        generation holds its key); kept with the level (per process for a generation, per query for
        a MemTable). A generation's mask under a newer set is derived from its kept mask under the
        set without the newest generations, when there is one (a flush or a merge adds one newer
        generation): only the added generations' keys are probed."""
        name = f"excluded:{column}"
        if self.newer is None or not self.newer.levels:
            return self.level.memo(name, lambda: ~vectors.usable)
        newer = self.newer
        generations = self.newer_generations  # newest first
        pk = ",".join(newer.primary_key)

        def under(gens: list[GenerationLevel]) -> str:
            uris = "\n".join(lv.uri for lv in gens)
            return f"{name}:{hashlib.sha256(uris.encode()).hexdigest()}:{pk}"

        def compute() -> np.ndarray:
            level = self.level
            if isinstance(level, GenerationLevel):
                for k in range(1, len(generations)):
                    older = level.cached(under(generations[k:]), lambda: None)
                    if older is not None:
                        added = NewerLevels(generations[:k], newer.primary_key, newer.key_type)
                        return np.asarray(older | added.stale(vectors.keys))
            return ~vectors.usable | newer.stale(vectors.keys)

        return self.level.memo(under(generations), compute)

    def describe(self) -> str:
        merged = "merged " if self.merged else ""
        return f"{merged}{self.level.label}"


@dataclass(frozen=True)
class F32Scores:
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
