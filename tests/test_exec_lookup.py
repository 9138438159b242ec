"""Point lookups: TakeLastExec / BloomFilterGuardExec / CoalesceFirstExec / UnionExec and their plan.

Every table here is real: built with memwal_df's writers (generations, unflushed MemTables) or Lance's
own `mem_wal_writer` (generations holding duplicates hidden by a deletion vector). Results are compared
with `tests/support/reference.py::stored_rows`, which reads every level row by row.

1. Keys in MemTables, in generations, only in the base, deleted in a newer level but present in the
   base, absent; IN lists mixing them; the base read through its key index, through a btree index and
   through a plain filtered scan; the key index against a scan after merges, deletes and compaction.
2. Composite (int64, utf8) keys, string keys (quotes, empty, non-ASCII), a spec on a non-key column.
3. Native generations: `_pk_index` offsets are physical (deleted rows included), `_take_rows` takes
   them, `take()` does not.
4. Random histories (hypothesis) against the reference.
5. Short-circuit and laziness (execution counts), bloom guards skipping levels, missing `_pk_index`,
   garbage-collected generations, the explain tree.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lance.dataset import LanceScanner
from support.lance_made import lance_made_table
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.format import layout, pk_index
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.union import UnionExec
from memwal_df.read.lookup.bloom_guard import BloomFilterGuardExec
from memwal_df.read.lookup.coalesce_first import CoalesceFirstExec
from memwal_df.read.lookup.planner import plan_point_lookup
from memwal_df.read.lookup.take_last import TakeLastExec
from memwal_df.read.lsm import base_key_index
from memwal_df.read.lsm.cache import GENERATIONS
from memwal_df.read.lsm.keys import key_filter
from memwal_df.read.lsm.levels import GenerationLevel, MemTableLevel
from memwal_df.read.lsm.snapshot import ReadSnapshot, take_snapshot

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string()), ("x", pa.float64())])


def rows(ids: Any, tag: str) -> pa.Table:
    ids = list(ids)
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "v": [f"{tag}{i}" for i in ids], "x": [float(i) for i in ids]},
        schema=SCHEMA,
    )


def make_table(path: Path | str, n_base: int = 100, btree: bool = False, spec: Any = None) -> mw.Table:
    t = mw.create_table(str(path), rows(range(n_base), "b"), "id", region_spec=spec or mw.bucket("id", 4))
    if btree:
        lance.dataset(t.uri).create_scalar_index("id", "BTREE")
        t.refresh()
    return t


def memtables_of(writer: mw.TableWriter | None) -> list[Any]:
    if writer is None:
        return []
    return [mt for rw in writer.writers.values() for mt in rw.memtables]


def plan_for(
    t: mw.Table,
    keys: pa.Table,
    writer: mw.TableWriter | None = None,
    columns: list[str] | None = None,
    snapshot: ReadSnapshot | None = None,
) -> ExecNode:
    snap = snapshot or take_snapshot(t, writer=writer)
    return plan_point_lookup(snap, t.spec, t.schema.field_ids, keys, columns)


def _key(row: dict[str, Any], pk: tuple[str, ...]) -> Any:
    return row[pk[0]] if len(pk) == 1 else tuple(row[c] for c in pk)


def run(plan: ExecNode, pk: tuple[str, ...]) -> dict[Any, dict[str, Any]]:
    out = plan.to_table()
    got = {_key(r, pk): r for r in out.to_pylist()}
    assert len(got) == out.num_rows, "a key came back twice"
    return got


def expected(
    t: mw.Table, keys: list[Any], writer: mw.TableWriter | None = None, columns: list[str] | None = None
) -> dict[Any, dict[str, Any]]:
    model = stored_rows(t, memtables_of(writer))
    out = {}
    for k in keys:
        if k in model:
            row = model[k]
            out[k] = row if columns is None else {c: row[c] for c in columns}
    return out


def id_keys(ids: list[int]) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64())})


class Counter:
    """Counts operator executions by their source label (monkeypatched `execute`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.takes: list[str] = []
        self.guards: list[tuple[int, int]] = []  # (generation, keys passed)
        take_execute, guard_execute = TakeLastExec.execute, BloomFilterGuardExec.execute

        def counted_take(node: TakeLastExec) -> Iterator[pa.RecordBatch]:
            self.takes.append(node.source_label)
            yield from take_execute(node)

        def counted_guard(node: BloomFilterGuardExec) -> Iterator[pa.RecordBatch]:
            yield from guard_execute(node)
            self.guards.append((node.level.generation, node.keys_passed or 0))

        monkeypatch.setattr(TakeLastExec, "execute", counted_take)
        monkeypatch.setattr(BloomFilterGuardExec, "execute", counted_guard)


# ------------------------------------------------------------------------------------------------
# 1. every kind of key, with and without a btree index on the base key


def scan_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read base tables through a Lance scan, as for a base too large for a key index."""
    monkeypatch.setattr(base_key_index, "MAX_INDEXED_BASE_ROWS", -1)


@pytest.mark.parametrize("base", ["key index", "btree", "scan"])
def test_lookup_across_levels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base: str) -> None:
    if base != "key index":
        scan_the_base(monkeypatch)
    t = make_table(tmp_path / "t", btree=base == "btree")
    with t.writer(max_memtable_rows=1000) as w:
        w.put(rows(range(10, 20), "g1"))
        w.flush()
        w.put(rows([16, 17], "g2"))
        w.delete(id_keys([15, 17]))  # 17: put then deleted in the same generation
        w.flush()
    w = t.writer(max_memtable_rows=1000)
    try:
        w.put(rows([11, 21, 200], "m"))  # 200: a new key only in a MemTable
        w.delete(id_keys([12, 50, 999]))  # in a generation + base; only in the base; nowhere
        cases = {
            "memtable update": [11],
            "memtable insert": [21, 200],
            "generation": [13, 16, 19],
            "only base": [0, 60, 99],
            "deleted in a newer level, present in base": [12, 15, 17, 50],
            "absent": [999, 1000, -1],
        }
        for name, keys in cases.items():
            got = run(plan_for(t, id_keys(keys), writer=w), ("id",))
            assert got == expected(t, keys, w), name
        mixed = [k for keys in cases.values() for k in keys] + [11, 13, 999]  # with repeats
        got = run(plan_for(t, id_keys(mixed), writer=w), ("id",))
        want = expected(t, mixed, w)
        assert got == want
        assert sorted(got) == [0, 11, 13, 16, 19, 21, 60, 99, 200]
        assert got[16]["v"] == "g216" and got[11]["v"] == "m11" and got[60]["v"] == "b60"

        # Projection: requested columns only, in the requested order, in the table's types.
        out = plan_for(t, id_keys(mixed), writer=w, columns=["x", "v"]).to_table()
        assert out.schema == pa.schema([("x", pa.float64()), ("v", pa.string())])
        assert sorted(out.to_pylist(), key=lambda r: r["x"]) == sorted(
            ({"x": r["x"], "v": r["v"]} for r in want.values()), key=lambda r: r["x"]
        )
        # Keys given as int32, with a NULL: conformed, the NULL matches nothing.
        keys32 = pa.table({"id": pa.array([11, None, 60], pa.int32())})
        assert run(plan_for(t, keys32, writer=w), ("id",)) == expected(t, [11, 60], w)
        # No keys at all: an empty result with the schema.
        empty = plan_for(t, id_keys([]), writer=w).to_table()
        assert empty.num_rows == 0 and empty.schema == t.schema.schema
    finally:
        w.close()

    # close() flushed the MemTables: the same answers without the writer.
    got = run(plan_for(t, id_keys(mixed)), ("id",))
    assert got == want


def test_base_lookup_uses_btree_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scan_the_base(monkeypatch)
    indexed = make_table(tmp_path / "i", n_base=2000, btree=True)
    plain = make_table(tmp_path / "p", n_base=2000)
    keys = id_keys([5, 1500, 7777])
    for t, uses_index in ((indexed, True), (plain, False)):
        ds = t.dataset
        plan = ds.scanner(columns=["id", "v"], filter=key_filter(keys, ["id"])).explain_plan()
        assert ("ScalarIndexQuery" in plan) is uses_index, plan
        node = TakeLastExec(ds, keys, ["v"], ["id"])
        assert ("btree index id_idx on id" in node.describe()) is uses_index
        out = pa.Table.from_batches(list(node.execute()))
        assert out.column_names == ["v", "id", "_tombstone"]
        assert sorted(out.to_pylist(), key=lambda r: r["id"]) == [
            {"v": "b5", "id": 5, "_tombstone": False},
            {"v": "b1500", "id": 1500, "_tombstone": False},
        ]


def test_base_scan_stops_when_every_key_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scan_the_base(monkeypatch)
    t = make_table(tmp_path / "t", n_base=0)
    ds = lance.write_dataset(rows(range(40_000), "b"), t.uri, mode="append", max_rows_per_file=1000)
    assert len(ds.get_fragments()) == 40
    pulls: list[int | str] = []
    real = LanceScanner.to_batches

    def counted(scanner: Any) -> Iterator[pa.RecordBatch]:
        for batch in real(scanner):
            pulls.append(batch.num_rows)
            yield batch
        pulls.append("end")

    monkeypatch.setattr(LanceScanner, "to_batches", counted)
    rows_out = TakeLastExec(ds, id_keys([3, 39_999]), ["v"], ["id"]).to_table().to_pylist()
    assert sorted(r["id"] for r in rows_out) == [3, 39_999]
    assert "end" not in pulls  # the scan was abandoned once both keys were found
    pulls.clear()
    assert TakeLastExec(ds, id_keys([3, 40_000]), ["v"], ["id"]).to_table().num_rows == 1
    assert pulls[-1] == "end"  # a missing key: the scan runs to its end


def _base_rows_by_key(ds: lance.LanceDataset) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in ds.to_table().to_pylist()}


def _take_base(
    ds: lance.LanceDataset, keys: list[int], key_type: pa.DataType | None = None
) -> dict[int, Any]:
    """Key -> row of the base rows TakeLastExec returns (checked: one per key, none a tombstone)."""
    node = TakeLastExec(ds, pa.table({"id": pa.array(keys, key_type or pa.int64())}), ["v", "x"], ["id"])
    out = [r for b in node.execute() for r in pa.Table.from_batches([b]).to_pylist()]
    assert all(r.pop("_tombstone") is False for r in out)
    got = {r["id"]: r for r in out}
    assert len(got) == len(out)
    return got


@pytest.mark.parametrize("stable_row_ids", [False, True], ids=["row-addresses", "stable-row-ids"])
def test_base_key_index_matches_scan_and_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stable_row_ids: bool
) -> None:
    """Every base version along deletes, upserts (rows move to new fragments) and a compaction: the
    key index, a btree-indexed scan and a plain scan all return exactly the version's rows."""
    import numpy as np

    uri = str(tmp_path / "base")
    lance.write_dataset(
        rows(range(0, 3000, 3), "b"), uri, max_rows_per_file=250, enable_stable_row_ids=stable_row_ids
    )
    ds = lance.dataset(uri)

    def deleted() -> None:
        ds.delete("id % 7 = 0")

    def upserted() -> None:
        ds.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
            rows(list(range(0, 600, 2)) + [5000, 5001], "u")
        )

    def compacted() -> None:
        ds.optimize.compact_files(target_rows_per_fragment=800)

    def indexed() -> None:
        ds.create_scalar_index("id", "BTREE")

    rng = np.random.default_rng(5)
    builds = base_key_index.BASE_KEYS.builds
    for step in [None, deleted, upserted, indexed, compacted, upserted]:
        if step is not None:
            step()
        ds = lance.dataset(uri)
        model = _base_rows_by_key(ds)
        pinned = lance.dataset(uri, version=ds.version)
        key_sets = [rng.integers(-5, 5100, size=n).tolist() for n in (1, 1, 3, 40, 400)]
        key_sets += [[0, 3, 3, 3], [5000, 5001, 7, 14], [-(2**63), 2**63 - 1]]
        for keys in key_sets:
            want = {k: model[k] for k in keys if k in model}
            assert _take_base(pinned, keys) == want
            assert _take_base(pinned, keys, pa.int32() if max(map(abs, keys)) < 2**31 else pa.int64()) == want
        with monkeypatch.context() as m:
            scan_the_base(m)
            scanned = lance.dataset(uri, version=ds.version)
            for keys in key_sets:
                assert _take_base(scanned, keys) == {k: model[k] for k in keys if k in model}
    assert base_key_index.BASE_KEYS.builds == builds + 1  # later versions patch the first version's index


def test_key_index_only_for_bases_up_to_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_table(tmp_path / "t", n_base=50)
    assert base_key_index.indexable(t.dataset)
    assert "via key index" in TakeLastExec(t.dataset, id_keys([1]), ["v"], ["id"]).describe()
    monkeypatch.setattr(base_key_index, "MAX_INDEXED_BASE_ROWS", 49)
    again = lance.dataset(t.uri)
    assert not base_key_index.indexable(again)
    assert "via filtered scan" in TakeLastExec(again, id_keys([1]), ["v"], ["id"]).describe()
    assert _take_base(again, [1, 2, 99]) == {k: {"v": f"b{k}", "x": float(k), "id": k} for k in (1, 2)}
    monkeypatch.undo()
    strings = mw.create_table(str(tmp_path / "s"), pa.table({"k": ["a", "b"], "v": ["x", "y"]}), "k")
    assert (
        "via key index" in TakeLastExec(strings.dataset, pa.table({"k": ["b", "z"]}), ["v"], ["k"]).describe()
    )
    got = TakeLastExec(strings.dataset, pa.table({"k": ["b", "z"]}), ["v"], ["k"]).to_table()
    assert got.select(["k", "v"]).to_pylist() == [{"k": "b", "v": "y"}]


# ------------------------------------------------------------------------------------------------
# 2. key types and routing


def test_composite_keys(tmp_path: Path) -> None:
    schema = pa.schema([("a", pa.int64()), ("b", pa.string()), ("v", pa.string())])

    def crows(keys: list[tuple[int, str]], tag: str) -> pa.Table:
        return pa.table(
            {"a": [k[0] for k in keys], "b": [k[1] for k in keys], "v": [f"{tag}{k}" for k in keys]},
            schema=schema,
        )

    base_keys = [(i, s) for i in range(-3, 12) for s in ("x", "y", "")]
    t = mw.create_table(
        str(tmp_path / "t"), crows(base_keys, "b"), ["a", "b"], region_spec=mw.multi_bucket(["a", "b"], 4)
    )
    ab = pa.schema([("a", pa.int64()), ("b", pa.string())])

    def keys_of(keys: list[tuple[int, str]]) -> pa.Table:
        return pa.Table.from_pylist([{"a": a, "b": b} for a, b in keys], schema=ab)

    with t.writer() as w:
        w.put(crows([(1, "x"), (1, "y"), (2, "x"), (100, "z"), (-3, "")], "g1"))
        w.flush()
        w.delete(keys_of([(1, "y"), (5, "x")]))
        w.put(crows([(2, "x")], "g2"))
    w = t.writer()
    try:
        w.put(crows([(7, "y"), (1, "y")], "m"))  # 1,y: deleted in a generation, back in a MemTable
        w.delete(keys_of([(2, "x")]))
        probe = [(1, "x"), (1, "y"), (2, "x"), (100, "z"), (5, "x"), (5, "y"), (7, "y"), (-3, ""), (1, "z")]
        probe += [(1, "x\x00"), (10, "")]  # prefixes and NUL bytes must not collide
        got = run(plan_for(t, keys_of(probe), writer=w), ("a", "b"))
        want = expected(t, probe, w)
        assert got == want
        assert set(got) == {(1, "x"), (1, "y"), (100, "z"), (5, "y"), (7, "y"), (-3, ""), (10, "")}
        assert got[(1, "y")]["v"] == "m(1, 'y')" and got[(1, "x")]["v"] == "g1(1, 'x')"
    finally:
        w.close()


def test_string_keys(tmp_path: Path) -> None:
    schema = pa.schema([("name", pa.string()), ("n", pa.int64())])
    names = ["alice", "bob", "o'brien", "", "zoë", "日本", "a\x00b", "a"]
    t = mw.create_table(
        str(tmp_path / "t"),
        pa.table({"name": names, "n": list(range(len(names)))}, schema=schema),
        "name",
        region_spec=mw.bucket("name", 4),
    )
    with t.writer() as w:
        w.put(pa.table({"name": ["bob", "o'brien", "carol"], "n": [10, 11, 12]}, schema=schema))
        w.flush()
        w.delete(pa.table({"name": ["alice", "a"]}))
    w = t.writer()
    try:
        w.put(pa.table({"name": ["zoë", "dave"], "n": [20, 21]}, schema=schema))
        probe = [*names, "carol", "dave", "eve", "ALICE", "a\x00"]
        got = run(plan_for(t, pa.table({"name": probe}), writer=w), ("name",))
        assert got == expected(t, probe, w)
        assert {k: r["n"] for k, r in got.items()} == {
            "bob": 10, "o'brien": 11, "": 3, "zoë": 20, "日本": 5, "a\x00b": 6, "carol": 12, "dave": 21
        }  # fmt: skip
    finally:
        w.close()


@pytest.mark.parametrize(
    ("key_type", "extremes"),
    [(pa.int64(), [-(2**63), 2**63 - 1, -1]), (pa.uint64(), [2**64 - 1, 2**63, 0])],
    ids=["int64", "uint64"],
)
def test_extreme_integer_keys(tmp_path: Path, key_type: pa.DataType, extremes: list[int]) -> None:
    """Values Lance's SQL parser cannot read back, under a column name that is a SQL keyword."""
    schema = pa.schema([("order", key_type), ("v", pa.string())])
    base = [*extremes, 5, 6]
    t = mw.create_table(
        str(tmp_path / "t"), pa.table({"order": base, "v": ["b"] * 5}, schema=schema), "order",
        region_spec=mw.unsharded(),
    )  # fmt: skip
    lance.dataset(t.uri).create_scalar_index("order", "BTREE")
    with t.writer() as w:
        w.put(pa.table({"order": [extremes[0], 7], "v": ["g", "g"]}, schema=schema))
        w.flush()
        w.delete(pa.table({"order": pa.array([extremes[1]], key_type)}))
    keys = pa.table({"order": pa.array([*extremes, 5, 7, 8], key_type)})
    got = run(plan_for(t, keys), ("order",))
    assert got == expected(t, keys.column("order").to_pylist())
    assert {k: r["v"] for k, r in got.items()} == {extremes[0]: "g", extremes[2]: "b", 5: "b", 7: "g"}
    t.refresh()
    for k in (extremes[1:2], [5], [5, extremes[2]]):  # the base alone, through both filter kinds
        node = TakeLastExec(t.dataset, pa.table({"order": pa.array(k, key_type)}), ["v"], ["order"])
        assert sorted(r["order"] for r in node.to_table().to_pylist()) == sorted(k)


_TEXT = ["a", "o'b", "", "nul\x00x", "back\\slash", "日本", "X'41'"]


@pytest.mark.parametrize(
    ("key_type", "values"),
    [
        (pa.large_string(), _TEXT),
        (pa.binary(), [v.encode() for v in _TEXT]),
        (pa.large_binary(), [v.encode() for v in _TEXT]),
        (pa.int32(), [-(2**31), 2**31 - 1, 0, 1, 2, 3, 4]),
    ],
    ids=["large_string", "binary", "large_binary", "int32"],
)
def test_key_types(tmp_path: Path, key_type: pa.DataType, values: list[Any]) -> None:
    """Every key value reaches Lance's filter exactly (quotes, NUL bytes, backslashes, extremes)."""
    schema = pa.schema([("k", key_type), ("n", pa.int64())])
    t = mw.create_table(
        str(tmp_path / "t"), pa.table({"k": values[:5], "n": range(5)}, schema=schema), "k",
        region_spec=mw.unsharded(),
    )  # fmt: skip
    with t.writer() as w:
        w.put(pa.table({"k": [values[1], values[5]], "n": [10, 11]}, schema=schema))
        w.flush()
        w.delete(pa.table({"k": pa.array([values[3]], key_type)}))
    keys = pa.table({"k": pa.array(values, key_type)})
    got = run(plan_for(t, keys), ("k",))
    assert got == expected(t, values)
    assert {k: r["n"] for k, r in got.items()} == {
        values[0]: 0,
        values[1]: 10,
        values[2]: 2,
        values[4]: 4,
        values[5]: 11,
    }
    for k in values[:5]:  # the base alone, one key at a time
        node = TakeLastExec(t.dataset, pa.table({"k": pa.array([k], key_type)}), ["n"], ["k"])
        assert [r["k"] for r in node.to_table().to_pylist()] == [k]


def test_spec_on_a_non_key_column_asks_every_region(tmp_path: Path) -> None:
    """A spec made by Lance over a non-key column (memwal_df refuses to create one): a key may be in
    any region, so a lookup asks all of them."""
    t = lance_made_table(
        str(tmp_path / "t"), pa.table({"id": [1, 2], "cat": ["a", "b"]}), "id", identity_column="cat"
    )
    schema = t.schema.schema
    with t.writer(allow_non_key_region_columns=True) as w:
        w.put(pa.table({"id": [1, 3, 4], "cat": ["a", "b", "c"]}, schema=schema))
        w.flush()
        w.put(pa.table({"id": [2], "cat": ["b"]}, schema=schema))
    plan = plan_for(t, id_keys([1, 2, 3, 4, 5]))
    (coalesce,) = plan.children
    assert coalesce.describe().count("region ") == 3  # one key group asking all three regions
    got = run(plan, ("id",))
    assert got == expected(t, [1, 2, 3, 4, 5])


# ------------------------------------------------------------------------------------------------
# 3. native generations: physical offsets, deletion vectors


def test_native_generation_with_hidden_duplicates(tmp_path: Path) -> None:
    t = make_table(tmp_path / "t", n_base=10)
    shard = uuid.uuid4()
    native = lance.dataset(t.uri).mem_wal_writer(str(shard))
    native.put(rows([1, 2, 3], "n1"))
    native.put(rows([2, 3, 30], "n2"))
    native.delete(id_keys([3]))
    native.close()

    snap = take_snapshot(t)
    (region,) = [r for r in snap.regions if r.region_id == shard]
    assert region.values is None  # a native shard records no region values: every key asks it
    (level,) = region.levels
    assert isinstance(level, GenerationLevel)
    ds = level.dataset()
    assert ds is not None
    frag = ds.get_fragments()[0]
    assert frag.metadata.physical_rows == 7 and ds.count_rows() == 4  # 3 duplicates hidden
    uri = t.storage.child_uri(level.path or "")
    values, ids = pk_index.read_pk_index(uri)
    assert values.to_pylist() == [1, 2, 2, 3, 3, 3, 30] and ids.tolist() == [0, 1, 3, 2, 4, 6, 5]
    newest = pk_index.lookup(values, ids, pa.array([2, 3, 30, 1], pa.int64()))
    assert newest.tolist() == [3, 6, 5, 0]
    # `_take_rows` takes physical offsets (= row addresses in fragment 0) ...
    assert ds._take_rows(newest.tolist(), columns=["id", "v", "_tombstone"]).to_pylist() == [
        {"id": 2, "v": "n22", "_tombstone": False},
        {"id": 3, "v": None, "_tombstone": True},
        {"id": 30, "v": "n230", "_tombstone": False},
        {"id": 1, "v": "n11", "_tombstone": False},
    ]
    # ... and drops what the deletion vector hides; `take()` counts visible rows only.
    assert ds._take_rows([1, 2, 4], columns=["id"]).num_rows == 0
    assert ds.take([3], columns=["id"]).to_pylist() != [{"id": 2}]

    node = TakeLastExec(level, id_keys([1, 2, 3, 30, 4]), ["v"], ["id"])
    out = {r["id"]: r for r in node.to_table().to_pylist()}
    assert node.method == "_pk_index"
    assert out == {
        1: {"v": "n11", "id": 1, "_tombstone": False},
        2: {"v": "n22", "id": 2, "_tombstone": False},
        3: {"v": None, "id": 3, "_tombstone": True},
        30: {"v": "n230", "id": 30, "_tombstone": False},
    }
    with t.writer() as w:  # routed regions beside the native one (distinct keys: a key has one region)
        w.put(rows([41, 42, 43], "w"))
        w.flush()
        w.delete(id_keys([5]))
    probe = [1, 2, 3, 4, 5, 30, 31, 41, 42, 43]
    plan = plan_for(t, id_keys(probe))
    got = run(plan, ("id",))
    assert got == expected(t, probe)
    assert got[2]["v"] == "n22" and 3 not in got and 5 not in got and got[4]["v"] == "b4"
    assert got[42]["v"] == "w42"
    # Keys routed to a bucket region also ask the native shard (its values are unknown), after it:
    labels = [line for line in plan.explain() if line.startswith("  CoalesceFirstExec")]
    assert any("(bucket[4](id)=" in line and f"region {str(shard)[:8]}" in line for line in labels), labels


def test_generation_without_pk_index_is_scanned(tmp_path: Path) -> None:
    t = make_table(tmp_path / "t", n_base=10)
    shard = uuid.uuid4()
    native = lance.dataset(t.uri).mem_wal_writer(str(shard))
    native.put(rows([1, 2, 3], "n1"))
    native.put(rows([2, 3], "n2"))
    native.delete(id_keys([1]))
    native.close()
    snap = take_snapshot(t)
    (level,) = [lv for lv in snap.levels if lv.region_id == shard]
    assert isinstance(level, GenerationLevel)
    t.storage.delete_prefix(f"{level.path}/{layout.PK_INDEX_DIR}")
    node = TakeLastExec(level, id_keys([1, 2, 3, 4]), ["v"], ["id"])
    out = {r["id"]: (r["v"], r["_tombstone"]) for r in node.to_table().to_pylist()}
    assert node.method == "filtered scan (no _pk_index)"
    assert out == {1: (None, True), 2: ("n22", False), 3: ("n23", False)}
    assert run(plan_for(t, id_keys([1, 2, 3, 4]), snapshot=snap), ("id",)) == expected(t, [1, 2, 3, 4])


# ------------------------------------------------------------------------------------------------
# 4. random histories


_ids = st.lists(st.integers(0, 40), min_size=1, max_size=8)
_op: st.SearchStrategy[tuple[str, list[int]]] = st.one_of(
    st.tuples(st.just("put"), _ids),
    st.tuples(st.just("delete"), _ids),
    st.tuples(st.just("flush"), st.just([])),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=st.lists(_op, max_size=10),
    unflushed=st.lists(
        st.one_of(st.tuples(st.just("put"), _ids), st.tuples(st.just("delete"), _ids)), max_size=4
    ),
    lookups=st.lists(st.lists(st.integers(-1, 45), max_size=12), min_size=1, max_size=3),
)
def test_random_histories_match_reference(
    history: list[tuple[str, list[int]]],
    unflushed: list[tuple[str, list[int]]],
    lookups: list[list[int]],
) -> None:
    root = tempfile.mkdtemp(prefix="memwal-exec-")
    try:
        t = make_table(Path(root) / "t", n_base=20)

        def apply(w: mw.TableWriter, ops: list[tuple[str, list[int]]], step0: int) -> None:
            for step, (op, ids) in enumerate(ops, start=step0):
                if op == "put":
                    w.put(rows(ids, f"s{step}-"))
                elif op == "delete":
                    w.delete(id_keys(ids))
                else:
                    w.flush()

        with t.writer(max_memtable_rows=6) as w:  # small MemTables: flushes in the background too
            apply(w, history, 0)
        w = t.writer(max_memtable_rows=10_000)
        try:
            apply(w, unflushed, len(history))
            snap = take_snapshot(t, writer=w)
            model = stored_rows(t, memtables_of(w))
            table = mw.MemWalTable(t, writer=w)
            for keys in lookups:
                want = {k: model[k] for k in keys if k in model}
                got = run(plan_for(t, id_keys(keys), snapshot=snap), ("id",))
                assert got == want
                # The SQL route: a point-lookup snapshot of the keys (routed regions' MemTables only)
                # planned with the snapshot's own conformed keys.
                out = table.to_table(filter=pc.field("id").isin(keys))
                assert {r["id"]: r for r in out.to_pylist()} == want and out.num_rows == len(want)
        finally:
            w.abort()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# 5. short-circuit, bloom guards, laziness, garbage collection, explain


def single_region_history(t: mw.Table) -> mw.TableWriter:
    """gen 1: 1..10, gen 2: 5..7, gen 3: 7; MemTable: 8 (one region); returns the open writer."""
    with t.writer() as w:
        w.put(rows(range(1, 11), "g1"))
        w.flush()
        w.put(rows([5, 6, 7], "g2"))
        w.flush()
        w.put(rows([7], "g3"))
    w = t.writer()
    w.put(rows([8], "m"))
    return w


def test_short_circuit_newest_level_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_table(tmp_path / "t", n_base=50, spec=mw.unsharded())
    w = single_region_history(t)
    try:
        snap = take_snapshot(t, writer=w)
        (region,) = snap.regions
        assert [(lv.noun, lv.generation) for lv in region.levels] == [
            ("memtable", 4), ("generation", 3), ("generation", 2), ("generation", 1)
        ]  # fmt: skip
        region_short = str(region.region_id)[:8]
        counter = Counter(monkeypatch)

        # Found in the newest level (the MemTable): nothing older runs, not even a bloom guard.
        assert run(plan_for(t, id_keys([8]), snapshot=snap), ("id",))[8]["v"] == "m8"
        assert counter.takes == [f"memtable 4 of region {region_short}\u2026"] and counter.guards == []

        # Found in generation 3: generations 2, 1 and the base never run.
        counter.takes.clear()
        assert run(plan_for(t, id_keys([7]), snapshot=snap), ("id",))[7]["v"] == "g37"
        assert counter.takes == [
            f"memtable 4 of region {region_short}\u2026",
            f"generation 3 of region {region_short}\u2026",
        ]
        assert counter.guards == [(3, 1)]

        # Two keys: each older level is asked only for the key still unresolved.
        counter.takes.clear()
        counter.guards.clear()
        plan = plan_for(t, id_keys([7, 6]), snapshot=snap)
        assert {k: r["v"] for k, r in run(plan, ("id",)).items()} == {7: "g37", 6: "g26"}
        assert counter.guards == [(3, 1), (2, 1)]  # gen 3 guard: 7 passes, 6 is ruled out
        assert len(counter.takes) == 3  # memtable, gen 3, gen 2; not gen 1, not the base
        lines = plan.explain()
        assert "inputs=5, keys=2, inputs run=3, found=2, deleted=0" in lines[1]
    finally:
        w.close()


def test_bloom_guard_skips_levels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_table(tmp_path / "t", n_base=50, spec=mw.unsharded())
    w = single_region_history(t)
    try:
        snap = take_snapshot(t, writer=w)
        counter = Counter(monkeypatch)
        got = run(plan_for(t, id_keys([40, 41, 99]), snapshot=snap), ("id",))
        assert {k: r["v"] for k, r in got.items()} == {40: "b40", 41: "b41"}
        assert counter.guards == [(3, 0), (2, 0), (1, 0)]  # every generation ruled out by its filter
        assert [label.split()[0] for label in counter.takes] == ["memtable", "base"]
    finally:
        w.close()

    # The guard on its own: the child sees only the keys that may be there, or is never built.
    gen1 = [lv for lv in take_snapshot(t).levels if lv.generation == 1][0]
    seen: list[list[int]] = []

    def child(k: pa.Table) -> ExecNode:
        seen.append(k.column("id").to_pylist())
        return TakeLastExec(gen1, k, ["v"], ["id"])

    guard = BloomFilterGuardExec(gen1, id_keys([3, 45, 9, 46]), child, ["id"])
    out = pa.Table.from_batches(list(guard.execute()))
    assert sorted(out.column("id").to_pylist()) == [3, 9] and seen == [[3, 9]]
    assert guard.describe().endswith("keys=4, passed=2")
    seen.clear()
    guard = BloomFilterGuardExec(gen1, id_keys([45, 46]), child, ["id"])
    assert list(guard.execute()) == [] and seen == []
    assert guard.describe().endswith("passed=0 (child skipped)")


def test_lazy_union_stops_with_the_consumer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_table(tmp_path / "t", n_base=50)
    with t.writer() as w:
        w.put(rows(range(0, 40, 3), "g"))
    plan = plan_for(t, id_keys(list(range(0, 40, 3))))
    assert isinstance(plan, UnionExec) and len(plan.children) == 4  # one key group per bucket
    counter = Counter(monkeypatch)
    it = plan.execute()
    assert isinstance(it, Generator)
    first = next(it)
    assert first.num_rows >= 1
    it.close()
    assert len(counter.takes) == 1  # only the first group's newest level ran
    assert [c.children_run for c in plan.children if isinstance(c, CoalesceFirstExec)] == [1, 0, 0, 0]


def test_garbage_collected_generation_is_skipped(tmp_path: Path) -> None:
    t = make_table(tmp_path / "t", n_base=30, spec=mw.unsharded())
    with t.writer() as w:
        w.put(rows([1, 2, 3, 40], "g1"))
        w.flush()
        w.put(rows([2], "g2"))
        w.delete(id_keys([3]))
    # "Merge" generation 1 by hand (the MemWAL index does not know), then collect its directory.
    lance.dataset(t.uri).merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(
        rows([1, 2, 3, 40], "g1")
    )
    snap = take_snapshot(t)
    gen1 = [lv for lv in snap.levels if lv.generation == 1][0]
    assert isinstance(gen1, GenerationLevel)
    t.storage.delete_prefix(gen1.path or "")
    probe = [1, 2, 3, 40, 5]
    want = {1: "g11", 2: "g22", 40: "g140", 5: "b5"}
    got = run(plan_for(t, id_keys(probe), snapshot=snap), ("id",))
    assert {k: r["v"] for k, r in got.items()} == want
    assert gen1.missing
    got = run(plan_for(t, id_keys(probe)), ("id",))  # a fresh snapshot still lists it
    assert {k: r["v"] for k, r in got.items()} == want

    # Collected after the level was opened and its index read, while a lookup uses it.
    t2 = make_table(tmp_path / "t2", n_base=30, spec=mw.unsharded())
    with t2.writer() as w:
        w.put(rows([1, 2], "g1"))
    snap = take_snapshot(t2)
    (gen,) = snap.levels
    assert isinstance(gen, GenerationLevel)
    assert TakeLastExec(gen, id_keys([1]), ["v"], ["id"]).to_table().num_rows == 1
    shutil.rmtree(t2.storage.child_uri(gen.path or ""))
    # The readers that lookup opened still hold the files: the rows the snapshot lists come back.
    kept = TakeLastExec(gen, id_keys([1, 2]), ["v"], ["id"]).to_table().to_pylist()
    assert sorted((r["id"], r["v"]) for r in kept) == [(1, "g11"), (2, "g12")]
    # Opened afresh (nothing cached), the collected generation holds nothing, without an error.
    GENERATIONS.forget(gen.uri)
    (fresh,) = take_snapshot(t2).levels  # still listed: nothing merged it
    node = TakeLastExec(fresh, id_keys([1, 2]), ["v"], ["id"])
    assert list(node.execute()) == [] and node.method == "nothing (generation garbage-collected)"


def test_pk_index_is_read_once_per_generation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_table(tmp_path / "t", n_base=30, spec=mw.unsharded())
    with t.writer() as w:
        w.put(rows([1, 2], "g1"))
        w.flush()
        w.put(rows([3], "g2"))
    reads: list[str] = []
    real = pk_index.read_pk_index

    def counted_read(uri: str, so: dict[str, str] | None = None) -> Any:
        reads.append(uri)
        return real(uri, so)

    monkeypatch.setattr(pk_index, "read_pk_index", counted_read)
    snap = take_snapshot(t)
    for keys in ([1], [2], [3], [1, 3]):
        run(plan_for(t, id_keys(keys), snapshot=snap), ("id",))
    assert len(reads) == 2 and len(set(reads)) == 2
    run(plan_for(t, id_keys([1])), ("id",))  # a new snapshot reuses the generations' cached indexes
    assert len(reads) == 2


def test_explain_tree(tmp_path: Path) -> None:
    t = make_table(tmp_path / "t", n_base=30, btree=True)
    with t.writer() as w:
        w.put(rows([1, 2, 3, 4, 5], "g1"))
    w = t.writer()
    try:
        w.put(rows([1], "m"))
        snap = take_snapshot(t, writer=w)
        plan = plan_point_lookup(snap, t.spec, t.schema.field_ids, id_keys([1, 100, 2]), ["v"])
        lines = plan.explain()
        text = "\n".join(lines)
        assert lines[0] == f"UnionExec: inputs={len(plan.children)}"
        assert "  CoalesceFirstExec: return_first_non_null, region " in text and "(bucket[4](id)=" in text
        assert "    TakeLastExec: memtable 2 of region " in text
        assert "    BloomFilterGuardExec: bf[region " in text and "][gen=1], keys=" in text
        assert "      TakeLastExec: generation 1 of region " in text and "via _pk_index" in text
        assert f"TakeLastExec: base table v{snap.base.version}, via key index" in text
        for line in lines:
            assert line.strip() and "\n" not in line
        plan.to_table()
        assert "inputs run=" in "\n".join(plan.explain())
    finally:
        w.close()


def test_level_kinds_direct(tmp_path: Path) -> None:
    """TakeLastExec over a MemTable level keeps the newest row per key and the tombstones."""
    t = make_table(tmp_path / "t", n_base=5, spec=mw.unsharded())
    w = t.writer()
    try:
        w.put(rows([1, 2, 3], "a"))
        w.put(rows([2], "b"))
        w.delete(id_keys([3]))
        snap = take_snapshot(t, writer=w)
        (level,) = snap.levels
        assert isinstance(level, MemTableLevel)
        out = TakeLastExec(level, id_keys([2, 3, 4]), [], ["id"]).to_table()
        assert out.column_names == ["id", "_tombstone"]
        got = {r["id"]: r["_tombstone"] for r in out.to_pylist()}
        assert got == {2: False, 3: True}
        out = TakeLastExec(level, id_keys([2]), ["x", "v", "id"], ["id"]).to_table()
        assert out.to_pylist() == [{"x": 2.0, "v": "b2", "id": 2, "_tombstone": False}]
    finally:
        w.close()
