"""Region manifest store: commit/read, put-if-not-exists races, finding the latest version (hint
missing, stale, ahead, corrupt, old versions GC'd), the version hint bytes, byte equality with the
manifests Lance 14's own writer produces, and corrupt manifests."""

from __future__ import annotations

import threading
import time
import uuid

import lance
import pyarrow as pa
import pytest
from support.optional import not_none

from memwal_df.errors import CorruptManifestError
from memwal_df.format import layout
from memwal_df.format.manifest import RegionManifestStore, new_manifest, next_version, region_id_of
from memwal_df.format.open_storage import open_storage
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage

PK = "lance-schema:unenforced-primary-key"


@pytest.fixture
def storage(table_uri: str, table_storage_options: dict[str, str] | None) -> Storage:
    return open_storage(table_uri, table_storage_options)


@pytest.fixture
def region() -> uuid.UUID:
    return uuid.uuid4()


def commit_versions(store: RegionManifestStore, n: int) -> list[pb.ShardManifest]:
    """Commit versions 1..n the way a writer does (each from the previous one)."""
    m = new_manifest(store.region_id, 1, {})
    out = []
    for v in range(1, n + 1):
        if v > 1:
            m = next_version(m)
            m.wal_entry_position_last_seen = v
        assert store.commit(m)
        out.append(m)
    return out


def hint_bytes(storage: Storage, region: uuid.UUID) -> bytes:
    return storage.get(layout.version_hint_path(region))


# ------------------------------------------------------------------ construction


def test_new_manifest_and_next_version(region: uuid.UUID) -> None:
    m = new_manifest(region, 3, {"bucket": b"\x02\x00\x00\x00", "day": b"x"})
    assert (m.version, m.writer_epoch, m.current_generation, m.shard_spec_id) == (1, 1, 1, 3)
    assert m.replay_after_wal_entry_position == 0 and m.wal_entry_position_last_seen == 0
    assert not m.sstables and m.status == pb.SHARD_STATUS_ACTIVE
    assert region_id_of(m) == region
    assert [(e.field_id, e.value) for e in m.shard_field_entries] == [
        ("bucket", b"\x02\x00\x00\x00"),
        ("day", b"x"),
    ]
    # shard_id is tag 11, wire type 2: `5a 12 0a 10 <16 uuid bytes>` (as Lance 14 writes it)
    assert bytes.fromhex("5a120a10") + region.bytes in m.SerializeToString()

    n = next_version(m)
    assert n.version == 2 and n is not m
    n.writer_epoch = 9
    n.sstables.add(generation=1, path="6a718328_gen_1")
    n.shard_field_entries[0].value = b"changed"
    assert m.version == 1 and m.writer_epoch == 1 and not m.sstables  # the original is untouched
    assert m.shard_field_entries[0].value == b"\x02\x00\x00\x00"
    n2 = next_version(n)
    assert n2.version == 3 and n2.writer_epoch == 9 and list(n2.sstables) == list(n.sstables)


def test_manual_region_omits_spec_id(region: uuid.UUID) -> None:
    m = new_manifest(region, 0, {})
    assert m.shard_id.uuid == region.bytes and m.shard_spec_id == 0
    data = m.SerializeToString()
    # tag order, proto3 defaults omitted: version(1) writer_epoch(2) current_generation(6) shard_id(11)
    assert data == bytes.fromhex("080110013001") + bytes.fromhex("5a120a10") + region.bytes


# ------------------------------------------------------------------ commit / read


def test_commit_read_roundtrip(storage: Storage, region: uuid.UUID) -> None:
    store = RegionManifestStore(storage, region)
    assert store.latest() is None and store.latest_version() == 0
    assert store.read(1) is None and store.list_versions() == [] and list(store.history()) == []

    m1 = new_manifest(region, 1, {"bucket": b"\x01\x00\x00\x00"})
    assert store.commit(m1)
    assert store.read(1) == m1 and store.latest() == m1
    assert storage.get(layout.manifest_path(region, 1)) == m1.SerializeToString()
    assert hint_bytes(storage, region) == b'{"version":1}'

    other = new_manifest(region, 1, {})
    other.writer_epoch = 5
    assert not store.commit(other)  # version 1 is taken: nothing changes
    assert store.read(1) == m1

    m2 = next_version(m1)
    m2.writer_epoch = 2
    m2.sstables.add(generation=1, path="0a1b2c3d_gen_1", in_memory_bytes=10, physical_rows=2)
    m2.replay_after_wal_entry_position = 4
    assert store.commit(m2)
    assert store.latest() == m2 and store.read(2) == m2 and store.read(1) == m1
    assert store.list_versions() == [1, 2] and list(store.history()) == [m1, m2]
    assert store.read(3) is None

    with pytest.raises(ValueError):
        store.commit(pb.ShardManifest())  # version 0


def test_version_hint_bytes_exact(storage: Storage, region: uuid.UUID) -> None:
    store = RegionManifestStore(storage, region)
    m = new_manifest(region, 0, {})
    for v in range(1, 12):
        if v > 1:
            m = next_version(m)
        assert store.commit(m)
        hint = hint_bytes(storage, region)
        assert hint == f'{{"version":{v}}}'.encode()  # serde_json: compact, no newline
    assert len(b'{"version":9}') == 13  # the reference's size for one digit


def test_regions_are_independent(storage: Storage) -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    commit_versions(RegionManifestStore(storage, a), 3)
    sb = RegionManifestStore(storage, b)
    assert sb.latest() is None and sb.list_versions() == []
    commit_versions(sb, 1)
    assert RegionManifestStore(storage, a).latest_version() == 3 and sb.latest_version() == 1


# ------------------------------------------------------------------ races


def test_same_version_race_has_one_winner(
    table_uri: str, table_storage_options: dict[str, str] | None, region: uuid.UUID
) -> None:
    """Many writers commit the same version at once: exactly one succeeds, its bytes are stored."""
    n_threads, rounds = 8, 3
    stores = [
        RegionManifestStore(open_storage(table_uri, table_storage_options), region) for _ in range(n_threads)
    ]
    base = new_manifest(region, 0, {})
    for r in range(rounds):
        version = r + 1
        barrier = threading.Barrier(n_threads)
        results: dict[int, bool] = {}
        candidates = {}
        for i in range(n_threads):
            m = pb.ShardManifest()
            m.CopyFrom(base)
            m.version = version
            m.writer_epoch = 100 * version + i  # distinguishable
            candidates[i] = m

        def run(
            i: int,
            barrier: threading.Barrier = barrier,
            results: dict[int, bool] = results,
            candidates: dict[int, pb.ShardManifest] = candidates,
        ) -> None:
            barrier.wait()
            results[i] = stores[i].commit(candidates[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, ok in results.items() if ok]
        assert len(results) == n_threads and len(winners) == 1, results
        assert stores[0].read(version) == candidates[winners[0]]
    assert stores[0].list_versions() == list(range(1, rounds + 1))


def test_retrying_writers_commit_each_version_once(
    table_uri: str, table_storage_options: dict[str, str] | None, region: uuid.UUID
) -> None:
    """Writers loop latest() → next_version → commit; every version ends up written by exactly one."""
    n_threads, per_thread = 4, 4
    RegionManifestStore(open_storage(table_uri, table_storage_options), region).commit(
        new_manifest(region, 0, {})
    )
    won: dict[int, list[int]] = {i: [] for i in range(n_threads)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def run(i: int) -> None:
        try:
            store = RegionManifestStore(open_storage(table_uri, table_storage_options), region)
            barrier.wait()
            while len(won[i]) < per_thread:
                latest = store.latest()
                assert latest is not None
                m = next_version(latest)
                m.writer_epoch = i + 1
                m.wal_entry_position_last_seen = latest.wal_entry_position_last_seen + 1
                if store.commit(m):
                    won[i].append(m.version)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    total = n_threads * per_thread
    all_won = sorted(v for vs in won.values() for v in vs)
    assert all_won == list(range(2, total + 2))  # no version won twice, none skipped
    store = RegionManifestStore(open_storage(table_uri, table_storage_options), region)
    assert store.list_versions() == list(range(1, total + 2))
    for i, versions in won.items():
        for v in versions:
            m = store.read(v)
            assert m is not None and m.writer_epoch == i + 1
            # each commit was based on the version just before it
            assert m.wal_entry_position_last_seen == v - 1
    assert store.latest_version() == total + 1


def test_latest_sees_every_completed_commit(storage: Storage, region: uuid.UUID) -> None:
    """latest() is at least as new as any commit that completed before it was called, while a writer
    keeps committing and a GC deletes superseded versions."""
    store = RegionManifestStore(storage, region)
    n = 25
    done = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            m = new_manifest(region, 0, {})
            for v in range(1, n + 1):
                if v > 1:
                    m = next_version(m)
                assert store.commit(m)
                done[0] = v
                if v > 3:  # GC: keep the newest three versions
                    storage.delete(layout.manifest_path(region, v - 3))
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    t = threading.Thread(target=writer)
    t.start()
    checks = 0
    while not stop.is_set() or checks < 5:
        before = done[0]
        m = RegionManifestStore(storage, region).latest()
        assert (m.version if m else 0) >= before
        checks += 1
    t.join()
    assert not errors, errors
    assert store.latest_version() == n


# ------------------------------------------------------------------ finding the latest version

SCAN_BATCHES = [1, 2, 3]  # manifest_scan_batch_size: 1, Lance's default 2, and 3


def test_latest_with_hint_missing(storage: Storage, region: uuid.UUID) -> None:
    commit_versions(RegionManifestStore(storage, region), 7)
    storage.delete(layout.version_hint_path(region))
    for scan_batch in SCAN_BATCHES:
        store = RegionManifestStore(storage, region, scan_batch)
        assert store.latest_version() == 7 and not_none(store.latest()).version == 7


def test_latest_with_stale_hint(storage: Storage, region: uuid.UUID) -> None:
    commit_versions(RegionManifestStore(storage, region), 20)
    for stale in (1, 3, 19):  # behind by up to 19 versions
        storage.put(layout.version_hint_path(region), f'{{"version":{stale}}}'.encode())
        for scan_batch in SCAN_BATCHES:
            store = RegionManifestStore(storage, region, scan_batch)
            assert store.latest_version() == 20 and not_none(store.latest()).version == 20


def test_latest_with_hint_ahead_of_reality(storage: Storage, region: uuid.UUID) -> None:
    commit_versions(RegionManifestStore(storage, region), 6)
    for ahead in (7, 9, 2**63, 2**64 - 1):  # pointing to versions that do not exist
        storage.put(layout.version_hint_path(region), f'{{"version":{ahead}}}'.encode())
        for scan_batch in SCAN_BATCHES:
            store = RegionManifestStore(storage, region, scan_batch)
            assert store.latest_version() == 6 and not_none(store.latest()).version == 6


CORRUPT_HINTS = [
    b"not json",
    b"",
    b"{",
    b"\xff\xfe\x00",
    b"null",
    b"[7]",
    b'{"v":7}',
    b'{"version":"x"}',
    b'{"version":null}',
    b'{"version":[3]}',
    b'{"version":-3}',
    b'{"version":0}',
    b'{"version":1e400}',  # json gives inf: int(inf) raises OverflowError
    b'{"version":NaN}',
    b'{"version":18446744073709551616}',  # beyond u64: no file name exists for it
    b'{"version":99999999999999999999999999}',
]


def test_latest_with_corrupt_hint(storage: Storage, region: uuid.UUID) -> None:
    commit_versions(RegionManifestStore(storage, region), 4)
    for i, hint in enumerate(CORRUPT_HINTS):
        storage.put(layout.version_hint_path(region), hint)
        store = RegionManifestStore(storage, region, SCAN_BATCHES[i % len(SCAN_BATCHES)])
        assert store.latest_version() == 4, hint
        assert not_none(store.latest()).version == 4, hint
    # a commit repairs the hint
    store = RegionManifestStore(storage, region)
    assert store.commit(next_version(not_none(store.latest())))
    assert hint_bytes(storage, region) == b'{"version":5}'


OLD_VERSIONS_HINTS = {
    "missing": None,
    "stale_deleted": b'{"version":3}',  # points at a deleted version
    "stale_kept": b'{"version":8}',
    "exact": b'{"version":12}',
    "ahead": b'{"version":40}',
    "corrupt": b"garbage",
}


def test_latest_with_old_versions_deleted(storage: Storage, region: uuid.UUID) -> None:
    """Versions 1..7 garbage-collected, 8..12 remain: latest must still be 12, whatever the hint says."""
    commit_versions(RegionManifestStore(storage, region), 12)
    for v in range(1, 8):
        storage.delete(layout.manifest_path(region, v))
    hint_path = layout.version_hint_path(region)
    for name, hint in OLD_VERSIONS_HINTS.items():
        if hint is None:
            storage.delete(hint_path)
        else:
            storage.put(hint_path, hint)
        for scan_batch in SCAN_BATCHES:
            store = RegionManifestStore(storage, region, scan_batch)
            assert store.list_versions() == [8, 9, 10, 11, 12]
            assert store.latest_version() == 12, (name, scan_batch)
            assert not_none(store.latest()).version == 12, (name, scan_batch)
    # and committing on top of it works
    storage.delete(hint_path)
    store = RegionManifestStore(storage, region)
    assert store.commit(next_version(not_none(store.latest())))
    assert RegionManifestStore(storage, region, 1).latest_version() == 13


def test_latest_after_every_version_deleted(storage: Storage, region: uuid.UUID) -> None:
    commit_versions(RegionManifestStore(storage, region), 3)
    for v in (1, 2, 3):
        storage.delete(layout.manifest_path(region, v))
    store = RegionManifestStore(storage, region)
    assert store.latest_version() == 0 and store.latest() is None


def test_listing_ignores_files_that_are_not_manifests(storage: Storage, region: uuid.UUID) -> None:
    commit_versions(RegionManifestStore(storage, region), 9)
    for v in range(1, 6):
        storage.delete(layout.manifest_path(region, v))
    storage.delete(layout.version_hint_path(region))
    manifest_dir = f"{layout.region_dir(region)}/{layout.MANIFEST_DIR}"
    # a stray WAL-style name far beyond the latest version, and other junk
    storage.put(f"{manifest_dir}/{layout.bitrev64_name(1000, 'arrow')}", b"x")
    storage.put(f"{manifest_dir}/{layout.bitrev64_name(1001, 'binpb')}.bak", b"x")
    storage.put(f"{manifest_dir}/README", b"x")
    store = RegionManifestStore(storage, region)
    assert store.list_versions() == [6, 7, 8, 9]
    assert store.latest_version() == 9


# ------------------------------------------------------------------ corrupt manifests


def _corrupt_cases(region: uuid.UUID) -> dict[str, tuple[int, bytes]]:
    good = new_manifest(region, 1, {})
    good.version = 2
    good.sstables.add(generation=1, path="6a718328_gen_1", physical_rows=3)
    data = good.SerializeToString()
    wrong = pb.ShardManifest()
    wrong.CopyFrom(good)
    wrong.version = 3
    cut = pb.ShardManifest()  # what a torn write cut right before the region id decodes to
    cut.CopyFrom(good)
    cut.ClearField("shard_id")
    assert data.startswith(cut.SerializeToString())
    foreign = pb.ShardManifest()
    foreign.CopyFrom(good)
    foreign.shard_id.uuid = uuid.uuid4().bytes
    return {
        "cut_at_a_field_boundary": (2, cut.SerializeToString()),
        "other_region": (2, foreign.SerializeToString()),
        "garbage": (2, b"\xff\xff\xff\xff\xff"),
        "not_protobuf_text": (2, b'{"version":2}'),
        "empty": (2, b""),  # parses as version 0
        "truncated": (2, data[:-3]),
        "wrong_version": (2, wrong.SerializeToString()),
        "bad_wire_type": (2, b"\x0f\x01"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "garbage",
        "not_protobuf_text",
        "empty",
        "truncated",
        "wrong_version",
        "bad_wire_type",
        "cut_at_a_field_boundary",
        "other_region",
    ],
)
def test_corrupt_manifest_raises_naming_the_file(storage: Storage, region: uuid.UUID, case: str) -> None:
    version, data = _corrupt_cases(region)[case]
    store = RegionManifestStore(storage, region)
    assert store.commit(new_manifest(region, 1, {}))
    path = layout.manifest_path(region, version)
    assert storage.put_if_not_exists(path, data)
    with pytest.raises(CorruptManifestError) as ei:
        store.read(version)
    assert ei.value.path == path and path in str(ei.value)
    # the newest version is corrupt: latest() must say so, not fall back to an older one
    storage.delete(layout.version_hint_path(region))
    with pytest.raises(CorruptManifestError) as ei:
        store.latest()
    assert ei.value.path == path
    with pytest.raises(CorruptManifestError):
        list(store.history())


# ------------------------------------------------------------------ Lance 14 native manifests

SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), nullable=False, metadata={PK: "true"}), pa.field("name", pa.utf8())]
)


def _rows(ids: list[int]) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "name": [f"n{i}" for i in ids]}, schema=SCHEMA)


def native_region(uri: str, opts: dict[str, str] | None) -> uuid.UUID:
    """A shard written by Lance's own MemWAL writer: flushes, a tombstone, a re-claim with a sentinel."""
    ds = lance.write_dataset(_rows([1, 2, 3]), uri, storage_options=opts)
    ds.initialize_mem_wal(bucket_column="id", num_buckets=4)
    shard = uuid.uuid4()
    w = lance.dataset(uri, storage_options=opts).mem_wal_writer(str(shard), max_memtable_rows=4)
    w.put(_rows([1, 2]))
    w.put(_rows([3, 4, 5]))
    w.delete(pa.table({"id": pa.array([3], pa.int64())}))
    w.put(_rows([6]))
    w.close()
    w = lance.dataset(uri, storage_options=opts).mem_wal_writer(str(shard), max_memtable_rows=4)
    w.put(_rows([7]))
    w.close()
    return shard


def rebuild(native: pb.ShardManifest, shard: uuid.UUID) -> pb.ShardManifest:
    """The same manifest, built field by field with our protobuf."""
    m = pb.ShardManifest()
    m.shard_id.uuid = shard.bytes
    m.version = native.version
    m.writer_epoch = native.writer_epoch
    m.replay_after_wal_entry_position = native.replay_after_wal_entry_position
    m.wal_entry_position_last_seen = native.wal_entry_position_last_seen
    m.current_generation = native.current_generation
    m.shard_spec_id = native.shard_spec_id
    m.status = native.status
    for s in native.sstables:
        e = m.sstables.add(generation=s.generation, path=s.path)
        for name in ("in_memory_bytes", "physical_rows", "primary_key_bytes"):
            if s.HasField(name):
                setattr(e, name, getattr(s, name))
    for f in native.shard_field_entries:
        m.shard_field_entries.add(field_id=f.field_id, value=f.value)
    return m


def test_manifest_bytes_equal_native(table_uri: str, table_storage_options: dict[str, str] | None) -> None:
    shard = native_region(table_uri, table_storage_options)
    storage = open_storage(table_uri, table_storage_options)
    store = RegionManifestStore(storage, shard)
    versions = store.list_versions()
    n = len(versions)
    assert n >= 5 and versions == list(range(1, n + 1))
    assert store.latest_version() == n
    assert hint_bytes(storage, shard) == f'{{"version":{n}}}'.encode()  # native's hint: same bytes as ours

    manifests: list[pb.ShardManifest] = []
    for v in versions:
        data = storage.get(layout.manifest_path(shard, v))
        native = pb.ShardManifest.FromString(data)
        assert native.version == v and region_id_of(native) == shard
        ours = rebuild(native, shard)
        assert ours.SerializeToString() == data, f"version {v}"  # (and no field we do not know)
        assert store.read(v) == native
        manifests.append(native)

    # v1 is exactly what new_manifest builds for a bucket-sharded table (spec id 1, no field entries)
    assert new_manifest(shard, 1, {}).SerializeToString() == storage.get(layout.manifest_path(shard, 1))

    # every native transition is one of the region writer's own edits of next_version(previous)
    kinds = []
    for prev, cur in zip(manifests, manifests[1:], strict=False):
        m = next_version(prev)
        if cur.writer_epoch == prev.writer_epoch + 1:
            m.writer_epoch += 1  # claim
            kinds.append("claim")
        elif len(cur.sstables) == len(prev.sstables) + 1:
            m.sstables.add().CopyFrom(cur.sstables[-1])  # flush
            m.current_generation += 1
            m.replay_after_wal_entry_position = cur.replay_after_wal_entry_position
            m.wal_entry_position_last_seen = cur.wal_entry_position_last_seen
            assert cur.sstables[-1].generation == prev.current_generation
            assert (
                not_none(layout.parse_generation_dir_name(cur.sstables[-1].path))[1]
                == prev.current_generation
            )
            kinds.append("flush")
        else:
            m.wal_entry_position_last_seen = cur.wal_entry_position_last_seen  # after the sentinel
            kinds.append("last_seen")
        assert m.SerializeToString() == cur.SerializeToString(), (prev, cur)
    assert {"claim", "flush", "last_seen"} <= set(kinds)
    assert manifests[-1].writer_epoch == 2 and manifests[0].writer_epoch == 1


def test_native_writer_reads_our_commits(
    table_uri: str, table_storage_options: dict[str, str] | None
) -> None:
    """We commit versions on a native shard (and drop the hint); Lance's writer claims on top of ours."""
    opts = table_storage_options
    shard = native_region(table_uri, opts)
    storage = open_storage(table_uri, opts)
    store = RegionManifestStore(storage, shard)
    latest = not_none(store.latest())
    for _ in range(3):
        m = next_version(latest)
        m.writer_epoch = latest.writer_epoch + 1
        assert store.commit(m)
        latest = m
    ours = latest.version
    storage.delete(layout.version_hint_path(shard))  # native must probe from 1 to find ours
    w = lance.dataset(table_uri, storage_options=opts).mem_wal_writer(str(shard))
    w.close()
    final = not_none(store.latest())
    assert final.version > ours and final.writer_epoch == latest.writer_epoch + 1
    assert list(final.sstables)[: len(latest.sstables)] == list(latest.sstables)
    # native rewrote the hint in the same compact form
    deadline = time.monotonic() + 5
    while (
        hint_bytes(storage, shard) != f'{{"version":{final.version}}}'.encode()
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert hint_bytes(storage, shard) == f'{{"version":{final.version}}}'.encode()
