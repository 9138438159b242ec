"""Base commits are durable before anything depends on them, and a base version a power loss tore is
rolled back (`Storage.synced_changes`, `memwal_df.jobs.base_recovery`).

Which fsyncs happen is recorded at `local_storage`'s one fsync function; the torn states are made on
real tables the way a power loss leaves them (a manifest without its bytes, a data file shorter than
written, a lost index segment or deletion file), then `open_table` / `Table.recover` must bring back
a table that reads every row of the model."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import datafusion
import lance
import pyarrow as pa
import pytest
from support.jobs import Workload, create, rows_at
from support.optional import not_none

import memwal_df as mw
from memwal_df.errors import MemWalError
from memwal_df.format import layout
from memwal_df.format import local_storage as ls
from memwal_df.format.open_storage import open_storage
from memwal_df.jobs.base_recovery import QUARANTINE_DIR, recover_base, version_problem
from memwal_df.jobs.compaction import CompactionSettings


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path `local_storage` fsyncs from now on."""
    seen: list[str] = []
    real = ls._fsync_path

    def record(path: str, flags: int) -> None:
        seen.append(os.path.normpath(path))
        real(path, flags)

    monkeypatch.setattr(ls, "_fsync_path", record)
    return seen


def test_synced_changes_fsyncs_new_and_changed_files_and_the_directories_that_changed(tmp_path, fsynced):
    root = tmp_path / "t"
    (root / "keep").mkdir(parents=True)
    (root / "keep" / "old").write_bytes(b"old")
    (root / "keep" / "same").write_bytes(b"same")
    (root / "_mem_wal").mkdir()
    storage = open_storage(str(root))
    with storage.synced_changes(skip=layout.NOT_BASE):
        (root / "keep" / "new").write_bytes(b"new")
        (root / "keep" / "old").unlink()
        (root / "deep" / "er").mkdir(parents=True)
        (root / "deep" / "er" / "f").write_bytes(b"f")
        (root / "_mem_wal" / "ours").write_bytes(b"synced by its writer")
    got = set(fsynced)
    expect = {root / "keep" / "new", root / "keep", root / "deep" / "er" / "f", root / "deep" / "er"}
    expect |= {root / "deep", root}  # new directories' entries in their parents
    assert {str(p) for p in expect} <= got
    assert str(root / "keep" / "same") not in got
    assert not any(p.startswith(str(root / "_mem_wal")) for p in got)


def test_synced_changes_syncs_a_new_root_entry_and_what_landed_before_an_error(tmp_path, fsynced):
    root = tmp_path / "fresh"
    storage = open_storage(str(root))
    with pytest.raises(RuntimeError):
        with storage.synced_changes():
            (root / "data").mkdir(parents=True)
            (root / "data" / "x").write_bytes(b"x")
            raise RuntimeError("the call failed after writing")
    assert {str(root / "data" / "x"), str(root / "data"), str(root), str(tmp_path)} <= set(fsynced)


def _base_files(uri: str) -> set[str]:
    return {
        os.path.normpath(os.path.join(d, f))
        for d, _, files in os.walk(uri)
        for f in files
        if layout.MEM_WAL_DIR not in os.path.relpath(d, uri).split(os.sep)
    }


def test_every_base_file_of_create_merge_index_and_compaction_is_fsynced(tmp_path, fsynced):
    uri = str(tmp_path / "t")
    table = create(uri, None, regions=2)
    assert _base_files(uri) <= set(fsynced)
    work = Workload(table, seed=3)
    for _ in range(3):
        with table.writer() as w:
            work.write(w)
        table.merge()
    before = _base_files(uri)
    lance.dataset(uri).create_scalar_index("id", "BTREE")  # Lance's own call: memwal_df syncs nothing
    direct = _base_files(uri) - before
    with table.writer() as w:
        work.write(w)
    table.merge()
    table.catch_up_indexes()
    table.compact(
        CompactionSettings(
            small_fragment_rows=1_000, target_rows_per_fragment=10_000, min_small_fragments=2
        )
    )
    assert _base_files(uri) - set(fsynced) <= direct
    table.gc(grace=timedelta(0))  # syncs the whole base before removing anything
    assert _base_files(uri) <= set(fsynced)
    assert rows_at(table) == work.model


def _newest_manifest(uri: str) -> Path:
    return min(Path(uri, "_versions").glob("*.manifest"), key=lambda p: int(p.stem))  # V2 naming


def _read(uri: str) -> dict[int, float]:
    ctx = datafusion.SessionContext()
    mw.register(ctx)
    ctx.register_table("t", mw.MemWalTable(uri))
    return {r["id"]: r["v"] for r in ctx.sql("SELECT id, v FROM t").to_pylist()}


def _merged_table(tmp_path: Path, seed: int = 1) -> tuple[mw.Table, Workload]:
    table = create(str(tmp_path / "t"), None, regions=2)
    work = Workload(table, seed=seed)
    with table.writer() as w:
        work.write(w)
    return table, work


def _model(work: Workload) -> dict[int, float]:
    return {k: r["v"] for k, r in work.model.items()}


def test_an_unreadable_newest_manifest_is_rolled_back_and_its_generations_read_again(tmp_path):
    table, work = _merged_table(tmp_path)
    table.merge()
    newest = lance.dataset(table.uri).version
    _newest_manifest(table.uri).write_bytes(b"")  # the rename landed, the bytes did not
    reopened = mw.open_table(table.uri)
    assert reopened.dataset.version == newest - 1
    assert _read(table.uri) == _model(work)
    assert list(Path(table.uri, QUARANTINE_DIR).glob("*.manifest"))
    reopened.merge()  # merges the unmerged generations again
    assert rows_at(reopened) == work.model


@pytest.mark.parametrize("tear", ["data_short", "data_missing", "deletion_missing", "index_missing"])
def test_recover_rolls_back_a_newest_version_whose_files_did_not_survive(tmp_path, tear):
    table, work = _merged_table(tmp_path, seed=7)
    table.merge()
    if tear == "index_missing":
        lance.dataset(table.uri).create_scalar_index("id", "BTREE")
        with table.writer() as w:
            work.write(w)
        table.merge()
    with table.writer() as w:
        work.write(w)
    good = table.dataset.version
    table.merge()
    if tear == "index_missing":
        table.catch_up_indexes()
    ds = lance.dataset(table.uri)
    new = {
        f
        for f in ds.get_fragments()
        if f.metadata.id
        not in {g.metadata.id for g in lance.dataset(table.uri, version=good).get_fragments()}
    }
    if tear.startswith("data"):
        path = Path(table.uri, "data", next(iter(new)).metadata.files[0].path)
        if tear == "data_short":
            os.truncate(path, path.stat().st_size // 2)
        else:
            path.unlink()
    elif tear == "deletion_missing":
        dels = [
            not_none(f.deletion_file()) for f in ds.get_fragments() if f.metadata.deletion_file is not None
        ]
        assert dels, "the merge deleted rows of older fragments"
        newest = max(dels, key=lambda p: Path(table.uri, p).stat().st_mtime_ns)
        Path(table.uri, newest).unlink()
    else:
        segment = max(
            (s for d in ds.describe_indices() if d.name == "id_idx" for s in d.segments),
            key=lambda s: s.dataset_version_at_last_update,
        )
        for f in Path(table.uri, "_indices", str(segment.uuid)).iterdir():
            f.unlink()
    storage = open_storage(table.uri)
    assert version_problem(storage, ds.version) is not None
    reopened = mw.open_table(table.uri)
    reopened.recover()
    assert version_problem(storage, reopened.dataset.version) is None
    assert reopened.dataset.version < ds.version
    assert _read(table.uri) == _model(work)
    reopened.merge()
    assert rows_at(reopened) == work.model


def test_a_table_that_survived_whole_is_not_touched(tmp_path):
    table, work = _merged_table(tmp_path)
    table.merge()
    versions = sorted(os.listdir(Path(table.uri, "_versions")))
    result = recover_base(table.storage)
    assert result.rolled_back == () and result.latest == table.dataset.version
    assert sorted(os.listdir(Path(table.uri, "_versions"))) == versions
    table.recover()
    assert rows_at(table) == work.model


def test_no_version_that_checks_out_leaves_everything_in_place(tmp_path):
    table = create(str(tmp_path / "t"), None, regions=1)
    for m in Path(table.uri, "_versions").glob("*.manifest"):
        m.write_bytes(b"\0" * 16)
    result = recover_base(table.storage)
    assert result.rolled_back == () and result.latest is None and len(result.problems) == 2
    with pytest.raises(MemWalError):
        mw.open_table(table.uri)


def test_object_storage_has_nothing_to_recover(s3_storage_options, s3_bucket, tmp_path):
    uri = f"s3://{s3_bucket}/base-durability-{tmp_path.name}"
    table = mw.create_table(
        uri, pa.table({"id": pa.array([1, 2], pa.int64())}), "id", storage_options=s3_storage_options
    )
    assert recover_base(table.storage).rolled_back == ()
