"""One key, one region: a region spec reads primary-key columns only, a region writer opens only
regions the spec can name, and a refused `create_table` leaves nothing behind.

- Every transform over a non-key column is refused where a spec is created or added (`create_table`,
  `memwal create`, `memwal_index.initialize`, `replace_details`); over key columns every transform
  keeps each key in exactly one region through random upserts, deletes and flushes (the stored
  generations and MemTables are walked region by region, and SQL returns each key once).
- A table whose spec was made elsewhere on a non-key column opens and reads; every writer (table
  writer, region writer, `memwal ingest`) refuses it until the caller opts in.
- A region id that names no existing region of a table with a spec is refused (API and CLI) and
  creates nothing; a new region is opened by its values; tables without a spec keep manual regions.
- A `create_table` refused for its spec, key, maintained indexes, or failing after the base table
  was written, leaves no table (local and S3), and the retry succeeds.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.figures import case_name, record
from support.lance_made import lance_made_table
from support.optional import not_none

import memwal_df as mw
from memwal_df import errors
from memwal_df.cli import Exit, main
from memwal_df.format import memwal_index
from memwal_df.format.open_storage import open_storage
from memwal_df.format.regions.spec import RegionSpec, lance_field_ids

GUARANTEE = "one key, one region"
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("cat", pa.string()),
        pa.field("ts", pa.timestamp("us")),
        pa.field("v", pa.int64()),
    ]
)


def rows(ids: list[int], cat: str = "a", v: int = 0) -> pa.Table:
    n = len(ids)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "cat": [cat] * n,
            "ts": pa.array([1_700_000_000_000_000 + i for i in ids], pa.timestamp("us")),
            "v": pa.array([v] * n, pa.int64()),
        },
        schema=SCHEMA,
    )


def sql(uri: str, query: str, storage_options: dict[str, str] | None = None) -> list[dict[str, Any]]:
    ctx = datafusion.SessionContext()
    ctx.register_dataset("t", mw.MemWalTable(uri, storage_options))
    return ctx.sql(query).to_arrow_table().to_pylist()


def assert_no_table(uri: str, storage_options: dict[str, str] | None) -> None:
    """Nothing at `uri`: no object at all, and `open_table` finds no table."""
    assert open_storage(uri, storage_options).list("") == []
    with pytest.raises(errors.TableNotFoundError):
        mw.open_table(uri, storage_options)


# ------------------------------------------------------------------------------------------------
# Specs over non-key columns are refused where a spec is created or added

NON_KEY_SPECS = {
    "identity": (mw.identity("cat"), ["cat"]),
    "bucket": (mw.bucket("cat", 4), ["cat"]),
    "multi_bucket": (mw.multi_bucket(["id", "cat"], 4), ["cat"]),
    "truncate": (mw.truncate("cat", 2), ["cat"]),
    "year": (mw.year("ts"), ["ts"]),
    "month": (mw.month("ts"), ["ts"]),
    "day": (mw.day("ts"), ["ts"]),
    "hour": (mw.hour("ts"), ["ts"]),
    "expression": (mw.expression("col0 || col1", ["cat", "cat"], "utf8"), ["cat"]),
    "second_field": (mw.bucket("id", 4, field_id="b") + mw.identity("v", field_id="v"), ["v"]),
}


@pytest.mark.parametrize("name", list(NON_KEY_SPECS))
def test_create_table_refuses_a_spec_over_non_key_columns(request, table_uri, table_storage_options, name):
    spec, columns = NON_KEY_SPECS[name]
    with pytest.raises(errors.NonKeyRegionColumnError) as caught:
        mw.create_table(
            table_uri, rows([1, 2]), "id", region_spec=spec, storage_options=table_storage_options
        )
    message = str(caught.value)
    assert f"reads {columns}" in message and "primary key" in message and "exactly one region" in message
    assert isinstance(caught.value, errors.InvalidRegionSpecError) and isinstance(caught.value, ValueError)
    assert_no_table(table_uri, table_storage_options)
    record(GUARANTEE, case_name(request), specs_refused=1)


def test_a_non_key_column_in_the_primary_key_may_route(tmp_path):
    """The fix the error names: with the column in the primary key, the spec is accepted, and a row
    whose `cat` changes is a new key (in its own region), not a moved one."""
    t = mw.create_table(str(tmp_path / "t"), rows([1]), ["id", "cat"], region_spec=mw.identity("cat"))
    with t.writer() as w:
        w.put(rows([1], "b", v=1))
    assert sql(t.uri, "SELECT id, cat, v FROM t ORDER BY cat") == [
        {"id": 1, "cat": "a", "v": 0},
        {"id": 1, "cat": "b", "v": 1},
    ]


def test_binding_a_spec_refuses_non_key_columns():
    schema = pa.schema([("id", pa.int64()), ("cat", pa.string())])
    ids = {"id": 0, "cat": 1}
    with pytest.raises(errors.NonKeyRegionColumnError, match=r"reads \['cat'\]"):
        mw.identity("cat").bind(ids, schema, primary_key=["id"])
    bound = mw.identity("cat").bind(ids, schema, primary_key=["id", "cat"])
    assert bound.fields[0].source_ids == (1,)


def test_memwal_index_refuses_to_add_a_non_key_spec(tmp_path):
    """The low-level commits refuse a new or changed spec over a non-key column and write nothing;
    rewriting the details with the table's existing spec (the index builder) still works."""
    t = mw.create_table(str(tmp_path / "t"), rows([1, 2]), "id", region_spec=mw.bucket("id", 4))
    version = t.dataset.version
    bad = mw.identity("cat").bind(lance_field_ids(t.dataset), t.dataset.schema, primary_key=["cat"])
    for spec_id in (2, 1):  # a new spec, then spec 1 replaced
        details = not_none(memwal_index.read_details(t.uri))[0]
        if spec_id == 1:
            del details.sharding_specs[:]
        details.sharding_specs.append(RegionSpec(spec_id, bad.fields).to_proto())
        with pytest.raises(errors.NonKeyRegionColumnError, match=r"reads \['cat'\]"):
            memwal_index.replace_details(t.uri, details, version)
    assert lance.dataset(t.uri).version == version
    t.build_index()
    assert not_none(memwal_index.read_details(t.uri))[0].sharding_specs == t.details.sharding_specs


def test_cli_create_refuses_a_non_key_spec_and_leaves_nothing(tmp_path, capsys):
    uri = str(tmp_path / "t")
    args = ["create", uri, "--schema", "id:int64,cat:string", "-k", "id"]
    assert main([*args, "--spec", "identity(cat)"]) == Exit.USAGE
    err = capsys.readouterr().err
    assert "['cat']" in err and "primary key" in err
    assert_no_table(uri, None)
    assert main([*args, "--spec", "bucket(id,2)"]) == Exit.OK


# ------------------------------------------------------------------------------------------------
# Over key columns, every key is in exactly one region


KEY_SPECS = {
    "bucket": lambda: mw.bucket("id", 3),
    "multi_bucket": lambda: mw.multi_bucket(["id", "k2"], 3),
    "identity": lambda: mw.identity("k2"),
    "truncate": lambda: mw.truncate("id", 4),
    "expression": lambda: mw.expression("col0 % 3", ["id"], "int64"),
    "two_fields": lambda: mw.bucket("id", 2, field_id="b") + mw.identity("k2", field_id="k"),
    "unsharded": lambda: mw.unsharded(),
}
KEYED = pa.schema([pa.field("id", pa.int64(), False), pa.field("k2", pa.string(), False), ("v", pa.int64())])

ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "delete", "flush"]),
        st.lists(st.tuples(st.integers(0, 11), st.sampled_from(["x", "y"])), min_size=1, max_size=6),
        st.integers(0, 1000),
    ),
    min_size=1,
    max_size=8,
)


def _keys_per_region(t: mw.Table) -> dict[tuple[Any, ...], set[uuid.UUID]]:
    """Every key found in any region's flushed generations, with the regions holding it."""
    found: dict[tuple[Any, ...], set[uuid.UUID]] = {}
    for status in t.status()["regions"]:
        for _, path in status.flushed_generations:
            gen = lance.dataset(t.storage.child_uri(f"_mem_wal/{status.region_id}/{path}"))
            for r in gen.to_table(columns=["id", "k2"]).to_pylist():
                found.setdefault((r["id"], r["k2"]), set()).add(status.region_id)
    return found


@pytest.mark.parametrize("name", list(KEY_SPECS))
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=ops)
def test_every_key_stays_in_one_region(request, tmp_path_factory, name, history):
    """Random upserts (changing every non-key column), deletes and flushes through `table.writer()`:
    each key is stored in one region only, and SQL returns each live key once, as the model."""
    uri = str(tmp_path_factory.mktemp("t") / "t")
    t = mw.create_table(uri, KEYED, ["id", "k2"], region_spec=KEY_SPECS[name]())
    model: dict[tuple[int, str], int] = {}
    with t.writer() as w:
        for op, keys, v in history:
            keys = list(dict.fromkeys(keys))
            if op == "flush":
                w.flush()
            elif op == "put":
                ids, k2 = [k for k, _ in keys], [s for _, s in keys]
                w.put(pa.table({"id": ids, "k2": k2, "v": [v] * len(keys)}, schema=KEYED))
                model.update({k: v for k in keys})
            else:
                w.delete(
                    pa.table({"id": [k for k, _ in keys], "k2": [s for _, s in keys]}, schema=KEYED.remove(2))
                )
                for k in keys:
                    model.pop(k, None)
    spread = _keys_per_region(t)
    assert all(len(regions) == 1 for regions in spread.values()), spread
    got = sql(uri, "SELECT id, k2, v FROM t")
    assert len(got) == len({(r["id"], r["k2"]) for r in got})
    assert {(r["id"], r["k2"]): r["v"] for r in got} == model
    record(GUARANTEE, case_name(request), histories=1, keys_checked=len(spread))


# ------------------------------------------------------------------------------------------------
# A table whose spec was made elsewhere on a non-key column


def test_a_lance_made_non_key_spec_opens_reads_and_refuses_writers(
    request, tmp_path, table_uri, table_storage_options, capsys
):
    """Lance's `initialize_mem_wal(identity_column="cat")`: the table opens and reads; every writer
    refuses it (naming the column and the opt-in) and creates nothing; opted in, writes land."""
    opts = table_storage_options
    t = lance_made_table(table_uri, rows([1, 2]), "id", opts, identity_column="cat")
    assert t.non_key_region_columns() == ["cat"]
    assert sql(table_uri, "SELECT count(*) AS n FROM t", opts) == [{"n": 2}]
    refusals: dict[str, Callable[[], object]] = {
        "writer": t.writer,
        "region_writer": lambda: t.region_writer(values=("a",)),
        "routed_writer": lambda: t.routed_writer(("a",), mw.WriterConfig()),
    }
    for what, make in refusals.items():
        with pytest.raises(errors.NonKeyRegionColumnError, match="allow_non_key_region_columns") as caught:
            make()
        assert "['cat']" in str(caught.value), what
    cli_opts = [a for k, v in (opts or {}).items() for a in ("-o", f"{k}={v}")]
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": 3, "cat": "b", "ts": null, "v": 3}\n')
    capsys.readouterr()
    assert main(["ingest", table_uri, str(data), *cli_opts]) == Exit.USAGE
    assert "['cat']" in capsys.readouterr().err
    assert t.region_ids() == []  # no refused writer created a region
    assert main(["ingest", table_uri, str(data), *cli_opts, "--allow-non-key-region-columns"]) == Exit.OK
    with t.writer(allow_non_key_region_columns=True) as w:
        w.put(rows([4], "c"))
    assert t.recover() == []  # recovery needs no opt-in (it adds no rows)
    assert sql(table_uri, "SELECT id, cat FROM t ORDER BY id", opts) == [
        {"id": 1, "cat": "a"},
        {"id": 2, "cat": "a"},
        {"id": 3, "cat": "b"},
        {"id": 4, "cat": "c"},
    ]
    record(GUARANTEE, case_name(request), writers_refused=len(refusals) + 1)


# ------------------------------------------------------------------------------------------------
# Phantom regions


@pytest.mark.parametrize("spec", [mw.bucket("id", 4), mw.unsharded()], ids=["bucket", "unsharded"])
def test_region_writer_refuses_a_region_id_the_spec_cannot_name(table_uri, table_storage_options, spec):
    t = mw.create_table(
        table_uri, rows([1, 2]), "id", region_spec=spec, storage_options=table_storage_options
    )
    with pytest.raises(errors.UnknownRegionError, match="region_writer\\(values=") as caught:
        t.region_writer(uuid.uuid4())
    assert isinstance(caught.value, errors.RegionRoutingError) and t.spec_text() in str(caught.value)
    assert t.region_ids() == []  # nothing was created
    (values,) = not_none(t.spec).evaluate(rows([7]), t.schema.field_ids)
    value = values[0].as_py()
    with t.region_writer(values=(value,)) as w:  # a new region, named by its values
        assert w.region_id == t.region_id_for((value,))
        w.put(rows([7], "new"))
        others = [k for k in range(40) if k not in _same_region(t, value)]  # none when unsharded
        if others:
            with pytest.raises(errors.RegionRoutingError):
                w.put(rows(others[:1]))  # a key of another region
    with t.region_writer(w.region_id) as again:  # an existing region, by its id
        assert again.region_id == w.region_id
    with pytest.raises(errors.RegionRoutingError, match="1 fields"):
        t.region_writer(values=(value, value))
    with pytest.raises(errors.RegionRoutingError, match="no row has region value 4"):
        t.region_writer(values=(4,))  # bucket[4] makes 0..3, unsharded 0
    with pytest.raises(errors.InvalidArgumentError, match="not both"):
        t.region_writer(w.region_id, values=(value,))
    assert t.region_ids() == [w.region_id]
    assert sql(t.uri, "SELECT id, cat FROM t WHERE id = 7", table_storage_options) == [
        {"id": 7, "cat": "new"}
    ]


def _same_region(t: mw.Table, value: Any) -> set[int]:
    (values,) = not_none(t.spec).evaluate(rows(list(range(40))), t.schema.field_ids)
    return {k for k, b in enumerate(values.to_pylist()) if b == value}


def test_a_table_without_spec_keeps_manual_regions(tmp_path):
    t = mw.create_table(str(tmp_path / "t"), rows([1]), "id")
    region = uuid.uuid4()
    with t.region_writer(region) as w:
        w.put(rows([1, 5], "m"))
    assert t.region_ids() == [region]
    with pytest.raises(errors.RegionRoutingError):
        t.region_writer(values=(1,))


def test_cli_ingest_refuses_a_phantom_region(tmp_path, capsys):
    uri = str(tmp_path / "t")
    assert main(["create", uri, "--schema", "id:int64,v:string", "-k", "id", "--spec", "bucket(id,2)"]) == 0
    data = tmp_path / "rows.csv"
    data.write_text("id,v\n1,a\n2,b\n")
    capsys.readouterr()
    assert main(["ingest", uri, str(data), "--region", str(uuid.uuid4())]) == Exit.USAGE
    assert "does not exist" in capsys.readouterr().err
    t = mw.open_table(uri)
    assert t.region_ids() == []
    assert main(["ingest", uri, str(data)]) == Exit.OK
    existing = t.region_ids()[0]
    one = tmp_path / "one.csv"
    key = next(
        k
        for k in range(100)
        if t.region_id_for(
            tuple(
                v[0].as_py()
                for v in not_none(t.spec).evaluate(
                    pa.table({"id": pa.array([k], pa.int64())}), t.schema.field_ids
                )
            )
        )
        == existing
    )
    one.write_text(f"id,v\n{key},z\n")
    assert main(["ingest", uri, str(one), "--region", str(existing)]) == Exit.OK
    assert sql(uri, f"SELECT v FROM t WHERE id = {key}") == [{"v": "z"}]


# ------------------------------------------------------------------------------------------------
# A refused create_table leaves nothing behind

REFUSED_CREATES: dict[str, tuple[dict[str, Any], type[Exception]]] = {
    "day_of_an_integer": (dict(region_spec=mw.day("id")), errors.InvalidRegionSpecError),
    "unknown_column": (dict(region_spec=mw.bucket("nope", 2)), errors.InvalidRegionSpecError),
    "non_key_column": (dict(region_spec=mw.identity("cat")), errors.NonKeyRegionColumnError),
    "maintained_index": (dict(maintained_indexes=["vec_idx"]), errors.InvalidConfigError),
    "key_type": (dict(primary_key="ts"), errors.SchemaMismatchError),
}


@pytest.mark.parametrize("case", list(REFUSED_CREATES))
def test_a_refused_create_leaves_nothing_and_the_retry_succeeds(table_uri, table_storage_options, case):
    kwargs, error = REFUSED_CREATES[case]
    args = {"primary_key": "id", **kwargs}
    with pytest.raises(error):
        mw.create_table(table_uri, rows([1, 2]), storage_options=table_storage_options, **args)
    assert_no_table(table_uri, table_storage_options)
    t = mw.create_table(
        table_uri, rows([1, 2]), "id", region_spec=mw.bucket("id", 2), storage_options=table_storage_options
    )
    assert sql(t.uri, "SELECT count(*) AS n FROM t", table_storage_options) == [{"n": 2}]


def test_a_create_failing_after_the_base_table_was_written_removes_it(
    table_uri, table_storage_options, monkeypatch
):
    """The MemWAL index commit loses a race (the step after the base table is written): what was
    written is removed, and the retry creates the table."""
    real = memwal_index.initialize

    def lose_the_race(*args: Any, **kwargs: Any) -> None:
        raise errors.CommitConflictError("MemWAL initialization on version 1 lost a race")

    monkeypatch.setattr(memwal_index, "initialize", lose_the_race)
    with pytest.raises(errors.CommitConflictError):
        mw.create_table(
            table_uri,
            rows([1, 2]),
            "id",
            region_spec=mw.bucket("id", 2),
            storage_options=table_storage_options,
        )
    assert_no_table(table_uri, table_storage_options)
    monkeypatch.setattr(memwal_index, "initialize", real)
    mw.create_table(
        table_uri, rows([1, 2]), "id", region_spec=mw.bucket("id", 2), storage_options=table_storage_options
    )
    assert sql(table_uri, "SELECT count(*) AS n FROM t", table_storage_options) == [{"n": 2}]


def test_cli_create_with_a_bad_spec_leaves_nothing(tmp_path, capsys):
    uri = str(tmp_path / "t")
    args = ["create", uri, "--schema", "id:int64,v:string", "-k", "id"]
    assert main([*args, "--spec", "day(id)"]) == Exit.USAGE
    assert "day cannot take" in capsys.readouterr().err
    assert_no_table(uri, None)
    assert main([*args, "--spec", "bucket(id,2)"]) == Exit.OK


def test_create_over_a_lance_table_without_memwal_index_says_so(tmp_path):
    """What a create killed between the base table and the MemWAL index leaves: refused, not taken
    over (it may be someone's table), with what to do."""
    uri = str(tmp_path / "t")
    lance.write_dataset(rows([1]), uri)
    with pytest.raises(errors.TableExistsError, match="without a MemWAL index .* remove it"):
        mw.create_table(uri, rows([1]), "id")
    assert lance.dataset(uri).count_rows() == 1
