"""int8 scalar quantization of a generation's vectors: the first pass of exact l2 brute-force search.

A level's float32 vectors x_i are kept as int8 codes c_i with one scale s (x_i ~ s * c_i) and the
largest quantization error of a row, e = max_i ||x_i - s * c_i|| (rounded up). A query q is
quantized the same way (q~, error e_q). The kernel computes D_i = ||c_i - q~||^2 exactly in
integers, reading a quarter of the bytes of the float32 vectors (several times faster than a float32
gemv). By the triangle inequality the true distance ||x_i - q||
lies within E = e + e_q of s * sqrt(D_i): both bounds grow with D_i, so the rows that can be among
the n nearest are those whose D_i is at most an integer threshold; the caller measures those exactly.

Guarantees: `Sq8Scores.uppers` are never below, and the rows `Sq8Scores.within` leaves out are
always above, the squared distance that `vectors.distances` computes in float32 (the bounds are widened
by that computation's rounding error), so a search that re-ranks `within` exactly stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Quantized", "Sq8Scores"]

_MAX_DIM = 32_767  # D_i, a sum of d squares of at most 254^2, fits an int32 below this
_UP = 1 + 1e-9  # rounds a float64 error term up past its own rounding
_EXCLUDED = np.iinfo(np.int32).max

_kernel: Any = None
_GROUPS = 64


def _smallest(values: np.ndarray, n: int) -> np.ndarray:
    """The `n` smallest of `values` (all of them when there are fewer), in no order: partitioned
    among the values at most the n-th smallest minimum of 64-strided groups (at least n values are),
    which touches fewer values than `np.partition` of all of them (which copies them)."""
    if n >= len(values):
        return values
    full = len(values) // _GROUPS * _GROUPS
    if full // _GROUPS > n:
        mins = values[:full].reshape(_GROUPS, -1).min(axis=0)  # contiguous rows: one vectorized pass
        values = values[values <= np.partition(mins, n - 1)[n - 1]]
    return np.partition(values, n - 1)[:n]


def _top(matrices: Sequence[np.ndarray]) -> float | None:
    """max|x| over `matrices`; None when they cannot be quantized (no rows, a non-finite value, or
    more dimensions than an int32 sum holds)."""
    if sum(len(m) for m in matrices) == 0 or matrices[0].shape[1] > _MAX_DIM:
        return None
    top = max(float(np.abs(m).max()) if len(m) else 0.0 for m in matrices)
    return top if np.isfinite(top) else None


def _compiled() -> Any:
    """The numba kernel, compiled on first use in a process (~0.3 s with numba's import). Not cached
    on disk: nothing is written next to the package, and no stale cache file can break a search."""
    global _kernel
    if _kernel is None:
        import numba

        @numba.njit(nogil=True, cache=False)
        def squared_distances(codes, q, excluded, out):
            n, d = codes.shape
            for i in range(n):
                if excluded[i]:
                    out[i] = _EXCLUDED
                    continue
                acc = np.int32(0)
                for j in range(d):
                    v = np.int32(codes[i, j]) - q[j]
                    acc += v * v
                out[i] = acc

        _kernel = squared_distances
    return _kernel


@dataclass(frozen=True)
class Sq8Scores:
    """One query's integer distances to a level's rows (`_EXCLUDED` for rows that are not candidates)
    and what turns them into bounds of the true squared distances."""

    scores: np.ndarray  # int32 per row
    scale: float
    slack: float  # E: the true distance is within E of scale * sqrt(score)
    widen: float  # relative rounding of float32 distances

    def uppers(self, n: int) -> np.ndarray:
        """Upper bounds of the squared distances of the min(n, candidates) rows with the smallest
        scores."""
        best = _smallest(self.scores, n)
        best = best[best != _EXCLUDED].astype(np.float64)
        return (self.scale * np.sqrt(best) + self.slack) ** 2 * (1 + self.widen)

    def within(self, limit: float) -> np.ndarray:
        """The rows whose squared distance may be at most `limit` (a superset)."""
        reach = (np.sqrt(limit / (1 - self.widen)) + self.slack) / self.scale
        threshold = min(np.floor(reach * reach * _UP) + 1, _EXCLUDED - 1)
        return np.flatnonzero(self.scores <= threshold)


@dataclass(frozen=True)
class Quantized:
    """A level's vectors as int8 codes with one scale, and the largest quantization error of a row."""

    codes: np.ndarray  # int8, one row per position
    scale: float
    error: float  # max_i ||x_i - scale * codes_i||, rounded up

    @classmethod
    def of(cls, matrices: Sequence[np.ndarray]) -> Quantized | None:
        """The rows of `matrices` (float32, one after the other) quantized with one scale; None when
        they cannot be (no rows, a non-finite value, or more dimensions than an int32 sum holds)."""
        top = _top(matrices)
        if top is None:
            return None
        return cls.at_scale(matrices, top / 127 if top > 0 else 1.0)

    @staticmethod
    def grid_scale(matrix: np.ndarray) -> float | None:
        """The smallest scale of the grid 2^(k/4) that quantizes `matrix` without clipping (levels
        with close ranges share it, so their codes can be put together); None as for `of`."""
        top = _top([matrix])
        if top is None:
            return None
        return float(2.0 ** (np.ceil(np.log2(top / 127) * 4) / 4)) if top > 0 else 1.0

    @classmethod
    def at_scale(cls, matrices: Sequence[np.ndarray], scale: float) -> Quantized:
        """The rows of `matrices` quantized with `scale` (at least max|x| / 127: nothing clips)."""
        rows = sum(len(m) for m in matrices)
        codes = np.empty((rows, matrices[0].shape[1]), np.int8)
        error, at = 0.0, 0
        for m in matrices:  # one matrix at a time: the float64 residuals stay small
            part = np.clip(np.rint(m / np.float32(scale)), -127, 127)
            codes[at : at + len(m)] = part
            residual = m.astype(np.float64) - part.astype(np.float64) * scale
            if len(m):
                error = max(error, float(np.sqrt(np.einsum("ij,ij->i", residual, residual).max())))
            at += len(m)
        return cls(codes, scale, error * _UP)

    @classmethod
    def joined(cls, parts: Sequence[Quantized]) -> Quantized:
        """`parts` (of one scale) as one matrix, one after the other."""
        assert len({p.scale for p in parts}) == 1, "parts of one scale only"
        return cls(np.concatenate([p.codes for p in parts]), parts[0].scale, max(p.error for p in parts))

    def scores(self, q: np.ndarray, excluded: np.ndarray) -> Sq8Scores:
        """The query's scores against every row (`excluded` rows are not candidates)."""
        q64 = q.astype(np.float64)
        q_codes = np.clip(np.rint(q64 / self.scale), -127, 127)
        q_error = float(np.sqrt(np.sum((q64 - q_codes * self.scale) ** 2))) * _UP
        out = np.empty(len(self.codes), np.int32)
        _compiled()(self.codes, q_codes.astype(np.int32), excluded, out)
        # float32 rounding of the exact distance: d products and sums, relative to the sum of squares
        widen = 4 * (self.codes.shape[1] + 2) * float(np.finfo(np.float32).eps)
        return Sq8Scores(out, self.scale, (self.error + q_error) * _UP, widen)
