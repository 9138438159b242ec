"""Structural view of the filters DataFusion pushes into a ``pyarrow.dataset.Dataset``.

DataFusion 54 (datafusion-python ``DatasetExec``) AND-s the pushed filters into one
``pyarrow.compute.Expression`` (marked Exact) and hands it to ``Dataset.get_fragments(filter)`` and
``Fragment.scanner(..., filter=)``. This module decodes that expression into a small typed tree and
answers the questions the read path asks of it: the primary-key point set, per-column pruning
predicates, the top-level conjuncts, the referenced columns, and a Lance scan filter.

Decoding does not parse ``str(expr)``. pyarrow pickles an Expression as
``(Expression._deserialize, (buffer,))``, where ``buffer`` is Arrow C++ ``compute::Serialize``'s output:
an Arrow IPC *file* holding one record batch of one row. The expression itself is the schema's
custom metadata, an ordered key/value list written by a pre-order walk:

* ``("literal", i)``: a scalar literal, the value of column ``i`` (row 0);
* ``("field_ref", name)``: a field by name; ``("nested_field_ref", n)`` is followed by ``n`` refs;
* ``("call", function)``, the arguments, then ``("options", i)`` when the call has options (column
  ``i`` is a struct: one field per option plus ``_type_name``, the options class), then
  ``("end", function)``.

Keys repeat, and ``pyarrow.Schema.metadata`` collapses them into a dict, so the ordered list is read
from the IPC file footer's ``Schema.custom_metadata`` flatbuffer by hand (``_ordered_metadata``); the
values come from pyarrow's own IPC reader. Field refs by index cannot be serialized (pyarrow raises),
and DataFusion never produces them.

What DataFusion 54 pushes (``pyarrow_filter_expression.rs``, checked by running queries, see
tests/test_predicate.py): field refs by name, literals of the column's type (DataFusion casts the
literal; a comparison that keeps a cast is not pushed), ``equal``/``not_equal``/``less``/
``less_equal``/``greater``/``greater_equal`` (column on the left), ``and_kleene``, ``or_kleene``,
``invert``, ``is_valid``, ``is_null`` (``nan_is_null=false``) and ``is_in`` (``IN`` lists of more than
3 numbers/strings/booleans; shorter lists arrive as an OR of equalities, ``NOT IN`` as an AND of
``!=``), a bare boolean column, and ``null[bool]`` literals (``x IN (1, NULL)``).

The pushed expression has pyarrow's semantics, not SQL's: ``x NOT IN (4+ values)`` keeps NULL rows
(``invert(is_in(..., MATCH))``) and ``f > 1`` drops NaN rows, where DataFusion itself would do the
opposite. Everything here follows pyarrow's semantics, so every level answers the same.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds

from memwal_df.errors import InvalidFilterError
from memwal_df.format.regions.predicates import Eq, In, Predicate, Range

__all__ = [
    "Call",
    "Field",
    "Literal",
    "Node",
    "check_filter",
    "column_predicates",
    "conjuncts",
    "decode",
    "key_lookups",
    "referenced_columns",
    "to_expression",
    "to_lance_filter",
]

MAX_KEY_LOOKUPS = 1 << 20  # key_lookups gives up (None) past this many key tuples

_AND = frozenset({"and_kleene", "and"})
_OR = frozenset({"or_kleene", "or"})
_FLIP = {
    "equal": "equal",
    "not_equal": "not_equal",
    "less": "greater",
    "less_equal": "greater_equal",
    "greater": "less",
    "greater_equal": "less_equal",
}
# SetLookupOptions.null_matching_behavior (Arrow C++ enum order)
_MATCH, _SKIP, _EMIT_NULL, _INCONCLUSIVE = 0, 1, 2, 3


# ----------------------------------------------------------------------------------------------
# The tree


@dataclass(frozen=True)
class Field:
    """A column reference; `path` names the struct children below column `name` (nested refs)."""

    name: str
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class Literal:
    """A scalar literal: `value` is ``scalar.as_py()`` (the scalar itself if that fails).

    `scalar` keeps the exact Arrow scalar for rebuilding; it is None for hand-built literals.
    """

    value: Any
    type: pa.DataType
    scalar: pa.Scalar | None = field(default=None, compare=False, repr=False)

    def to_scalar(self) -> pa.Scalar:
        """The literal as an Arrow scalar."""
        if self.scalar is not None:
            return self.scalar
        if isinstance(self.value, pa.Scalar):
            return self.value
        return pa.scalar(self.value, type=self.type)


@dataclass(frozen=True)
class Call:
    """A function call. `options` maps each option to its Python value (``value_set``: a pa.Array,
    ``to_type``: a pa.DataType); `raw_options` is the serialized options struct (one row), used to
    rebuild the call exactly (None for hand-built calls)."""

    function: str
    args: tuple[Node, ...]
    options: dict[str, Any] = field(default_factory=dict)
    raw_options: pa.StructArray | None = field(default=None, compare=False, repr=False)


Node = Field | Literal | Call


# ----------------------------------------------------------------------------------------------
# Decoding


_U16, _U32, _I32 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<i")


class _FlatBuffer:
    """Just enough of a flatbuffer reader for tables, vectors of tables and strings (bounds-checked)."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf

    def _read(self, fmt: struct.Struct, pos: int) -> int:
        if pos < 0 or pos + fmt.size > len(self.buf):
            raise ValueError("serialized Expression: flatbuffer offset out of bounds")
        return fmt.unpack_from(self.buf, pos)[0]

    def _deref(self, pos: int) -> int:
        return pos + self._read(_U32, pos)

    def root(self) -> int:
        return self._deref(0)

    def field(self, table: int, index: int) -> int | None:
        """The position an offset-typed field points to, or None when the field is absent."""
        vtable = table - self._read(_I32, table)
        slot = 4 + 2 * index
        if slot + 2 > self._read(_U16, vtable):
            return None
        off = self._read(_U16, vtable + slot)
        return None if off == 0 else self._deref(table + off)

    def tables(self, vector: int) -> list[int]:
        return [self._deref(vector + 4 + 4 * i) for i in range(self._read(_U32, vector))]

    def string(self, pos: int | None) -> str:
        if pos is None:
            return ""
        n = self._read(_U32, pos)
        if pos + 4 + n > len(self.buf):
            raise ValueError("serialized Expression: flatbuffer string out of bounds")
        return self.buf[pos + 4 : pos + 4 + n].decode("utf-8")


_MAGIC = b"ARROW1"


def _ordered_metadata(data: bytes | memoryview | pa.Buffer) -> list[tuple[str, str]]:
    """The schema custom metadata of an Arrow IPC file, in order, duplicates kept.

    File layout: ``ARROW1`` ... footer flatbuffer, int32 footer length, ``ARROW1``. Footer field 1
    is the Schema table, whose field 2 is ``custom_metadata: [KeyValue]`` (KeyValue: key, value).
    """
    mv = memoryview(data)
    n = len(mv)
    if n < 2 * len(_MAGIC) + 4 or bytes(mv[:6]) != _MAGIC or bytes(mv[n - 6 :]) != _MAGIC:
        raise ValueError("serialized Expression is not an Arrow IPC file")
    footer_len = int.from_bytes(mv[n - 10 : n - 6], "little", signed=True)
    if not 0 < footer_len <= n - 10 - len(_MAGIC):
        raise ValueError("serialized Expression: bad IPC footer length")
    fb = _FlatBuffer(bytes(mv[n - 10 - footer_len : n - 10]))
    schema = fb.field(fb.root(), 1)
    if schema is None:
        raise ValueError("serialized Expression: IPC footer has no schema")
    kvs = fb.field(schema, 2)
    if kvs is None:
        return []
    return [(fb.string(fb.field(kv, 0)), fb.string(fb.field(kv, 1))) for kv in fb.tables(kvs)]


def _py(scalar: pa.Scalar) -> Any:
    try:
        return scalar.as_py()
    except (ValueError, TypeError, OverflowError, NotImplementedError, pa.ArrowException):
        return scalar


def _options_dict(raw: pa.StructArray) -> dict[str, Any]:
    scalar = raw[0]
    out: dict[str, Any] = {}
    if not scalar.is_valid:
        return out
    for i, f in enumerate(raw.type):
        if f.name == "_type_name":
            continue
        v = scalar[i]
        if f.name == "value_set" and (pa.types.is_list(f.type) or pa.types.is_large_list(f.type)):
            out[f.name] = v.values if v.is_valid else None
        elif f.name == "to_type":
            out[f.name] = v.type
        else:
            out[f.name] = _py(v)
    return out


class _Decoder:
    def __init__(self, items: list[tuple[str, str]], batch: pa.RecordBatch | None) -> None:
        self.items = items
        self.batch = batch
        self.pos = 0

    def _column(self, ref: str) -> pa.Array:
        try:
            i = int(ref)
        except ValueError:
            raise ValueError(f"serialized Expression: bad column index {ref!r}") from None
        if self.batch is None or not 0 <= i < self.batch.num_columns or self.batch.num_rows != 1:
            raise ValueError(f"serialized Expression: column {i} out of range")
        return self.batch.column(i)

    def _next(self) -> tuple[str, str]:
        if self.pos >= len(self.items):
            raise ValueError("serialized Expression is truncated")
        item = self.items[self.pos]
        self.pos += 1
        return item

    def node(self) -> Node:
        key, value = self._next()
        if key == "literal":
            scalar = self._column(value)[0]
            return Literal(_py(scalar), scalar.type, scalar)
        if key == "field_ref":
            return Field(value)
        if key == "nested_field_ref":
            names: list[str] = []
            for _ in range(int(value)):
                child = self.node()
                if not isinstance(child, Field):
                    raise ValueError("serialized Expression: bad nested field ref")
                names += [child.name, *child.path]
            if not names:
                raise ValueError("serialized Expression: empty nested field ref")
            return Field(names[0], tuple(names[1:]))
        if key != "call":
            raise ValueError(f"serialized Expression: unexpected key {key!r}")
        args: list[Node] = []
        raw: pa.StructArray | None = None
        while True:
            if self.pos >= len(self.items):
                raise ValueError("serialized Expression: unterminated call")
            k, v = self.items[self.pos]
            if k == "end":
                self.pos += 1
                break
            if k == "options":
                self.pos += 1
                raw = self._column(v)
                if not pa.types.is_struct(raw.type) or self._next()[0] != "end":
                    raise ValueError("serialized Expression: bad options")
                break
            args.append(self.node())
        options = _options_dict(raw) if raw is not None else {}
        if raw is not None and not raw[0].is_valid:
            raw = None
        return Call(value, tuple(args), options, raw)


def decode(expr: pc.Expression) -> Node:
    """The tree of `expr`. ValueError if pyarrow cannot serialize it (e.g. a field ref by index)."""
    if not isinstance(expr, pc.Expression):
        raise TypeError(f"expected a pyarrow.compute.Expression, got {type(expr)!r}")
    try:
        _, (buf,) = expr.__reduce__()
    except (pa.ArrowException, NotImplementedError) as e:
        raise ValueError(f"cannot serialize expression {expr}: {e}") from e
    return _decode_serialized(buf.to_pybytes())


@functools.lru_cache(maxsize=256)
def _decode_serialized(data: bytes) -> Node:
    """The tree of a serialized expression; kept (trees are immutable): planning one query decodes
    its filter several times, and DataFusion sends the same filters again and again."""
    buf = pa.py_buffer(data)
    items = _ordered_metadata(buf)
    reader = pa.ipc.open_file(buf)
    batch = reader.get_batch(0) if reader.num_record_batches else None
    dec = _Decoder(items, batch)
    node = dec.node()
    if dec.pos != len(items):
        raise ValueError("serialized Expression has trailing items")
    return node


# ----------------------------------------------------------------------------------------------
# Rebuilding


def _raw_options_from_dict(call: Call) -> pa.StructArray:
    """Best-effort options struct for a hand-built call (exact for is_in and is_null)."""
    options_class = pc.get_function(call.function)._doc.options_class
    if not options_class:
        raise ValueError(f"function {call.function!r} takes no options")
    names, arrays = [], []
    for name, v in call.options.items():
        if isinstance(v, pa.Array):
            arrays.append(pa.array([v.to_pylist()], pa.list_(v.type)))
        elif isinstance(v, pa.DataType):
            arrays.append(pa.nulls(1, v))
        elif name == "null_matching_behavior":
            arrays.append(pa.array([v], pa.uint32()))
        else:
            arrays.append(pa.array([v]))
        names.append(name)
    names.append("_type_name")
    arrays.append(pa.array([options_class.encode()], pa.binary()))
    return pa.StructArray.from_arrays(arrays, names=names)


def _function_options(call: Call) -> pc.FunctionOptions | None:
    if call.raw_options is None and not call.options:
        return None
    raw = call.raw_options if call.raw_options is not None else _raw_options_from_dict(call)
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([raw], names=[""])
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return pc.FunctionOptions.deserialize(sink.getvalue())


def to_expression(node: Node) -> pc.Expression:
    """The pyarrow Expression for a tree (``to_expression(decode(e)).equals(e)``)."""
    if isinstance(node, Field):
        return pc.field(node.name, *node.path) if node.path else pc.field(node.name)
    if isinstance(node, Literal):
        return pc.scalar(node.to_scalar())
    if isinstance(node, Call):
        args = [to_expression(a) for a in node.args]
        return pc.Expression._call(node.function, args, _function_options(node))
    raise TypeError(f"not a predicate node: {node!r}")


# ----------------------------------------------------------------------------------------------
# Conjuncts and columns


def _split_and(node: Node) -> list[Node]:
    if isinstance(node, Call) and node.function in _AND and len(node.args) == 2:
        return _split_and(node.args[0]) + _split_and(node.args[1])
    return [node]


def conjuncts(expr: pc.Expression | None) -> list[pc.Expression]:
    """The top-level AND (``and_kleene`` / ``and``) operands of `expr`, flattened; ``[expr]`` when it
    is not an AND (or does not decode), ``[]`` for None. Filtering by all of them keeps exactly the
    rows `expr` keeps."""
    if expr is None:
        return []
    try:
        parts = _split_and(decode(expr))
    except ValueError:
        return [expr]
    if len(parts) == 1:
        return [expr]
    return [to_expression(p) for p in parts]


def _walk(node: Node) -> Iterable[Node]:
    yield node
    if isinstance(node, Call):
        for a in node.args:
            yield from _walk(a)


def referenced_columns(expr: pc.Expression | None) -> set[str]:
    """The top-level column names `expr` reads (a nested ref counts as its top-level column).

    ValueError when `expr` does not decode.
    """
    if expr is None:
        return set()
    return {n.name for n in _walk(decode(expr)) if isinstance(n, Field)}


def _field_literal(call: Call) -> tuple[str, Field, Literal] | None:
    """``(function, field, literal)`` for a comparison of a column with a literal, column first."""
    if call.function not in _FLIP or len(call.args) != 2:
        return None
    a, b = call.args
    if isinstance(a, Field) and isinstance(b, Literal):
        return call.function, a, b
    if isinstance(a, Literal) and isinstance(b, Field):
        return _FLIP[call.function], b, a
    return None


def _is_null_literal(lit: Literal) -> bool:
    return lit.value is None or pa.types.is_null(lit.type)


def _set_values(call: Call) -> tuple[list[Any], bool, int] | None:
    """``(non-null values, has_null, null_matching_behavior)`` of an ``is_in`` call, or None."""
    value_set = call.options.get("value_set")
    if call.function != "is_in" or len(call.args) != 1 or not isinstance(value_set, pa.Array):
        return None
    values = [_py(s) for s in value_set if s.is_valid]
    if any(isinstance(v, pa.Scalar) for v in values):
        return None
    return values, value_set.null_count > 0, int(call.options.get("null_matching_behavior", _MATCH))


_BIND_ERRORS = (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError)


@functools.lru_cache(maxsize=64)
def _empty_dataset(schema: pa.Schema) -> pds.Dataset:
    return pds.dataset(schema.empty_table())


def _binds(expr: pc.Expression, schema: pa.Schema) -> BaseException | None:
    """Why `expr` is not a condition on rows of `schema` (Arrow's error), or None. Bound as the
    projection of a scan of an empty dataset, which resolves columns, kernels and the result type
    without running anything (an order of magnitude cheaper than filtering an empty table)."""
    try:
        scanner = _empty_dataset(schema).scanner(columns={"condition": expr})
    except _BIND_ERRORS as e:
        return e
    result = scanner.projected_schema.field(0).type
    if result != pa.bool_():
        return pa.ArrowTypeError(f"Filter expression must evaluate to bool, but {expr} evaluates to {result}")
    return None


def check_filter(expr: pc.Expression | None, schema: pa.Schema, text: str | None = None) -> None:
    """Return when `expr` is a condition on rows of `schema`; else raise `InvalidFilterError` naming
    the column the table lacks, or the column and the value of another type it is compared with.
    `text`: the filter as the user wrote it (shown instead of the expression)."""
    if expr is None or (error := _binds(expr, schema)) is None:
        return
    shown = repr(text) if text is not None else str(expr)
    try:
        nodes = list(_walk(decode(expr)))
    except ValueError:  # an expression the decoder does not know: Arrow's message only
        nodes = []
    unknown = sorted({n.name for n in nodes if isinstance(n, Field)} - set(schema.names))
    if unknown:
        raise InvalidFilterError(
            f"filter {shown} names column {', '.join(map(repr, unknown))}, which the table does not "
            f"have (columns: {', '.join(schema.names)})"
        )
    for node in nodes:
        if not isinstance(node, Call):
            continue
        found = _field_literal(node)
        column, value = (found[1], found[2].value) if found else (None, None)
        if found is None and (values := _set_values(node)) is not None and isinstance(node.args[0], Field):
            column, value = node.args[0], values[0]
        if column is not None and _binds(to_expression(node), schema) is not None:
            column_type = schema.field(column.name).type
            raise InvalidFilterError(
                f"filter {shown} compares column {column.name!r} ({column_type}) with {value!r}, which "
                f"is not of the column's type: compare it with a value of type {column_type}"
            )
    raise InvalidFilterError(f"filter {shown} is not a condition on the table's rows: {error}")


# ----------------------------------------------------------------------------------------------
# Primary-key point lookups


def _float_doubt(v: Any) -> bool:
    """Float keys that compare in surprising ways (NaN never equal, -0.0 == 0.0)."""
    return isinstance(v, float) and (math.isnan(v) or v == 0.0)


def _keys(node: Node, pk: frozenset[str]) -> list[dict[str, Any]] | None:
    """Partial key assignments, one per disjunct, covering every matching row; None: unconstrained."""
    if isinstance(node, Literal):
        if pa.types.is_boolean(node.type) or pa.types.is_null(node.type):
            return None if node.value is True else []
        return None
    if not isinstance(node, Call):
        return None
    if node.function in _AND and len(node.args) == 2:
        left, right = (_keys(a, pk) for a in node.args)
        if left is None or right is None:
            return right if left is None else left
        out: list[dict[str, Any]] = []
        for p in left:
            for q in right:
                if all(p[c] == q[c] for c in p.keys() & q.keys()):
                    out.append({**p, **q})
                    if len(out) > MAX_KEY_LOOKUPS:
                        raise _TooMany
        return out
    if node.function in _OR and len(node.args) == 2:
        left, right = (_keys(a, pk) for a in node.args)
        if left is None or right is None:
            return None
        if len(left) + len(right) > MAX_KEY_LOOKUPS:
            raise _TooMany
        return left + right
    if node.function == "equal":
        fl = _field_literal(node)
        if fl is None:
            return None
        lit = fl[2]
        if _is_null_literal(lit):
            return []  # NULL == anything is NULL
        if fl[1].path or fl[1].name not in pk or isinstance(lit.value, pa.Scalar) or _float_doubt(lit.value):
            return None
        return [{fl[1].name: lit.value}]
    if node.function == "is_in":
        arg = node.args[0] if node.args else None
        sv = _set_values(node)
        if sv is None or not isinstance(arg, Field):
            return None
        values, has_null, behavior = sv
        if arg.path or arg.name not in pk:
            return [] if not values and not (has_null and behavior == _MATCH) else None
        if any(_float_doubt(v) for v in values):  # key columns are non-NULL: NULLs never match
            return None
        return [{arg.name: v} for v in values]
    return None


class _TooMany(Exception):
    pass


def key_lookups(
    expr: pc.Expression | Node | None, primary_key: Sequence[str]
) -> list[tuple[Any, ...]] | None:
    """The finite set of primary-key tuples (in `primary_key` order, deduplicated) that rows matching
    `expr` (an Expression, or its `decode`d tree) can have, or None when the filter does not pin the
    key down.

    Understands ``pk == x`` / ``x == pk``, ``is_in(pk, ...)`` (NULLs dropped: key columns are
    non-NULL), AND (intersection, so a composite key may be pinned by equalities and IN lists on its
    columns) and OR (union). Other predicates under an AND only shrink the result further: the caller
    still applies the whole filter. Returns None on any doubt (a float key that is NaN or zero, more
    than MAX_KEY_LOOKUPS tuples, an unserializable expression).
    """
    if expr is None:
        return None
    pk = list(primary_key)
    if not pk or len(set(pk)) != len(pk):
        raise ValueError(f"bad primary key {primary_key!r}")
    try:
        node = decode(expr) if isinstance(expr, pc.Expression) else expr
        parts = _keys(node, frozenset(pk))
    except (ValueError, _TooMany):
        return None
    if parts is None or any(len(p) != len(pk) for p in parts):
        return None
    try:
        return list(dict.fromkeys(tuple(p[c] for c in pk) for p in parts))
    except TypeError:
        return None


# ----------------------------------------------------------------------------------------------
# Per-column pruning predicates


def _same(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)


def _is_nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


class _Nothing:
    """Marker: the node matches no row."""


_NOTHING = _Nothing()
_Facts = dict[str, list[Predicate]]


def _facts(node: Node) -> _Facts | _Nothing:
    """Predicates per column that every row matching `node` satisfies (or _NOTHING)."""
    if isinstance(node, Literal):
        if pa.types.is_boolean(node.type) or pa.types.is_null(node.type):
            return {} if node.value is True else _NOTHING
        return {}
    if isinstance(node, Field):
        return {node.name: [Eq(True)]} if not node.path else {}
    if node.function in _AND and len(node.args) == 2:
        left, right = (_facts(a) for a in node.args)
        if isinstance(left, _Nothing) or isinstance(right, _Nothing):
            return _NOTHING
        merged = {c: list(ps) for c, ps in left.items()}
        for c, ps in right.items():
            merged.setdefault(c, []).extend(ps)
        return merged
    if node.function in _OR and len(node.args) == 2:
        left, right = (_facts(a) for a in node.args)
        if isinstance(left, _Nothing) or isinstance(right, _Nothing):
            return right if isinstance(left, _Nothing) else left
        out = {}
        for c in left.keys() & right.keys():
            hull = _hull(_summary(left[c]), _summary(right[c]))
            if hull is not None:
                out[c] = [hull]
        return out
    if node.function == "invert" and len(node.args) == 1:
        arg = node.args[0]
        return {arg.name: [Eq(False)]} if isinstance(arg, Field) and not arg.path else {}
    if node.function == "is_in":
        arg = node.args[0] if node.args else None
        sv = _set_values(node)
        if sv is None or not isinstance(arg, Field) or arg.path:
            return {}
        values, has_null, behavior = sv
        if has_null and behavior == _MATCH:
            return {}  # NULL rows match too
        if not values:
            return _NOTHING
        return {arg.name: [_point_predicate(values)]}
    fl = _field_literal(node)
    if fl is None or fl[1].path:
        return {}
    fn, col, lit = fl
    v = lit.value
    if isinstance(v, pa.Scalar):
        return {}
    if _is_null_literal(lit) or (fn != "not_equal" and _is_nan(v)):
        return _NOTHING  # NULL compares to NULL; NaN compares false
    pred = {
        "equal": lambda: Eq(v),
        "less": lambda: Range(hi=v, hi_inclusive=False),
        "less_equal": lambda: Range(hi=v, hi_inclusive=True),
        "greater": lambda: Range(lo=v, lo_inclusive=False),
        "greater_equal": lambda: Range(lo=v, lo_inclusive=True),
    }.get(fn)
    return {col.name: [pred()]} if pred is not None else {}


def _point_predicate(values: Iterable[Any]) -> Predicate:
    """Eq for one distinct value, else In (duplicates dropped, NaN equal to NaN)."""
    distinct: list[Any] = []
    for x in values:
        if not any(_same(x, y) and type(x) is type(y) for y in distinct):
            distinct.append(x)
    return Eq(distinct[0]) if len(distinct) == 1 else In(distinct)


def _intersect(ranges: Sequence[Range]) -> Range | None:
    """The intersection of `ranges` (None when empty); TypeError if bounds do not compare."""
    lo, lo_inc, hi, hi_inc = None, True, None, True
    for r in ranges:
        if r.lo is not None:
            if lo is None or r.lo > lo:
                lo, lo_inc = r.lo, r.lo_inclusive
            elif r.lo == lo:
                lo_inc = lo_inc and r.lo_inclusive
        if r.hi is not None:
            if hi is None or r.hi < hi:
                hi, hi_inc = r.hi, r.hi_inclusive
            elif r.hi == hi:
                hi_inc = hi_inc and r.hi_inclusive
    if lo is not None and hi is not None and (lo > hi or (lo == hi and not (lo_inc and hi_inc))):
        return None
    return Range(lo, lo_inc, hi, hi_inc)


def _summary(preds: Sequence[Predicate]) -> list[Predicate]:
    """An equivalent-or-weaker, shorter AND-list: one point predicate, or one Range, or `preds`."""
    points: list[Any] | None = None
    for p in preds:
        if isinstance(p, Eq | In):
            vals = [p.value] if isinstance(p, Eq) else list(p.values)
            points = vals if points is None else [x for x in points if any(_same(x, y) for y in vals)]
    ranges = [p for p in preds if isinstance(p, Range)]
    if points is not None:
        return [_point_predicate([x for x in points if all(r.test(x) for r in ranges)])]
    if not ranges:
        return list(preds)
    try:
        if any(_is_nan(b) for r in ranges for b in (r.lo, r.hi)):
            return list(preds)
        merged = _intersect(ranges)
    except TypeError:
        return list(preds)
    return [In(())] if merged is None else [merged]


def _hull(a: list[Predicate], b: list[Predicate]) -> Predicate | None:
    """One predicate that holds wherever summary `a` or summary `b` holds, or None."""
    if len(a) != 1 or len(b) != 1:
        return None
    pa_, pb = a[0], b[0]
    pts = [_points(p) for p in (pa_, pb)]
    if pts[0] is not None and pts[1] is not None:
        return _point_predicate(pts[0] + pts[1])
    bounds = []
    for p, ps in zip((pa_, pb), pts, strict=True):
        if ps is not None:
            if not ps:
                continue
            if any(_is_nan(x) for x in ps):
                return None
            try:
                bounds.append(Range(min(ps), True, max(ps), True))
            except TypeError:
                return None
        elif isinstance(p, Range):
            if _is_nan(p.lo) or _is_nan(p.hi):
                return None
            bounds.append(p)
        else:
            return None
    if not bounds:
        return In(())
    try:
        lo, lo_inc, hi, hi_inc = bounds[0].lo, bounds[0].lo_inclusive, bounds[0].hi, bounds[0].hi_inclusive
        for r in bounds[1:]:
            if lo is not None and (r.lo is None or r.lo < lo):
                lo, lo_inc = r.lo, r.lo_inclusive
            elif lo is not None and r.lo == lo:
                lo_inc = lo_inc or r.lo_inclusive
            if hi is not None and (r.hi is None or r.hi > hi):
                hi, hi_inc = r.hi, r.hi_inclusive
            elif hi is not None and r.hi == hi:
                hi_inc = hi_inc or r.hi_inclusive
    except TypeError:
        return None
    if lo is None and hi is None:
        return None
    return Range(lo, lo_inc if lo is not None else True, hi, hi_inc if hi is not None else True)


def _points(p: Predicate) -> list[Any] | None:
    if isinstance(p, Eq):
        return [p.value]
    if isinstance(p, In):
        return list(p.values)
    return None


def column_predicates(expr: pc.Expression | None) -> dict[str, list[Predicate]]:
    """Region-pruning predicates (`Eq`, `In`, `Range`) per top-level column, AND-ed per column.

    Sound: every row matching `expr` satisfies every returned predicate. Read from the top-level
    conjuncts: comparisons of a column with a literal (either side; ``!=`` gives nothing),
    ``is_in`` (nothing when a NULL in the set matches NULL rows), a bare boolean column (and its
    ``invert``), and OR-s of those (point sets unite, ranges take their hull). Ranges on one column
    merge into one; points are intersected and filtered by the ranges. A comparison with a NULL or
    NaN literal matches nothing, giving ``In(())``. Literal values are taken as of the column's type,
    which is what DataFusion pushes (it casts literals to the column type). ``{}`` when `expr` does
    not decode.
    """
    if expr is None:
        return {}
    try:
        node = decode(expr)
    except ValueError:
        return {}
    facts = _facts(node)
    if isinstance(facts, _Nothing):
        return {n.name: [In(())] for n in _walk(node) if isinstance(n, Field)}
    return {c: _summary(ps) for c, ps in facts.items() if ps}


# ----------------------------------------------------------------------------------------------
# Lance scan filters


class _Unsupported(Exception):
    pass


_UNITS = {"s": "Second", "ms": "Millisecond", "us": "Microsecond", "ns": "Nanosecond"}
_NULL_BOOL = "CAST(NULL AS BOOLEAN)"
_SQL_OP = {
    "equal": "=",
    "not_equal": "<>",
    "less": "<",
    "less_equal": "<=",
    "greater": ">",
    "greater_equal": ">=",
}


def _family(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return "binary"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_timestamp(t):
        return "timestamp-tz" if t.tz else "timestamp"
    if pa.types.is_time(t):
        return "time"
    if pa.types.is_duration(t):
        return "duration"
    if pa.types.is_decimal(t):
        return "decimal"
    return f"other:{t}"


def _int_of(scalar: pa.Scalar) -> int:
    """The integer storage value of a temporal scalar."""
    width = scalar.type.bit_width
    return pa.array([scalar], scalar.type).view(pa.int32() if width == 32 else pa.int64())[0].as_py()


def _float_sql(v: float, t: pa.DataType) -> str:
    return f"CAST('{v!r}' AS {'FLOAT' if pa.types.is_float32(t) else 'DOUBLE'})"


def _literal_sql(scalar: pa.Scalar) -> str:
    """A Lance (DataFusion) SQL literal equal to a valid scalar."""
    t = scalar.type
    if pa.types.is_boolean(t):
        return "TRUE" if scalar.as_py() else "FALSE"
    if pa.types.is_integer(t):
        v = scalar.as_py()
        if -(1 << 63) < v < (1 << 63):
            return str(v) if v >= 0 else f"({v})"
        return f"arrow_cast('{v}', '{'UInt64' if v > 0 else 'Int64'}')"
    if pa.types.is_float32(t) or pa.types.is_float64(t):
        return _float_sql(scalar.as_py(), t)
    if _family(t) == "string":
        return "'" + scalar.as_py().replace("'", "''") + "'"
    if _family(t) == "binary":
        return f"X'{scalar.as_py().hex()}'"
    if pa.types.is_decimal128(t):
        return f"arrow_cast('{scalar.as_py():f}', 'Decimal128({t.precision}, {t.scale})')"
    if pa.types.is_date32(t):
        return f"arrow_cast({_int_of(scalar)}, 'Date32')"
    if pa.types.is_date64(t):
        return f"arrow_cast({_int_of(scalar)}, 'Date64')"
    if pa.types.is_timestamp(t):
        if t.tz is not None and ('"' in t.tz or "'" in t.tz):
            raise _Unsupported
        tz = f'Some("{t.tz}")' if t.tz is not None else "None"
        return f"arrow_cast({_int_of(scalar)}, 'Timestamp({_UNITS[t.unit]}, {tz})')"
    if pa.types.is_time32(t) or pa.types.is_time64(t):
        return f"arrow_cast({_int_of(scalar)}, 'Time{t.bit_width}({_UNITS[t.unit]})')"
    if pa.types.is_duration(t):
        return f"arrow_cast({_int_of(scalar)}, 'Duration({_UNITS[t.unit]})')"
    raise _Unsupported


class _LanceSql:
    """Boolean nodes to Lance SQL with pyarrow's semantics, NULL results included.

    Lance evaluates with DataFusion: float comparisons use the IEEE total order (NaN equals NaN and
    sorts above +inf, or below -inf when negative) and ``IN`` follows SQL NULL rules. Both are
    rewritten so that every SQL piece is NULL exactly where pyarrow's result is NULL.
    """

    def __init__(self, schema: pa.Schema | None) -> None:
        self.schema = schema

    def ident(self, f: Field) -> str:
        names = [f.name, *f.path]
        if any("`" in n for n in names):
            raise _Unsupported
        return ".".join(f"`{n}`" for n in names)

    def field_type(self, f: Field) -> pa.DataType | None:
        if self.schema is None:
            return None
        if self.schema.get_field_index(f.name) < 0:
            raise _Unsupported
        t = self.schema.field(f.name).type
        for name in f.path:
            if not pa.types.is_struct(t) or t.get_field_index(name) < 0:
                raise _Unsupported
            t = t.field(name).type
        return t

    def boolean(self, node: Node) -> str:
        if isinstance(node, Literal):
            if pa.types.is_null(node.type) or (pa.types.is_boolean(node.type) and node.value is None):
                return _NULL_BOOL
            if pa.types.is_boolean(node.type):
                return "TRUE" if node.value else "FALSE"
            raise _Unsupported
        if isinstance(node, Field):
            t = self.field_type(node)
            if t is not None and not pa.types.is_boolean(t):
                raise _Unsupported
            return self.ident(node)
        fn, args = node.function, node.args
        if fn in ("and_kleene", "or_kleene") and len(args) == 2:
            op = " AND " if fn == "and_kleene" else " OR "
            return "(" + op.join(self.boolean(a) for a in args) + ")"
        if fn == "invert" and len(args) == 1:
            return f"(NOT {self.boolean(args[0])})"
        if fn == "is_valid" and len(args) == 1:
            return f"({self.value(args[0])[0]} IS NOT NULL)"
        if fn == "is_null" and len(args) == 1:
            sql, t = self.value(args[0])
            if not node.options.get("nan_is_null", False) or (t is not None and not pa.types.is_floating(t)):
                return f"({sql} IS NULL)"
            if t is not None:
                return f"({sql} IS NULL OR isnan({sql}))"
            raise _Unsupported
        if fn == "is_nan" and len(args) == 1:
            sql, t = self.value(args[0])
            if t is None or not pa.types.is_floating(t):
                raise _Unsupported
            return f"isnan({sql})"
        if fn in _SQL_OP and len(args) == 2:
            return self.compare(fn, args[0], args[1])
        if fn == "is_in" and len(args) == 1:
            return self.is_in(node)
        raise _Unsupported

    def value(self, node: Node) -> tuple[str, pa.DataType | None]:
        """SQL for a column-like operand and its type (None: unknown)."""
        if isinstance(node, Field):
            return self.ident(node), self.field_type(node)
        if isinstance(node, Call):
            return self.boolean(node), pa.bool_()
        raise _Unsupported

    def compare(self, fn: str, a: Node, b: Node) -> str:
        if isinstance(a, Literal) and not isinstance(b, Literal):
            fn, a, b = _FLIP[fn], b, a
        if isinstance(a, Literal):
            raise _Unsupported
        col, col_type = self.value(a)
        if isinstance(b, Literal):
            if _is_null_literal(b):
                return _NULL_BOOL
            scalar = b.to_scalar()
            if col_type is not None and _family(col_type) != _family(scalar.type):
                raise _Unsupported
            t = col_type if col_type is not None else scalar.type
            if pa.types.is_floating(t):
                if not (pa.types.is_float32(scalar.type) or pa.types.is_float64(scalar.type)):
                    raise _Unsupported
                return self._float_compare(fn, col, scalar.as_py(), scalar.type)
            return f"({col} {_SQL_OP[fn]} {_literal_sql(scalar)})"
        other, other_type = self.value(b)
        if col_type is None or other_type is None or _family(col_type) != _family(other_type):
            raise _Unsupported
        if pa.types.is_floating(col_type) or _family(col_type).startswith("other"):
            raise _Unsupported
        return f"({col} {_SQL_OP[fn]} {other})"

    @staticmethod
    def _float_compare(fn: str, col: str, v: float, t: pa.DataType) -> str:
        if math.isnan(v):
            # IEEE: NaN compares false (not_equal: true) with everything; NULL stays NULL
            if fn == "not_equal":
                return f"({col} IS NOT NULL OR {_NULL_BOOL})"
            return f"({col} IS NULL AND {_NULL_BOOL})"
        not_nan = f"NOT isnan({col})"
        if v == 0.0:
            pos, neg = _float_sql(0.0, t), _float_sql(-0.0, t)
            return {
                "equal": f"({col} = {pos} OR {col} = {neg})",
                "not_equal": f"({col} <> {pos} AND {col} <> {neg})",
                "less": f"({col} < {neg} AND {not_nan})",
                "less_equal": f"({col} <= {pos} AND {not_nan})",
                "greater": f"({col} > {pos} AND {not_nan})",
                "greater_equal": f"({col} >= {neg} AND {not_nan})",
            }[fn]
        lit = _float_sql(v, t)
        if fn in ("equal", "not_equal"):
            return f"({col} {_SQL_OP[fn]} {lit})"
        return f"({col} {_SQL_OP[fn]} {lit} AND {not_nan})"

    def is_in(self, node: Call) -> str:
        sv = _set_values(node)
        if sv is None:
            raise _Unsupported
        col, col_type = self.value(node.args[0])
        value_set = node.options["value_set"]
        if col_type is not None and _family(col_type) != _family(value_set.type):
            raise _Unsupported
        t = col_type if col_type is not None else value_set.type
        values, has_null, behavior = sv
        if pa.types.is_floating(t) and any(v != v or v == 0.0 for v in values):
            raise _Unsupported  # pyarrow matches NaN / -0.0 / 0.0 bitwise, Lance does not
        if pa.types.is_floating(t) and not pa.types.is_floating(value_set.type):
            raise _Unsupported
        items = [s for s in value_set if s.is_valid]
        if items:
            member = f"({col} IN ({', '.join(_literal_sql(s) for s in items)}))"
        else:
            member = f"({col} IS NULL AND {_NULL_BOOL})"
        if behavior == _MATCH:
            return f"({col} IS NULL OR {member})" if has_null else f"({col} IS NOT NULL AND {member})"
        if behavior == _SKIP:
            return f"({col} IS NOT NULL AND {member})"
        if behavior == _EMIT_NULL:
            return member
        if behavior == _INCONCLUSIVE:
            return f"({member} OR {_NULL_BOOL})" if has_null else member
        raise _Unsupported


def to_lance_filter(
    expr: pc.Expression | None, schema: pa.Schema | None = None
) -> pc.Expression | str | None:
    """A Lance SQL filter keeping exactly the rows pyarrow's own filtering of `expr` keeps, or None.

    Always a SQL string, never the Expression itself: pylance accepts a pc.Expression but converts it
    through pyarrow's Substrait serializer and DataFusion, which (a) fails for the whole filter when
    the dataset has a column Substrait cannot type (duration, decimal256, ...) and for filters on
    unsigned, large_string, large_binary, date64, timestamp[ns], time and dictionary columns, (b)
    has no ``and``/``or`` (non-Kleene), and (c) gives other answers for floats (IEEE total order: NaN
    == NaN, NaN > inf) and for NULLs in ``is_in``. The SQL here rewrites those cases exactly.

    `schema` (the table's Arrow schema) gives column types; without it, each compared column is
    assumed to have its literal's type (true of everything DataFusion pushes) and column-to-column
    comparisons are not converted. None means "not convertible" (e.g. non-Kleene and/or, other
    functions, float IN-lists holding NaN or zero, decimal256): filter with pyarrow instead, or
    convert `conjuncts(expr)` one by one and apply the rest afterwards.
    """
    if expr is None:
        return None
    try:
        return _LanceSql(schema).boolean(decode(expr))
    except (_Unsupported, ValueError, KeyError):
        return None


def split_for_lance(
    expr: pc.Expression | None, schema: pa.Schema | None = None
) -> tuple[str | None, pc.Expression | None]:
    """(Lance SQL filter, residual pyarrow filter) that together keep exactly the rows `expr` keeps.

    The whole filter goes to Lance when it converts; otherwise each top-level conjunct that converts
    does, and the rest is left for pyarrow to apply to the scanned rows."""
    if expr is None:
        return None, None
    whole = to_lance_filter(expr, schema)
    if isinstance(whole, str):
        return whole, None
    pushed: list[str] = []
    rest: list[pc.Expression] = []
    for part in conjuncts(expr):
        sql = to_lance_filter(part, schema)
        if isinstance(sql, str):
            pushed.append(f"({sql})")
        else:
            rest.append(part)
    residual = None
    for part in rest:
        residual = part if residual is None else residual & part
    return (" AND ".join(pushed) or None), residual
