"""Text forms of a schema and a region spec, as `memwal create` takes them.

Schema: `name:type` items separated by commas, e.g. `id:int64,text:string,vec:vector[128]`. A type
is any Arrow alias (`int64`, `float32`, `string`, `bool`, `date32`, `timestamp[us]`, ...),
`vector[N]` (N float32s; `vector[N,float16]` / `vector[N,float64]`) or `list[TYPE]`.

Region spec: `bucket(col,N)`, `multi_bucket(col,col,...,N)`, `identity(col)`, `year(col)`,
`month(col)`, `day(col)`, `hour(col)`, `truncate(col,W)` or `unsharded`; several joined with `+`
(each then gets the field id `TRANSFORM_I`, its position I).
"""

from __future__ import annotations

import re

import pyarrow as pa

from memwal_df.errors import InvalidArgumentError
from memwal_df.format.regions import spec as rs

_VECTOR_TYPES = {"float16": pa.float16(), "float32": pa.float32(), "float64": pa.float64()}


def split_top_level(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside brackets and parentheses, items stripped."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == sep and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    out.append(text[start:].strip())
    return out


def parse_type(text: str) -> pa.DataType:
    """One type of the schema syntax (see the module docstring)."""
    t = text.strip()
    if m := re.fullmatch(r"vector\[\s*(\d+)\s*(?:,\s*(\w+)\s*)?\]", t):
        dim, item = int(m.group(1)), m.group(2) or "float32"
        if dim < 1 or item not in _VECTOR_TYPES:
            raise InvalidArgumentError(f"bad vector type {t!r}: use vector[N] or vector[N,float16|float64]")
        return pa.list_(_VECTOR_TYPES[item], dim)
    if m := re.fullmatch(r"list\[(.+)\]", t):
        return pa.list_(parse_type(m.group(1)))
    try:
        return pa.type_for_alias(t)
    except ValueError:
        raise InvalidArgumentError(
            f"unknown type {t!r}: use an Arrow type name (int64, float64, string, bool, date32, "
            "timestamp[us], ...), vector[N] or list[TYPE]"
        ) from None


def parse_schema(text: str) -> pa.Schema:
    """`name:type,...` as an Arrow schema; InvalidArgumentError on malformed text."""
    fields = []
    for item in split_top_level(text, ","):
        name, sep, type_text = item.partition(":")
        if not sep or not name.strip() or not type_text.strip():
            raise InvalidArgumentError(f"schema items are NAME:TYPE, got {item!r} in {text!r}")
        fields.append(pa.field(name.strip(), parse_type(type_text)))
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"duplicate column names in the schema: {names}")
    return pa.schema(fields)


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"{what} must be an integer, got {text!r}") from None


def _one_spec(text: str, field_id: str) -> rs.UnboundRegionSpec:
    m = re.fullmatch(r"(\w+)\s*(?:\((.*)\))?", text.strip())
    if m is None:
        raise InvalidArgumentError(f"cannot read the region spec {text!r}: use e.g. bucket(id,4)")
    name, raw = m.group(1), m.group(2)
    args = [a for a in split_top_level(raw, ",") if a] if raw else []
    arity = {"bucket": 2, "truncate": 2, "unsharded": 0}.get(name, 1)
    if name == "multi_bucket":
        if len(args) < 2:
            raise InvalidArgumentError("multi_bucket takes columns and a bucket count: multi_bucket(a,b,8)")
        return rs.multi_bucket(args[:-1], _int(args[-1], "the bucket count"), field_id=field_id)
    single = {"identity": rs.identity, "year": rs.year, "month": rs.month, "day": rs.day, "hour": rs.hour}
    if name not in {*single, "bucket", "truncate", "unsharded"}:
        raise InvalidArgumentError(
            f"unknown region transform {name!r}: use bucket, multi_bucket, identity, year, month, day, "
            "hour, truncate or unsharded"
        )
    if len(args) != arity:
        raise InvalidArgumentError(f"{name} takes {arity} argument(s), got {len(args)} in {text!r}")
    if name == "bucket":
        return rs.bucket(args[0], _int(args[1], "the bucket count"), field_id=field_id)
    if name == "truncate":
        return rs.truncate(args[0], _int(args[1], "the truncate width"), field_id=field_id)
    if name == "unsharded":
        return rs.unsharded(field_id=field_id)
    return single[name](args[0], field_id=field_id)


def parse_region_spec(text: str) -> rs.UnboundRegionSpec:
    """A region spec in the text form of the module docstring."""
    parts = split_top_level(text, "+")
    if len(parts) == 1:
        return _one_spec(parts[0], rs.DEFAULT_FIELD_ID)
    specs = [_one_spec(p, f"{p.split('(')[0].strip()}_{i}") for i, p in enumerate(parts)]
    out = specs[0]
    for s in specs[1:]:
        out = out + s
    return out
