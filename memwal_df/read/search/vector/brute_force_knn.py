"""BruteForceKnnExec: the exact nearest live rows of some generations and MemTables, searched as one.

Exact distances to every row that matches the filter, computed with numpy over the levels' vectors
(a generation's are read once per process), with the rows that a newer generation replaces masked
(once per process: generations never change). An l2 search of generations only ranks first with
int8 scores (`sq8`), anything else with float32 ones (`vectors.F32Scores`); the rows
those bounds cannot rule out are re-ranked with exact distances.

Guarantees: `top(n)` is exactly the `n` nearest matching, unmasked rows of all its levels, with
Lance's distances.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa

from memwal_df.read.lsm.cache import ImmutableCache
from memwal_df.read.lsm.levels import GenerationLevel, Level
from memwal_df.read.search.ranked import POSITION
from memwal_df.read.search.vector.knn import KnnExec
from memwal_df.read.search.vector.sq8 import Quantized, Sq8Scores
from memwal_df.read.search.vector.vectors import (
    DISTANCE,
    F32Scores,
    KnnQuery,
    LevelVectors,
    ShadowedLevel,
    distances,
    ranked_positions,
)

__all__ = ["BruteForceKnnExec"]


@dataclass(frozen=True)
class _Candidates:
    """Every searched level's vectors, the scores of all their rows (one segment for quantized
    generations, else one per level), where each level's positions start, and the number of
    candidates."""

    vectors: list[LevelVectors]
    segments: list[tuple[int, F32Scores | Sq8Scores]]  # (first position, scores of its rows)
    offsets: np.ndarray  # the first position of each level, and the total
    count: int

    def level_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, positions, side="right") - 1


_QUANTIZED_SETS = ImmutableCache(capacity=16)  # int8 matrices of sets of generations, by their identity


def _codes_bytes(quantized: Quantized) -> int:
    return int(quantized.codes.nbytes)


class BruteForceKnnExec(KnnExec):
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
        return level.memo(name, lambda: LevelVectors.of_level(level, self.column, self.primary_key))

    def _quantized(self, vectors: list[LevelVectors]) -> tuple[Quantized, np.ndarray] | None:
        """For an l2 search of generations only: their vectors as one int8 matrix and which of its
        rows are not candidates (before the filter), kept per set of generations and newer
        generations (generations never change); None otherwise (a MemTable's rows change with every
        query)."""
        generations = [sl.level for sl in self.levels if isinstance(sl.level, GenerationLevel)]
        if self.metric != "l2" or len(generations) != len(self.levels):
            return None
        identity = "\n".join(
            f"{level.uri}|{','.join(lv.uri for lv in sl.newer_generations)}"
            for level, sl in zip(generations, self.levels, strict=True)
        )
        name = f"{self.column}:{','.join(self.primary_key)}"

        def build() -> tuple[Quantized, np.ndarray] | None:
            quantized = self._joined(generations, vectors)
            if quantized is None:
                return None
            excluded = [sl.excluded(v, self.column) for sl, v in zip(self.levels, vectors, strict=True)]
            return quantized, np.concatenate(excluded)

        digest = hashlib.sha256(identity.encode()).hexdigest()
        return _QUANTIZED_SETS.get(digest, name, build)

    def _joined(self, generations: list[GenerationLevel], vectors: list[LevelVectors]) -> Quantized | None:
        """The generations' int8 codes as one matrix, at the largest of their grid scales. Each
        generation's grid scale, and its codes at a scale, are kept with it (`GENERATIONS`, the codes'
        bytes declared), so a set that grows by one generation quantizes only that one (all of them
        again only when the new one needs a larger scale); None when a generation's vectors cannot be
        quantized."""
        scales = [
            level.cached(f"sq8 grid scale:{self.column}", partial(Quantized.grid_scale, v.matrix))
            if len(v.matrix)
            else 0.0
            for level, v in zip(generations, vectors, strict=True)
        ]
        if not vectors or any(s is None for s in scales):
            return None
        scale = max(s for s in scales if s is not None)
        if scale == 0.0:
            return None  # no rows
        name = f"sq8:{self.column}:{','.join(self.primary_key)}:{scale!r}"
        parts = [
            level.cached(name, partial(Quantized.at_scale, [v.matrix], scale), _codes_bytes)
            for level, v in zip(generations, vectors, strict=True)
        ]
        return Quantized.joined(parts)

    def _excluded(self, excluded: np.ndarray) -> np.ndarray:
        """`excluded`, plus every row that does not match the filter."""
        if self.filter is None:
            return excluded
        matches = np.concatenate([sl.level.filter_mask(self.filter) for sl in self.levels])
        return excluded | ~matches

    def _candidates(self) -> _Candidates:
        if self._ranked is None:
            vectors = [self._vectors(sl.level) for sl in self.levels]
            offsets = np.cumsum([0] + [len(v.matrix) for v in vectors])
            segments: list[tuple[int, F32Scores | Sq8Scores]] = []
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
                    segments.append((int(offsets[i]), F32Scores(approx, bound)))
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
        return self._take(c, positions, lambda i, local: self.levels[i].level.take(local, columns))

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
