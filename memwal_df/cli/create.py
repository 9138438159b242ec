"""`memwal create`: a new MemWAL table (base Lance table + MemWAL index), empty or from a file."""

from __future__ import annotations

import argparse

from memwal_df.cli import common as c
from memwal_df.cli.inputs import FORMAT_NAMES, format_of, read_all
from memwal_df.cli.parse import parse_region_spec, parse_schema
from memwal_df.errors import InvalidArgumentError
from memwal_df.table import create_table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "create",
        help="create a table",
        description="Create a MemWAL table: a Lance base table with a primary key and a MemWAL index.",
        epilog='example: memwal create ./t --schema "id:int64,text:string,vec:vector[128]" '
        '--primary-key id --spec "bucket(id,4)"',
    )
    c.add_table(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--schema", help="columns as NAME:TYPE,... (types: int64, string, vector[N], ...)")
    src.add_argument("--from", dest="from_file", metavar="FILE", help="initial rows (and schema) from a file")
    p.add_argument("--format", choices=FORMAT_NAMES, help="format of --from (default: from its extension)")
    p.add_argument("-k", "--primary-key", required=True, help="primary key column(s), comma separated")
    p.add_argument("--spec", help='region spec, e.g. "bucket(id,4)" (default: none, regions by hand)')
    p.add_argument(
        "--maintained-indexes",
        help='base indexes the index catch-up maintains, comma separated: "" for none (default: all; '
        "a new table has no indexes, so only none or all can be given here)",
    )
    c.add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.from_file:
        path = c.existing_file(args.from_file)
        fmt = format_of(path, args.format)
        data = read_all(path, fmt)
    else:
        data = parse_schema(args.schema)
    pk = [k.strip() for k in args.primary_key.split(",") if k.strip()]
    if not pk:
        raise InvalidArgumentError("--primary-key needs at least one column")
    indexes = None
    if args.maintained_indexes is not None:
        indexes = [i.strip() for i in args.maintained_indexes.split(",") if i.strip()]
    table = create_table(
        args.uri,
        data,
        pk,
        region_spec=parse_region_spec(args.spec) if args.spec else None,
        maintained_indexes=indexes,
        storage_options=c.storage_options(args),
    )
    info = {
        "uri": table.uri,
        "base_version": table.dataset.version,
        "base_rows": table.dataset.count_rows(),
        "primary_key": pk,
        "region_spec": table.spec_text(),
        "schema": [f"{f.name}: {f.type}" for f in table.schema.schema],
    }
    c.emit(args, info, lambda: _text(info))
    return c.Exit.OK


def _text(info: dict) -> str:
    return (
        f"created {info['uri']}: {c.count(info['base_rows'], 'row')}, "
        f"primary key {', '.join(info['primary_key'])}, "
        f"region spec {info['region_spec']}\ncolumns: {', '.join(info['schema'])}"
    )
