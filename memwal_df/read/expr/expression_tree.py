"""The typed tree of a pyarrow Expression that DataFusion pushes into a ``pyarrow.dataset.Dataset``.

DataFusion 54 (datafusion-python ``DatasetExec``) AND-s the pushed filters into one
``pyarrow.compute.Expression`` (marked Exact) and hands it to ``Dataset.get_fragments(filter)`` and
``Fragment.scanner(..., filter=)``. This module owns the node types (`Field`, `Literal`, `Call`),
`decode` (Expression to tree), `to_expression` (tree to Expression) and the facts of single nodes
that both the filter analysis (`memwal_df.read.expr.predicate`) and the Lance filter compiler
(`memwal_df.read.expr.lance_filter`) read: `SWAPPED_COMPARISON`, `value_set`, `NullMatching`.

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
opposite. Everything that reads these trees follows pyarrow's semantics, so every level answers the
same.
"""

from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "SWAPPED_COMPARISON",
    "Call",
    "Field",
    "Literal",
    "Node",
    "NullMatching",
    "ValueSet",
    "decode",
    "to_expression",
    "value_set",
]

SWAPPED_COMPARISON = {
    "equal": "equal",
    "not_equal": "not_equal",
    "less": "greater",
    "less_equal": "greater_equal",
    "greater": "less",
    "greater_equal": "less_equal",
}
"""Each comparison function and the one that gives the same result with its operands swapped."""


class NullMatching(enum.IntEnum):
    """``SetLookupOptions.null_matching_behavior`` of an ``is_in`` call (Arrow C++ enum order)."""

    MATCH = 0
    SKIP = 1
    EMIT_NULL = 2
    INCONCLUSIVE = 3


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

    @property
    def is_null(self) -> bool:
        """Whether the literal is NULL (of any type): a comparison with it is NULL."""
        return self.value is None or pa.types.is_null(self.type)


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


def tree_of(expr: pc.Expression | Node) -> Node:
    """`expr`'s tree: `decode`d when it is an Expression, itself when it is one already (a caller that
    decoded a filter hands the tree on instead of decoding it again)."""
    return decode(expr) if isinstance(expr, pc.Expression) else expr


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
# Sets of is_in calls


class ValueSet(NamedTuple):
    """The set of an ``is_in`` call: its non-NULL values (Python values), whether it holds a NULL,
    and the call's `NullMatching` behaviour."""

    values: list[Any]
    has_null: bool
    null_matching: int


def value_set(call: Call) -> ValueSet | None:
    """The set of `call` when it is an ``is_in`` of one argument whose values convert to Python
    values; None otherwise."""
    values_array = call.options.get("value_set")
    if call.function != "is_in" or len(call.args) != 1 or not isinstance(values_array, pa.Array):
        return None
    values = [_py(s) for s in values_array if s.is_valid]
    if any(isinstance(v, pa.Scalar) for v in values):
        return None
    null_matching = int(call.options.get("null_matching_behavior", NullMatching.MATCH))
    return ValueSet(values, values_array.null_count > 0, null_matching)
