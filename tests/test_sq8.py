"""The int8 first pass of exact l2 brute force (`read/search/vector/sq8.py`): its bounds must hold for
the float32 distances the search ranks by, on any data, so the rows it lets through always contain
the exact nearest rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memwal_df.read.search.vector.sq8 import Quantized, _smallest
from memwal_df.read.search.vector.vectors import distances


def _check(matrix: np.ndarray, q: np.ndarray, excluded: np.ndarray, n: int, parts: int = 1) -> None:
    quantized = Quantized.of(np.array_split(matrix, parts))  # the levels of one search, one scale
    assert quantized is not None
    scores = quantized.scores(q, excluded)
    exact = distances(matrix, q, "l2").astype(np.float64)
    live = np.flatnonzero(~excluded)
    n = min(n, len(live))
    uppers = scores.uppers(n)
    assert len(uppers) == n
    # the n rows with the smallest scores are within their upper bounds
    best_scored = live[np.argsort(scores.scores[live], kind="stable")[:n]]
    assert (np.sort(exact[best_scored]) <= np.sort(uppers)).all()
    if n == 0:
        return
    limit = float(np.partition(uppers, n - 1)[n - 1])
    within = scores.within(limit)
    assert not np.isin(within, np.flatnonzero(excluded)).any()
    outside = np.setdiff1d(live, within)
    assert (exact[outside] > limit).all()
    # hence the exact n nearest live rows (ties by position) are among `within`
    nearest = live[np.lexsort((live, exact[live]))[:n]]
    assert np.isin(nearest, within).all()


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 400),
    dim=st.sampled_from([1, 2, 3, 8, 64, 130]),
    spread=st.sampled_from([1e-6, 1e-2, 1.0, 1e3, 1e6]),
    outliers=st.integers(0, 3),
    duplicates=st.booleans(),
    query_scale=st.sampled_from([0.0, 1.0, 10.0, 1e4]),
    excluded_share=st.sampled_from([0.0, 0.5, 0.99]),
    n=st.integers(1, 50),
    parts=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_bounds_hold_for_any_data(
    rows: int,
    dim: int,
    spread: float,
    outliers: int,
    duplicates: bool,
    query_scale: float,
    excluded_share: float,
    n: int,
    parts: int,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    matrix = (rng.standard_normal((rows, dim)) * spread).astype(np.float32)
    for _ in range(outliers):  # one huge row makes the scale coarse for all the others
        matrix[rng.integers(rows)] *= 1e4
    if duplicates:
        matrix[rows // 2 :] = matrix[: rows - rows // 2]
    q = (rng.standard_normal(dim) * spread * query_scale).astype(np.float32)
    if duplicates and query_scale == 1.0:
        q = matrix[0].copy()  # distance 0 to some rows
    for i, part in enumerate(np.array_split(np.arange(rows), parts)):  # levels of different spreads
        matrix[part] *= np.float32(10.0**i)
    excluded = rng.random(rows) < excluded_share
    _check(matrix, q, excluded, n, parts)


def test_the_first_pass_narrows_a_realistic_search() -> None:
    """On Gaussian vectors (the benchmark's) the rows let through are a small share of the level."""
    rng = np.random.default_rng(3)
    matrix = rng.standard_normal((20_000, 64)).astype(np.float32)
    quantized = Quantized.of([matrix])
    assert quantized is not None
    for _ in range(20):
        q = rng.standard_normal(64).astype(np.float32)
        scores = quantized.scores(q, np.zeros(len(matrix), bool))
        limit = float(np.partition(scores.uppers(20), 19)[19])
        assert 20 <= len(scores.within(limit)) < 2_000
        _check(matrix, q, np.zeros(len(matrix), bool), 20)


@pytest.mark.parametrize(
    "matrix",
    [
        np.zeros((0, 4), np.float32),
        np.array([[np.nan, 1.0]], np.float32),
        np.array([[np.inf, 0.0]], np.float32),
    ],
)
def test_data_that_cannot_be_quantized_is_searched_in_float32(matrix: np.ndarray) -> None:
    assert Quantized.of([matrix]) is None


def test_all_zero_vectors() -> None:
    _check(np.zeros((10, 4), np.float32), np.ones(4, np.float32), np.zeros(10, bool), 3)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(0, 2**31 - 1) | st.integers(0, 50), min_size=1, max_size=5000),
    n=st.integers(1, 300),
)
def test_smallest_values(values: list[int], n: int) -> None:
    array = np.asarray(values, np.int32)
    assert np.array_equal(np.sort(_smallest(array, n)), np.sort(array)[:n])


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    spread=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_generations_quantized_alone_join_into_the_matrix_of_all(
    sizes: list[int], spread: float, seed: int
) -> None:
    """Codes kept per generation at a shared grid scale, put together, are the codes of all the rows
    at that scale, with the largest error of the parts: a search over them stays exact."""
    rng = np.random.default_rng(seed)
    matrices = [(rng.standard_normal((n, 8)) * spread * rng.random()).astype(np.float32) for n in sizes]
    scales = [Quantized.grid_scale(m) for m in matrices if len(m)]
    if not scales:
        return
    scale = max(s for s in scales if s is not None)
    assert all(scale >= float(np.abs(m).max()) / 127 for m in matrices if len(m))
    parts = [Quantized.at_scale([m], scale) for m in matrices]
    joined, whole = Quantized.joined(parts), Quantized.at_scale(matrices, scale)
    np.testing.assert_array_equal(joined.codes, whole.codes)
    assert joined.error == whole.error
    matrix = np.concatenate(matrices)
    q = rng.standard_normal(8).astype(np.float32) * spread
    excluded = np.zeros(len(matrix), bool)
    n = min(3, len(matrix))
    exact = distances(matrix, q, "l2")
    scores = joined.scores(q, excluded)
    limit = float(np.partition(scores.uppers(n), n - 1)[n - 1])
    assert set(np.argsort(exact, kind="stable")[:n]) <= set(scores.within(limit).tolist())
