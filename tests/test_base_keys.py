"""The base key index and the deletion files it reads, against Lance itself: an index patched across
base versions (appends, deletes, updates, compaction, an older version read after a newer one) locates
exactly what an index read afresh locates, and every masked scan equals Lance's own rows."""

from __future__ import annotations

import itertools
import struct
from unittest import mock

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.optional import not_none

from memwal_df.format.deletion_files import decode, deleted_offsets, roaring_values
from memwal_df.format.open_storage import open_storage
from memwal_df.format.storage import Storage
from memwal_df.read.lsm.base_key_index import BaseKeyIndex, BaseShadow, ShadowSet, fragment_signatures
from memwal_df.read.scan import masked_scan
from memwal_df.read.scan.masked_scan import MaskedScanExec, fragment_rows
from memwal_df.read.scan.spans import base_spans


def _rows(ids: np.ndarray, tag: int = 0) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "v": pa.array((ids % 13 + tag).astype(np.float64))})


def _live(ds: lance.LanceDataset) -> pa.Table:
    return ds.to_table(columns=["id"], with_row_address=True)


def _lance_deleted(ds: lance.LanceDataset, fragment) -> np.ndarray:
    live = ds.scanner(columns=[], with_row_address=True, fragments=[fragment]).to_table()
    offsets = live.column("_rowaddr").to_numpy() & 0xFFFFFFFF
    return np.setdiff1d(np.arange(fragment.metadata.physical_rows), offsets).astype(np.uint32)


@pytest.mark.parametrize(
    "where",
    [
        "id IN (3, 5, 900)",  # a few: an Arrow deletion file
        "id % 3 = 0",  # many: a Roaring bitmap
        "id >= 10000 AND id < 60000",  # one long range
        "id < 70000 AND id % 2 = 1",  # more than one container of each kind
    ],
)
def test_deletion_files_read_as_lance_reads_them(tmp_path, where):
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(100_000)), uri)
    ds = lance.dataset(uri)
    ds.delete(where)
    ds = lance.dataset(uri)
    (fragment,) = ds.get_fragments()
    d = not_none(fragment.metadata.deletion_file)
    data = open_storage(uri).get(not_none(fragment.deletion_file()))
    assert np.array_equal(decode(data, d.file_type), _lance_deleted(ds, fragment))
    assert np.array_equal(deleted_offsets(open_storage(uri), fragment), _lance_deleted(ds, fragment))
    assert np.array_equal(deleted_offsets(None, fragment), _lance_deleted(ds, fragment))  # Lance's scan


def _roaring_with_runs(runs: list[tuple[int, int]], array: list[int]) -> bytes:
    """A portable Roaring bitmap of two containers: one run container (key 0), one array (key 1)."""
    n = 2
    out = struct.pack("<I", 12347 | ((n - 1) << 16)) + bytes([0b01])  # container 0 holds runs
    card0 = sum(length for _, length in runs)
    out += struct.pack("<HHHH", 0, card0 - 1, 1, len(array) - 1)
    out += struct.pack("<H", len(runs)) + b"".join(struct.pack("<HH", s, n - 1) for s, n in runs)
    out += b"".join(struct.pack("<H", v) for v in array)
    return out


def test_roaring_run_containers_and_bad_bytes():
    data = _roaring_with_runs([(2, 3), (10, 1), (100, 4)], [7, 9])
    want = [2, 3, 4, 10, 100, 101, 102, 103, 65536 + 7, 65536 + 9]
    assert roaring_values(data).tolist() == want
    for bad in (b"", b"\x00\x00\x00\x00", data[:9]):
        with pytest.raises(ValueError):
            roaring_values(bad)
    with pytest.raises(ValueError):
        decode(b"not arrow", "array")
    with pytest.raises(ValueError):
        decode(data, "something else")


def _expected(ds: lance.LanceDataset, keys: np.ndarray) -> np.ndarray:
    t = _live(ds)
    hit = np.isin(t.column("id").to_numpy(), keys)
    return np.sort(t.column("_rowaddr").to_numpy()[hit].astype(np.uint64))


CHANGES = st.lists(
    st.sampled_from(["append", "delete", "update", "compact", "older"]), min_size=1, max_size=8
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=CHANGES, seed=st.integers(0, 2**16))
def test_patched_index_locates_what_a_fresh_one_does(tmp_path_factory, changes, seed):
    rng = np.random.default_rng(seed)
    uri = str(tmp_path_factory.mktemp("idx") / "t")
    lance.write_dataset(_rows(np.arange(3000)), uri, max_rows_per_file=1200)
    storage = open_storage(uri)
    ds = lance.dataset(uri)
    index = BaseKeyIndex.build(ds, storage, ["id"], pa.int64())
    top = 3000
    for step, change in enumerate(changes):
        ds = lance.dataset(uri)  # changes go to the latest version
        if change == "append":
            lance.write_dataset(_rows(np.arange(top, top + 200)), uri, mode="append")
            top += 200
        elif change == "delete":
            ds.delete(f"id % {int(rng.integers(5, 40))} = {int(rng.integers(0, 5))}")
        elif change == "update":
            ids = rng.choice(top, 150, replace=False)
            ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
                _rows(ids, step)
            )
        elif change == "compact":
            ds.optimize.compact_files(target_rows_per_fragment=100_000)
        ds = lance.dataset(uri)
        if change == "older" and ds.version > 1:
            ds = lance.dataset(uri, version=int(rng.integers(1, ds.version)))
        index = index.advance(ds, storage, ["id"], fragment_signatures(ds))
        probe = np.unique(np.r_[rng.choice(top + 100, 400), np.arange(0, 50)]).astype(np.int64)
        assert np.array_equal(index.locate(pa.array(probe)), _expected(ds, probe)), change
        fresh = BaseKeyIndex.build(ds, storage, ["id"], pa.int64())
        assert np.array_equal(fresh.locate(pa.array(probe)), index.locate(pa.array(probe)))
        _check_masked_scans(ds, index, probe, storage)


def _check_masked_scans(
    ds: lance.LanceDataset, index: BaseKeyIndex, keys: np.ndarray, storage: Storage
) -> None:
    part = BaseShadow(index.locate(pa.array(keys)), index.physical_rows)
    shadow = ShadowSet([part], lambda: index.mask([part]))
    live_rows = _live(ds)
    want = live_rows.filter(pa.array(~np.isin(live_rows.column("id").to_numpy(), keys)))
    # live spans only without a filter (as the planner makes them); physical spans with and without
    cases = [(True, None), (False, None), (False, pc.field("id") < 1700)]
    # through Lance with the usual head scan; with a tiny head scan; with the storage (fragments with
    # deletion files read from their data files directly)
    variants = [(masked_scan.HEAD_ROWS, None), (7, None), (7, storage)]
    for (live, flt), (head, store) in itertools.product(cases, variants):
        fragments = list(fragment_rows(ds, live).items())
        spans = base_spans(fragments, 3, 1)
        with (
            mock.patch.object(masked_scan, "HEAD_ROWS", head),
            mock.patch.object(masked_scan, "DIRECT_MIN_ROWS", 0),  # small fragments read directly too
        ):  # first scans split into a head and the rest
            scans = [
                MaskedScanExec(
                    ds, s, ["id"], flt, lambda: shadow, live=live, counts_all=i == 0, storage=store
                )
                for i, s in enumerate(spans)
            ]
            got = pa.Table.from_batches(
                [b for n in scans for b in n.execute()], schema=pa.schema([("id", pa.int64())])
            )
        expected = want if flt is None else want.filter(flt)
        ids = sorted(got.column("id").to_pylist())
        assert ids == sorted(expected.column("id").to_pylist()), (live, flt, head, store)
        if flt is not None:
            continue
        counts = [
            b.num_rows
            for i, s in enumerate(spans)
            for b in MaskedScanExec(ds, s, [], None, lambda: shadow, live=live, counts_all=i == 0).execute()
        ]
        assert sum(counts) == want.num_rows


def test_shadow_probes_and_counts_by_address():
    addrs = np.array([(1 << 32) | 5, 7, 3, (1 << 32) | 0], dtype=np.uint64)
    shadow = BaseShadow(addrs, {0: 10, 1: 6})
    probe = np.array([3, 4, 7, (1 << 32) | 5, (2 << 32) | 5, (1 << 32) | 9], dtype=np.uint64)
    assert shadow.hidden(probe).tolist() == [True, False, True, True, False, False]
    assert shadow.count_between(0, 1 << 32) == 2 and len(shadow) == 4


def test_take_by_key_reads_the_live_rows(tmp_path):
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(np.arange(5000)), uri, max_rows_per_file=2000)
    ds = lance.dataset(uri)
    ds.delete("id % 7 = 0")
    ds = lance.dataset(uri)
    storage = open_storage(uri)
    before = BaseKeyIndex.build(ds, storage, ["id"], pa.int64())
    ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
        _rows(np.array([1, 2, 3, 4999, 6000]), 5)
    )
    ds = lance.dataset(uri)
    patched = before.advance(ds, storage, ["id"], fragment_signatures(ds))
    for index in (BaseKeyIndex.build(ds, storage, ["id"], pa.int64()), patched):
        keys = np.array([0, 1, 2, 3, 8, 9, 1999, 2000, 2001, 4999, 6000, 7000], dtype=np.int64)
        got = index.take(ds, storage, pa.array(keys), ["id", "v"]).sort_by("id")
        want = ds.to_table(columns=["id", "v"], filter=f"id IN ({', '.join(map(str, keys))})")
        assert got.to_pylist() == want.sort_by("id").to_pylist()
