"""Every file memwal_df writes for a flushed generation is verified before it is trusted:

* damage to any file of a generation (data file, bloom filter, pk index, maintained index, the
  checksum sidecar itself, manifest, version hint, transaction), at random offsets, flipped bytes or
  zeroed ranges, never yields a wrong answer: SQL scans, lookups, counts and filters return exactly
  the dict model or raise `CorruptGenerationError` naming the file (and do raise it when a byte
  changed); a lookup in another region is always answered; a missing or an unlisted file is an error;
* the merger refuses a corrupt generation (the generations before it merge, the base keeps the rest
  intact, other regions merge);
* `status` and `memwal status` list it (exit code 1);
* `repair_region` / `memwal repair` rebuild it from the WAL, or, when its WAL entries are gone, set
  it aside and say how many rows are lost;
* a generation Lance's own writer made (no sidecar) with a repeated key or a wrong row count is
  refused before a merge; an intact one merges;
* Lance still reads a generation that carries the sidecar (`lance.dataset`, `LsmScanner`,
  `LsmPointLookupPlanner`, a native merge).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import secrets
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lance.mem_wal import CompactedSsTable, LsmPointLookupPlanner, LsmScanner, ShardSnapshot
from support.figures import case_name, record
from support.optional import not_none

import memwal_df as mw
from memwal_df import errors
from memwal_df.cli import Exit, main
from memwal_df.format import checksums, layout, memwal_index
from memwal_df.format.manifest import RegionManifestStore, next_version
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.wal import Wal

GUARANTEE = "verified reads"
SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float64())])
BASE = range(1000, 1010)
GEN1_PUTS, GEN1_DELETES = range(40), [1000, 1001, 1002, 1003]
GEN2_PUTS = [*range(10), *range(50, 60)]


def _rows(keys: Iterable[int], tag: float) -> pa.Table:
    keys = list(keys)
    return pa.table({"id": pa.array(keys, pa.int64()), "v": [k + tag for k in keys]}, schema=SCHEMA)


@dataclass
class Written:
    """A table of two regions (bucket(id, 2)), each with generation 1 (puts and deletes of base
    keys) and generation 2 (updates and new keys); `model` is key -> v."""

    table: mw.Table
    model: dict[int, float]
    regions: dict[uuid.UUID, list[int]]  # region -> the keys it holds (base keys too)
    written: dict[uuid.UUID, str] = dataclasses.field(
        default_factory=dict
    )  # region -> generation 1 as written

    def region_of(self, key: int) -> uuid.UUID:
        return next(r for r, keys in self.regions.items() if key in keys)

    def generation(self, region: uuid.UUID, g: int) -> str:
        m = RegionManifestStore(self.table.storage, region).latest()
        assert m is not None
        return layout.generation_path(region, next(s.path for s in m.sstables if s.generation == g))


def _after_generation_1() -> dict[int, float]:
    """The model after generation 1 (base, its puts and deletes)."""
    rows = {k: k + 0.0 for k in BASE} | {k: k + 0.5 for k in GEN1_PUTS}
    return {k: v for k, v in rows.items() if k not in GEN1_DELETES}


def _written(
    uri: str, *, index: bool = False, generations: int = 2, options: dict[str, str] | None = None
) -> Written:
    table = mw.create_table(
        uri, _rows(BASE, 0.0), "id", region_spec=mw.bucket("id", 2), storage_options=options
    )
    if index:  # a maintained scalar index: each generation gets its own `_indices/`
        lance.dataset(uri, storage_options=options).create_scalar_index("v", "BTREE")
        table = mw.open_table(uri, storage_options=options)
    model = {k: k + 0.0 for k in BASE}
    with table.writer() as w:
        w.put(_rows(GEN1_PUTS, 0.5))
        w.delete(GEN1_DELETES)
        w.flush()
        if generations > 1:
            w.put(_rows(GEN2_PUTS, 0.25))
    model.update({k: k + 0.5 for k in GEN1_PUTS})
    for k in GEN1_DELETES:
        del model[k]
    if generations > 1:
        model.update({k: k + 0.25 for k in GEN2_PUTS})
    every = [*BASE, *GEN1_PUTS, *GEN2_PUTS]
    values = not_none(table.spec).evaluate(_rows(every, 0), table.schema.field_ids)[0].to_pylist()
    regions: dict[uuid.UUID, list[int]] = {}
    for k, v in zip(every, values, strict=True):
        regions.setdefault(table.region_id_for((v,)), []).append(k)
    assert len(regions) == 2
    written = Written(table, model, regions)
    written.written = {r: written.generation(r, 1) for r in regions}
    return written


def _ctx(uri: str, options: dict[str, str] | None = None) -> datafusion.SessionContext:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri, storage_options=options))
    return ctx


def _scan(ctx: datafusion.SessionContext) -> dict[int, float]:
    got = mw.query(ctx, "SELECT id, v FROM t").to_pylist()
    out = {r["id"]: r["v"] for r in got}
    assert len(out) == len(got), "a key returned twice"
    return out


def _damage(table: mw.Table, path: str, change: Callable[[bytearray], None]) -> bool:
    """Apply `change` to the file at `path`; whether its bytes changed."""
    data = bytearray(table.storage.get(path))
    before = bytes(data)
    change(data)
    table.storage.put(path, bytes(data))
    return bytes(data) != before


def _zero(start: int, length: int) -> Callable[[bytearray], None]:
    def change(data: bytearray) -> None:
        data[start : start + length] = bytes(len(data[start : start + length]))

    return change


def _assert_names(e: errors.CorruptGenerationError, rel: str) -> None:
    assert e.path.startswith(rel) and rel in str(e), (e.path, rel)


# ---------------------------------------------------------------------------------------------------
# (a) damage to any file never yields a wrong answer
# ---------------------------------------------------------------------------------------------------

KINDS = {  # kind -> does a path inside the generation directory belong to it
    "data": lambda p: p.startswith("data/"),
    "bloom filter": lambda p: p == layout.BLOOM_FILTER_FILE,
    "pk index": lambda p: p.startswith(f"{layout.PK_INDEX_DIR}/"),
    "maintained index": lambda p: p.startswith("_indices/"),
    "checksum sidecar": lambda p: p == layout.CHECKSUMS_FILE,
    "manifest": lambda p: p.startswith("_versions/") and p.endswith(".manifest"),
    "version hint": lambda p: p == "_versions/latest_version_hint.json",
    "transaction": lambda p: p.startswith("_transactions/"),
}


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory) -> Written:
    return _written(str(tmp_path_factory.mktemp("checksums") / "t"), index=True, generations=1)


def _damaged_copy(w: Written, region: uuid.UUID, pick: Callable[[list[str]], str]) -> tuple[str, str]:
    """A copy of the region's generation 1 under a new directory name (the process verified the
    original already), listed in a new region manifest version in its place; (directory, the path
    `pick` chose among its files, relative to the directory)."""
    storage = w.table.storage
    source = w.written[region]
    name = layout.generation_dir_name(secrets.token_hex(4), 1)
    copy = layout.generation_path(region, name)
    files = [p[len(source) + 1 :] for p in storage.list(source)]
    for f in files:
        storage.put(f"{copy}/{f}", storage.get(f"{source}/{f}"))
    store = RegionManifestStore(storage, region)
    latest = store.latest()
    assert latest is not None
    m = next_version(latest)
    next(s for s in m.sstables if s.generation == 1).path = name
    assert store.commit(m)
    return copy, pick(files)


def test_every_kind_of_generation_file_is_written_and_listed(indexed: Written) -> None:
    region = indexed.region_of(0)
    rel = indexed.generation(region, 1)
    files = [p[len(rel) + 1 :] for p in indexed.table.storage.list(rel)]
    for kind, belongs in KINDS.items():
        assert any(belongs(f) for f in files), kind
    sums = checksums.GenerationChecksums.decode(indexed.table.storage.get(checksums.sidecar_path(rel)))
    assert set(sums.files) == set(files) - {layout.CHECKSUMS_FILE}
    assert checksums.verify_generation(indexed.table.storage, region, 1, rel) == checksums.VERIFIED


@st.composite
def _changes(draw: st.DrawFn, size: int) -> Callable[[bytearray], None]:
    if draw(st.booleans()):
        offsets = draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=4, unique=True))
        masks = [draw(st.integers(1, 255)) for _ in offsets]

        def flip(data: bytearray) -> None:
            for offset, mask in zip(offsets, masks, strict=True):
                data[offset] ^= mask

        return flip
    start = draw(st.integers(0, size - 1))
    return _zero(start, draw(st.integers(1, 64)))


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damage_to_any_generation_file_never_yields_a_wrong_answer(
    request: pytest.FixtureRequest, indexed: Written, kind: str, data: st.DataObject
) -> None:
    w = indexed
    region = w.region_of(GEN1_DELETES[0])
    other = next(r for r in w.regions if r != region)
    copy, target = _damaged_copy(
        w, region, lambda fs: data.draw(st.sampled_from(sorted(filter(KINDS[kind], fs))))
    )
    path = f"{copy}/{target}"
    size = w.table.storage.head(path)
    assert size
    changed = _damage(w.table, path, data.draw(_changes(size)))

    ours = [k for k in w.regions[region] if k in w.model][:3]
    deleted = next(k for k in GEN1_DELETES if w.region_of(k) == region)
    theirs = next(k for k in w.regions[other] if k in w.model)
    queries: list[tuple[str, Any]] = [
        ("SELECT id, v FROM t", w.model),
        ("SELECT count(*) AS n FROM t", len(w.model)),
        (f"SELECT id, v FROM t WHERE id IN ({', '.join(map(str, ours))})", {k: w.model[k] for k in ours}),
        (f"SELECT id, v FROM t WHERE id = {deleted}", {}),
        ("SELECT id, v FROM t WHERE v >= 30", {k: v for k, v in w.model.items() if v >= 30}),
    ]
    ctx = _ctx(w.table.uri)
    failed = 0
    for sql, expected in queries:
        try:
            got = mw.query(ctx, sql)
        except errors.CorruptGenerationError as e:
            _assert_names(e, copy)
            assert e.region_id == region and e.generation == 1
            failed += 1
            continue
        answer = got["n"][0].as_py() if "count" in sql else {r["id"]: r["v"] for r in got.to_pylist()}
        assert answer == expected, sql
    assert failed == (len(queries) if changed else 0)  # verified before anything is read from it
    # the other region's rows are answered whatever this generation holds
    assert mw.query(ctx, f"SELECT v FROM t WHERE id = {theirs}")["v"].to_pylist() == [w.model[theirs]]
    record(GUARANTEE, case_name(request), corrupt_files=int(changed), queries_checked=len(queries) + 1)


@pytest.mark.parametrize("how", ["missing data file", "missing bloom filter", "unlisted manifest version"])
def test_a_missing_or_unlisted_file_is_an_error(
    request: pytest.FixtureRequest, indexed: Written, how: str
) -> None:
    w = indexed
    region = w.region_of(GEN1_DELETES[0])
    kind = "data" if "data" in how else "bloom filter" if "bloom" in how else "manifest"
    copy, target = _damaged_copy(w, region, lambda fs: sorted(filter(KINDS[kind], fs))[0])
    if how.startswith("missing"):
        w.table.storage.delete(f"{copy}/{target}")
        named = f"{copy}/{target}"
    else:  # one more manifest version (V2 names count down): Lance would read it instead
        newest = min(
            int(f.rsplit("/", 1)[1].split(".")[0])
            for f in w.table.storage.list(f"{copy}/_versions")
            if f.endswith(".manifest")
        )
        named = f"{copy}/_versions/{newest - 1}.manifest"
        w.table.storage.put(named, w.table.storage.get(f"{copy}/{target}"))
    ctx = _ctx(w.table.uri)
    for sql in ("SELECT id, v FROM t", f"SELECT v FROM t WHERE id = {w.regions[region][0]}"):
        with pytest.raises(errors.CorruptGenerationError) as raised:
            mw.query(ctx, sql)
        assert raised.value.path == named
    record(GUARANTEE, case_name(request), corrupt_files=1, queries_checked=2)


def test_zeroed_bloom_filter_is_an_error_not_key_not_found(request: pytest.FixtureRequest, tmp_path) -> None:
    w = _written(str(tmp_path / "t"))
    key = GEN1_PUTS[20]  # held by generation 1 only
    rel = w.generation(w.region_of(key), 1)
    assert _damage(w.table, f"{rel}/{layout.BLOOM_FILTER_FILE}", _zero(0, 1 << 20))
    with pytest.raises(errors.CorruptGenerationError, match=layout.BLOOM_FILTER_FILE):
        mw.query(_ctx(w.table.uri), f"SELECT v FROM t WHERE id = {key}")
    with pytest.raises(errors.CorruptGenerationError, match=layout.BLOOM_FILTER_FILE):
        w.table.changes().read_all()
    record(GUARANTEE, case_name(request), corrupt_files=1, queries_checked=2)


def test_verification_on_every_backend(
    request: pytest.FixtureRequest, table_uri: str, table_storage_options: dict[str, str] | None
) -> None:
    """The sidecar is written and checked through each storage backend (local directory, S3)."""
    w = _written(table_uri, options=table_storage_options)
    bad = w.region_of(0)
    rel = w.generation(bad, 2)
    data = next(p for p in w.table.storage.list(rel) if "/data/" in p)
    assert _damage(w.table, data, _zero(0, 64))
    with pytest.raises(errors.CorruptGenerationError) as raised:
        _scan(_ctx(table_uri, table_storage_options))
    assert raised.value.path == data
    (problem,) = w.table.status()["corrupt_regions"]
    assert problem.path == data
    plan = w.table.repair_region(bad, apply=True)
    assert plan.applied and plan.generations[0].rebuild
    assert _scan(_ctx(table_uri, table_storage_options)) == w.model
    record(GUARANTEE, case_name(request), corrupt_files=1, rows_checked=2 * len(w.model))


# ---------------------------------------------------------------------------------------------------
# (b) merge, (c) status
# ---------------------------------------------------------------------------------------------------


def _base(table: mw.Table) -> dict[int, float]:
    return {r["id"]: r["v"] for r in lance.dataset(table.uri).to_table().to_pylist()}


@pytest.mark.parametrize("generation", [1, 2])
def test_merge_refuses_a_corrupt_generation_and_leaves_the_base_intact(
    request: pytest.FixtureRequest, tmp_path, generation: int
) -> None:
    w = _written(str(tmp_path / "t"))
    bad = w.region_of(0)
    rel = w.generation(bad, generation)
    data = next(p for p in w.table.storage.list(rel) if "/data/" in p)
    assert _damage(w.table, data, _zero(0, 50))
    before = _base(w.table)

    with pytest.raises(errors.CorruptRegionsError) as raised:
        w.table.merge()
    error = raised.value.errors[bad]
    assert isinstance(error, errors.CorruptGenerationError) and error.path == data
    assert (error.region_id, error.generation) == (bad, generation)
    progress = memwal_index.merged_generations(mw.open_table(w.table.uri).details)
    assert progress.get(bad, 0) == generation - 1  # the generations before it merged
    other = next(r for r in w.regions if r != bad)
    assert progress[other] == 2
    after = _base(w.table)
    merged = before if generation == 1 else _after_generation_1()
    assert {k: after.get(k) for k in w.regions[bad]} == {k: merged.get(k) for k in w.regions[bad]}
    assert {k: after.get(k) for k in w.regions[other]} == {k: w.model.get(k) for k in w.regions[other]}

    code, out = _cli("merge", w.table.uri)
    assert code == Exit.FAILED and data in out
    record(GUARANTEE, case_name(request), corrupt_files=1, rows_checked=len(after))


def _cli(*argv: str) -> tuple[int, str]:
    """Run `memwal ARGV` in this process: (exit code, stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_status_lists_a_corrupt_generation_and_the_cli_exits_non_zero(request, tmp_path) -> None:
    w = _written(str(tmp_path / "t"))
    bad = w.region_of(0)
    rel = w.generation(bad, 2)
    bloom = f"{rel}/{layout.BLOOM_FILTER_FILE}"
    assert w.table.status()["corrupt_regions"] == []
    assert _cli("status", w.table.uri)[0] == Exit.OK
    assert _damage(w.table, bloom, _zero(0, 1 << 20))

    (problem,) = w.table.status()["corrupt_regions"]
    assert (problem.region_id, problem.kind, problem.path) == (bad, "generation", bloom)
    assert "generation 2" in problem.error and bloom in problem.error
    assert w.table.status(check_generations=False)["corrupt_regions"] == []
    code, out = _cli("status", w.table.uri)
    assert code == Exit.FAILED and "CORRUPT" in out and bloom in out and "memwal repair" in out
    code, out = _cli("status", w.table.uri, "--json")
    assert code == Exit.FAILED
    (listed,) = json.loads(out)["corrupt_regions"]
    assert (listed["region_id"], listed["kind"], listed["path"]) == (str(bad), "generation", bloom)
    assert _cli("status", w.table.uri, "--no-generation-check")[0] == Exit.OK
    record(GUARANTEE, case_name(request), corrupt_files=1, entry_points_checked=4)


# ---------------------------------------------------------------------------------------------------
# (d) repair
# ---------------------------------------------------------------------------------------------------


def _listing(table: mw.Table) -> dict[str, bytes]:
    return {p: table.storage.get(p) for p in table.storage.list(layout.MEM_WAL_DIR)}


def test_repair_rebuilds_a_corrupt_generation_from_the_wal(request: pytest.FixtureRequest, tmp_path) -> None:
    w = _written(str(tmp_path / "t"), index=True)
    bad = w.region_of(0)
    rel = w.generation(bad, 1)
    data = next(p for p in w.table.storage.list(rel) if "/data/" in p)
    assert _damage(w.table, data, _zero(10, 50))
    damaged = w.table.storage.get(data)
    before = _listing(w.table)

    plan = w.table.repair_region(bad)
    (fix,) = plan.generations
    assert not plan.applied and fix.rebuild and fix.path == rel and fix.generation == 1
    assert fix.complete and fix.rebuilt_rows == fix.rows and plan.rows_lost == 0
    assert "would rebuild it from WAL entries" in plan.describe()
    code, out = _cli("repair", w.table.uri, "--region", str(bad))
    assert code == Exit.OK and "rebuild" in out and "--yes" in out
    assert _listing(w.table) == before  # nothing changed without confirmation

    code, out = _cli("repair", w.table.uri, "--region", str(bad), "--yes")
    assert code == Exit.OK and "rebuilt from WAL entries" in out, out
    assert not w.table.storage.list(rel)
    aside = f"{layout.region_dir(bad)}/quarantine/generations/{rel.rsplit('/', 1)[1]}"
    assert w.table.storage.get(f"{aside}/{data[len(rel) + 1 :]}") == damaged  # set aside as it was
    rebuilt = w.generation(bad, 1)
    assert rebuilt != rel and any("/_indices/" in p for p in w.table.storage.list(rebuilt))
    assert w.table.status()["corrupt_regions"] == []
    assert _scan(_ctx(w.table.uri)) == w.model
    w.table.merge()
    assert _base(w.table) == w.model
    record(GUARANTEE, case_name(request), corrupt_files=1, generations_rebuilt=1, rows_checked=len(w.model))


@pytest.mark.parametrize("gone", ["its WAL entries", "the manifest versions locating them"])
def test_repair_sets_aside_a_generation_it_cannot_rebuild(
    request: pytest.FixtureRequest, tmp_path, gone: str
) -> None:
    w = _written(str(tmp_path / "t"))
    bad = w.region_of(0)
    rel = w.generation(bad, 1)
    pk_index = next(p for p in w.table.storage.list(rel) if f"/{layout.PK_INDEX_DIR}/" in p)
    assert _damage(w.table, pk_index, lambda d: d.__setitem__(len(d) // 2, d[len(d) // 2] ^ 0xFF))
    store = RegionManifestStore(w.table.storage, bad)
    if gone == "its WAL entries":  # as if collected
        wal = Wal(w.table.storage, bad)
        entries = [p for p in wal.stored_positions() if (e := wal.read(p)) is not None and e.generation == 1]
        assert entries
        for position in entries:
            w.table.storage.delete(wal.path(position))
    else:  # as GC keeps only the newest versions: the one that added generation 1 goes too
        versions = store.list_versions()
        added = next(v for v in versions if any(s.generation == 1 for s in not_none(store.read(v)).sstables))
        for v in versions:
            if v <= added:
                w.table.storage.delete(layout.manifest_path(bad, v))
    m = store.latest()
    assert m is not None
    rows = next(s.physical_rows for s in m.sstables if s.generation == 1)

    plan = w.table.repair_region(bad)
    (fix,) = plan.generations
    why = "gone" if gone == "its WAL entries" else "garbage-collected"
    assert not fix.rebuild and why in (fix.why_not or "") and fix.rows == rows
    assert plan.rows_lost == rows and f"its {rows} row(s) are lost" in plan.describe()
    plan = w.table.repair_region(bad, apply=True)
    assert plan.applied and plan.rows_lost == rows
    m = RegionManifestStore(w.table.storage, bad).latest()
    assert m is not None and [s.generation for s in m.sstables] == [2]
    assert w.table.status()["corrupt_regions"] == []

    # generation 1 of the region is lost: its keys show their next older version (base, or none)
    expected = dict(w.model)
    for k in w.regions[bad]:
        if k in GEN2_PUTS:
            continue
        if k in BASE:
            expected[k] = k + 0.0
        else:
            expected.pop(k, None)
    assert _scan(_ctx(w.table.uri)) == expected
    w.table.merge()
    assert _base(w.table) == expected
    record(
        GUARANTEE, case_name(request), corrupt_files=1, generations_set_aside=1, rows_checked=len(expected)
    )


# ---------------------------------------------------------------------------------------------------
# (e) generations Lance's own writer made
# ---------------------------------------------------------------------------------------------------


def _native(tmp_path) -> tuple[mw.Table, uuid.UUID, str, pb.SsTable]:
    table = mw.create_table(str(tmp_path / "t"), _rows(BASE, 0.0), "id")
    region = uuid.uuid4()
    writer = lance.dataset(table.uri).mem_wal_writer(str(region))
    writer.put(_rows(range(20), 0.5))
    writer.delete(pa.table({"id": pa.array([3, 1000], pa.int64())}))
    writer.put(_rows([5, 6], 0.75))
    writer.close()  # one generation of 23 rows, 3 older duplicates hidden by a deletion vector
    m = RegionManifestStore(table.storage, region).latest()
    assert m is not None
    (sst,) = m.sstables
    rel = layout.generation_path(region, sst.path)
    assert not table.storage.exists(checksums.sidecar_path(rel))
    return table, region, rel, sst


def test_an_intact_native_generation_merges(request: pytest.FixtureRequest, tmp_path) -> None:
    table, region, _, _ = _native(tmp_path)
    assert table.status()["corrupt_regions"] == []
    assert table.merge().generations == {region: (1,)}
    expected = {k: k + 0.0 for k in BASE if k != 1000} | {k: k + 0.5 for k in range(20) if k != 3}
    expected |= {5: 5.75, 6: 6.75}
    assert _base(table) == expected
    record(GUARANTEE, case_name(request), rows_checked=len(expected))


@pytest.mark.parametrize("damage", ["repeated key", "row count"])
def test_a_native_generation_contradicting_its_manifest_entry_is_refused(
    request: pytest.FixtureRequest, tmp_path, damage: str
) -> None:
    table, region, rel, sst = _native(tmp_path)
    uri = table.storage.child_uri(rel)
    ds = lance.dataset(uri)
    rows = ds.to_table()
    if damage == "repeated key":  # as many rows as listed, one key twice
        extra = sst.physical_rows - rows.num_rows
        rows = pa.concat_tables([rows, rows.slice(0, 1), rows.slice(0, 1).take([0] * (extra - 1))])
        assert rows.num_rows == sst.physical_rows
    else:  # unique keys, fewer rows than listed
        rows = rows.slice(1)
    # the lance stub types data_storage_version as the literal names it accepts; the dataset's is a str
    lance.write_dataset(rows, uri, mode="overwrite", data_storage_version=ds.data_storage_version)  # type: ignore[arg-type]
    before = _base(table)

    with pytest.raises(errors.CorruptRegionsError) as raised:
        table.merge()
    error = raised.value.errors[region]
    assert isinstance(error, errors.CorruptGenerationError) and error.path == rel
    assert ("repeat a primary key" if damage == "repeated key" else "rows where its region manifest") in str(
        error
    )
    assert _base(table) == before
    (problem,) = table.status()["corrupt_regions"]
    assert (problem.kind, problem.path) == ("generation", rel)
    record(GUARANTEE, case_name(request), corrupt_files=1, entry_points_checked=2)


# ---------------------------------------------------------------------------------------------------
# (f) Lance reads a generation with the sidecar
# ---------------------------------------------------------------------------------------------------


def test_lance_reads_a_generation_with_the_checksum_sidecar(request: pytest.FixtureRequest, tmp_path) -> None:
    w = _written(str(tmp_path / "t"), index=True)
    table = w.table
    snaps = []
    for region in table.region_ids():
        m = RegionManifestStore(table.storage, region).latest()
        assert m is not None
        snap = (
            ShardSnapshot(str(region))
            .with_spec_id(m.shard_spec_id)
            .with_current_generation(m.current_generation)
        )
        for sst in sorted(m.sstables, key=lambda s: s.generation):
            rel = layout.generation_path(region, sst.path)
            assert table.storage.exists(checksums.sidecar_path(rel))
            assert lance.dataset(table.storage.child_uri(rel)).count_rows() == sst.physical_rows
            snap = snap.with_sstable(sst.generation, sst.path)
        snaps.append(snap)
    base = lance.dataset(table.uri)
    got = LsmScanner.from_snapshots(base, snaps).to_table()
    assert {r["id"]: r["v"] for r in got.to_pylist()} == w.model and got.num_rows == len(w.model)
    planner = LsmPointLookupPlanner(base, snaps)
    for key in (0, 20, 55, 1000, 1005):
        found = planner.plan_lookup(pa.array([key], pa.int64())).to_table().to_pylist()
        assert [r["v"] for r in found] == ([w.model[key]] if key in w.model else []), key

    # Lance's own merge of one region's generations, in order, marks them compacted; ours reads on
    region = w.region_of(0)
    for g in (1, 2):
        rel = w.generation(region, g)
        rows = lance.dataset(table.storage.child_uri(rel)).to_table()
        live = rows.filter(pc.invert(rows["_tombstone"])).drop_columns(["_tombstone"])
        dead = rows.filter(rows["_tombstone"]).drop_columns(["_tombstone"])
        ds = lance.dataset(table.uri)
        if dead.num_rows:
            ds.merge_insert("id").when_matched_delete().execute(dead)
            ds = lance.dataset(table.uri)
        ds.merge_insert(
            "id"
        ).when_matched_update_all().when_not_matched_insert_all().mark_sstables_as_compacted(
            [CompactedSsTable(str(region), g)]
        ).execute(live)
    assert _scan(_ctx(table.uri)) == w.model
    record(GUARANTEE, case_name(request), rows_checked=2 * len(w.model))
