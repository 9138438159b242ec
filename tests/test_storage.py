"""memwal_df.format storage on both backends: local files and S3 (a real moto server on 127.0.0.1)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import uuid
from pathlib import Path
from typing import Any

import boto3
import lance
import obstore
import pyarrow as pa
import pytest
from botocore.exceptions import ClientError
from obstore.exceptions import AlreadyExistsError

import memwal_df.format.local_storage as local_mod
import memwal_df.format.object_storage as object_mod
from memwal_df.errors import NotFoundError, StorageError
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.object_storage import ObjectStorage, obstore_options
from memwal_df.format.open_storage import open_storage
from memwal_df.format.storage import Storage


@pytest.fixture
def st(table_uri: str, table_storage_options: dict[str, str] | None) -> Storage:
    return open_storage(table_uri, table_storage_options)


@pytest.fixture(params=["unnamed", "named"])
def publish(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Local publishing through an unnamed O_TMPFILE, or through a named temp file (the fallback for
    file systems without O_TMPFILE)."""
    if request.param == "named":
        monkeypatch.setattr(local_mod, "_unnamed_files", False)
    elif not local_mod._unnamed_files:
        pytest.skip("this file system has no O_TMPFILE")
    return request.param


def _is_s3(st: Storage) -> bool:
    return st.uri.startswith("s3://")


def _temp_files(root: str | Path) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".tmp." in f]


# ------------------------------------------------------------------------------------------------
# opening


def test_open_storage_picks_backend_and_normalises_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = open_storage("rel/t/")
    assert isinstance(rel, LocalStorage)
    assert rel.uri == str(tmp_path / "rel" / "t") and rel.root == rel.uri
    assert rel.storage_options == {}

    f = open_storage(f"file://{tmp_path}/t/")
    assert isinstance(f, LocalStorage)
    assert f.uri == f"file://{tmp_path}/t" and f.root == str(tmp_path / "t")
    assert f.child_uri("a/b") == f"file://{tmp_path}/t/a/b"

    opts: dict[str, Any] = {
        "aws_endpoint": "http://127.0.0.1:9",
        "aws_region": "us-east-1",
        "allow_http": True,
    }
    s3 = open_storage("s3://bucket/some/table/", opts)
    assert isinstance(s3, ObjectStorage)
    assert s3.uri == "s3://bucket/some/table"
    assert s3.storage_options == {
        "aws_endpoint": "http://127.0.0.1:9",
        "aws_region": "us-east-1",
        "allow_http": "true",
    }
    assert s3.child_uri("_mem_wal/x/gen") == "s3://bucket/some/table/_mem_wal/x/gen"

    mem = open_storage("memory:///m1")
    assert isinstance(mem, ObjectStorage) and mem.uri == "memory:///m1"


def test_child_uri_local(tmp_path):
    st = open_storage(str(tmp_path / "t"))
    assert st.child_uri("_mem_wal/r/0a1b2c3d_gen_1") == str(
        tmp_path / "t" / "_mem_wal" / "r" / "0a1b2c3d_gen_1"
    )
    with pytest.raises(ValueError):
        st.child_uri("../escape")


def test_unsupported_uri_is_a_storage_error():
    with pytest.raises(StorageError, match="nosuchscheme://x"):
        open_storage("nosuchscheme://x/y")


# ------------------------------------------------------------------------------------------------
# every method, both backends


def test_put_get_head_exists(st, publish):
    data = bytes(range(256)) * 17
    assert st.put_if_not_exists("_mem_wal/r/wal/one.arrow", data) is True
    assert st.get("_mem_wal/r/wal/one.arrow") == data
    assert st.head("_mem_wal/r/wal/one.arrow") == len(data)
    assert st.exists("_mem_wal/r/wal/one.arrow")

    # an existing object is never replaced by put_if_not_exists, whatever the data
    assert st.put_if_not_exists("_mem_wal/r/wal/one.arrow", b"other") is False
    assert st.put_if_not_exists("_mem_wal/r/wal/one.arrow", data) is False
    assert st.get("_mem_wal/r/wal/one.arrow") == data

    # put creates and overwrites
    st.put("_mem_wal/r/manifest/version_hint.json", b'{"version":1}')
    assert st.get("_mem_wal/r/manifest/version_hint.json") == b'{"version":1}'
    st.put("_mem_wal/r/manifest/version_hint.json", b'{"version":12}')
    assert st.get("_mem_wal/r/manifest/version_hint.json") == b'{"version":12}'
    assert st.head("_mem_wal/r/manifest/version_hint.json") == 14

    # empty objects are objects
    assert st.put_if_not_exists("empty", b"") is True
    assert st.get("empty") == b"" and st.head("empty") == 0 and st.exists("empty")
    assert st.put_if_not_exists("empty", b"x") is False

    # bytes-like input
    st.put("view", memoryview(b"abc"))
    assert st.get("view") == b"abc"


def test_missing_objects(st):
    with pytest.raises(NotFoundError) as ei:
        st.get("_mem_wal/r/wal/missing.arrow")
    assert isinstance(ei.value, StorageError) and isinstance(ei.value, FileNotFoundError)
    assert "_mem_wal/r/wal/missing.arrow" in str(ei.value)
    assert st.head("_mem_wal/r/wal/missing.arrow") is None
    assert not st.exists("_mem_wal/r/wal/missing.arrow")
    st.delete("_mem_wal/r/wal/missing.arrow")  # idempotent
    assert st.list("nothing/here") == []
    assert st.list_dir("nothing/here") == []
    assert st.delete_prefix("nothing/here") == 0

    # a "directory" is not an object
    st.put("d/x", b"1")
    assert st.head("d") is None and not st.exists("d")
    with pytest.raises(NotFoundError, match="'d'"):
        st.get("d")
    st.delete("d")
    assert st.get("d/x") == b"1"
    # nor is anything below an object
    with pytest.raises(NotFoundError):
        st.get("d/x/y")
    assert st.head("d/x/y") is None


def test_list_and_list_dir(st):
    assert st.list("") == []
    assert st.list_dir("") == []
    for p in ["a/b/c", "a/b/d/e", "a/bc", "a/b.txt", "z", "a/b/d/f"]:
        st.put(p, p.encode())
    assert st.list("") == sorted(["a/b/c", "a/b/d/e", "a/b/d/f", "a/bc", "a/b.txt", "z"])
    # prefixes match whole segments
    assert st.list("a/b") == ["a/b/c", "a/b/d/e", "a/b/d/f"]
    assert st.list("a/b/") == ["a/b/c", "a/b/d/e", "a/b/d/f"]
    assert st.list("a/b/d") == ["a/b/d/e", "a/b/d/f"]
    assert st.list("z") == []  # an object is not a prefix of itself
    assert st.list("a/b/c") == []
    assert st.list_dir("") == ["a", "z"]
    assert st.list_dir("a") == ["b", "b.txt", "bc"]
    assert st.list_dir("a/b") == ["c", "d"]
    assert st.list_dir("a/b/d") == ["e", "f"]
    assert st.list_dir("z") == []


def test_list_is_sorted_like_the_object_store(st):
    names = [f"{n:064b}"[::-1] + ".arrow" for n in range(1, 40)]  # bit-reversed WAL names
    for n in reversed(names):
        st.put(f"wal/{n}", b"x")
    assert st.list("wal") == [f"wal/{n}" for n in sorted(names)]
    assert st.list_dir("wal") == sorted(names)


def test_delete_and_delete_prefix(st):
    for p in ["g/1/a", "g/1/b/c", "g/10/a", "g/2", "h"]:
        st.put(p, b"x")
    st.delete("g/2")
    st.delete("g/2")
    assert not st.exists("g/2")
    assert st.delete_prefix("g/1") == 2  # not g/10
    assert st.list("") == ["g/10/a", "h"]
    assert st.list_dir("g") == ["10"]
    assert st.delete_prefix("g/1") == 0
    assert st.delete_prefix("") == 2
    assert st.list("") == [] and st.list_dir("") == []
    # the root stays usable
    assert st.put_if_not_exists("again", b"1")
    assert st.list("") == ["again"]


def test_invalid_paths_are_rejected(st):
    for bad in ["", "/abs", "a//b", "../x", "a/../b", "a/./b", "a/", "."]:
        with pytest.raises(ValueError):
            st.put(bad, b"x")
        with pytest.raises(ValueError):
            st.get(bad)
    with pytest.raises(ValueError):
        st.list("../up")
    with pytest.raises(ValueError):
        st.delete_prefix("/")


def test_pickle_roundtrip(st):
    st.put("p/q", b"pickled")
    st2 = pickle.loads(pickle.dumps(st))
    assert type(st2) is type(st) and st2.uri == st.uri and st2.storage_options == st.storage_options
    assert st2.get("p/q") == b"pickled"


# ------------------------------------------------------------------------------------------------
# races and atomicity


def test_put_if_not_exists_race_8_threads(st, publish):
    rounds = 15 if _is_s3(st) else 60
    for r in range(rounds):
        path = f"race/{r}/{uuid.uuid4().hex}"
        barrier = threading.Barrier(8)
        results: dict[int, bool | BaseException] = {}

        def worker(i: int, path: str = path, barrier: threading.Barrier = barrier, results=results) -> None:
            barrier.wait()
            try:
                results[i] = st.put_if_not_exists(path, f"writer-{i}".encode() * 100)
            except BaseException as e:  # reported below
                results[i] = e

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(isinstance(v, bool) for v in results.values()), results
        winners = [i for i, won in results.items() if won is True]
        assert len(winners) == 1, f"round {r}: {results}"
        assert st.get(path) == f"writer-{winners[0]}".encode() * 100
    if not _is_s3(st):
        assert _temp_files(st.root) == []


def _race_worker(root: str, paths: list[str], tag: str, barrier, queue) -> None:
    st = open_storage(root)
    won = []
    for p in paths:
        barrier.wait(timeout=60)
        won.append(st.put_if_not_exists(p, f"{tag}:{p}".encode()))
    queue.put((tag, won))


def test_put_if_not_exists_race_2_processes_local(tmp_path):
    root = str(tmp_path / "t")
    paths = [f"_mem_wal/r/wal/{i:04d}.arrow" for i in range(150)]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(root, paths, tag, barrier, queue)) for tag in ("p0", "p1")
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    st = open_storage(root)
    for i, path in enumerate(paths):
        won = [tag for tag in ("p0", "p1") if results[tag][i]]
        assert len(won) == 1, (path, results["p0"][i], results["p1"][i])
        assert st.get(path) == f"{won[0]}:{path}".encode()
    assert _temp_files(root) == []


def test_reader_never_sees_a_partial_object(st, publish):
    size = (256 << 10) if _is_s3(st) else (4 << 20)
    writes = 20 if _is_s3(st) else 60
    payloads = [bytes([65 + i]) * size for i in range(3)]
    fresh = [f"fresh/{i}" for i in range(writes)]
    done = threading.Event()
    seen = {"overwritten": 0, "fresh": 0, "missing": 0}
    bad: list[str] = []

    def reader() -> None:
        i = 0
        while not done.is_set():
            i += 1
            for path, allowed in (("hot/obj", payloads), (fresh[i % writes], None)):
                try:
                    data = st.get(path)
                except NotFoundError:
                    seen["missing"] += 1
                    continue
                ok = data in allowed if allowed else data == bytes([i % writes % 200 + 1]) * size
                if not ok:
                    bad.append(f"{path}: {len(data)} bytes")
                seen["overwritten" if allowed else "fresh"] += 1

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for i in range(writes):
            st.put("hot/obj", payloads[i % 3])
            assert st.put_if_not_exists(fresh[i], bytes([i % 200 + 1]) * size)
    finally:
        done.set()
        for t in readers:
            t.join()
    assert bad == []
    assert seen["overwritten"] > 0 and seen["fresh"] > 0
    if not _is_s3(st):
        assert _temp_files(st.root) == []


# ------------------------------------------------------------------------------------------------
# local specifics: durability protocol, temp files, error mapping


def test_local_publish_protocol_fsyncs_data_then_directory(tmp_path, monkeypatch, publish):
    st = open_storage(str(tmp_path / "t"))
    calls: list[str] = []
    real_datasync, real_fsync = local_mod._datasync, os.fsync

    def fsync(fd: int) -> None:  # directories are fsync'd; record which one
        calls.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path))
        real_fsync(fd)

    def datasync(fd: int) -> None:
        calls.append("data")
        real_datasync(fd)

    monkeypatch.setattr(local_mod, "_datasync", datasync)
    monkeypatch.setattr(os, "fsync", fsync)
    assert st.put_if_not_exists("_mem_wal/r/wal/1.arrow", b"x")
    # new directories are made durable in their parents, then the data, then the new entry
    assert calls == [".", "t", "t/_mem_wal", "t/_mem_wal/r", "data", "t/_mem_wal/r/wal"]
    calls.clear()
    assert st.put_if_not_exists("_mem_wal/r/wal/2.arrow", b"x")
    assert calls == ["data", "t/_mem_wal/r/wal"]
    calls.clear()
    st.put("_mem_wal/r/wal/2.arrow", b"y")
    assert calls == ["data", "t/_mem_wal/r/wal"]
    assert sorted(os.listdir(tmp_path / "t/_mem_wal/r/wal")) == ["1.arrow", "2.arrow"]


def test_local_sync_tree_fsyncs_every_file_and_directory_once(tmp_path, monkeypatch):
    """A generation's tree (more entries than the fsync pool has threads): every file, every directory
    and the tree's entry in its parent are fsync'd, each once, before sync_tree returns."""
    st = open_storage(str(tmp_path / "t"))
    files = [f"g/d{i}/f{j}" for i in range(4) for j in range(5)] + ["g/top.bin"]
    for path in files:
        os.makedirs(tmp_path / "t" / os.path.dirname(path), exist_ok=True)
        (tmp_path / "t" / path).write_bytes(path.encode())  # written without fsync, as pylance does
    synced: list[str] = []
    lock = threading.Lock()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        target = os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path / "t")
        real_fsync(fd)
        with lock:
            synced.append(target)

    monkeypatch.setattr(os, "fsync", fsync)
    st.sync_tree("g")
    dirs = ["g", *(f"g/d{i}" for i in range(4)), "."]
    assert sorted(synced) == sorted(files + dirs)
    assert all((tmp_path / "t" / p).read_bytes() == p.encode() for p in files)
    with pytest.raises(StorageError):
        st.sync_tree("missing/g")  # its parent directory does not exist


def test_local_no_temp_files_left_on_errors(tmp_path, monkeypatch, publish):
    st = open_storage(str(tmp_path / "t"))
    st.put("wal/keep", b"k")

    def fail_sync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local_mod, "_datasync", fail_sync)
    with pytest.raises(StorageError, match="wal/new") as ei:
        st.put_if_not_exists("wal/new", b"data")
    assert not isinstance(ei.value, NotFoundError) and ei.value.errno == 5
    with pytest.raises(StorageError, match="wal/keep"):
        st.put("wal/keep", b"replacement")
    monkeypatch.undo()

    def fail_write(fd: int, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local_mod, "_write_all", fail_write)
    with pytest.raises(StorageError, match="No space left"):
        st.put_if_not_exists("wal/new", b"data")
    monkeypatch.undo()

    assert sorted(os.listdir(tmp_path / "t" / "wal")) == ["keep"]
    assert st.get("wal/keep") == b"k" and not st.exists("wal/new")
    # losing a race leaves nothing behind either
    assert st.put_if_not_exists("wal/keep", b"other") is False
    assert sorted(os.listdir(tmp_path / "t" / "wal")) == ["keep"]


def test_local_temp_files_are_invisible_and_removed_by_delete_prefix(tmp_path):
    st = open_storage(str(tmp_path / "t"))
    st.put("wal/a", b"1")
    stray = tmp_path / "t" / "wal" / f"b.tmp.{uuid.uuid4()}"  # a crashed writer's leftover
    stray.write_bytes(b"partial")
    assert st.list("") == ["wal/a"]
    assert st.list_dir("wal") == ["a"]
    assert st.delete_prefix("wal") == 1
    assert not (tmp_path / "t" / "wal").exists()


def test_local_error_mapping(tmp_path):
    st = open_storage(str(tmp_path / "t"))
    st.put("file", b"x")
    with pytest.raises(StorageError, match="file/below") as ei:
        st.put("file/below", b"y")  # a parent is an object, not a directory
    assert not isinstance(ei.value, NotFoundError)
    with pytest.raises(StorageError, match="file/below"):
        st.put_if_not_exists("file/below", b"y")
    with pytest.raises(NotFoundError, match="file/below"):
        st.get("file/below")
    st.put("dir/x", b"1")
    with pytest.raises(StorageError, match="a directory exists"):
        st.put_if_not_exists("dir", b"y")
    with pytest.raises(StorageError, match="'dir'"):
        st.put("dir", b"y")


# ------------------------------------------------------------------------------------------------
# S3 specifics: conditional put on moto, error mapping, storage_options


@pytest.mark.s3
def test_moto_honours_if_none_match(s3_server, s3_bucket):
    """The pinned moto implements `If-None-Match: *` on PutObject (412 PreconditionFailed)."""
    client = boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    key = f"cond/{uuid.uuid4()}"
    client.put_object(Bucket=s3_bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as ei:
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == b"first"


@pytest.mark.s3
def test_s3_racing_conditional_puts_have_one_winner(s3_bucket, s3_storage_options):
    """Conditional PUTs of one key sent at once: exactly one is created, as S3 guarantees (the test
    server runs moto through `support/moto_atomic.py`, whose lock gives moto that guarantee)."""
    n_threads = 12
    st = open_storage(f"s3://{s3_bucket}/race-{uuid.uuid4()}", s3_storage_options)
    for round_ in range(10):
        barrier = threading.Barrier(n_threads)
        outcomes: dict[int, bool] = {}

        def race(
            i: int,
            barrier: threading.Barrier = barrier,
            outcomes: dict[int, bool] = outcomes,
            key: str = f"k/{round_}",
        ) -> None:
            barrier.wait()
            outcomes[i] = st.put_if_not_exists(key, f"writer {i}".encode())

        threads = [threading.Thread(target=race, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, won in outcomes.items() if won]
        assert len(outcomes) == n_threads and len(winners) == 1, outcomes
        assert st.get(f"k/{round_}") == f"writer {winners[0]}".encode()


@pytest.mark.s3
def test_s3_put_if_not_exists_is_a_conditional_put(s3_bucket, s3_storage_options):
    st = open_storage(f"s3://{s3_bucket}/{uuid.uuid4()}", s3_storage_options)
    assert st.put_if_not_exists("m/1.binpb", b"v1")
    assert not st.put_if_not_exists("m/1.binpb", b"v1-other")
    assert st.get("m/1.binpb") == b"v1"
    st.put("m/1.binpb", b"v1-overwritten")  # plain put overwrites
    assert st.get("m/1.binpb") == b"v1-overwritten"


@pytest.mark.s3
def test_s3_error_mapping(s3_server, s3_storage_options):
    missing_bucket = open_storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/t", s3_storage_options)
    with pytest.raises(StorageError, match="a/b") as ei:
        missing_bucket.put("a/b", b"1")
    assert not isinstance(ei.value, NotFoundError)  # a failed write is never "not found"
    with pytest.raises(StorageError, match="a/b"):
        missing_bucket.put_if_not_exists("a/b", b"1")
    with pytest.raises(StorageError):
        missing_bucket.list("")
    with pytest.raises(NotFoundError, match="a/b"):
        missing_bucket.get("a/b")

    # nobody listening: a StorageError, fast with client_max_retries=0
    opts = dict(
        s3_storage_options, aws_endpoint="http://127.0.0.1:9", client_max_retries="0", connect_timeout="2s"
    )
    dead = open_storage("s3://bucket/t", opts)
    for op in (
        lambda: dead.put("x/y", b"1"),
        lambda: dead.get("x/y"),
        lambda: dead.head("x/y"),
        lambda: dead.put_if_not_exists("x/y", b"1"),
    ):
        with pytest.raises(StorageError, match="x/y") as ei:
            op()
        assert not isinstance(ei.value, NotFoundError)


@pytest.mark.s3
def test_s3_lance_key_aliases_work(s3_server, s3_bucket):
    """Lance accepts object_store's key aliases, in any case; so do we."""
    opts = {
        "AWS_ENDPOINT_URL": s3_server,
        "access_key_id": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "region": "us-east-1",
        "aws_allow_http": "true",
        "download_retry_count": "3",  # Lance-only: ignored
        "use_opendal": "false",
        "lance_io_parallelism": "8",
    }
    st = open_storage(f"s3://{s3_bucket}/{uuid.uuid4()}", opts)
    assert st.put_if_not_exists("k", b"v") and st.get("k") == b"v"


def test_storage_options_mapping():
    config, client, retry = obstore_options(
        "s3",
        {
            "aws_endpoint": "http://127.0.0.1:9000",
            "aws_access_key_id": "AK",
            "aws_secret_access_key": "SK",
            "aws_session_token": "TOK",
            "AWS_REGION": "eu-west-1",
            "aws_virtual_hosted_style_request": "false",
            "allow_http": "true",
            "aws_allow_invalid_certificates": "true",
            "timeout": "30s",
            "connect_timeout": "5s",
            "client_max_retries": "2",
            "client_retry_timeout": "30",
            "download_retry_count": "5",
            "use_opendal": "false",
            "expires_at_millis": "123",
            "aws_unsigned_payload": "",
        },
    )
    assert config == {
        "aws_endpoint": "http://127.0.0.1:9000",
        "aws_access_key_id": "AK",
        "aws_secret_access_key": "SK",
        "aws_session_token": "TOK",
        "aws_region": "eu-west-1",
        "aws_virtual_hosted_style_request": "false",
    }
    assert client == {
        "allow_http": "true",
        "allow_invalid_certificates": "true",
        "timeout": "30s",
        "connect_timeout": "5s",
    }
    assert retry["max_retries"] == 2 and retry["retry_timeout"].total_seconds() == 30
    # the memory store takes no options at all
    assert obstore_options("memory", {"aws_region": "x", "timeout": "1s"})[0] == {}


def test_s3_region_defaults_like_lance(monkeypatch):
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    config = {"aws_endpoint": "http://127.0.0.1:9"}
    object_mod._default_s3_region("b", config)
    assert config["region"] == "us-west-2"
    config = {"aws_endpoint": "http://127.0.0.1:9", "aws_region": "eu-central-1"}
    object_mod._default_s3_region("b", config)
    assert "region" not in config


def test_retried_conditional_put_recognises_its_own_write(monkeypatch):
    """A PUT that object_store retried can get 412 for its own first attempt: then it is ours."""
    st = open_storage(f"memory:///{uuid.uuid4()}")
    real_put = obstore.put

    def put_then_412(store, key, data, **kw):
        real_put(store, key, data, **kw)
        raise AlreadyExistsError(f"Object at location {key} already exists ... retries: 1, max_retries: 10")

    monkeypatch.setattr(obstore, "put", put_then_412)
    assert st.put_if_not_exists("a", b"mine") is True
    monkeypatch.undo()
    assert st.put_if_not_exists("a", b"theirs") is False


def test_memory_backend_is_shared_per_uri():
    name = uuid.uuid4().hex
    a = open_storage(f"memory:///{name}/t")
    b = open_storage(f"memory:///{name}/t")
    other = open_storage(f"memory:///{name}/u")
    assert a.put_if_not_exists("x/1", b"1")
    assert not b.put_if_not_exists("x/1", b"2")
    assert b.get("x/1") == b"1" and b.list("") == ["x/1"] and b.list_dir("x") == ["1"]
    assert other.list("") == [] and not other.exists("x/1")
    assert a.delete_prefix("x") == 1 and b.list("") == []


# ------------------------------------------------------------------------------------------------
# pylance at the same URIs with the same storage_options


def test_pylance_reads_and_writes_at_table_uri(st, table_uri, table_storage_options):
    data = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "v": ["a", "b", "c"]})
    lance.write_dataset(data, table_uri, storage_options=table_storage_options)
    lance.write_dataset(data, table_uri, mode="append", storage_options=table_storage_options)
    ds = lance.dataset(table_uri, storage_options=table_storage_options)
    assert ds.version == 2 and ds.count_rows() == 6
    assert ds.to_table().sort_by("id")["id"].to_pylist() == [1, 1, 2, 2, 3, 3]
    # memwal_df sees Lance's files at the same root
    assert "_versions" in st.list_dir("") and "data" in st.list_dir("")
    assert any(p.startswith("_versions/") for p in st.list("_versions"))

    # and a dataset at a child URI (how flushed generations are written)
    gen = "_mem_wal/3f0e6c1a-0000-4000-8000-000000000000/0a1b2c3d_gen_1"
    lance.write_dataset(data, st.child_uri(gen), storage_options=st.storage_options or None)
    st.put(f"{gen}/bloom_filter.bin", b"\x00" * 16)
    assert lance.dataset(st.child_uri(gen), storage_options=st.storage_options or None).count_rows() == 3
    assert {"_versions", "data", "bloom_filter.bin"} <= set(st.list_dir(gen))
    assert st.delete_prefix(gen) >= 3
    assert st.list(gen) == []
    assert lance.dataset(table_uri, storage_options=table_storage_options).count_rows() == 6
