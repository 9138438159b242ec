"""Health you can see: `table.status()["health"]` (fragments, deletion files, compaction debt, index
segments and coverage) after real merges, index catch-ups and compactions; the maintain loop's job
error record (a job failing on a corrupt region manifest, seen from a freshly opened table and from
`memwal status --json`, resolved once the job succeeds again, never failing a round when it cannot be
written); `memwal compact`; `memwal maintain` printing each failed job on stderr, also `--quiet`,
and its compaction and index upkeep flags."""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import lance
import numpy as np
import pyarrow as pa
import pytest
from support.optional import not_none

import memwal_df as mw
from memwal_df.cli import Exit, main
from memwal_df.errors import StorageError
from memwal_df.format import layout
from memwal_df.jobs import health
from memwal_df.jobs.compaction import CompactionSettings
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings

ZERO = timedelta(0)
VEC = pa.list_(pa.float32(), 4)


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _rows(keys: list[int], tag: float = 0.0) -> pa.Table:
    return pa.table({"id": pa.array(keys, pa.int64()), "v": pa.array([tag] * len(keys), pa.float64())})


def _table(uri: str, regions: int = 2, base: int = 100) -> mw.Table:
    return mw.create_table(uri, _rows(list(range(base))), "id", region_spec=mw.bucket("id", regions))


def _upsert_and_merge(table: mw.Table, keys: list[int], tag: float = 1.0) -> None:
    with table.writer() as w:
        w.put(_rows(keys, tag))
    table.merge()


def _health(table: mw.Table) -> health.Health:
    found = table.status(check_wal=False)["health"]
    assert isinstance(found, health.Health)
    return found


def _vector_rows(keys: list[int]) -> pa.Table:
    rng = np.random.default_rng(keys[0])
    vectors = rng.random((len(keys), 4), dtype=np.float32).tolist()
    return pa.table({"id": pa.array(keys, pa.int64()), "vec": pa.array(vectors, VEC)})


def _vector_table(uri: str) -> mw.Table:
    table = mw.create_table(uri, _vector_rows(list(range(256))), "id", region_spec=mw.bucket("id", 1))
    lance.dataset(uri).create_index("vec", "IVF_FLAT", num_partitions=2)
    return table


def _corrupt_manifest(table: mw.Table) -> tuple[str, bytes]:
    """Cut the latest manifest of the first region in half (a torn write): its path and bytes."""
    region = table.region_ids()[0]
    path = layout.manifest_path(region, not_none(table.region_status(region)).manifest_version)
    data = table.storage.get(path)
    table.storage.put(path, data[: len(data) // 2])
    return path, data


# ---------------------------------------------------------------------------------------------------
# the base table's shape and its indexes
# ---------------------------------------------------------------------------------------------------


def test_health_counts_fragments_deletions_and_debt_after_merges(tmp_path):
    table = _table(str(tmp_path / "t"))
    lance.dataset(table.uri).create_scalar_index("id", "BTREE")
    first = _health(table)
    assert (first.fragments, first.fragments_with_deletions, first.deleted_rows) == (1, 0, 0)
    assert first.compaction.small_fragments == 1 and not first.compaction.due
    (btree,) = first.indexes
    assert (btree.name, btree.maintained, btree.segments) == ("id_idx", True, 1)
    assert (btree.rows_indexed, btree.base_rows, btree.unindexed_fragments) == (100, 100, 0)

    small = CompactionSettings(min_small_fragments=4, max_deleted_share=1.0)
    due = []
    for i in range(2):  # new keys only: one new fragment per region per merge, nothing deleted
        _upsert_and_merge(table, list(range(100 + 10 * i, 110 + 10 * i)))
        got = _health(table)
        assert (got.fragments, got.fragments_with_deletions) == (1 + 2 * (i + 1), 0)
        assert not got.compaction.due  # 16 small fragments by default
        (btree,) = got.indexes  # the merged fragments are not indexed until catch-up
        assert (btree.unindexed_fragments, btree.unindexed_rows) == (2, 10)
        assert (btree.rows_indexed, btree.base_rows) == (100 + 10 * i, 110 + 10 * i)
        table.catch_up_indexes()
        (btree,) = _health(table).indexes
        assert (btree.segments, btree.unindexed_fragments, btree.rows_indexed) == (1, 0, 110 + 10 * i)
        due.append(health.table_health(table.dataset, table.details, table.storage, small).compaction.due)
    assert due == [False, True]  # 3 small fragments, then 5 (>= 4)

    _upsert_and_merge(table, list(range(20)), 2.0)  # 20 of the base fragment's 100 rows replaced
    got = _health(table)
    assert got.fragments == 7 and got.fragments_with_deletions == 1 and got.deleted_rows == 20
    assert got.deleted_share == pytest.approx(20 / (120 + 20))
    assert got.compaction.mostly_deleted_fragments == 1 and got.compaction.due  # 20% >= 10%
    assert got.physical_rows - got.deleted_rows == table.status()["base_rows"] == 120

    table.compact(CompactionSettings(min_small_fragments=2))
    got = _health(table)  # indexed and unindexed fragments are compacted apart (Lance)
    assert (got.fragments, got.fragments_with_deletions, got.deleted_rows) == (2, 0, 0)
    assert not got.compaction.due and got.indexes[0].unindexed_fragments == 1
    table.catch_up_indexes()
    (btree,) = _health(table).indexes
    assert (btree.unindexed_fragments, btree.rows_indexed, btree.base_rows) == (0, 120, 120)


def test_health_counts_index_segments_through_catch_up(tmp_path):
    table = _vector_table(str(tmp_path / "t"))
    upkeep = IndexUpkeepSettings(max_segments=2, retrain_share=100)  # never retrain here
    seen = []
    for i in range(4):
        with table.writer() as w:
            w.put(_vector_rows(list(range(1000 + 10 * i, 1010 + 10 * i))))
        table.merge()
        (vec,) = _health(table).indexes
        assert (vec.index_type, vec.unindexed_fragments, vec.unindexed_rows) == ("IVF_FLAT", 1, 10)
        done = table.catch_up_indexes(upkeep=upkeep).indexes[0]
        (vec,) = _health(table).indexes
        described = {d.name: d for d in lance.dataset(table.uri).describe_indices()}
        assert vec.segments == len(described["vec_idx"].segments)
        assert (vec.unindexed_fragments, vec.rows_indexed, vec.base_rows) == (0, 266 + 10 * i, 266 + 10 * i)
        if done.merged_segments:
            assert vec.segments == 1
        seen.append(vec.segments)
    assert max(seen) == 2 and 1 in seen[1:]  # delta segments appear and are merged at the bound


# ---------------------------------------------------------------------------------------------------
# job errors of the maintain loop
# ---------------------------------------------------------------------------------------------------


def test_a_failing_job_is_recorded_seen_from_another_reader_and_resolved(tmp_path, capsys):
    table = _table(str(tmp_path / "t"))
    with table.writer() as w:  # a flushed generation in each region
        w.put(_rows(list(range(40)), 1.0))
    path, original = _corrupt_manifest(table)

    table.maintain(interval=0, max_rounds=2, grace=ZERO, version_retention=None)
    errors = mw.open_table(table.uri).status()["health"].job_errors
    assert {"merge", "build_index", "gc"} <= set(errors)
    merge = errors["merge"]
    assert (merge.error_type, merge.round, merge.failures) == ("CorruptRegionsError", 2, 2)
    assert not merge.resolved
    assert path in merge.message and "\n" not in merge.message
    assert "catch_up_indexes" not in errors  # it did not fail

    code, out, _ = _cli(capsys, "status", table.uri, "--json")
    assert code == Exit.FAILED  # a corrupt region
    listed = json.loads(out)["health"]["job_errors"]["merge"]
    assert listed["error_type"] == "CorruptRegionsError" and listed["resolved_at"] is None
    assert listed["failures"] == 2 and path in listed["message"]
    code, out, _ = _cli(capsys, "status", table.uri)
    assert code == Exit.FAILED and "merge: FAILING (2 rounds in a row)" in out and "CORRUPT" in out

    table.storage.put(path, original)  # the manifest restored (from a backup)
    (done,) = table.maintain(interval=0, max_rounds=1, grace=ZERO, version_retention=None)
    assert not done.errors
    errors = mw.open_table(table.uri).status()["health"].job_errors
    assert all(e.resolved for e in errors.values()) and errors["merge"].round == 2
    code, out, _ = _cli(capsys, "status", table.uri)
    assert code == Exit.OK and "merge: resolved" in out and "FAILING" not in out
    stored = table.storage.get(health.JOB_ERRORS_PATH)
    table.maintain(interval=0, max_rounds=1, grace=ZERO, version_retention=None)
    assert table.storage.get(health.JOB_ERRORS_PATH) == stored  # nothing changed: not rewritten


def test_recording_never_fails_a_round(tmp_path, caplog, monkeypatch):
    table = _table(str(tmp_path / "t"))
    with table.writer() as w:
        w.put(_rows(list(range(40)), 1.0))
    _corrupt_manifest(table)
    put = table.storage.put

    def failing_put(p: str, data: bytes) -> None:
        if p == health.JOB_ERRORS_PATH:
            raise StorageError(f"no space left writing {p}")
        put(p, data)

    monkeypatch.setattr(table.storage, "put", failing_put)
    with caplog.at_level(logging.WARNING, logger="memwal_df.jobs.health"):
        (done,) = table.maintain(interval=0, max_rounds=1, grace=ZERO, version_retention=None)
    assert "merge" in done.errors and "merge" in done.results  # the round ran and reported
    assert any("could not record job errors" in r.getMessage() for r in caplog.records)
    assert mw.open_table(table.uri).status()["health"].job_errors == {}


def test_job_error_record_updates():
    boom = ValueError("first line\n  second   line")
    first = health.updated_job_errors({}, 1, ["a", "b"], {"a": boom}, now=10.0)
    assert first == {"a": health.JobError("a", 10.0, 1, "ValueError", "first line second line")}
    second = health.updated_job_errors(first, 2, ["a", "b"], {"a": boom}, now=20.0)
    assert second["a"].failures == 2 and second["a"].failed_at == 20.0
    third = health.updated_job_errors(second, 3, ["a"], {}, now=30.0)
    assert third["a"].resolved_at == 30.0 and third["a"].failures == 2 and third["a"].round == 2
    again = health.updated_job_errors(third, 4, ["a"], {"a": KeyError("x")}, now=40.0)
    assert (again["a"].failures, again["a"].resolved_at, again["a"].error_type) == (1, None, "KeyError")
    assert len(health.one_line(ValueError("x" * 2000))) == health.MAX_MESSAGE


# ---------------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------------


def test_compact_command(tmp_path, capsys):
    table = _table(str(tmp_path / "t"))
    for i in range(2):
        _upsert_and_merge(table, list(range(100 + 10 * i, 110 + 10 * i)))
    rows_before = table.status()["base_rows"]

    code, out, _ = _cli(capsys, "compact", table.uri)  # 5 small fragments: not due by default
    assert code == Exit.OK and "not due" in out and "nothing rewritten" in out
    code, out, err = _cli(capsys, "compact", table.uri, "--min-small-fragments", "4", "--json")
    assert code == Exit.OK, err
    done = json.loads(out)
    assert done["debt"]["fragments"] == 5 and len(done["debt"]["small"]) == 5 and done["debt"]["due"]
    assert done["compacted"] and done["fragments_removed"] == 5 and done["fragments_added"] == 1
    got = _health(mw.open_table(table.uri))
    assert got.fragments == 1 and got.physical_rows == rows_before
    code, out, _ = _cli(capsys, "compact", table.uri, "--min-small-fragments", "4")
    assert code == Exit.OK and "debt: 1 fragment" in out and "nothing rewritten" in out

    code, _, err = _cli(capsys, "compact", table.uri, "--max-deleted-share", "0")
    assert code == Exit.USAGE and "max_deleted_share" in err


def test_maintain_prints_each_failed_job_also_quiet(tmp_path, capsys):
    table = _table(str(tmp_path / "t"))
    with table.writer() as w:
        w.put(_rows(list(range(40)), 1.0))
    path, _ = _corrupt_manifest(table)
    argv = ["maintain", table.uri, "--rounds", "2", "--interval", "0", "--grace", "0", "--no-compact"]

    code, out, err = _cli(capsys, *argv, "--quiet")
    assert code == Exit.FAILED
    for n in (1, 2):
        for job in ("merge", "build_index", "gc"):
            line = next(x for x in err.splitlines() if x.startswith(f"round {n}: {job} failed: "))
            assert "CorruptRegionsError" in line and path in line
    assert "failed jobs: build_index, gc, merge" in out and path in out

    code, out, err = _cli(capsys, *argv, "--json")
    assert code == Exit.FAILED and "round 1: merge failed: CorruptRegionsError" in err
    rounds = json.loads(out)
    assert [r["round"] for r in rounds] == [1, 2] and "compact" not in rounds[0]["jobs"]
    failure = rounds[-1]["errors"]["merge"]
    assert failure["error_type"] == "CorruptRegionsError" and path in failure["message"]

    code, _, err = _cli(capsys, *argv[:2], "--rounds", "1", "--max-index-segments", "0")
    assert code == Exit.USAGE and "max_segments" in err


def test_maintain_compaction_and_index_upkeep_flags(tmp_path, capsys):
    table = _vector_table(str(tmp_path / "t"))
    argv = ["maintain", table.uri, "--rounds", "1", "--interval", "0", "--quiet", "--json"]
    argv += ["--max-index-segments", "1", "--retrain-share", "100"]
    argv += ["--min-small-fragments", "2", "--max-deleted-share", "1"]
    fragments = []
    for i in range(3):
        with table.writer() as w:
            w.put(_vector_rows(list(range(1000 + 10 * i, 1010 + 10 * i))))
        code, out, err = _cli(capsys, *argv)
        assert code == Exit.OK, err
        (done,) = json.loads(out)
        assert "compact" in done["jobs"] and not done["errors"]
        got = json.loads(_cli(capsys, "status", table.uri, "--json")[1])["health"]
        (vec,) = got["indexes"]
        assert vec["segments"] == 1 and vec["unindexed_fragments"] == 0  # merged into one every round
        assert vec["rows_indexed"] == vec["base_rows"] == 266 + 10 * i
        fragments.append(got["fragments"])
    assert fragments == [1, 1, 1]  # two small fragments after each merge: compacted into one
