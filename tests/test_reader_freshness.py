"""Reader freshness: one `MemWalTable` registered once in one `SessionContext` (a service embedding
DataFusion) sees every write flushed before each query, however many background rounds ran since it
was registered: merges, base version cleanup down to the latest version and generation GC, which
remove the very base versions and generations it read before.

After every round the same registered table is queried through every read path (count, full scan,
point lookups, a filter, vector_search, fts, memwal_explain) and compared with a dict model of
every write; `consistency="snapshot"` too (the MemWAL index snapshot of the latest base version).
"""

from __future__ import annotations

import random
import re
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pytest
from support.figures import case_name, record
from support.search_oracle import make_rows

import memwal_df as mw
from memwal_df.errors import StorageError
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.read.lsm.snapshot import _latest_manifest

GUARANTEE = "reader freshness"
ZERO = timedelta(0)
KEYS = 120
ROUNDS = 4
WORD = "apple"

Model = dict[int, dict[str, Any]]


def _rows(ctx: datafusion.SessionContext, sql: str) -> list[dict[str, Any]]:
    return ctx.sql(sql).to_arrow_table().to_pylist()


def _by_id(rows: list[dict[str, Any]]) -> Model:
    return {r["id"]: {k: v for k, v in r.items() if not k.startswith("_")} for r in rows}


def _write(table: mw.Table, model: Model, rng: random.Random, seed: int, flush: bool = True) -> None:
    """Upserts of new and existing keys and deletes of some, through a table writer, into `model`."""
    data = make_rows(sorted(rng.sample(range(KEYS), 25)), seed)
    dead = sorted(rng.sample(range(KEYS), 6))
    with table.writer() as w:
        w.put(data)
        w.delete(pa.table({"id": pa.array(dead, pa.int64())}))
        if flush:
            w.flush()
    model.update(_by_id(data.to_pylist()))
    for k in dead:
        model.pop(k, None)


def _check(ctx: datafusion.SessionContext, model: Model, latest: int, rng: random.Random) -> int:
    """Every read path of the registered table `t` against `model`; the number of rows compared."""
    assert _rows(ctx, "SELECT count(*) AS n FROM t") == [{"n": len(model)}]
    assert _by_id(_rows(ctx, "SELECT * FROM t")) == model
    probe = sorted(rng.sample(range(KEYS), 10))
    got = _by_id(_rows(ctx, f"SELECT * FROM t WHERE id IN ({', '.join(map(str, probe))})"))
    assert got == {k: model[k] for k in probe if k in model}
    one = probe[0]
    assert _by_id(_rows(ctx, f"SELECT * FROM t WHERE id = {one}")) == (
        {one: model[one]} if one in model else {}
    )
    cat = _by_id(_rows(ctx, "SELECT * FROM t WHERE category = 'a'"))
    assert cat == {k: r for k, r in model.items() if r["category"] == "a"}
    query = ", ".join(["0.5"] * 8)
    found = _by_id(_rows(ctx, f"SELECT * FROM vector_search('t', 'vec', [{query}], {KEYS * 2})"))
    assert found == model
    matched = _by_id(_rows(ctx, f"SELECT * FROM fts('t', 'text', '{WORD}', {KEYS * 2})"))
    assert matched == {k: r for k, r in model.items() if WORD in r["text"].split()}
    plan = [r["line"] for r in _rows(ctx, f"SELECT line FROM memwal_explain('t', 'id = {one}')")]
    assert any(f"v{latest}" in line for line in plan), plan
    return len(model) * 4 + len(probe) + len(cat)


@pytest.mark.parametrize("consistency", ["latest", pytest.param("snapshot", marks=pytest.mark.slow)])
@pytest.mark.slow_on_s3
def test_a_registered_table_stays_fresh_across_maintain_rounds(
    table_uri: str,
    table_storage_options: dict[str, str] | None,
    consistency: str,
    request: pytest.FixtureRequest,
) -> None:
    """One registered table, queried after each of several rounds of writes + flush + merge + index
    build + cleanup of every base version but the latest + GC, returns exactly the model; with
    `latest` also after a flush that is not merged yet."""
    rng = random.Random(7)
    base = make_rows(list(range(0, KEYS, 2)), seed=1)
    jobs = mw.create_table(
        table_uri, base, "id", region_spec=mw.bucket("id", 2), storage_options=table_storage_options
    )
    model = _by_id(base.to_pylist())
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(table_uri, table_storage_options, consistency=consistency))
    checked = 0
    for round_ in range(ROUNDS):
        _write(jobs, model, rng, seed=100 + round_)
        (done,) = jobs.maintain(interval=0, max_rounds=1, grace=ZERO, version_retention=ZERO)
        assert not done.errors, done.errors
        latest = lance.dataset(table_uri, storage_options=table_storage_options).version
        assert len(lance.dataset(table_uri, storage_options=table_storage_options).versions()) == 1
        checked += _check(ctx, model, latest, rng)
        if consistency == "latest":
            _write(jobs, model, rng, seed=200 + round_)  # flushed, not merged
            checked += _check(ctx, model, latest, rng)
    record(GUARANTEE, case_name(request), rounds=ROUNDS, rows_checked=checked)


class _CollectAfterHead(LocalStorage):
    """The table's directory, where garbage collection runs right after the answer to the first
    HEAD of `trigger`: it deletes `doomed`, in ascending order as GC does."""

    def __init__(self, root: str, trigger: str, doomed: list[str]) -> None:
        super().__init__(root, root)
        self.trigger, self.doomed = trigger, doomed

    def head(self, path: str) -> int | None:
        answer = super().head(path)
        if path == self.trigger:
            self.trigger = ""
            for p in self.doomed:
                self.delete(p)
        return answer


def test_a_known_region_manifest_is_reused_only_while_it_is_the_latest(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A region manifest a reader read before (version v) is not taken for the latest when garbage
    collection deletes v and v + 1 while the reader checks it: the reader gets the newest version."""
    uri = str(tmp_path / "t")
    table = mw.create_table(uri, make_rows([0], seed=1), "id", region_spec=mw.unsharded())
    for i in range(3):
        with table.writer() as w:
            w.put(make_rows([i], seed=i))
    (region,) = table.region_ids()
    store = RegionManifestStore(table.storage, region)
    newest = store.latest()
    assert newest is not None and newest.version >= 3
    v = newest.version - 2
    known = store.read(v)
    assert isinstance(table.storage, LocalStorage)
    racing = _CollectAfterHead(table.storage.root, store.path(v), [store.path(v), store.path(v + 1)])
    got = _latest_manifest(RegionManifestStore(racing, region), known)
    assert got is not None and got.version == newest.version
    record(GUARANTEE, case_name(request), races=1)


def test_a_reader_of_a_removed_table_gets_a_typed_error(tmp_path: Path) -> None:
    """When the base table's versions can no longer be listed (the table was removed), the next
    freshness check raises `StorageError` naming the table instead of reading a version it cannot
    know is the latest."""
    uri = str(tmp_path / "t")
    mw.create_table(uri, make_rows([0, 1], seed=1), "id", region_spec=mw.bucket("id", 2))
    reader = mw.MemWalTable(uri)
    assert reader.to_table().num_rows == 2
    shutil.rmtree(uri)
    with pytest.raises(StorageError, match=re.escape(uri)):
        reader.to_table()
