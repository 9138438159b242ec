"""What point lookups keep across queries: in-memory copies of generations' rows and the byte-bounded
`GENERATIONS` cache they live in, and the one-probe freshness check of the base version.

A kept value must never hide a newer state: every SQL answer is compared with `reference.stored_rows`
of a separate table object (the dict model of what is durable) right after flushes, deletes, merges
and garbage collection, with the copies loaded (`generation_copies.wait_for_loads`) before each check.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.jobs import cleanup, gc_merged, merge_all
from support.optional import not_none
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.format import base_manifest, pk_index
from memwal_df.read.lookup import generation_copies
from memwal_df.read.lookup.take_last import TakeLastExec
from memwal_df.read.lsm.cache import GENERATIONS, ImmutableCache
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.read.lsm.snapshot import take_snapshot

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string()), ("x", pa.float64())])
N_BASE = 60


def rows(ids: Any, tag: str) -> pa.Table:
    ids = list(ids)
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "v": [f"{tag}{i}" for i in ids], "x": [float(i) for i in ids]},
        schema=SCHEMA,
    )


def id_keys(ids: list[int]) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64())})


@pytest.fixture
def cache_bound() -> Iterator[None]:
    """Restores `GENERATIONS`' byte bound after a test changes it."""
    before = GENERATIONS.max_bytes
    yield
    GENERATIONS.configure(max_bytes=before)


class Reader:
    """One `MemWalTable` registration queried through SQL; every answer checked against the model."""

    def __init__(self, uri: str, options: dict[str, str] | None = None) -> None:
        self.uri, self.options = uri, options
        self.ctx = datafusion.SessionContext()
        self.ctx.register_table("t", mw.MemWalTable(uri, options))

    def lookup(self, keys: list[int]) -> dict[int, str]:
        got: dict[int, str] = {}
        for k in keys:
            out = self.ctx.sql(f"SELECT id, v FROM t WHERE id = {k}").to_arrow_table().to_pylist()
            assert len(out) <= 1
            got.update({r["id"]: r["v"] for r in out})
        listed = ", ".join(map(str, keys))
        out = self.ctx.sql(f"SELECT id, v FROM t WHERE id IN ({listed})").to_arrow_table().to_pylist()
        assert {r["id"]: r["v"] for r in out} == got and len(out) == len(got)
        return got

    def check(self, keys: list[int]) -> dict[int, str]:
        """Looks `keys` up twice, before and after the copies the first round started are loaded;
        asserts both answers equal the model and returns it."""
        model = stored_rows(mw.open_table(self.uri, self.options))
        want = {k: model[k]["v"] for k in keys if k in model}
        assert self.lookup(keys) == want
        generation_copies.wait_for_loads()
        assert self.lookup(keys) == want
        return want


def collect(t: mw.Table) -> Any:
    """The real GC, after dropping every older base version (which would still need the generations)."""
    cleanup(t)
    return t.gc(grace=timedelta(0))


def generation_levels(t: mw.Table) -> list[GenerationLevel]:
    return [lv for lv in take_snapshot(t).levels if isinstance(lv, GenerationLevel)]


def test_generation_rows_come_from_memory_once_loaded(
    table_uri: str, table_storage_options: dict[str, str] | None
) -> None:
    t = mw.create_table(
        table_uri, rows(range(N_BASE), "b"), "id", mw.unsharded(), storage_options=table_storage_options
    )
    with t.writer() as w:
        w.put(rows([1, 2, 3, 100], "g1-"))
        w.flush()
        w.put(rows([2, 101], "g2-"))
        w.delete(id_keys([3, 100]))
    newest, oldest = generation_levels(t)
    assert (newest.generation, oldest.generation) == (2, 1)
    keys = id_keys([1, 2, 3, 100, 101, 7])
    for level in (newest, oldest):
        first = TakeLastExec(level, keys, ["v", "x"], ["id"])
        read = first.to_table()
        generation_copies.wait_for_loads()
        again = TakeLastExec(level, keys, ["v", "x"], ["id"])
        assert again.to_table() == read  # same rows, columns and types, tombstones included
        assert (first.method, again.method) == ("_pk_index", "_pk_index, in-memory rows")
    got = {
        r["id"]: (r["v"], r["_tombstone"])
        for r in TakeLastExec(newest, keys, ["v"], ["id"]).to_table().to_pylist()
    }
    assert got == {2: ("g2-2", False), 101: ("g2-101", False), 3: (None, True), 100: (None, True)}
    one = TakeLastExec(oldest, id_keys([2]), [], ["id"]).to_table()
    assert one.to_pylist() == [{"id": 2, "_tombstone": False}]


@pytest.mark.slow_on_s3
def test_lookups_see_every_change_with_copies_loaded(
    table_uri: str, table_storage_options: dict[str, str] | None
) -> None:
    """Flush, delete, merge, GC (the real one and a directory removal) between lookups of one
    registration whose generation copies are loaded: each answer is the newest state."""
    opts = table_storage_options
    t = mw.create_table(table_uri, rows(range(N_BASE), "b"), "id", mw.bucket("id", 2), storage_options=opts)
    reader = Reader(table_uri, opts)
    keys = [1, 2, 3, 4, 5, N_BASE + 1, N_BASE + 2, -1]
    assert reader.check(keys) == {k: f"b{k}" for k in range(1, 6)}
    with t.writer() as w:
        w.put(rows([1, 2, N_BASE + 1], "g1-"))
        w.flush()
    assert reader.check(keys)[1] == "g1-1"
    with t.writer() as w:  # a newer generation overrides the loaded copy's rows
        w.put(rows([1, N_BASE + 2], "g2-"))
        w.delete(id_keys([2, 3]))
    after = reader.check(keys)
    assert (
        after[1] == "g2-1" and 2 not in after and 3 not in after and after[N_BASE + 2] == f"g2-{N_BASE + 2}"
    )
    merge_all(mw.open_table(table_uri, opts))
    assert reader.check(keys) == after
    removed = collect(mw.open_table(table_uri, opts))
    assert removed.generations
    assert reader.check(keys) == after
    with t.writer() as w:
        w.put(rows([2, 4], "g3-"))
    assert reader.check(keys) == {**after, 2: "g3-2", 4: "g3-4"}
    merge_all(mw.open_table(table_uri, opts))
    assert gc_merged(mw.open_table(table_uri, opts))  # directories gone at once, copies maybe kept
    assert reader.check(keys) == {**after, 2: "g3-2", 4: "g3-4"}


_ids = st.lists(st.integers(0, 30), min_size=1, max_size=6)
_op: st.SearchStrategy[tuple[str, list[int]]] = st.one_of(
    st.tuples(st.just("put"), _ids),
    st.tuples(st.just("delete"), _ids),
    st.tuples(st.just("flush"), st.just([])),
    st.tuples(st.just("merge"), st.just([])),
    st.tuples(st.just("gc"), st.just([])),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=st.lists(_op, min_size=1, max_size=12),
    probe=st.lists(st.integers(-1, 32), min_size=1, max_size=6),
)
def test_random_histories_with_copies_match_the_model(
    history: list[tuple[str, list[int]]], probe: list[int]
) -> None:
    root = tempfile.mkdtemp(prefix="memwal-cache-")
    try:
        uri = str(Path(root) / "t")
        t = mw.create_table(uri, rows(range(20), "b"), "id", mw.bucket("id", 2))
        reader = Reader(uri)
        w = t.writer()
        try:
            for step, (op, ids) in enumerate(history):
                if op == "put":
                    w.put(rows(ids, f"s{step}-"))
                elif op == "delete":
                    w.delete(id_keys(ids))
                elif op == "flush":
                    w.flush()
                elif op == "merge":
                    merge_all(mw.open_table(uri))
                else:
                    collect(mw.open_table(uri))
                reader.check(sorted(set(probe + ids)))
        finally:
            w.close()
        reader.check(sorted(set(probe)))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_copy_is_kept_only_when_it_matches_the_index_and_fits(tmp_path: Path, cache_bound: None) -> None:
    t = mw.create_table(str(tmp_path / "t"), rows(range(N_BASE), "b"), "id", mw.unsharded())
    with t.writer() as w:
        w.put(rows(range(100, 140), "g1-"))
    (level,) = generation_levels(t)
    ds = level.dataset()
    assert ds is not None
    values, ids = pk_index.read_pk_index(level.uri)
    # An index that does not describe these rows: no copy, and none tried again.
    generation_copies.load(level, ds, values, ids[::-1].copy(), ["id"])
    assert generation_copies.cached_rows(level, ds, values, ids, ["id"]) is None
    node = TakeLastExec(level, id_keys([105]), ["v"], ["id"])
    assert node.to_table().column("v").to_pylist() == ["g1-105"] and node.method == "_pk_index"
    # A generation larger than its share of the bound (on disk or in memory) is not copied.
    GENERATIONS.forget(level.uri)
    on_disk = sum(not_none(f.file_size_bytes) for f in ds.get_fragments()[0].data_files())
    size = max(ds.to_table().nbytes, on_disk)
    GENERATIONS.configure(max_bytes=size * generation_copies.MAX_SHARE - 1)
    generation_copies.load(level, ds, values, ids, ["id"])
    assert generation_copies.cached_rows(level, ds, values, ids, ["id"]) is None
    # Within the share: kept, at its Arrow size.
    GENERATIONS.forget(level.uri)
    GENERATIONS.configure(max_bytes=size * generation_copies.MAX_SHARE)
    generation_copies.load(level, ds, values, ids, ["id"])
    copy = generation_copies.cached_rows(level, ds, values, ids, ["id"])
    assert copy is not None and copy.equals(ds.to_table())
    assert GENERATIONS.nbytes >= copy.nbytes


def test_native_generation_with_a_deletion_vector_is_not_copied(tmp_path: Path) -> None:
    t = mw.create_table(str(tmp_path / "t"), rows(range(10), "b"), "id", mw.unsharded())
    native = lance.dataset(t.uri).mem_wal_writer("00000000-0000-4000-8000-000000000001")
    native.put(rows([1, 2], "n1"))
    native.put(rows([2], "n2"))  # the older row of 2 is hidden by a deletion vector
    native.close()
    (level,) = generation_levels(t)
    for _ in range(2):
        node = TakeLastExec(level, id_keys([1, 2]), ["v"], ["id"])
        assert sorted(node.to_table().column("v").to_pylist()) == ["n11", "n22"]
        generation_copies.wait_for_loads()
        assert node.method == "_pk_index"
    assert GENERATIONS.peek(level.uri, "rows") is None  # never even tried


def test_generations_cache_is_bounded_in_bytes_and_entries(tmp_path: Path, cache_bound: None) -> None:
    cache = ImmutableCache(3, max_bytes=100)
    cache.put("a", "x", "A", 60)
    cache.put("b", "x", "B", 30)
    assert cache.nbytes == 90 and cache.peek("a", "x") == "A"  # a is now the most recently used
    cache.put("c", "x", "C", 30)  # 120 > 100: the least recently used (b) goes
    assert cache.peek("b", "x") is None and cache.nbytes == 90
    cache.put("d", "x", "D", 0)
    cache.put("e", "x", "E", 0)  # four entries > 3: a goes
    assert cache.peek("a", "x") is None and len(cache) == 3 and cache.nbytes == 30
    assert cache.get("c", "x", lambda: pytest.fail("computed again")) == "C"
    cache.forget("c")
    assert cache.nbytes == 0 and cache.get("c", "x", lambda: "C2", lambda v: 7) == "C2" and cache.nbytes == 7
    cache.put("c", "x", "C3", 5)  # replacing an entry replaces its size
    assert cache.nbytes == 5
    cache.configure(max_bytes=4)
    assert cache.peek("c", "x") is None and cache.nbytes == 0

    # The process-wide cache stays within its bound while lookups load many generations.
    t = mw.create_table(str(tmp_path / "t"), rows(range(N_BASE), "b"), "id", mw.unsharded())
    with t.writer() as w:
        for g in range(6):
            w.put(rows(range(100 + 10 * g, 110 + 10 * g), f"g{g}-"))
            w.flush()
    levels = generation_levels(t)
    per_generation = 32768 + max(lv.dataset().to_table().nbytes for lv in levels)  # type: ignore[union-attr]
    GENERATIONS.configure(max_bytes=3 * per_generation)  # about half of what six generations declare
    for lv in levels:
        GENERATIONS.forget(lv.uri)
    reader = Reader(t.uri)
    want = {k: f"g{(k - 100) // 10}-{k}" for k in range(100, 160, 3)}
    for _ in range(2):
        assert reader.check(sorted(want)) == want  # every generation read, some entries dropped
        assert GENERATIONS.max_bytes is not None and GENERATIONS.nbytes <= GENERATIONS.max_bytes
    held = [GENERATIONS.peek(lv.uri, name) is not None for lv in levels for name in ("bloom", "rows")]
    assert any(held) and not all(held)


def test_base_freshness_is_lances_latest_version_resolution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The freshness check of an unchanged base is Lance's own latest-version resolution, with no
    read through memwal_df's storage (no hint, no probe); a commit by another table object is seen
    by the next check, also after version cleanup removed every version but the latest (the
    successor of the open version among them), and a lookup snapshot pins the new version."""
    uri = str(tmp_path / "t")
    t = mw.create_table(uri, rows(range(N_BASE), "b"), "id", mw.unsharded())
    reader = mw.open_table(uri)
    calls: list[str] = []

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return real(*a, **k)

        return call

    for name in ("head", "get", "list", "list_dir"):
        monkeypatch.setattr(reader.storage, name, counted(name, getattr(reader.storage, name)))
    version = reader.dataset.version
    reader.sync()
    assert calls == [] and reader.dataset.version == version
    for key in (1, 2):
        with t.writer() as w:
            w.put(rows([key], "g"))
        merge_all(mw.open_table(uri))
    lance.dataset(uri).cleanup_old_versions(older_than=timedelta(0))
    assert not (tmp_path / "t" / base_manifest.manifest_path(version + 1)).exists()
    assert reader.is_latest(version) is False
    reader.sync()
    assert reader.dataset.version == lance.dataset(uri).version and reader.is_latest(reader.dataset.version)
    snap = take_snapshot(reader, keys=id_keys([1]))
    assert snap.base.version == reader.dataset.version
    assert not reader.is_latest(version)


def test_a_commit_through_the_tables_own_dataset_object_is_seen(tmp_path: Path) -> None:
    """A commit through `table.dataset` (here a delete and an update) moves that object to a new
    version in place; the next query replaces it, so the key map and fragment sessions kept for the
    old version never answer for the new one."""
    uri = str(tmp_path / "t")
    mw.create_table(uri, rows(range(N_BASE), "b"), "id", mw.bucket("id", 2))
    table = mw.MemWalTable(uri)
    ctx = datafusion.SessionContext()
    ctx.register_table("t", table)

    def lookup(key: int) -> list[dict[str, Any]]:
        return ctx.sql(f"SELECT id, v FROM t WHERE id = {key}").to_arrow_table().to_pylist()

    assert lookup(5) == [{"id": 5, "v": "b5"}] and lookup(6) == [{"id": 6, "v": "b6"}]  # maps built
    table.table.dataset.delete("id = 5")
    table.table.dataset.update({"v": "'u7'"}, where="id = 7")
    assert lookup(5) == []
    assert lookup(6) == [{"id": 6, "v": "b6"}]
    assert lookup(7) == [{"id": 7, "v": "u7"}]
    assert {r["id"]: r["v"] for r in stored_rows(mw.open_table(uri)).values()} == {
        r["id"]: r["v"] for r in ctx.sql("SELECT id, v FROM t").to_arrow_table().to_pylist()
    }
