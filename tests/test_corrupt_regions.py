"""A corrupt region stays one region's problem, and an operator can repair it:

* `recover` replays every healthy region past a region with a corrupt WAL entry or manifest, then
  raises `CorruptRegionsError` naming each skipped region and file;
* a routed write or delete (API and `memwal ingest`) stores the rows of healthy regions and refuses
  only those of the corrupt region;
* `status` (API, CLI, `--json`, `--no-wal-check`) lists the corrupt file and error of each region;
* `maintain` / merge / GC / index build go on for the healthy regions and report the corrupt ones;
  the index build keeps the corrupt region's previous snapshot row;
* a corrupt region manifest fails only the queries that need that region (lookups, vector search
  filters, the pinned scan plan Spark distributes);
* `repair_region` / `memwal repair` say what is lost and change nothing without confirmation, set a
  corrupt trailing entry aside into the region's quarantine directory, refuse a corrupt entry in the
  middle unless told to discard the later entries, set aside corrupt entries generations already
  hold, leave a corrupt manifest alone, and leave a region that memwal_df and Lance claim and replay
  again.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support.cases import backend, cases
from support.figures import case_name, record

import memwal_df as mw
from memwal_df import errors
from memwal_df.cli import Exit, main
from memwal_df.format import layout, memwal_index
from memwal_df.format.wal import Wal
from memwal_df.jobs.index_builder import BuildResult
from memwal_df.read.expr.predicate import column_predicates
from memwal_df.read.lsm.snapshot import pin, restore, take_snapshot
from memwal_df.read.scan.planner import plan_scan

KEYS = range(40)
GUARANTEE = "a corrupt region stays one region's problem"


def _table(uri: str, options: dict[str, str] | None) -> mw.Table:
    base = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "v": ["b1", "b2", "b3"]})
    table = mw.create_table(uri, base, "id", region_spec=mw.bucket("id", 4), storage_options=options)
    with table.writer() as w:  # a flushed generation in every region
        w.put(_rows(KEYS, "g"))
    return table


def _rows(keys: Any, tag: str) -> pa.Table:
    keys = list(keys)
    return pa.table({"id": pa.array(keys, pa.int64()), "v": [f"{tag}{k}" for k in keys]})


def _status(table: mw.Table, region_id: uuid.UUID) -> mw.RegionStatus:
    status = table.region_status(region_id)
    assert status is not None
    return status


def _failed_path(failure: BaseException, region_id: uuid.UUID) -> str:
    """The corrupt file a CorruptRegionsError names for `region_id`."""
    assert isinstance(failure, errors.CorruptRegionsError)
    error = failure.errors[region_id]
    assert isinstance(
        error, errors.CorruptWalEntryError | errors.CorruptManifestError | errors.CorruptGenerationError
    )
    return error.path


def _keys_of(table: mw.Table, region_id: uuid.UUID) -> list[int]:
    assert table.spec is not None
    values = table.spec.evaluate(_rows(KEYS, ""), table.schema.field_ids)[0].to_pylist()
    return [k for k, v in zip(KEYS, values, strict=True) if table.region_id_for((v,)) == region_id]


def _unflushed(table: mw.Table, region_id: uuid.UUID, *puts: pa.Table) -> list[int]:
    """Durable WAL entries (one per put) that no generation covers, as a crashed writer leaves
    them; their positions."""
    rw = table.region_writer(region_id)
    positions = []
    for rows in puts:
        rw.put(rows)
        positions.append(rw.stats()["next_wal_position"] - 1)
    rw.abort()
    return positions


def _corrupt(table: mw.Table, path: str) -> bytes:
    """Cut the file at `path` (a torn write); its original bytes."""
    data = table.storage.get(path)
    table.storage.put(path, data[: len(data) // 2])
    return data


def _sql(uri: str, options: dict[str, str] | None, query: str) -> dict[int, str]:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri, storage_options=options))
    return {r["id"]: r["v"] for r in ctx.sql(query).to_arrow_table().to_pylist()}


def _options_args(options: dict[str, str] | None) -> list[str]:
    return [a for k, v in (options or {}).items() for a in ("-o", f"{k}={v}")]


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


# ---------------------------------------------------------------------------------------------------
# recover, routed writes, status, maintain
# ---------------------------------------------------------------------------------------------------


def test_recover_replays_healthy_regions_past_a_corrupt_wal_entry(request, tmp_path):
    table = _table(str(tmp_path / "t"), None)
    bad, *good = table.region_ids()
    (position,) = _unflushed(table, bad, _rows(_keys_of(table, bad)[:2], "lost"))
    path = layout.wal_path(bad, position)
    _corrupt(table, path)
    pending = {r: _keys_of(table, r)[:3] for r in good}
    for region_id, keys in pending.items():
        _unflushed(table, region_id, _rows(keys, "w"))

    with pytest.raises(errors.CorruptRegionsError) as e:
        table.recover()
    assert set(e.value.errors) == {bad}
    assert isinstance(e.value.errors[bad], errors.CorruptWalEntryError)
    assert _failed_path(e.value, bad) == path and path in str(e.value)
    assert isinstance(e.value.result, list) and sorted(e.value.result) == sorted(good)
    seen = _sql(table.uri, None, "SELECT * FROM t")  # the healthy regions' writes are flushed
    assert all(seen[k] == f"w{k}" for keys in pending.values() for k in keys)
    for region_id in good:
        status = _status(table, region_id)
        assert status.replay_after_wal_entry_position >= status.wal_entry_position_last_seen - 1
    record(
        GUARANTEE, case_name(request), corrupt_files=1, regions_recovered=len(good), rows_checked=len(seen)
    )


def test_recover_skips_a_region_whose_manifest_is_corrupt(request, tmp_path):
    table = _table(str(tmp_path / "t"), None)
    bad, good = table.region_ids()[:2]
    _unflushed(table, good, _rows(_keys_of(table, good)[:2], "w"))
    path = layout.manifest_path(bad, _status(table, bad).manifest_version)
    _corrupt(table, path)
    with pytest.raises(errors.CorruptRegionsError) as e:
        table.recover()
    assert _failed_path(e.value, bad) == path
    assert e.value.result == [good]
    record(GUARANTEE, case_name(request), corrupt_files=1, regions_recovered=1)


@pytest.mark.parametrize("what", ["wal", "manifest"])
def test_routed_write_stores_healthy_regions_and_refuses_the_corrupt_one(request, tmp_path, capsys, what):
    table = _table(str(tmp_path / "t"), None)
    bad = table.region_ids()[0]
    refused = _keys_of(table, bad)
    healthy = [k for k in KEYS if k not in refused]
    (position,) = _unflushed(table, bad, _rows(refused[:1], "x"))
    manifest = _status(table, bad).manifest_version
    path = layout.wal_path(bad, position) if what == "wal" else layout.manifest_path(bad, manifest)
    _corrupt(table, path)
    expected = errors.CorruptWalEntryError if what == "wal" else errors.CorruptManifestError
    w = table.writer()
    with pytest.raises(expected) as e:
        w.put(_rows(KEYS, "new"))
    assert isinstance(e.value, errors.CorruptWalEntryError | errors.CorruptManifestError)
    assert e.value.path == path and str(bad) in str(e.value)
    assert any("were not written" in n for n in e.value.__notes__)
    with pytest.raises(expected):
        w.delete(pa.array([refused[0], healthy[0]], pa.int64()))
    w.abort()  # a crash: only what is durable in the WAL survives
    with pytest.raises(errors.CorruptRegionsError):
        mw.open_table(table.uri).recover()
    listed = ", ".join(map(str, healthy))
    seen = _sql(table.uri, None, f"SELECT * FROM t WHERE id IN ({listed})")  # prunes the corrupt region
    assert seen == {k: f"new{k}" for k in healthy[1:]}  # healthy[0] was deleted
    if what == "wal":
        listed = ", ".join(map(str, refused))
        assert _sql(table.uri, None, f"SELECT * FROM t WHERE id IN ({listed})") == {
            k: f"g{k}" for k in refused
        }

    csv = tmp_path / "rows.csv"
    csv.write_text("id,v\n" + "".join(f"{k},cli{k}\n" for k in KEYS))
    code, out = _cli(capsys, "ingest", table.uri, str(csv))
    assert code == Exit.FAILED and path in out and "were not written" in out
    record(GUARANTEE, case_name(request), corrupt_files=1, rows_checked=len(seen))


@pytest.mark.parametrize("what", ["wal", "manifest"])
def test_status_lists_each_corrupt_region_file_and_error(request, tmp_path, capsys, what):
    table = _table(str(tmp_path / "t"), None)
    bad = table.region_ids()[0]
    (position,) = _unflushed(table, bad, _rows(_keys_of(table, bad)[:1], "x"))
    manifest = _status(table, bad).manifest_version
    path = layout.wal_path(bad, position) if what == "wal" else layout.manifest_path(bad, manifest)
    _corrupt(table, path)

    status = table.status()
    (problem,) = status["corrupt_regions"]
    assert (problem.region_id, problem.kind, problem.path) == (bad, what, path)
    expected = errors.CorruptWalEntryError if what == "wal" else errors.CorruptManifestError
    assert expected.__name__ not in problem.error and path in problem.error
    listed = {r.region_id for r in status["regions"]}
    assert listed == set(table.region_ids()) - ({bad} if what == "manifest" else set())

    code, out = _cli(capsys, "status", table.uri)  # exit code 1: a region is corrupt
    assert code == Exit.FAILED and "CORRUPT" in out and path in out and "--region REGION" in out
    unchecked = table.status(check_wal=False)["corrupt_regions"]
    assert unchecked == ([] if what == "wal" else [problem])
    code, out = _cli(capsys, "status", table.uri, "--no-wal-check")
    assert code == (Exit.FAILED if what == "manifest" else Exit.OK) and (path in out) == (what == "manifest")
    code, out = _cli(capsys, "status", table.uri, "--json")
    assert code == Exit.FAILED
    (listed_json,) = json.loads(out)["corrupt_regions"]
    assert listed_json["region_id"] == str(bad) and listed_json["path"] == path
    record(GUARANTEE, case_name(request), corrupt_files=1, entry_points_checked=3)


def test_maintain_and_jobs_go_on_for_healthy_regions(request, tmp_path, capsys):
    table = _table(str(tmp_path / "t"), None)
    bad = table.region_ids()[0]
    path = layout.manifest_path(bad, _status(table, bad).manifest_version)
    _corrupt(table, path)

    (done,) = table.maintain(interval=0, max_rounds=1, version_retention=None, grace=timedelta(0))
    for job in ("merge", "build_index", "gc"):
        assert isinstance(done.errors[job], errors.CorruptRegionsError), job
        assert _failed_path(done.errors[job], bad) == path
    progress = memwal_index.merged_generations(mw.open_table(table.uri).details)
    assert bad not in progress and all(progress[r] >= 1 for r in table.region_ids() if r != bad)
    assert len(done.results["merge"].regions) == len(table.region_ids()) - 1
    assert done.results["build_index"].regions == len(table.region_ids()) - 1

    code, out = _cli(capsys, "maintain", table.uri, "--rounds", "1", "--interval", "0")
    assert code == Exit.FAILED and path in out
    code, out = _cli(capsys, "merge", table.uri)
    assert code == Exit.FAILED and "skipped 1 corrupt region" in out and path in out
    code, out = _cli(capsys, "recover", table.uri, "--json")
    assert code == Exit.FAILED and json.loads(out)["corrupt_regions"][str(bad)].endswith(path)
    record(GUARANTEE, case_name(request), corrupt_files=1, entry_points_checked=7)


def test_index_build_keeps_the_snapshot_row_of_a_region_with_a_corrupt_manifest(request, tmp_path):
    table = _table(str(tmp_path / "t"), None)
    table.build_index()
    bad = table.region_ids()[0]
    path = layout.manifest_path(bad, _status(table, bad).manifest_version)
    _corrupt(table, path)
    with pytest.raises(errors.CorruptRegionsError) as e:
        table.build_index()
    assert _failed_path(e.value, bad) == path
    assert isinstance(e.value.result, BuildResult)
    assert e.value.result.regions == len(table.region_ids())  # the corrupt region's row is kept
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(table.uri, consistency="snapshot"))
    rows = ctx.sql("SELECT id, v FROM t").to_arrow_table().to_pylist()
    assert {r["id"]: r["v"] for r in rows} == {k: f"g{k}" for k in KEYS}
    record(GUARANTEE, case_name(request), corrupt_files=1, rows_checked=len(rows))


# ---------------------------------------------------------------------------------------------------
# Queries
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", cases([("local",)], [("local",), ("s3",)]))
def test_corrupt_manifest_fails_only_queries_that_need_the_region(request, tmp_path, kind):
    uri, options = backend(request, kind, tmp_path)
    table = _table(uri, options)
    bad, good = table.region_ids()[:2]
    b, g = _keys_of(table, bad)[0], _keys_of(table, good)
    path = layout.manifest_path(bad, _status(table, bad).manifest_version)
    _corrupt(table, path)
    assert _sql(uri, options, f"SELECT * FROM t WHERE id = {g[0]}") == {g[0]: f"g{g[0]}"}
    in_list = ", ".join(map(str, g[:3]))
    assert _sql(uri, options, f"SELECT * FROM t WHERE id IN ({in_list})") == {k: f"g{k}" for k in g[:3]}
    for query in (
        f"SELECT * FROM t WHERE id = {b}",
        f"SELECT * FROM t WHERE id IN ({b}, {g[0]})",
        "SELECT * FROM t",
    ):
        with pytest.raises(Exception, match=f"CorruptManifestError.*{path}"):
            _sql(uri, options, query)
    lookup = mw.MemWalTable(uri, storage_options=options)
    with pytest.raises(errors.CorruptManifestError) as e:
        lookup.to_table(filter=None)
    assert e.value.path == path
    record(GUARANTEE, case_name(request), corrupt_files=1, queries_checked=6)


def test_search_runs_when_its_filter_prunes_a_region_with_a_corrupt_manifest(request, tmp_path):
    uri = str(tmp_path / "t")
    vec = pa.list_(pa.float32(), 2)
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("vec", vec)])
    table = mw.create_table(uri, schema, "id", region_spec=mw.bucket("id", 4))
    with table.writer() as w:
        w.put(pa.table({"id": pa.array(KEYS, pa.int64()), "vec": pa.array([[k, 0] for k in KEYS], vec)}))
    bad, good = table.region_ids()[:2]
    g = _keys_of(table, good)[0]
    path = layout.manifest_path(bad, _status(table, bad).manifest_version)
    _corrupt(table, path)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    search = "SELECT id FROM vector_search('t', 'vec', [0.0, 0.0], 5{})"
    pruned = search.format(f", named_struct('filter', 'id = {g}')")
    assert ctx.sql(pruned).to_arrow_table().column("id").to_pylist() == [g]
    with pytest.raises(Exception, match=f"CorruptManifestError.*{path}"):
        ctx.sql(search.format("")).to_arrow_table()
    record(GUARANTEE, case_name(request), corrupt_files=1, queries_checked=2)


def test_pinned_scan_leaves_out_an_unreadable_region_its_filter_prunes(request, tmp_path):
    """The scan plan Spark distributes: planned on the driver, pinned, restored and planned again in
    each task."""
    table = _table(str(tmp_path / "t"), None)
    bad, good = table.region_ids()[:2]
    g = _keys_of(table, good)[0]
    path = layout.manifest_path(bad, _status(table, bad).manifest_version)
    _corrupt(table, path)
    reader = mw.open_table(table.uri)
    snapshot = take_snapshot(reader)
    with pytest.raises(errors.CorruptManifestError) as e:  # every region is needed
        plan_scan(snapshot, reader.specs, None, {})
    assert e.value.path == path
    flt = pc.field("id") == g
    driver = plan_scan(snapshot, reader.specs, flt, column_predicates(flt))
    task = plan_scan(restore(reader, pin(snapshot)), reader.specs, flt, column_predicates(flt))
    assert [p.label for p in task] == [p.label for p in driver]
    rows = [r for p in task for b in p.make(["id", "v"]).execute() for r in b.to_pylist()]
    assert rows == [{"id": g, "v": f"g{g}"}]
    record(GUARANTEE, case_name(request), corrupt_files=1, rows_checked=len(rows))


# ---------------------------------------------------------------------------------------------------
# Repair
# ---------------------------------------------------------------------------------------------------


def _listing(table: mw.Table, region_id: uuid.UUID) -> dict[str, bytes]:
    prefix = layout.region_dir(region_id)
    return {p: table.storage.get(p) for p in table.storage.list(prefix)}


@pytest.mark.parametrize("kind", cases([("local",), ("s3",)], [("local",), ("s3",)]))
def test_repair_sets_a_corrupt_trailing_entry_aside(request, tmp_path, capsys, kind):
    uri, options = backend(request, kind, tmp_path)
    table = _table(uri, options)
    bad = table.region_ids()[0]
    keys = _keys_of(table, bad)
    kept, torn = _unflushed(table, bad, _rows(keys[:2], "acked"), _rows(keys[2:4], "torn"))
    path = layout.wal_path(bad, torn)
    original = _corrupt(table, path)
    before = _listing(table, bad)

    plan = table.repair_region(bad)  # a plan only
    assert not plan.applied and plan.trailing and [e.position for e in plan.entries] == [torn]
    assert plan.entries[0].path == path and plan.entries[0].error is not None
    assert f"position {torn}" in plan.describe() and path in plan.describe()
    code, out = _cli(capsys, "repair", uri, "--region", str(bad), *_options_args(options))
    assert code == Exit.OK and path in out and "--yes" in out
    assert _listing(table, bad) == before  # nothing changed without confirmation

    code, out = _cli(capsys, "repair", uri, "--region", str(bad), "--yes", *_options_args(options))
    assert code == Exit.OK, out
    moved = [p for p in table.storage.list(layout.region_dir(bad)) if "/quarantine/" in p]
    assert len(moved) == 1 and moved[0].endswith(path.rsplit("/", 1)[1])
    assert table.storage.get(moved[0]) == original[: len(original) // 2]  # set aside as it was
    sentinel = Wal(table.storage, bad).read(torn)
    assert sentinel is not None
    assert sentinel.is_sentinel and sentinel.writer_epoch == _status(table, bad).writer_epoch

    assert table.recover() == [bad]  # the acknowledged entry before it is replayed
    assert table.status()["corrupt_regions"] == []
    seen = _sql(uri, options, "SELECT * FROM t")
    assert {k: seen[k] for k in keys[:4]} == {
        keys[0]: f"acked{keys[0]}",
        keys[1]: f"acked{keys[1]}",
        keys[2]: f"g{keys[2]}",
        keys[3]: f"g{keys[3]}",
    }
    assert kept < torn
    with table.writer() as w:
        w.put(_rows(keys[2:4], "after"))
    # Lance claims the repaired region, replays across the sentinel and flushes.
    lance.dataset(uri, storage_options=options).mem_wal_writer(str(bad)).close()
    seen = _sql(uri, options, "SELECT * FROM t")
    assert {k: seen[k] for k in keys[2:4]} == {k: f"after{k}" for k in keys[2:4]}
    record(GUARANTEE, case_name(request), corrupt_files=1, entries_set_aside=1, rows_checked=len(seen))


def test_repair_refuses_a_corrupt_middle_entry_unless_told_to_discard_later_ones(request, tmp_path, capsys):
    table = _table(str(tmp_path / "t"), None)
    bad = table.region_ids()[0]
    keys = _keys_of(table, bad)
    first, later = _unflushed(table, bad, _rows(keys[:2], "a"), _rows(keys[2:5], "b"))
    path = layout.wal_path(bad, first)
    _corrupt(table, path)
    before = _listing(table, bad)

    with pytest.raises(errors.RepairRefusedError, match="followed by valid entries") as e:
        table.repair_region(bad, apply=True)
    assert path in str(e.value)
    code, out = _cli(capsys, "repair", table.uri, "--region", str(bad), "--yes")
    assert code == Exit.USAGE and "--discard-later" in out
    assert _listing(table, bad) == before

    plan = table.repair_region(bad, discard_later=True)
    assert [(x.position, x.rows) for x in plan.entries] == [(first, None), (later, 3)]
    assert plan.rows_lost == 3 and "3 readable row(s)" in plan.describe()
    code, out = _cli(capsys, "repair", table.uri, "--region", str(bad), "--yes", "--discard-later", "--json")
    assert code == Exit.OK and json.loads(out)["applied"] and json.loads(out)["rows_lost"] == 3
    assert table.recover() == []  # only a sentinel is left to replay
    with table.writer() as w:
        w.put(_rows(keys[:5], "c"))
    seen = _sql(table.uri, None, "SELECT * FROM t")
    assert {k: seen[k] for k in keys[:5]} == {k: f"c{k}" for k in keys[:5]}
    record(GUARANTEE, case_name(request), corrupt_files=1, entries_set_aside=2, rows_checked=len(seen))


def test_repair_sets_aside_a_corrupt_entry_generations_already_hold(request, tmp_path, capsys):
    table = _table(str(tmp_path / "t"), None)
    region_id = table.region_ids()[0]
    keys = _keys_of(table, region_id)
    with table.region_writer(region_id) as rw:  # flushed: the entry's position is covered
        rw.put(_rows(keys[:2], "flushed"))
        position = rw.stats()["next_wal_position"] - 1
    assert _status(table, region_id).replay_after_wal_entry_position >= position
    path = layout.wal_path(region_id, position)
    _corrupt(table, path)
    jobs: dict[str, Any] = {
        "interval": 0,
        "max_rounds": 1,
        "grace": timedelta(0),
        "version_retention": timedelta(0),
    }
    (done,) = table.maintain(**jobs, keep_versions=1)  # GC reads merged entries to delete them
    assert _failed_path(done.errors["gc"], region_id) == path

    plan = table.repair_region(region_id)
    assert [x.path for x in plan.covered] == [path] and plan.entries == () and plan.rows_lost == 0
    assert "nothing is lost" in plan.describe()
    code, out = _cli(capsys, "repair", table.uri, "--region", str(region_id), "--yes")
    assert code == Exit.OK and path in out
    (done,) = table.maintain(**jobs, keep_versions=1)
    assert done.errors == {}
    seen = _sql(table.uri, None, "SELECT * FROM t")
    assert {k: seen[k] for k in keys[:2]} == {k: f"flushed{k}" for k in keys[:2]}
    record(GUARANTEE, case_name(request), corrupt_files=1, entries_set_aside=1, rows_checked=len(seen))


def test_repair_does_not_touch_a_corrupt_region_manifest(request, tmp_path, capsys):
    table = _table(str(tmp_path / "t"), None)
    region_id = table.region_ids()[0]
    path = layout.manifest_path(region_id, _status(table, region_id).manifest_version)
    _corrupt(table, path)
    before = _listing(table, region_id)
    with pytest.raises(errors.CorruptManifestError) as e:
        table.repair_region(region_id, apply=True)
    assert e.value.path == path and any("backup" in n for n in e.value.__notes__)
    code, out = _cli(capsys, "repair", table.uri, "--region", str(region_id), "--yes")
    assert code == Exit.FAILED and path in out and "backup" in out
    assert _listing(table, region_id) == before
    record(GUARANTEE, case_name(request), corrupt_files=1, entry_points_checked=2)


def test_repair_of_a_healthy_region_changes_nothing(request, tmp_path, capsys):
    table = _table(str(tmp_path / "t"), None)
    region_id = table.region_ids()[0]
    _unflushed(table, region_id, _rows(_keys_of(table, region_id)[:1], "x"))
    before = _listing(table, region_id)
    plan = table.repair_region(region_id, apply=True)
    assert plan.entries == () and not plan.applied and "nothing to repair" in plan.describe()
    assert _listing(table, region_id) == before
    code, out = _cli(capsys, "repair", table.uri, "--region", "not-a-uuid")
    assert code == Exit.USAGE and "--region" in out
    record(GUARANTEE, case_name(request), regions_checked=1)
