"""Base index catch-up (`Table.catch_up_indexes`, `memwal_df.jobs.index_catchup`).

The tests check the coverage oracle `support.jobs.assert_catchup_covered`; one proves it can fail.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import lance
import pyarrow as pa
import pytest
from support.jobs import Workload, assert_catchup_covered, catchup_at, create, rows_at

import memwal_df as mw
from memwal_df.format import memwal_index
from memwal_df.jobs.index_catchup import progress_entry

ZERO = timedelta(0)


def _write(table, work: Workload, generations: int) -> None:
    with table.writer() as w:
        for _ in range(generations):
            work.generation(w)


def _merged(table) -> dict:
    table.refresh()
    return memwal_index.merged_generations(table.details)


def test_catch_up_rebuilds_lagging_index_and_lets_gc_go(table_uri, table_storage_options):
    table = create(table_uri, table_storage_options, regions=2)
    work = Workload(table, seed=21)
    ds = lance.dataset(table.uri, storage_options=table_storage_options)
    ds.create_scalar_index("id", "BTREE")  # before any merge: nothing to record yet
    _write(table, work, 3)
    table.merge()
    assert table.gc(grace=ZERO).generations == {}  # the index covers no merged generation yet
    result = table.catch_up_indexes()
    (idx,) = result.indexes
    assert idx.name == "id_idx" and idx.rebuilt and idx.covers_latest and not idx.unverified
    assert idx.caught_up == _merged(table) == catchup_at(table, result.version)["id_idx"]
    assert_catchup_covered(table)
    again = table.catch_up_indexes()  # nothing new: no rebuild, no commit
    assert not again.indexes[0].rebuilt and not again.indexes[0].raised
    assert again.version == result.version
    lance.dataset(table.uri, storage_options=table_storage_options).cleanup_old_versions(older_than=ZERO)
    removed = table.gc(grace=ZERO)
    assert removed.generations == {r: tuple(range(1, g + 1)) for r, g in _merged(table).items()}
    assert rows_at(table) == work.model


def test_merge_without_new_fragments_is_recorded_by_catch_up(tmp_path):
    table = create(str(tmp_path / "t"), None, regions=1)
    work = Workload(table, seed=22)
    _write(table, work, 1)
    table.merge()
    lance.dataset(table.uri).create_scalar_index("id", "BTREE")  # Lance records catch-up = merged
    with table.writer() as w:  # a generation of tombstones only: its merge adds no fragment
        w.delete(pa.table({"id": pa.array([1, 2], pa.int64())}))
        w.flush()
    table.merge()
    ((region, gen),) = _merged(table).items()
    assert gen == 2 and catchup_at(table, table.dataset.version)["id_idx"] == {region: 1}
    (idx,) = table.catch_up_indexes().indexes
    assert not idx.rebuilt and idx.raised == {region: 2} and idx.caught_up == {region: 2}
    assert_catchup_covered(table)


def test_only_maintained_indexes_are_caught_up(tmp_path):
    data = pa.table({"id": pa.array(range(50), pa.int64()), "v": pa.array([0.0] * 50)})
    table = mw.create_table(
        str(tmp_path / "t"), data, "id", region_spec=mw.bucket("id", 2), maintained_indexes=[]
    )
    lance.dataset(table.uri).create_scalar_index("v", "BTREE")
    work = Workload(table, seed=23, base=50)
    _write(table, work, 2)
    table.merge()
    version = lance.dataset(table.uri).version
    result = table.catch_up_indexes()
    assert result.indexes == () and result.version == version  # nothing rebuilt, nothing recorded
    lance.dataset(table.uri).cleanup_old_versions(older_than=ZERO)
    assert table.gc(grace=ZERO).generations  # GC does not wait for an index nobody maintains


@pytest.mark.parametrize("rounds", [6])
def test_catch_up_racing_writer_and_merger_claims_only_covered_rows(tmp_path, rounds):
    table = create(str(tmp_path / "t"), None, regions=2)
    lance.dataset(table.uri).create_scalar_index("id", "BTREE")
    work = Workload(table, seed=24)
    done = threading.Event()
    errors: list[BaseException] = []

    def loop(job) -> None:
        while not done.is_set():
            try:
                job()
            except Exception as e:  # noqa: BLE001 - conflicts are expected; anything else is not
                if "race" not in str(e) and "oncurrent" not in str(e) and "onflict" not in str(e):
                    errors.append(e)

    jobs = [threading.Thread(target=loop, args=(j,)) for j in (table.merge, table.catch_up_indexes)]
    for t in jobs:
        t.start()
    try:
        _write(table, work, rounds)
    finally:
        done.set()
        for t in jobs:
            t.join()
    assert not errors, errors
    table.merge()
    table.catch_up_indexes()
    assert catchup_at(table, lance.dataset(table.uri).version)["id_idx"] == _merged(table)
    assert_catchup_covered(table)
    assert rows_at(table) == work.model


def test_the_oracle_catches_a_claim_the_index_does_not_cover(tmp_path):
    table = create(str(tmp_path / "t"), None, regions=1)
    lance.dataset(table.uri).create_scalar_index("id", "BTREE")
    _write(table, Workload(table, seed=25), 1)
    table.merge()  # the merge wrote a fragment the index does not cover
    assert_catchup_covered(table)
    details = table.details
    details.index_catchup.add().CopyFrom(progress_entry("id_idx", _merged(table)))  # claim it anyway
    memwal_index.replace_details(table.uri, details, table.dataset.version)
    with pytest.raises(AssertionError, match="is not indexed"):
        assert_catchup_covered(table)
