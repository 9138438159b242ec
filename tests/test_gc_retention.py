"""What GC removes outside the regions so that a long-running table's upkeep stays bounded
(`memwal_df.jobs.garbage`, rules 6 to 8, and "Cost per run"): commit records of stopped streaming
queries, stale change-feed consumer records, temp files of interrupted writes — each after its
retention and not before, on real storage — and base manifests read once per table handle."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path

import lance
import pytest
from support.jobs import Workload, create, every_version_reads, rows_at

import memwal_df as mw
from memwal_df.errors import ChangesExpiredError, InvalidConfigError
from memwal_df.format import consumers, layout, memwal_index, stream_commits
from memwal_df.format.consumers import ChangeOffsets, Consumer
from memwal_df.jobs import garbage

DAY = 86400.0
HOUR = 3600.0


def _record_at(storage, query: str, batch: int, age_s: float) -> None:
    """A commit record of `query`'s `batch` as the sink writes it, committed `age_s` seconds ago."""
    body = {"batch": batch, "committed_ms": int((time.time() - age_s) * 1000), "rows": 1, "regions": 1}
    storage.put(f"{layout.stream_dir(query)}/{batch:020d}.json", json.dumps(body).encode())


def test_stopped_queries_records_go_after_the_retention_and_not_before(table_uri, table_storage_options):
    table = create(table_uri, table_storage_options)
    storage = table.storage
    stopped, young, running, unreadable = (str(uuid.uuid4()) for _ in range(4))
    for batch in range(3):
        _record_at(storage, stopped, batch, 8 * DAY)  # newest record 8 days old
        _record_at(storage, young, batch, 6 * DAY)  # stopped 6 days ago: within the retention
        _record_at(storage, running, batch, 30 * DAY)  # old batches of a query still running ...
    stream_commits.record(storage, running, 3, rows=1, regions=1)  # ... that committed just now
    storage.put(f"{layout.stream_dir(unreadable)}/{0:020d}.json", b"not json")

    assert garbage.gc(table, stream_commit_retention=timedelta(days=9)).stream_queries == ()
    assert stream_commits.batches(storage, stopped) == [0, 1, 2]

    result = garbage.gc(table)  # the default retention: 7 days
    assert result.stream_queries == (stopped,)
    assert stream_commits.batches(storage, stopped) == []
    assert not stream_commits.committed(storage, stopped, 2)  # a restart would apply batch 2 again
    assert stream_commits.batches(storage, young) == [0, 1, 2]
    assert stream_commits.batches(storage, running) == [0, 1, 2, 3]
    assert stream_commits.batches(storage, unreadable) == [0]  # no commit time: kept
    assert sorted(stream_commits.queries(storage)) == sorted([young, running, unreadable])

    assert garbage.gc(table, stream_commit_retention=timedelta(days=5)).stream_queries == (young,)
    assert garbage.gc(table, stream_commit_retention=timedelta(0)).stream_queries == (running,)
    assert stream_commits.queries(storage) == [unreadable]
    with pytest.raises(InvalidConfigError):
        garbage.gc(table, stream_commit_retention=timedelta(seconds=-1))


def _consumer_at(storage, consumer_id: str, age_s: float, expiry: timedelta) -> None:
    offsets = ChangeOffsets({})
    consumers.write_consumer(storage, Consumer(consumer_id, offsets, time.time() - age_s, expiry))


def test_stale_consumer_records_go_after_expiry_plus_retention_and_not_before(
    table_uri, table_storage_options
):
    table = create(table_uri, table_storage_options)
    storage = table.storage
    week = timedelta(days=7)
    _consumer_at(storage, "recent", 60, week)
    _consumer_at(storage, "expired", 8 * DAY, week)  # stopped pinning a day ago
    _consumer_at(storage, "stale", 38 * DAY, week)  # stopped pinning 31 days ago
    _consumer_at(storage, "long-expiry", 38 * DAY, timedelta(days=30))  # stopped pinning 8 days ago
    table.register_consumer("registered")

    assert garbage.gc(table, consumer_retention=timedelta(days=32)).consumers == ()
    result = garbage.gc(table)  # the default retention: 30 days after the expiry
    assert result.consumers == ("stale",)
    assert consumers.read_consumer(storage, "stale") is None
    assert sorted(c.consumer_id for c in table.consumers()) == [
        "expired",
        "long-expiry",
        "recent",
        "registered",
    ]

    result = garbage.gc(table, consumer_retention=timedelta(days=2))
    assert sorted(result.consumers) == ["long-expiry"]
    result = garbage.gc(table, consumer_retention=timedelta(hours=12))
    assert sorted(result.consumers) == ["expired"]
    assert sorted(c.consumer_id for c in table.consumers()) == ["recent", "registered"]
    with pytest.raises(InvalidConfigError):
        garbage.gc(table, consumer_retention=timedelta(seconds=-1))


def test_a_consumer_that_commits_again_keeps_its_record(tmp_path):
    table = create(str(tmp_path / "t"), None)
    storage = table.storage
    _consumer_at(storage, "back", 60 * DAY, timedelta(days=7))
    found = consumers.list_consumers(storage)  # what GC read: stale
    assert [c.stale(time.time(), timedelta(days=30)) for c in found] == [True]
    table.commit_consumer("back", {})  # commits before GC removes it
    assert consumers.remove_stale(storage, found, timedelta(days=30), time.time()) == []
    assert consumers.read_consumer(storage, "back") is not None


def _temp(root: Path, directory: str, name: str, age_s: float) -> str:
    path = f"{directory}/{name}.tmp.{uuid.uuid4()}"
    (root / directory).mkdir(parents=True, exist_ok=True)
    (root / path).write_bytes(b"half written")
    stamp = time.time() - age_s
    os.utime(root / path, (stamp, stamp))
    return path


def test_temp_files_of_interrupted_writes_go_after_the_grace_and_not_before(tmp_path):
    table = create(str(tmp_path / "t"), None)
    work = Workload(table, seed=3)
    with table.writer() as w:
        work.generation(w)
    table.register_consumer("c")
    query = str(uuid.uuid4())
    stream_commits.record(table.storage, query, 0, rows=1, regions=1)
    root = Path(table.uri)
    region = table.region_ids()[0]
    manifests = f"{layout.region_dir(region)}/{layout.MANIFEST_DIR}"
    wals = f"{layout.region_dir(region)}/{layout.WAL_DIR}"
    lease_dir = layout.write_lease_dir("job", region)
    old = sorted(
        [
            _temp(root, manifests, layout.VERSION_HINT, 3 * HOUR),
            _temp(root, wals, layout.bitrev64_name(99, "arrow"), 3 * HOUR),
            _temp(root, layout.CONSUMER_DIR, "c.json", 3 * HOUR),
            _temp(root, layout.stream_dir(query), f"{1:020d}.json", 3 * HOUR),
            _temp(root, lease_dir, f"{1:020d}.json", 3 * HOUR),
            _temp(root, layout.ENTRY_LEASE_DIR, f"{1:020d}.json", 3 * HOUR),
        ]
    )
    in_flight = _temp(root, manifests, layout.VERSION_HINT, 0)
    recent = _temp(root, wals, layout.bitrev64_name(98, "arrow"), 0.5 * HOUR)
    running = {"holder": "h", "expires_ms": int((time.time() + DAY) * 1000), "released": False}
    table.storage.put(f"{lease_dir}/{1:020d}.json", json.dumps(running).encode())  # a job still writing

    assert garbage.gc(table, grace=timedelta(hours=4)).temp_files == ()  # younger than the grace
    assert all((root / p).exists() for p in [*old, in_flight, recent])
    result = garbage.gc(table, grace=timedelta(hours=2))
    assert sorted(result.temp_files) == old
    assert not any((root / p).exists() for p in old)
    # grace 0 still spares files younger than TEMP_FILE_MIN_AGE: a write may be in flight
    assert garbage.gc(table, grace=timedelta(0)).temp_files == ()
    assert (root / in_flight).exists() and (root / recent).exists()
    assert consumers.read_consumer(table.storage, "c") is not None
    assert stream_commits.batches(table.storage, query) == [0]
    assert rows_at(table) == work.model


def test_a_second_run_reads_only_the_base_manifests_committed_since(tmp_path, monkeypatch):
    table = create(str(tmp_path / "t"), None, regions=2)
    work = Workload(table, seed=5)
    for _ in range(4):
        with table.writer() as w:
            work.generation(w)
        table.merge()
        table.build_index()
    lance.dataset(table.uri).cleanup_old_versions(older_than=timedelta(0), retain_versions=6)
    retained = [v["version"] for v in lance.dataset(table.uri).versions()]
    assert retained[0] > 1 and len(retained) == 6

    handle = mw.open_table(table.uri)
    reads: list[int | None] = []
    read_details = memwal_index.read_details

    def counting(uri, options=None, version=None):
        reads.append(version)
        return read_details(uri, options, version)

    monkeypatch.setattr(memwal_index, "read_details", counting)
    garbage.gc(handle, grace=timedelta(0))
    assert Counter(reads) == Counter([*retained, retained[-1]])  # each version, the latest once more
    reads.clear()
    again = garbage.gc(handle, grace=timedelta(0))
    assert reads == [retained[-1]]  # the latest only: every other one was read by the first run
    assert again.generations == {}

    with table.writer() as w:  # new versions: only they are read
        work.generation(w)
    table.merge()
    new = [v["version"] for v in lance.dataset(table.uri).versions() if v["version"] > retained[-1]]
    reads.clear()
    garbage.gc(handle, grace=timedelta(0))
    assert Counter(reads) == Counter([*new, new[-1]])

    lance.dataset(table.uri).cleanup_old_versions(older_than=timedelta(0))
    reads.clear()
    removed = garbage.gc(handle, grace=timedelta(0))
    assert removed.generations  # every generation the dropped versions read goes
    assert reads == [new[-1]]
    every_version_reads(table, work.model)


def test_a_removed_consumer_reads_an_error_not_a_silent_gap(tmp_path):
    """GC removes a stale record but leaves a marker: the consumer's next read raises instead of
    starting over from the earliest retained change; reading with `since=` registers it again."""
    table = create(str(tmp_path / "t"), None)
    storage = table.storage
    _consumer_at(storage, "gone", 60 * DAY, timedelta(days=7))
    assert garbage.gc(table).consumers == ("gone",)
    assert consumers.read_consumer(storage, "gone") is None
    assert "gone" not in [c.consumer_id for c in table.consumers()]
    with pytest.raises(ChangesExpiredError, match="removed by GC"):
        table.changes(consumer="gone")
    with pytest.raises(ChangesExpiredError):
        table.changes(consumer="gone")  # still, until the consumer chooses where to start
    feed = table.changes(since="earliest", consumer="gone")  # registers it again
    assert consumers.read_consumer(storage, "gone") is not None
    feed.commit()
    table.changes(consumer="gone")  # reads on from its offsets
    assert garbage.gc(table).consumers == ()
    _consumer_at(storage, "again", 60 * DAY, timedelta(days=7))
    garbage.gc(table)
    table.remove_consumer("again")  # removing forgets the marker: a new consumer of that id starts fresh
    table.changes(consumer="again")
