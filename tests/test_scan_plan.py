"""Building blocks of scan plans: base spans (`_rowaddr` ranges that split fragments across partitions)
and the incrementally grown key sets of the anti-joins, each checked against a plain reference."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memwal_df.read.lsm.keys import KeySet
from memwal_df.read.scan.anti_join_scan import AntiJoinScanExec
from memwal_df.read.scan.spans import base_spans


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> lance.LanceDataset:
    """Five fragments of uneven sizes, with deleted rows at fragment edges and inside."""
    uri = str(tmp_path_factory.mktemp("spans") / "base")
    sizes = [700, 3, 1, 250, 46]
    start = 0
    for i, n in enumerate(sizes):
        ids = np.arange(start, start + n, dtype=np.int64)
        t = pa.table({"id": ids, "v": (ids % 17).astype(np.float64), "s": pa.array([f"r{k}" for k in ids])})
        lance.write_dataset(t, uri, mode="create" if i == 0 else "append")
        start += n
    ds = lance.dataset(uri)
    ds.delete("id IN (0, 699, 700, 703, 950, 999) OR (id > 100 AND id < 140)")
    return lance.dataset(uri)


def _no_shadow() -> KeySet:
    return KeySet.union([], pa.int64())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(1, 9), min_rows=st.sampled_from([1, 2, 7, 100, 10_000]), filtered=st.booleans())
def test_spans_cover_every_row_exactly_once(base, count, min_rows, filtered):
    fragments = [(f.fragment_id, f.metadata.physical_rows) for f in base.get_fragments()]
    spans = base_spans(fragments[::-1], count, min_rows)  # any order in
    assert 1 <= len(spans) <= count
    assert [s.start for s in spans[1:]] == [s.stop for s in spans[:-1]]  # contiguous
    flt = pc.field("v") < 5 if filtered else None
    got = [
        b
        for span in spans
        for b in AntiJoinScanExec(base, span, ["id"], ["id", "s"], flt, _no_shadow).execute()
    ]
    want = base.to_table(columns=["id", "s"], filter="v < 5" if filtered else None)
    assert pa.Table.from_batches(got, schema=want.schema).equals(want)


def test_one_large_fragment_is_split_evenly():
    spans = base_spans([(0, 1_000_000)], 4, 65_536)
    assert [(s.start, s.stop) for s in spans] == [(i * 250_000, (i + 1) * 250_000) for i in range(4)]
    assert base_spans([(3, 1000)], 4, 65_536) == base_spans([(3, 1000)], 1, 1)  # too small to split
    assert base_spans([], 4, 1) == [] and base_spans([(1, 0)], 4, 1) == []


@given(
    parts=st.lists(
        st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-20, 20), max_size=30), max_size=6
    ),
    probe=st.lists(st.integers(-25, 25), max_size=20),
)
def test_key_sets_grown_level_by_level_equal_the_union(parts, probe):
    arrays = [pa.array(p, pa.int64()) for p in parts]
    grown = KeySet.union([], pa.int64())
    for a in arrays:
        grown = grown.add(a)
    merged = KeySet.merge([KeySet(a) for a in arrays], pa.int64())
    want = sorted({k for p in parts for k in p})
    probe_keys = pa.array(probe + want[:5], pa.int64())
    for s in (grown, merged):
        assert s.to_array().to_pylist() == want
        assert s.contains(probe_keys).tolist() == [k in set(want) for k in probe_keys.to_pylist()]


@given(parts=st.lists(st.lists(st.text(max_size=3), max_size=10), max_size=5))
def test_string_key_sets_grown_level_by_level_equal_the_union(parts):
    grown = KeySet.union([], pa.string())
    for p in parts:
        grown = grown.add(pa.array(p, pa.string()))
    assert sorted(grown.to_array().to_pylist()) == sorted({k for p in parts for k in p})


@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.integers(1024, 5000),
    spread=st.sampled_from([1, 3, 15, 17, 1000]),  # dense (lookup table) and sparse (searchsorted)
    offset=st.sampled_from([0, -(2**63), 2**63 - 100_000_000, -12345]),
)
def test_large_integer_key_sets_probe_exactly(seed, size, spread, offset):
    rng = np.random.default_rng(seed)
    keys = offset + rng.choice(size * spread, size, replace=False).astype(np.int64)
    s = KeySet(pa.array(keys[: size // 2])).add(pa.array(keys[size // 2 :]))
    probe = np.concatenate(
        [keys[:50], keys[:50] + 1, keys[:50] - 1, rng.integers(-(2**63), 2**63 - 1, 50, dtype=np.int64)]
    )
    probe = np.concatenate([probe, np.array([-(2**63), 2**63 - 1], dtype=np.int64)])
    assert s.contains(pa.array(probe)).tolist() == np.isin(probe, keys).tolist()
