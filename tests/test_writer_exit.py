"""`table.writer()` on a table without a region spec, and what both writers do when the block of a
`with` statement raises: acknowledged writes become visible (close), and when closing fails too the
writer stops like `abort()`, its durable writes left in the WAL for the maintain loop's recovery.
Every check reads the table through SQL and compares it with a dict model of the acknowledged writes."""

from __future__ import annotations

import random
import threading
import uuid
from typing import Any

import datafusion
import pyarrow as pa
import pytest

import memwal_df as mw
from memwal_df import errors
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.jobs import region_recovery
from memwal_df.write import flush

SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string()), pa.field("v", pa.float64())]
)


def rows(ids: list[int], tag: str) -> pa.Table:
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "name": [f"{tag}{i}" for i in ids], "v": [float(i) for i in ids]},
        schema=SCHEMA,
    )


def sql_rows(uri: str) -> dict[int, dict[str, Any]]:
    """What a fresh SQL reader of the flushed levels sees (no writer attached)."""
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    got = ctx.sql("SELECT id, name, v FROM t").to_arrow_table().to_pylist()
    return {r["id"]: r for r in got}


class Model:
    """The acknowledged state, key -> row."""

    def __init__(self, base: pa.Table) -> None:
        self.rows = {r["id"]: r for r in base.to_pylist()}

    def random_ops(self, writer: Any, rng: random.Random, n: int, tag: str) -> None:
        """`n` random puts and deletes on `writer`, each applied to the model once acknowledged."""
        for i in range(n):
            keys = sorted(rng.sample(range(40), rng.randint(1, 5)))
            if rng.random() < 0.25:
                writer.delete(keys)
                for k in keys:
                    self.rows.pop(k, None)
            else:
                data = rows(keys, f"{tag}{i}-")
                writer.put(data)
                self.rows.update({r["id"]: r for r in data.to_pylist()})


def spec_less(tmp_path) -> mw.Table:
    return mw.create_table(str(tmp_path / "t"), rows([1, 2, 3], "base"), "id")


# ------------------------------------------------------------------------------- a table without a spec


def test_writer_on_a_table_without_region_spec_writes_one_region(tmp_path):
    table = spec_less(tmp_path)
    assert table.spec is None
    model = Model(rows([1, 2, 3], "base"))
    with table.writer() as w:
        model.random_ops(w, random.Random(1), 20, "a")
    assert table.spec is not None and table.status()["region_spec"] is not None
    (region,) = table.region_ids()
    assert sql_rows(table.uri) == model.rows
    again = mw.open_table(table.uri)
    with again.writer() as w:  # the same single region, from another handle
        model.random_ops(w, random.Random(2), 10, "b")
        assert list(w.writers) == [region]
    assert mw.open_table(table.uri).region_ids() == [region]
    assert sql_rows(table.uri) == model.rows


def test_two_handles_opening_writers_at_once_agree_on_one_spec_and_region(tmp_path):
    spec_less(tmp_path)
    uri = str(tmp_path / "t")
    handles = [mw.open_table(uri) for _ in range(3)]
    opened: list[Any] = []
    failures: list[BaseException] = []

    def open_one(table: mw.Table) -> None:
        try:
            opened.append(table.writer())
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            failures.append(e)

    threads = [threading.Thread(target=open_one, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert all(w.spec == opened[0].spec for w in opened)
    assert len({h.region_id_for((0,)) for h in handles}) == 1
    assert len(mw.open_table(uri).details.sharding_specs) == 1
    for i, w in enumerate(opened):  # one after the other: each claims the one region in turn
        with w:
            w.put(rows([100 + i], "w"))
    assert len(mw.open_table(uri).region_ids()) == 1
    assert set(sql_rows(uri)) == {1, 2, 3, 100, 101, 102}


def test_writer_refuses_a_table_whose_regions_were_made_by_hand(tmp_path):
    table = spec_less(tmp_path)
    with table.region_writer(uuid.uuid4()) as rw:
        rw.put(rows([5], "manual"))
    with pytest.raises(errors.RegionRoutingError, match="region_writer"):
        table.writer()
    assert mw.open_table(table.uri).spec is None  # nothing was changed


# ------------------------------------------------------------------------------- an error inside `with`


def open_writer(table: mw.Table, kind: str) -> Any:
    return table.writer() if kind == "table" else table.region_writer(values=(0,))


@pytest.mark.parametrize("kind", ["table", "region"])
@pytest.mark.parametrize("seed", [1, 2])
def test_an_error_inside_with_still_makes_acknowledged_writes_visible(tmp_path, kind, seed):
    table = mw.create_table(str(tmp_path / "t"), rows([1, 2, 3], "base"), "id", region_spec=mw.unsharded())
    model = Model(rows([1, 2, 3], "base"))
    rng = random.Random(seed)
    with pytest.raises(ZeroDivisionError) as raised:
        with open_writer(table, kind) as w:
            model.random_ops(w, rng, rng.randint(5, 25), "a")
            raise ZeroDivisionError("in the block")
    assert not getattr(raised.value, "__notes__", None)  # closing succeeded: nothing to note
    assert sql_rows(table.uri) == model.rows  # no recover, no maintain
    with pytest.raises(errors.WriterClosedError):
        w.put(rows([7], "late"))
    (region,) = table.region_ids()
    m = RegionManifestStore(table.storage, region).latest()
    assert m is not None and m.replay_after_wal_entry_position >= m.wal_entry_position_last_seen - 1


@pytest.mark.parametrize("kind", ["table", "region"])
def test_when_closing_fails_too_the_writes_wait_in_the_wal_for_recovery(tmp_path, monkeypatch, kind):
    table = mw.create_table(str(tmp_path / "t"), rows([1, 2, 3], "base"), "id", region_spec=mw.unsharded())
    model = Model(rows([1, 2, 3], "base"))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise errors.StorageError("the disk is gone")

    with pytest.raises(KeyError) as raised:
        with open_writer(table, kind) as w:
            model.random_ops(w, random.Random(3), 12, "a")
            monkeypatch.setattr(flush, "write_generation", broken)
            raise KeyError("in the block")
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "StorageError" in notes and "WAL" in notes
    assert sql_rows(table.uri) == {r["id"]: r for r in rows([1, 2, 3], "base").to_pylist()}
    monkeypatch.undo()
    # The writer released its lease when it stopped: the maintain loop's recovery replays the WAL.
    result = region_recovery.recover_abandoned(mw.open_table(table.uri))
    assert result.recovered == tuple(table.region_ids())
    assert sql_rows(table.uri) == model.rows


@pytest.mark.parametrize("kind", ["table", "region"])
def test_abort_leaves_durable_writes_in_the_wal_until_recovery(tmp_path, kind):
    table = mw.create_table(str(tmp_path / "t"), rows([1, 2, 3], "base"), "id", region_spec=mw.unsharded())
    base = {r["id"]: r for r in rows([1, 2, 3], "base").to_pylist()}
    model = Model(rows([1, 2, 3], "base"))
    w = open_writer(table, kind)
    model.random_ops(w, random.Random(4), 8, "a")
    w.abort()
    assert sql_rows(table.uri) == base
    with pytest.raises(errors.WriterClosedError):
        w.delete([1])
    assert region_recovery.recover_abandoned(mw.open_table(table.uri)).recovered == tuple(table.region_ids())
    assert sql_rows(table.uri) == model.rows
