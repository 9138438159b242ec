"""Where a partial write's lookup reads the current rows: the MemTables a writer flushed itself (kept
in memory, so their generations are not read from storage, and still right after those generations
are merged and collected), the generations its manifest listed when it made its first partial write
(read back once, up to one that is gone), and the base rows read once per write for all its regions
(used only by a region lookup that reads the same base version)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pyarrow as pa
import pytest
from support.children import SOURCE_ROOT
from test_partial import SCHEMA, new_table, sql_rows

import memwal_df as mw
from memwal_df.read.lookup import current_rows
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.write import region_state


def full_row(k: int, tag: str) -> dict[str, Any]:
    return {"id": k, "a": f"{tag}{k}", "b": k, "ver": 1, "vec": [float(k), 1.0]}


def two_regions(table: mw.Table) -> tuple[int, int]:
    """Two keys above the base's keys that route to different regions."""
    ids = pa.table({"id": pa.array(range(100, 120), pa.int64())})
    assert table.spec is not None
    buckets = table.spec.evaluate(ids, table.schema.field_ids)[0].to_pylist()
    first = buckets[0]
    return 100, 100 + next(i for i, b in enumerate(buckets) if b != first)


def merge_and_collect_elsewhere(uri: str) -> None:
    """Merge every generation, clean up old base versions and collect the merged generations, in
    another process (this one's caches of the generations stay cold)."""
    code = (
        "import sys; from datetime import timedelta; import memwal_df as mw; "
        "from memwal_df.jobs.maintain import cleanup_versions; t = mw.open_table(sys.argv[1]); t.merge(); "
        "cleanup_versions(t, timedelta(0)); assert t.gc(grace=timedelta(0)).regions"
    )
    env = {**os.environ, "PYTHONPATH": SOURCE_ROOT}
    subprocess.run([sys.executable, "-c", code, uri], check=True, env=env, timeout=120)


def test_flushed_memtables_answer_without_reading_their_generations(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a region writer made a partial write, the generations it flushes are read from its kept
    MemTables, also once another process merged and collected them; beyond the byte bound (here 0)
    the generations are read from storage."""
    table = new_table(tmp_path)
    keys = [100, 101, 102, 103]
    model = {r["id"]: r for r in sql_rows(table).values()}
    opened: list[int] = []  # generations whose files (data, bloom filter) a lookup read
    for name in ("dataset", "bloom"):
        read = getattr(GenerationLevel, name)

        def counted(level: GenerationLevel, read: Any = read) -> Any:
            opened.append(level.generation)
            return read(level)

        monkeypatch.setattr(GenerationLevel, name, counted)
    with table.writer() as w:
        w.put({"id": keys, "b": keys}, partial=True)  # from now on their regions keep what they flush
        for round_, tag in enumerate(("x", "y")):
            w.put(pa.Table.from_pylist([full_row(k, tag) for k in keys], schema=SCHEMA))
            w.flush()
            if round_ == 0:
                merge_and_collect_elsewhere(table.uri)  # the first generations are gone
        opened.clear()
        w.put({"id": [*keys, 200], "b": [-k for k in keys] + [2]}, partial=True)  # 200: a new key
        assert opened == []  # every level the writer flushed was answered in memory
    model.update({k: {**full_row(k, "y"), "b": -k} for k in keys})
    model[200] = {"id": 200, "a": None, "b": 2, "ver": None, "vec": None}
    assert sql_rows(table) == model

    monkeypatch.setattr(region_state, "KEPT_FLUSHED_BYTES", 0)  # keeps nothing: storage answers
    with table.writer() as w:
        w.put({"id": keys, "ver": [7] * 4}, partial=True)
        w.put({"id": keys, "a": ["z"] * 4}, partial=True)
        w.flush()
        opened.clear()
        w.put({"id": keys, "ver": [8] * 4}, partial=True)
        assert opened  # the generation just flushed is read from storage
    model.update({k: {**model[k], "a": "z", "ver": 8} for k in keys})
    assert sql_rows(table) == model


def test_shared_base_rows_stand_only_for_their_base_version(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write over two regions reads its base rows once. When the base moves on before a region's
    lookup (another process merges that region's generation and collects it), the region reads the
    new base: the shared rows, which lack the merged row, are not used."""
    table = new_table(tmp_path)
    k, other_key = two_regions(table)
    row = full_row(k, "gen")
    read = current_rows.base_rows

    def then_merge(t: Any, keys: pa.Table, columns: Any) -> Any:
        base = read(t, keys, columns)
        rows = base.rows()
        assert rows is not None and k not in rows.column("id").to_pylist()
        merge_and_collect_elsewhere(table.uri)
        return base

    with table.writer() as w:
        w.put(pa.Table.from_pylist([row], schema=SCHEMA))
        w.flush()
        monkeypatch.setattr(current_rows, "base_rows", then_merge)
        w.put({"id": [k, other_key, 4], "b": [55, 66, 44]}, partial=True)
    got = sql_rows(table, where=f"where id in ({k}, {other_key}, 4)")
    assert got[k] == {**row, "b": 55}
    assert got[other_key] == {"id": other_key, "a": None, "b": 66, "ver": None, "vec": None}
    assert got[4] == {"id": 4, "a": "base4", "b": 44, "ver": 1, "vec": [4.0, 0.0]}


def test_base_rows_are_read_once_per_write(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial write over several regions reads the base once; each region's lookup answers its
    base keys from those rows."""
    table = new_table(tmp_path)
    reads: list[int] = []
    read = current_rows.base_rows

    def counted(t: Any, keys: pa.Table, columns: Any) -> Any:
        reads.append(keys.num_rows)
        return read(t, keys, columns)

    monkeypatch.setattr(current_rows, "base_rows", counted)
    with table.writer() as w:
        w.put({"id": [0, 2, 4, 6, 8, 1], "b": [10, 12, 14, 16, 18, 11]}, partial=True)
    assert reads == [6]
    got = sql_rows(table)
    assert {k: (r["a"], r["b"]) for k, r in got.items()} == {
        **{k: (f"base{k}", 10 + k) for k in (0, 2, 4, 6, 8)},
        1: (None, 11),
    }


@pytest.mark.parametrize("collected", [False, True])
def test_listed_generations_are_read_back_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, collected: bool
) -> None:
    """A writer's first partial write reads back the generations its manifest lists, newest first:
    from then on its lookups answer them in memory. When they were merged and collected meanwhile,
    nothing is read back and the base answers, with the merged rows."""
    table = new_table(tmp_path)
    keys = [100, 101, 102, 103]
    model = {r["id"]: r for r in sql_rows(table).values()}
    with table.writer() as w:  # two generations per region, written before any partial write
        for tag in ("x", "y"):
            w.put(
                pa.Table.from_pylist(
                    [full_row(k, tag) for k in keys[: 2 if tag == "y" else 4]], schema=SCHEMA
                )
            )
            w.flush()
    model.update({k: full_row(k, "y" if k in keys[:2] else "x") for k in keys})
    if collected:
        merge_and_collect_elsewhere(table.uri)
    opened: list[int] = []
    read = GenerationLevel.dataset

    def counted(level: GenerationLevel) -> Any:
        opened.append(level.generation)
        return read(level)

    monkeypatch.setattr(GenerationLevel, "dataset", counted)
    with table.writer() as w:
        for round_ in range(3):
            w.put({"id": keys, "b": [round_] * 4}, partial=True)
            assert opened == []  # read back (or collected: the base answers), never looked up
    model.update({k: {**model[k], "b": 2} for k in keys})
    assert sql_rows(table) == model
