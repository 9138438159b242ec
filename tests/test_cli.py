"""The `memwal` command line: every command on real tables (local and once on the moto S3 server),
results checked against a dict model of the input files and against `reference.stored_rows`, and
every error class mapped to its exit code."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.optional import not_none
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.cli import Exit, main
from memwal_df.cli import bench as cli_bench
from memwal_df.cli.inputs import Progress, rebatch
from memwal_df.cli.parse import parse_region_spec, parse_schema
from memwal_df.errors import InvalidArgumentError
from memwal_df.format import layout

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "id:int64,name:string,score:float64,vec:vector[3]"


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """Run `memwal ARGV` in this process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture, *argv: str) -> Any:
    code, out, err = cli(capsys, *argv, "--json")
    assert code == Exit.OK, err
    return json.loads(out)


def options_args(options: dict[str, str] | None) -> list[str]:
    return [a for k, v in (options or {}).items() for a in ("-o", f"{k}={v}")]


def rows(ids: range, tag: str, with_vec: bool = True) -> list[dict]:
    return [
        {
            "id": i,
            "name": f"{tag}-{i}",
            "score": i / 4,
            **({"vec": [i / 2, 1.0, -0.25]} if with_vec else {}),
        }
        for i in ids
    ]


def write_inputs(d: Path) -> tuple[list[Path], dict[int, dict]]:
    """One file per format with overlapping keys, and the model after ingesting the first three in
    order (the CSV file, last, lacks the vector column, which CSV cannot hold)."""
    d.mkdir(parents=True, exist_ok=True)
    vec_type = pa.list_(pa.float32(), 3)
    schema = pa.schema(
        [("id", pa.int64()), ("name", pa.string()), ("score", pa.float64()), ("vec", vec_type)]
    )
    parts = [rows(range(0, 60), "parquet"), rows(range(40, 90), "arrow"), rows(range(80, 120), "json")]
    csv_rows = rows(range(100, 130), "csv", with_vec=False)
    files = [d / "a.parquet", d / "b.arrow", d / "c.jsonl", d / "d.csv"]
    pq.write_table(pa.Table.from_pylist(parts[0], schema), files[0], row_group_size=7)
    with pa.ipc.new_file(str(files[1]), schema) as w:
        w.write_table(pa.Table.from_pylist(parts[1], schema), max_chunksize=9)
    files[2].write_text("\n".join(json.dumps(r) for r in parts[2]) + "\n")
    pcsv.write_csv(pa.Table.from_pylist(csv_rows), files[3])
    model: dict[int, dict] = {}
    for r in [*parts[0], *parts[1], *parts[2]]:
        model[r["id"]] = r
    return files, model


def sql_rows(capsys: pytest.CaptureFixture, uri: str, opts: list[str], *extra: str) -> dict[int, dict]:
    got = cli_json(capsys, "sql", "-t", f"t={uri}", *opts, *extra, "SELECT * FROM t")
    return {r["id"]: r for r in got}


@pytest.mark.slow_on_s3
def test_every_command_on_a_table(capsys, tmp_path, table_uri, table_storage_options):
    uri, opts = table_uri, options_args(table_storage_options)
    files, model = write_inputs(tmp_path / "in")

    created = cli_json(capsys, "create", uri, *opts, "--schema", SCHEMA, "-k", "id", "--spec", "bucket(id,4)")
    assert created["region_spec"] == "bucket[4](id)" and created["base_rows"] == 0

    ingested = cli_json(
        capsys, "ingest", uri, *opts, *map(str, files[:3]), "--batch-size", "16", "--no-progress"
    )
    assert ingested["rows"] == 60 + 50 + 40 and len(ingested["regions"]) == 4
    code, out, err = cli(capsys, "ingest", uri, *opts, str(files[3]))  # no vectors: would erase them
    assert (code, out) == (Exit.USAGE, "") and "MissingColumnsError" in err and "['vec']" in err
    keys = tmp_path / "in" / "keys.parquet"
    pq.write_table(pa.table({"id": pa.array([5, 45, 500], pa.int64()), "other": ["x", "y", "z"]}), keys)
    cli_json(capsys, "delete", uri, *opts, str(keys))
    cli_json(capsys, "ingest", uri, *opts, "--delete", str(files[3]))  # a data file as a key file
    cli_json(capsys, "delete", uri, *opts, "--keys", "1, 2,3", "--no-durable")
    for k in [5, 45, 500, *range(100, 130), 1, 2, 3]:
        model.pop(k, None)

    table = mw.open_table(uri, table_storage_options)
    assert sql_rows(capsys, uri, opts) == model == stored_rows(table)

    status = cli_json(capsys, "status", uri, *opts)
    assert status["base_rows"] == 0 and len(status["regions"]) == 4 and status["region_snapshot_ms"] is None
    assert all(r["unmerged_generations"] for r in status["regions"])
    code, text, _ = cli(capsys, "status", uri, *opts)
    assert code == 0 and "4 regions" in text and "bucket[4](id)" in text

    plan = cli_json(capsys, "explain", uri, *opts, "id = 7", "--columns", "id,name")
    assert any("TakeLastExec" in line for line in plan["plan"])

    merged = cli_json(capsys, "merge", uri, *opts)
    assert sum(len(r["generations"]) for r in merged["regions"]) == sum(
        len(r["unmerged_generations"]) for r in status["regions"]
    )
    after = cli_json(capsys, "status", uri, *opts)
    assert after["base_rows"] == len(model) and not any(r["unmerged_generations"] for r in after["regions"])
    assert sql_rows(capsys, uri, opts) == model

    built = cli_json(capsys, "build-index", uri, *opts)
    assert built["regions"] == 4
    assert cli_json(capsys, "status", uri, *opts)["region_snapshot_ms"] == built["snapshot_ts_millis"]
    assert sql_rows(capsys, uri, opts, "--consistency", "snapshot") == model

    lance.dataset(uri, storage_options=table_storage_options).cleanup_old_versions(older_than=timedelta(0))
    removed = cli_json(capsys, "gc", uri, *opts, "--grace", "0")
    gone = {r["region_id"]: r["generations"] for r in removed["regions"]}
    assert gone == {r["region_id"]: [g for g, _ in r["flushed_generations"]] for r in after["regions"]}
    assert sql_rows(capsys, uri, opts) == model == stored_rows(table)


def test_sql_text_output_joins_and_search(capsys, tmp_path):
    files, _ = write_inputs(tmp_path / "in")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for uri in (a, b):
        assert (
            cli(capsys, "create", uri, "--from", str(files[0]), "-k", "id", "--spec", "bucket(id,2)")[0] == 0
        )
    cli_json(capsys, "ingest", b, str(files[1]), str(files[2]))  # arrow rows 40..89, then json 80..119
    b_names = {r["id"]: r["name"] for r in [*rows(range(0, 60), "parquet"), *rows(range(40, 90), "arrow")]}
    b_names |= {r["id"]: r["name"] for r in rows(range(80, 120), "json")}
    query = "SELECT count(*) AS n FROM a JOIN b ON a.id = b.id WHERE b.name LIKE 'arrow%'"
    got = cli_json(capsys, "sql", "-t", f"a={a}", "-t", f"b={b}", query)
    assert got == [{"n": sum(1 for k, n in b_names.items() if k < 60 and n.startswith("arrow"))}]
    code, out, _ = cli(capsys, "sql", "-t", a, "SELECT id, name FROM t ORDER BY id", "--max-rows", "3")
    assert (
        code == 0 and out.splitlines()[2].split() == ["0", "parquet-0"] and "(60 rows, first 3 shown)" in out
    )
    top = cli_json(capsys, "sql", "-t", b, "SELECT id FROM vector_search('t', 'vec', [59.5, 1.0, -0.25], 1)")
    assert top == [{"id": 119}]  # vec = [id / 2, 1, -0.25]: id 119 is exactly the query
    hits = cli_json(capsys, "sql", "-t", b, "SELECT id FROM fts('t', 'name', 'json', 100) ORDER BY id")
    assert [r["id"] for r in hits] == sorted(k for k, n in b_names.items() if n.startswith("json"))


def test_sql_shell(capsys, tmp_path, monkeypatch):
    files, _ = write_inputs(tmp_path / "in")
    uri = str(tmp_path / "t")
    cli(capsys, "create", uri, "--from", str(files[0]), "-k", "id")

    def shell(script: str) -> tuple[int, list[str], str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(script))
        code, out, err = cli(capsys, "sql", "-t", uri)
        return code, out.splitlines(), err

    code, lines, err = shell("\\d\nSELECT count(*)\n  AS n FROM t;\n\\d t\nSELECT max(id) + 1 AS m FROM t")
    assert code == Exit.OK and err == ""
    assert lines[0] == "t" and "60" in lines  # \d, then the two-line count
    assert any(line.startswith("vec ") for line in lines)
    assert lines[-2:] == ["60", "(1 row)"]  # the unterminated statement runs at end of input

    code, lines, err = shell("SELEC 1;\nSELECT 7 AS x;\nSELECT 8 AS y\n\\q\nSELECT 9 AS z;\n")
    assert code == Exit.SQL and "ParserError" in err  # the failed statement did not stop the shell
    assert "7" in lines and "8" not in lines and "9" not in lines  # \q dropped the unfinished one


def test_maintain_and_recover(capsys, tmp_path):
    uri = str(tmp_path / "t")
    cli(capsys, "create", uri, "--schema", SCHEMA, "-k", "id", "--spec", "bucket(id,2)")
    table = mw.open_table(uri)
    crashed = table.writer(durable=True)
    crashed.put(pa.Table.from_pylist(rows(range(10), "wal"), table.schema.schema))
    crashed.abort()  # durable in the WAL, never flushed
    assert cli_json(capsys, "sql", "-t", uri, "SELECT count(*) AS n FROM t") == [{"n": 0}]
    recovered = cli_json(capsys, "recover", uri)
    assert sorted(recovered["recovered"]) == sorted(str(r) for r in table.region_ids())
    assert cli_json(capsys, "sql", "-t", uri, "SELECT count(*) AS n FROM t") == [{"n": 10}]

    rounds = cli_json(capsys, "maintain", uri, "--rounds", "2", "--interval", "0", "--grace", "0")
    assert [r["round"] for r in rounds] == [1, 2] and not any(r["errors"] for r in rounds)
    status = cli_json(capsys, "status", uri)
    assert status["base_rows"] == 10 and not any(r["unmerged_generations"] for r in status["regions"])
    assert {k: {**v, "vec": None} for k, v in stored_rows(table).items()} == {
        r["id"]: {**r, "vec": None} for r in rows(range(10), "wal")
    }


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["status", "{missing}"], Exit.NOT_FOUND, "TableNotFoundError"),
        (["create", "{table}", "--schema", "id:int64", "-k", "id"], Exit.NOT_FOUND, "TableExistsError"),
        (["create", "{new}", "--schema", "id:int65", "-k", "id"], Exit.USAGE, "unknown type 'int65'"),
        (["create", "{new}", "--schema", "id int64", "-k", "id"], Exit.USAGE, "NAME:TYPE"),
        (["create", "{new}", "--schema", "v:float64", "-k", "id"], Exit.USAGE, "SchemaMismatchError"),
        (
            ["create", "{new}", "--schema", "id:int64", "-k", "id", "--spec", "bucket(nope,4)"],
            Exit.USAGE,
            "InvalidRegionSpecError",
        ),
        (
            ["create", "{new}", "--schema", "id:int64", "-k", "id", "--spec", "buckets(id,4)"],
            Exit.USAGE,
            "unknown region transform",
        ),
        (["create", "{new}", "--from", "{dir}/none.parquet", "-k", "id"], Exit.NOT_FOUND, "no such file"),
        (["ingest", "{table}", "{dir}/none.parquet"], Exit.NOT_FOUND, "no such file"),
        (["ingest", "{table}", "{dir}/data.txt"], Exit.USAGE, "cannot tell the format"),
        (["ingest", "{table}", "{dir}/bad.parquet"], Exit.USAGE, "SchemaMismatchError"),
        (["ingest", "{table}", "{dir}/data.txt", "--batch-size", "0"], Exit.USAGE, "--batch-size"),
        (["ingest", "{table}", "{dir}/corrupt.parquet"], Exit.USAGE, "ArrowInvalid"),
        (["ingest", "{table}", "{dir}/data.txt", "--format", "csv", "--region", "r1"], Exit.USAGE, "a UUID"),
        (["ingest", "{nospec}", "{dir}/data.txt", "--format", "csv"], Exit.USAGE, "RegionRoutingError"),
        (["delete", "{table}"], Exit.USAGE, "give --keys or key FILEs"),
        (["delete", "{table}", "{dir}/other.csv"], Exit.USAGE, "lacks the primary key columns ['id']"),
        (["delete", "{table}", "--keys", "1,x"], Exit.USAGE, "cannot read"),
        (["sql", "-t", "{table}", "SELEC 1"], Exit.SQL, "ParserError"),
        (["sql", "-t", "{table}", "SELECT * FROM nope"], Exit.SQL, "not found"),
        (["sql", "-t", "{table}", "SELECT * FROM fts('t', 'id', 'x', 0)"], Exit.SQL, "InvalidConfigError"),
        (["sql", "-t", "{table}", "-t", "{table}", "SELECT 1"], Exit.USAGE, "name every table"),
        (["sql", "-t", "1x={table}", "SELECT 1"], Exit.USAGE, "SQL identifier"),
        (["status", "{table}", "-o", "novalue"], Exit.USAGE, "KEY=VALUE"),
        (["explain", "{table}", "id ="], Exit.USAGE, "expected a column or a value"),
        (
            ["explain", "{table}", "nope = 1"],
            Exit.USAGE,
            "names column 'nope', which the table does not have",
        ),
        (["explain", "{table}", "v = 'x'"], Exit.USAGE, "compares column 'v' (double) with 'x'"),
        (
            ["sql", "-t", "{table}", "SELECT * FROM memwal_explain('t', 'v = ''x''')"],
            Exit.SQL,
            "InvalidFilterError: filter \"v = 'x'\" compares column 'v' (double) with 'x'",
        ),
        (["explain", "{table}", "--columns", "id,nope"], Exit.USAGE, "no such columns"),
        (["gc", "{table}", "--grace", "-1"], Exit.USAGE, "--grace"),
        (["maintain", "{table}", "--rounds", "0"], Exit.USAGE, "--rounds"),
    ],
)
def test_errors_map_to_exit_codes(capsys, tmp_path, argv, code, message):
    table = tmp_path / "t"
    mw.create_table(str(table), parse_schema("id:int64,v:float64"), "id", region_spec=mw.bucket("id", 2))
    nospec = mw.create_table(str(tmp_path / "nospec"), parse_schema("id:int64,v:float64"), "id")
    nospec.region_writer(uuid.uuid4()).close()  # a region made by hand: rows cannot be routed
    (tmp_path / "data.txt").write_text("id\n1\n")
    (tmp_path / "corrupt.parquet").write_bytes(b"not a parquet file")
    (tmp_path / "other.csv").write_text("x\n1\n")
    pq.write_table(pa.table({"id": [1], "other": ["x"]}), tmp_path / "bad.parquet")
    names = {"table": table, "missing": tmp_path / "missing", "new": tmp_path / "new", "dir": tmp_path}
    names["nospec"] = tmp_path / "nospec"
    got, out, err = cli(capsys, *(a.format(**names) for a in argv))
    assert (got, out) == (code, "")
    assert err.startswith(f"memwal {argv[0]}: error: ") and message in err and len(err.splitlines()) == 1


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["nope"], ["create"], ["status"], ["sql", "SELECT 1"], ["merge", "x", "--bad"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == Exit.USAGE
        assert "usage:" in capsys.readouterr().err


def test_help_of_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    commands = ["create", "ingest", "delete", "sql", "explain", "status", "merge", "build-index", "gc"]
    commands += ["compact", "recover", "repair", "maintain", "bench"]
    top = capsys.readouterr().out
    assert e.value.code == 0 and all(c in top for c in commands)
    for command in commands:
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0 and f"usage: memwal {command}" in capsys.readouterr().out


def test_entry_points_run_the_cli(tmp_path):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["memwal"].partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is main
    run = subprocess.run(
        [sys.executable, "-m", "memwal_df", "status", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == Exit.NOT_FOUND and "python -m memwal_df status: error:" in run.stderr


def test_bench_runs_a_script_of_the_checkout(capsys):
    code, _, _ = cli(capsys, "bench", "merge", "--help")  # the script's output goes to the real stdout
    assert code == 0
    assert cli(capsys, "bench", "merge", "--no-such-option")[0] == 2  # the script's exit code


def test_bench_finds_the_checkout_around_the_current_directory(monkeypatch):
    monkeypatch.setattr(cli_bench, "PACKAGE_CHECKOUT", Path("/nonexistent"))
    assert cli_bench.bench_dir(ROOT / "memwal_df" / "cli") == ROOT / "bench"


def test_bench_without_a_source_checkout_fails_with_a_typed_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli_bench, "PACKAGE_CHECKOUT", tmp_path / "site-packages")  # an installed wheel
    monkeypatch.chdir(tmp_path)
    with pytest.raises(cli_bench.BenchNotFoundError, match="source checkout"):
        cli_bench.bench_dir()
    code, out, err = cli(capsys, "bench", "merge", "--help")
    assert code == Exit.NOT_FOUND and out == ""
    assert "memwal bench: error: BenchNotFoundError: no bench/ directory" in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("bucket(id,4)", mw.bucket("id", 4)),
        ("bucket( id , 4 )", mw.bucket("id", 4)),
        ("multi_bucket(a,b,8)", mw.multi_bucket(["a", "b"], 8)),
        ("identity(c)", mw.identity("c")),
        ("year(ts)", mw.year("ts")),
        ("month(ts)", mw.month("ts")),
        ("day(ts)", mw.day("ts")),
        ("hour(ts)", mw.hour("ts")),
        ("truncate(s,3)", mw.truncate("s", 3)),
        ("unsharded", mw.unsharded()),
        ("unsharded()", mw.unsharded()),
        (
            "bucket(id,4)+identity(c)",
            mw.bucket("id", 4, field_id="bucket_0") + mw.identity("c", field_id="identity_1"),
        ),
    ],
)
def test_region_spec_text(text, expected):
    assert parse_region_spec(text) == expected


@pytest.mark.parametrize(
    "text", ["bucket(id)", "bucket(id,x)", "foo(id)", "bucket(id,4", "identity(a,b)", ""]
)
def test_bad_region_spec_text(text):
    with pytest.raises(InvalidArgumentError):
        parse_region_spec(text)


def test_schema_text():
    got = parse_schema(
        "id:int64, s:string,v:vector[8],h:vector[2,float16],ts:timestamp[us],l:list[int32],b:bool"
    )
    assert got == pa.schema(
        [
            ("id", pa.int64()),
            ("s", pa.string()),
            ("v", pa.list_(pa.float32(), 8)),
            ("h", pa.list_(pa.float16(), 2)),
            ("ts", pa.timestamp("us")),
            ("l", pa.list_(pa.int32())),
            ("b", pa.bool_()),
        ]
    )
    for bad in ["id:int64,id:string", "id:", ":int64", "v:vector[0]", "v:vector[3,int8]", "x:nope"]:
        with pytest.raises(InvalidArgumentError):
            parse_schema(bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=12), st.integers(1, 25))
def test_rebatch_keeps_rows_and_order(sizes, rows_per_batch):
    start = [0, *itertools.accumulate(sizes)]
    batches = [
        pa.record_batch({"x": pa.array(range(a, a + n), pa.int64())})
        for a, n in zip(start[:-1], sizes, strict=True)
    ]
    out = list(rebatch(iter(batches), rows_per_batch))
    assert [v for b in out for v in b.column(0).to_pylist()] == list(range(sum(sizes)))
    assert all(b.num_rows == rows_per_batch for b in out[:-1])
    assert not out or 0 < out[-1].num_rows <= rows_per_batch


def write_rows(path: Path, data: pa.Table) -> None:
    """`data` as a CSV, JSON lines or Parquet file, by the extension of `path`."""
    if path.suffix == ".csv":
        pcsv.write_csv(data, path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in data.to_pylist()))
    else:
        pq.write_table(data, path)


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
@pytest.mark.parametrize("region", [False, True], ids=["routed", "region"])
def test_ingest_of_a_file_lacking_a_column_is_refused_and_writes_nothing(capsys, tmp_path, fmt, region):
    """A file without some columns of the table (here `score`, and the vectors) would erase them in
    the rows it names: `memwal ingest` exits with the usage code, naming the missing columns, and the
    table is unchanged, its WALs included."""
    uri = str(tmp_path / "t")
    spec = [] if region else ["--spec", "bucket(id,2)"]
    cli_json(capsys, "create", uri, "--schema", SCHEMA, "-k", "id", *spec)
    path = tmp_path / f"in.{fmt}"
    write_rows(path, pa.Table.from_pylist(rows(range(30), fmt, with_vec=False)).drop_columns(["score"]))
    target = ["--region", "6b1f3a52-0d3e-4c1a-9a43-5f0e2b7c8d11"] if region else []
    code, out, err = cli(capsys, "ingest", uri, str(path), *target, "--batch-size", "7")
    assert (code, out) == (Exit.USAGE, "")
    assert err.startswith(
        "memwal ingest: error: MissingColumnsError: data lacks the columns of the table ['score', 'vec']"
    )
    table = mw.open_table(uri)
    table.recover()
    assert stored_rows(table) == {}


def test_ingest_into_a_region_of_a_table_without_spec(capsys, tmp_path):
    uri, region = str(tmp_path / "t"), "6b1f3a52-0d3e-4c1a-9a43-5f0e2b7c8d11"
    cli(capsys, "create", uri, "--schema", "id:int64,v:string", "-k", "id", "--maintained-indexes", "")
    assert cli_json(capsys, "status", uri)["maintained_indexes"] == []
    data = tmp_path / "rows.csv"
    data.write_text("id,v\n1,a\n2,b\n1,c\n")
    got = cli_json(capsys, "ingest", uri, str(data), "--region", region)
    assert got["regions"] == [region] and got["rows"] == 3
    assert cli_json(capsys, "sql", "-t", uri, "SELECT * FROM t ORDER BY id") == [
        {"id": 1, "v": "c"},
        {"id": 2, "v": "b"},
    ]


def test_progress_bar():
    out = io.StringIO()
    bar = Progress("ingest", 200, enabled=True, out=out)
    time.sleep(0.15)  # drawn at most every 0.1 s
    bar.update(50)
    assert re.fullmatch(
        r"\ringest: \[#{7} {23}\]  25% 50/200 rows, [\d,]+ rows/s, ETA 0:0\d\x1b\[K", out.getvalue()
    ), out.getvalue()
    bar.update(150)
    bar.close()
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("ingest: [" + "#" * 30 + "] 100% 200/200 rows, ")
    assert last.endswith(" rows/s\x1b[K\n")  # no ETA when done; the rest of the line cleared
    quiet = io.StringIO()
    Progress("ingest", None, enabled=False, out=quiet).close()
    assert quiet.getvalue() == ""


def test_sql_shell_on_a_terminal(tmp_path):
    """The interactive path (readline, prompts, continuation lines) in a pseudo-terminal."""
    uri = str(tmp_path / "t")
    mw.create_table(uri, parse_schema("id:int64,v:float64"), "id")
    leader, follower = os.openpty()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "TERM": "dumb",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "memwal_df", "sql", "-t", uri],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    os.write(leader, b"SELECT 41 + 1\n  AS answer;\n\\q\n")
    out = b""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if select.select([leader], [], [], 0.2)[0]:
            try:
                out += os.read(leader, 4096)
            except OSError:
                break
    proc.wait(timeout=10)
    os.close(leader)
    text = out.decode(errors="replace").replace("\r", "")
    assert proc.returncode == 0
    assert "memwal SQL shell; tables: t." in text and "memwal> " in text and "   ...> " in text
    assert re.search(r"^answer\n-+\n42\n\(1 row\)$", text, flags=re.M)


class Terminal:
    """`memwal ARGV` in a pseudo-terminal: write keystrokes, wait for output, send signals."""

    def __init__(self, *argv: str) -> None:
        self.leader, follower = os.openpty()
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TERM": "dumb",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memwal_df", *argv],
            stdin=follower,
            stdout=follower,
            stderr=follower,
            env=env,
        )
        os.close(follower)
        self.text = ""

    def expect(self, pattern: str, timeout: float = 60) -> None:
        """Read until `pattern` (a regex) matches the output after the previous match."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.text, flags=re.M)):
            assert time.monotonic() < deadline and self.proc.poll() is None, (pattern, self.text)
            if select.select([self.leader], [], [], 0.2)[0]:
                self.text += os.read(self.leader, 4096).decode(errors="replace").replace("\r", "")
        self.text = self.text[m.end() :]

    def send(self, data: bytes) -> None:
        os.write(self.leader, data)

    def close(self) -> int:
        code = self.proc.wait(timeout=30)
        os.close(self.leader)
        return code


# Still running when Ctrl-C comes (it reads 10^11 rows).
SLOW_QUERY = b"SELECT count(*) FROM range(100000000000) WHERE value % 7 = 3;\n"


def test_ctrl_c_in_the_sql_shell_returns_to_the_prompt(tmp_path):
    uri = str(tmp_path / "t")
    mw.create_table(uri, parse_schema("id:int64,v:float64"), "id")
    term = Terminal("sql", "-t", uri)
    term.expect(r"^memwal> ")
    term.send(b"SELECT 2 AS typed\n")  # a statement being typed, then Ctrl-C: it is dropped
    term.expect(r"^   \.\.\.> ")
    time.sleep(0.5)  # readline shows the prompt before it waits for keys: let it wait (a person would)
    term.proc.send_signal(signal.SIGINT)
    term.expect(r"^memwal> ")
    term.send(b"SELECT 3 AS three;\n")
    term.expect(r"^three\n-+\n3\n\(1 row\)\n")
    term.send(SLOW_QUERY)  # a running statement, then Ctrl-C: it is cancelled
    term.expect(r"% 7 = 3;\n")  # the shell has the statement
    time.sleep(1)
    term.proc.send_signal(signal.SIGINT)
    term.expect(r"^cancelled\nmemwal> ", timeout=30)
    term.send(b"SELECT 4 AS four;\n")
    term.expect(r"^four\n-+\n4\n\(1 row\)\nmemwal> ")
    time.sleep(0.5)
    term.send(b"\x04")  # Ctrl-D ends the shell
    assert term.close() == Exit.OK


def stdin_of(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """Make `data` the process's standard input (binary underneath, as a pipe is)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))


def test_ingest_reads_standard_input(capsys, tmp_path, monkeypatch):
    uri = str(tmp_path / "t")
    cli(capsys, "create", uri, "--schema", "id:int64,name:string", "-k", "id", "--spec", "bucket(id,2)")
    table = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "name": ["a", "b", "c"]})
    parquet, stream = io.BytesIO(), io.BytesIO()
    pq.write_table(table, parquet)
    with pa.ipc.new_stream(stream, table.schema) as w:
        w.write_table(table.slice(2), max_chunksize=1)
    inputs = {  # format: (input, rows)
        "csv": (b"id,name\n1,x\n4,d\n", 2),
        "json": (b'{"id": 5, "name": "e"}\n{"id": 2, "name": "y"}\n', 2),
        "parquet": (parquet.getvalue(), 3),
        "arrows": (stream.getvalue(), 1),
    }
    for fmt, (data, n) in inputs.items():
        stdin_of(monkeypatch, data)
        got = cli_json(capsys, "ingest", uri, "-", "--format", fmt, "--batch-size", "1")
        assert got["files"] == ["-"] and got["rows"] == n
    # The parquet input (1, 2, 3) replaced the csv's 1 and the json's 2.
    rows_now = cli_json(capsys, "sql", "-t", uri, "SELECT * FROM t ORDER BY id")
    assert [(r["id"], r["name"]) for r in rows_now] == [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e")]
    stdin_of(monkeypatch, b"id\n4\n")
    code, out, _ = cli(capsys, "delete", uri, "-", "--format", "csv")
    assert code == Exit.OK
    assert out.startswith("deleted 1 key (1 existed) from standard input through 1 region in ")
    code, _, err = cli(capsys, "ingest", uri, "-")
    assert code == Exit.USAGE and "reading standard input (-) needs --format" in err
    code, _, err = cli(capsys, "ingest", uri, "-", "-", "--format", "csv")
    assert code == Exit.USAGE and "standard input (-) can be read only once" in err


def test_empty_inputs_ingest_no_rows(capsys, tmp_path, monkeypatch):
    uri = str(tmp_path / "t")
    cli(capsys, "create", uri, "--schema", "id:int64,name:string", "-k", "id", "--spec", "bucket(id,2)")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.json").write_bytes(b"\n  \n")
    (tmp_path / "empty.csv").write_bytes(b"")
    files = [str(tmp_path / n) for n in ("empty.jsonl", "blank.json", "empty.csv")]
    got = cli_json(capsys, "ingest", uri, *files)
    assert got["rows"] == 0 and got["regions"] == []
    stdin_of(monkeypatch, b"")
    assert cli_json(capsys, "ingest", uri, "-", "--format", "json")["rows"] == 0
    code, out, _ = cli(capsys, "ingest", uri, files[0])
    assert code == Exit.OK and out.startswith("upserted 0 rows from 1 file through 0 regions in ")


@pytest.mark.parametrize("composite", [False, True])
def test_delete_reports_how_many_keys_existed(capsys, tmp_path, composite):
    uri = str(tmp_path / "t")
    schema, key = ("id:int64,k:string,v:string", "id,k") if composite else ("id:int64,v:string", "id")
    cli(capsys, "create", uri, "--schema", schema, "-k", key, "--spec", "bucket(id,2)")
    held = {"id": [1, 2, 3], "v": ["a", "b", "c"], **({"k": ["x", "x", "y"]} if composite else {})}
    pq.write_table(pa.table(held), tmp_path / "rows.parquet")
    cli_json(capsys, "ingest", uri, str(tmp_path / "rows.parquet"))
    # 2 and 3 exist; 9 does not; with a composite key (1, "y") does not either (1 is held as (1, "x"))
    given = {"id": [2, 9, 3, 2, 1], **({"k": ["x", "x", "y", "x", "y"]} if composite else {})}
    pq.write_table(pa.table(given), tmp_path / "keys.parquet")
    got = cli_json(capsys, "delete", uri, str(tmp_path / "keys.parquet"), "--batch-size", "2")
    assert got["rows"] == 5 and got["keys_existed"] == (2 if composite else 3)
    assert cli_json(capsys, "delete", uri, str(tmp_path / "keys.parquet"))["keys_existed"] == 0
    left = cli_json(capsys, "sql", "-t", uri, "SELECT id FROM t ORDER BY id")
    assert left == ([{"id": 1}] if composite else [])


def test_region_values_are_labelled_with_their_columns(capsys, tmp_path):
    uri = str(tmp_path / "t")
    cli(capsys, "create", uri, "--schema", "id:int64,v:string", "-k", "id", "--spec", "identity(id)")
    (tmp_path / "rows.csv").write_text("id,v\n2,a\n")
    cli_json(capsys, "ingest", uri, str(tmp_path / "rows.csv"))
    code, text, _ = cli(capsys, "status", uri)
    assert code == Exit.OK and re.search(r"^\w{8}  id=2 ", text, flags=re.M) and "bucket" not in text
    assert [r["values_text"] for r in cli_json(capsys, "status", uri)["regions"]] == ["id=2"]
    plan = cli_json(capsys, "explain", uri, "id = 2")["plan"]
    assert any("CoalesceFirstExec" in line and "(id=2)" in line for line in plan), plan
    table = mw.open_table(uri)
    with pytest.raises(mw.errors.RegionRoutingError, match=r"region value id=3, not to region .* \(id=2\)"):
        with table.region_writer(table.region_ids()[0]) as w:
            w.put(pa.table({"id": pa.array([3], pa.int64()), "v": ["b"]}))

    hashed = str(tmp_path / "h")
    cli(capsys, "create", hashed, "--schema", "id:int64,v:string", "-k", "id", "--spec", "bucket(id,4)")
    cli_json(capsys, "ingest", hashed, str(tmp_path / "rows.csv"))
    [region] = cli_json(capsys, "status", hashed)["regions"]
    assert region["values_text"] == f"bucket[4](id)={region['values'][0]}"


def test_counts_are_in_the_right_number(capsys, tmp_path):
    uri = str(tmp_path / "t")
    spec = ("--schema", "id:int64,v:string", "-k", "id", "--spec", "bucket(id,1)")
    code, out, _ = cli(capsys, "create", uri, *spec)
    assert out.startswith(f"created {uri}: 0 rows, ")
    (tmp_path / "one.csv").write_text("id,v\n1,a\n")
    code, out, _ = cli(capsys, "ingest", uri, str(tmp_path / "one.csv"))
    assert out.startswith("upserted 1 row from 1 file through 1 region in ")
    code, out, _ = cli(capsys, "status", uri)
    assert out.rstrip().endswith("\n1 region, 1 flushed generation not merged yet")
    code, out, _ = cli(capsys, "merge", uri)
    assert out.startswith("merged 1 generation of 1 region: 1 row upserted, 0 tombstones applied; ")
    code, out, _ = cli(capsys, "status", uri)
    assert "version 3, 1 row\n" in out
    assert out.rstrip().endswith("1 region, 0 flushed generations not merged yet")
    code, out, _ = cli(capsys, "maintain", uri, "--rounds", "1", "--interval", "0", "--quiet")
    assert out.startswith("1 round; ")
    code, out, _ = cli(capsys, "sql", "-t", uri, "SELECT * FROM t")
    assert out.rstrip().endswith("(1 row)")


def test_ingest_progress_shows_the_total_when_the_input_has_one(capsys, tmp_path, monkeypatch):
    uri = str(tmp_path / "t")
    cli(capsys, "create", uri, "--schema", "id:int64,v:string", "-k", "id", "--spec", "bucket(id,2)")
    pq.write_table(pa.table({"id": pa.array(range(30), pa.int64()), "v": ["x"] * 30}), tmp_path / "r.parquet")
    code, _, err = cli(capsys, "ingest", uri, str(tmp_path / "r.parquet"), "--progress", "--batch-size", "7")
    assert code == Exit.OK and "ingest: [" + "#" * 30 + "] 100% 30/30 rows, " in err
    stdin_of(monkeypatch, b"id,v\n1,a\n2,b\n")  # standard input: no total known
    code, _, err = cli(capsys, "ingest", uri, "-", "--format", "csv", "--progress")
    assert code == Exit.OK and re.search(r"\ringest: 2 rows, [\d,]+ rows/s\x1b\[K\n$", err), err


@pytest.mark.parametrize("region", [False, True], ids=["routed", "region"])
def test_ingest_partial_updates_only_the_columns_given(capsys, tmp_path, region):
    """`memwal ingest --partial`: a file of keys and some columns updates those columns of existing
    rows, keeps the others, and creates new keys with NULL elsewhere; without --partial such a file is
    refused (test above)."""
    uri, rid = str(tmp_path / "t"), "6b1f3a52-0d3e-4c1a-9a43-5f0e2b7c8d11"
    spec = [] if region else ["--spec", "bucket(id,2)"]
    cli(capsys, "create", uri, "--schema", "id:int64,v:string,n:int64", "-k", "id", *spec)
    target = ["--region", rid] if region else []
    full, part = tmp_path / "full.csv", tmp_path / "part.csv"
    full.write_text("id,v,n\n1,a,10\n2,b,20\n")
    part.write_text("id,n\n2,21\n3,31\n2,22\n")
    cli_json(capsys, "ingest", uri, str(full), *target)
    got = cli_json(capsys, "ingest", uri, str(part), "--partial", *target)
    assert (got["operation"], got["rows"]) == ("partial upsert", 3)
    assert cli_json(capsys, "sql", "-t", uri, "SELECT * FROM t ORDER BY id") == [
        {"id": 1, "v": "a", "n": 10},
        {"id": 2, "v": "b", "n": 22},
        {"id": 3, "v": None, "n": 31},
    ]
    code, _, err = cli(capsys, "ingest", uri, str(part), "--partial", "--delete")
    assert code == Exit.USAGE and "--partial" in err


def test_status_lists_change_feed_consumers(tmp_path, capsys):
    """`memwal status` names each registered consumer, how many generations it has not read and
    whether it still pins garbage collection."""
    uri = str(tmp_path / "t")
    cli(capsys, "create", uri, "--schema", SCHEMA, "-k", "id", "--spec", "bucket(id,2)")
    table = mw.open_table(uri)
    table.register_consumer("mirror")
    table.register_consumer("gone", expiry=timedelta(milliseconds=1))
    with table.writer() as w:
        w.put(pa.Table.from_pylist(rows(range(10), "a"), table.schema.schema))
    consumers = {k["consumer_id"]: k for k in cli_json(capsys, "status", uri)["consumers"]}
    assert consumers["mirror"]["pins"] and not consumers["gone"]["pins"]
    assert consumers["mirror"]["generations_behind"] == 2  # one flush per region, none read
    feed = table.changes(consumer="mirror")
    feed.read_all()
    feed.commit()
    status = cli_json(capsys, "status", uri)
    assert {k["consumer_id"]: k["generations_behind"] for k in status["consumers"]}["mirror"] == 0
    code, text, _ = cli(capsys, "status", uri)
    assert code == Exit.OK and "change-feed consumers" in text and "no (expired)" in text


# ---------------------------------------------------------------------------------------------------
# exit codes and --json output of real `memwal` processes
# ---------------------------------------------------------------------------------------------------


def run_cli(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m memwal_df ARGV` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "memwal_df", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def flushed_table(uri: str) -> mw.Table:
    """A table of two regions, ids 0-9 in flushed generations."""
    table = mw.create_table(uri, parse_schema("id:int64,v:float64"), "id", region_spec=mw.bucket("id", 2))
    with table.writer() as w:
        w.put({"id": list(range(10)), "v": [i / 2 for i in range(10)]})
        w.flush()
    return table


@pytest.mark.parametrize("damage", ["manifest", "generation"])
def test_status_exits_non_zero_when_it_lists_corrupt_regions(tmp_path, damage):
    uri = str(tmp_path / "t")
    table = flushed_table(uri)
    healthy = run_cli("status", uri, "--json")
    assert healthy.returncode == Exit.OK and json.loads(healthy.stdout)["corrupt_regions"] == []
    region = table.region_ids()[0]
    if damage == "manifest":
        path = layout.manifest_path(region, not_none(table.region_status(region)).manifest_version)
        manifest = table.storage.get(path)
        table.storage.put(path, manifest[: len(manifest) // 2])
    else:
        path = next(p for p in table.storage.list(f"_mem_wal/{region}") if "/data/" in p and "_gen_" in p)
        data = bytearray(table.storage.get(path))
        data[10] ^= 0xFF
        table.storage.put(path, bytes(data))
    text = run_cli("status", uri)
    assert text.returncode == Exit.FAILED and "CORRUPT" in text.stdout and path in text.stdout
    as_json = run_cli("status", uri, "--json")
    assert as_json.returncode == Exit.FAILED
    (listed,) = json.loads(as_json.stdout)["corrupt_regions"]
    assert (listed["region_id"], listed["path"]) == (str(region), path)


def test_json_errors_are_one_document_on_stdout(tmp_path):
    """With --json a failed command prints {"error": {"type", "message"}} as the one line of stdout
    and exits with the error's code; JSON input is converted by the table's type rules."""
    uri = str(tmp_path / "t")
    flushed_table(uri)
    floats = tmp_path / "floats.jsonl"
    floats.write_text('{"id": 20, "v": 1.5}\n{"id": 21.0, "v": 2.5}\n')
    ints = tmp_path / "ints.jsonl"
    ints.write_text('{"id": 22, "v": 3}\n')
    cases = [
        (["status", str(tmp_path / "none")], Exit.NOT_FOUND, "TableNotFoundError", "no Lance table"),
        (["merge", str(tmp_path / "none")], Exit.NOT_FOUND, "TableNotFoundError", "no Lance table"),
        (
            ["sql", "-t", uri, "SELECT * FROM vector_search('t', 'v', [1.0], id)"],
            Exit.SQL,
            "InvalidConfigError",
            "vector_search: k must be a literal value, not the expression id",
        ),
        (
            ["sql", "-t", uri, "SELECT * FROM fts('u', 'v', 'x', 3)"],
            Exit.SQL,
            "TableNotRegisteredError",
            "'u'",
        ),
        (["sql", "-t", uri, "SELECT nope FROM t"], Exit.SQL, "SqlError", "nope"),
        (["explain", uri, "nope = 1"], Exit.USAGE, "InvalidArgumentError", "nope"),
        (
            ["ingest", uri, str(floats)],
            Exit.USAGE,
            "SchemaMismatchError",
            "column 'id' has type double, the table has int64: floating-point values are never converted",
        ),
    ]
    for argv, code, kind, words in cases:
        run = run_cli(*argv, "--json")
        assert run.returncode == code, (argv, run.stdout, run.stderr)
        (line,) = run.stdout.splitlines()
        error = json.loads(line)["error"]
        assert error["type"] == kind and words in error["message"], (argv, error)
    assert run_cli("ingest", uri, str(ints), "--json").returncode == Exit.OK  # integers for a float column
    got = json.loads(run_cli("sql", "-t", uri, "--json", "SELECT id, v FROM t WHERE id > 9").stdout)
    assert got == [{"id": 22, "v": 3.0}]


def test_sql_json_prints_one_line_per_statement(tmp_path):
    uri = str(tmp_path / "t")
    flushed_table(uri)
    script = (
        "SELECT count(*) AS n FROM t;\n"
        "SELECT * FROM vector_search('t', 'v', [1.0], id);\n"
        "\\d\n"
        "\\timing\n"
        "SELECT id FROM t\n  WHERE id < 2 ORDER BY id;\n"
        "SELECT 'a;b' AS s, 1.5 AS x;\n"
    )
    run = run_cli("sql", "-t", uri, "--json", stdin=script)
    assert run.returncode == Exit.SQL  # a statement failed
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert lines[0] == [{"n": 10}]
    assert (
        lines[1]["error"]["type"] == "InvalidConfigError"
        and "k must be a literal" in lines[1]["error"]["message"]
    )
    assert lines[2:] == [["t"], [{"id": 0}, {"id": 1}], [{"s": "a;b", "x": 1.5}]]
    assert "timing on" in run.stderr and "time:" in run.stderr
