"""Region specs (Lance 14: "sharding specs"): how rows map to regions, and how filters prune regions.

A spec is a list of region fields. Each field turns source columns, referenced by Lance field id, into
one region value, either through a well-known transform or a DataFusion SQL expression over ``col0``,
``col1``, ... (spec "Region Spec", "Region Expression", "Region Transform").

Transforms follow pyiceberg's shape: ``apply`` evaluates a batch, ``project`` turns a predicate on the
source column into a predicate on region values (None when it cannot prune).

Where Lance 14's native implementation and the spec text disagree, this module follows native:

* ``bucket`` is ``(murmur3(x) & 0x7fffffff) % N``, not ``abs(murmur3(x)) % N``;
* ``bucket`` sends NULL to bucket 0 (native hashes a NULL as the seed, 0);
* murmur3 hashes a value at its Arrow width, so ``int32(5)`` and ``int64(5)`` land in different
  buckets (the spec asks for type-promotion resistance);
* native writes ``field_id="bucket"`` for every transform; the constructors here default to that too.

``year``, ``month``, ``day`` and ``hour`` are the spec's ``date_part`` values: the calendar year, the
month of the year (1-12), the day of the month (1-31) and the hour of the day (0-23), in the
timestamp's own time zone.
"""

from __future__ import annotations

import itertools
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidRegionSpecError, NonKeyRegionColumnError, RegionRoutingError
from memwal_df.format.intexpr import Evaluator, as_array, compile_int_expression
from memwal_df.format.murmur3 import is_hashable, murmur3_32_spark, murmur3_multi
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.pools import shared_pool

__all__ = [
    "Bucket",
    "Day",
    "Eq",
    "Expression",
    "Hour",
    "Identity",
    "In",
    "Month",
    "MultiBucket",
    "Predicate",
    "Range",
    "RegionField",
    "RegionSpec",
    "Transform",
    "Truncate",
    "UnboundRegionSpec",
    "Unsharded",
    "Year",
    "bucket",
    "check_key_only",
    "day",
    "decode_region_value",
    "encode_region_value",
    "expression",
    "hour",
    "identity",
    "lance_field_ids",
    "month",
    "multi_bucket",
    "non_key_columns",
    "non_key_message",
    "result_arrow_type",
    "result_type_name",
    "transform_from_name",
    "truncate",
    "unsharded",
    "year",
]

DEFAULT_FIELD_ID = "bucket"  # what Lance 14 writes for every transform
DEFAULT_SPEC_ID = 1
MAX_NUM_BUCKETS = 1024  # Lance 14's initialize_mem_wal limit; `bucket()` enforces it
_I32_MAX = 0x7FFFFFFF
_I64_MAX = (1 << 63) - 1
_MAX_POINTS = 4096  # largest Eq/In cross product a projection enumerates


# ----------------------------------------------------------------------------------------------
# Predicates


def _same(a: Any, b: Any) -> bool:
    """SQL equality on non-NULL values, with Arrow's NaN == NaN."""
    return a == b or (a != a and b != b)


@dataclass(frozen=True)
class Eq:
    """``column = value``."""

    value: Any

    def test(self, v: Any) -> bool:
        """Whether `v` may satisfy the predicate (NULL never does)."""
        return v is not None and _same(v, self.value)


@dataclass(frozen=True)
class In:
    """``column IN (values)``; an empty list matches nothing."""

    values: tuple[Any, ...]

    def __init__(self, values: Iterable[Any]) -> None:
        object.__setattr__(self, "values", tuple(values))

    def test(self, v: Any) -> bool:
        """Whether `v` may satisfy the predicate (NULL never does)."""
        return v is not None and any(_same(v, x) for x in self.values)


@dataclass(frozen=True)
class Range:
    """``lo <(=) column <(=) hi``; a None bound is unbounded."""

    lo: Any = None
    lo_inclusive: bool = True
    hi: Any = None
    hi_inclusive: bool = True

    def test(self, v: Any) -> bool:
        """Whether `v` may satisfy the predicate; incomparable values (NaN, mixed types) may."""
        if v is None:
            return False
        try:
            if any(x is not None and x != x for x in (v, self.lo, self.hi)):
                return True
            if self.lo is not None and (v < self.lo or (v == self.lo and not self.lo_inclusive)):
                return False
            if self.hi is not None and (v > self.hi or (v == self.hi and not self.hi_inclusive)):
                return False
        except TypeError:
            return True
        return True


Predicate = Eq | In | Range


def _points(pred: Predicate | None) -> list[Any] | None:
    """The values a predicate allows, when it names them (Eq, In, or a one-value Range)."""
    if isinstance(pred, Eq):
        return [pred.value]
    if isinstance(pred, In):
        return list(pred.values)
    if (
        isinstance(pred, Range)
        and pred.lo is not None
        and pred.lo_inclusive
        and pred.hi_inclusive
        and pred.lo == pred.hi
    ):
        return [pred.lo]
    return None


def _to_array(values: Sequence[Any], source_type: pa.DataType | None) -> pa.Array | None:
    """`values` as an array of the source type; None when they do not convert."""
    if source_type is None:
        scalar_types = {v.type for v in values if isinstance(v, pa.Scalar)}
        source_type = scalar_types.pop() if len(scalar_types) == 1 else None
    py = [v.as_py() if isinstance(v, pa.Scalar) else v for v in values]
    try:
        return pa.array(py, type=source_type)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None


# ----------------------------------------------------------------------------------------------
# Transforms


class Transform(ABC):
    """A well-known region expression (or a SQL one) from source columns to one region value."""

    name: ClassVar[str]
    arity: ClassVar[int | None] = 1  # number of source columns; None: one or more

    def parameters(self) -> dict[str, str]:
        """The transform's parameters as stored in ``ShardingField.parameters``."""
        return {}

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        """Whether the transform accepts source columns of these types."""
        return True

    def can_produce(self, value: Any) -> bool:
        """False when no row can have region value `value` (True when the transform cannot tell)."""
        return True

    @abstractmethod
    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        """The type of the region value for these source types."""

    @abstractmethod
    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        """The region value of every row (`num_rows` is needed only by source-less transforms)."""

    def project(self, pred: Predicate, source_type: pa.DataType | None = None) -> Predicate | None:
        """A predicate on region values that every row satisfying `pred` satisfies, or None.

        The default maps the named values of Eq / In through the transform, which is sound for any
        deterministic transform. `source_type` is the source column's type (inferred when None).
        """
        return self._project_points([pred], [source_type])

    def project_sources(
        self, preds: Sequence[Predicate | None], source_types: Sequence[pa.DataType | None] | None = None
    ) -> Predicate | None:
        """Like `project`, with one predicate (or None) per source column."""
        types = list(source_types) if source_types is not None else [None] * len(preds)
        if len(preds) == 1:
            return None if preds[0] is None else self.project(preds[0], types[0])
        return self._project_points(preds, types)

    def _project_points(
        self, preds: Sequence[Predicate | None], source_types: Sequence[pa.DataType | None]
    ) -> Predicate | None:
        value_lists = [_points(p) for p in preds]
        if not value_lists or any(v is None for v in value_lists):
            return None
        combos = 1
        for v in value_lists:
            combos *= len(v)
        if combos > _MAX_POINTS:
            return None
        rows = list(itertools.product(*value_lists))
        columns = [[r[i] for r in rows] for i in range(len(value_lists))]
        arrays = [_to_array(c, t) for c, t in zip(columns, source_types, strict=True)]
        if any(a is None for a in arrays):
            return None
        mapped = list(dict.fromkeys(self.apply(arrays, len(rows)).to_pylist()))
        if all(isinstance(p, Eq) for p in preds) and len(mapped) == 1:
            return Eq(mapped[0])
        return In(mapped)

    def __str__(self) -> str:
        params = ",".join(self.parameters().values())
        return f"{self.name}[{params}]" if params else self.name


def _single(arrays: Sequence[pa.Array], name: str) -> pa.Array:
    if len(arrays) != 1:
        raise RegionRoutingError(f"{name} takes one source column, got {len(arrays)}")
    a = arrays[0]
    return a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a


def _is_temporal(t: pa.DataType) -> bool:
    return pa.types.is_date32(t) or pa.types.is_date64(t) or pa.types.is_timestamp(t)


def _as_timestamp(a: pa.Array) -> pa.Array:
    if pa.types.is_date32(a.type):
        return a.cast(pa.timestamp("s"))
    if pa.types.is_date64(a.type):
        return a.cast(pa.timestamp("ms"))
    return a


def _int_param(params: Mapping[str, str], key: str, transform: str) -> int:
    raw = params.get(key)
    if raw is None:
        raise InvalidRegionSpecError(f"{transform} needs parameter {key!r}")
    try:
        return int(raw)
    except ValueError:
        raise InvalidRegionSpecError(f"{transform} parameter {key}={raw!r} is not an integer") from None


def _check_positive_int(value: Any, what: str, upper: int = _I32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value <= upper:
        raise InvalidRegionSpecError(f"{what} must be an integer in [1, {upper}], got {value!r}")


@dataclass(frozen=True)
class Identity(Transform):
    """``col0``: the source value itself."""

    name: ClassVar[str] = "identity"

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        return _type_name_or_none(source_types[0]) is not None and not pa.types.is_null(source_types[0])

    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        return source_types[0]

    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        return _single(arrays, self.name)

    def project(self, pred: Predicate, source_type: pa.DataType | None = None) -> Predicate | None:
        return pred


class _DatePart(Transform):
    """``date_part(part, col0)`` as int32, in the timestamp's time zone."""

    _kernel: ClassVar[Callable[[pa.Array], pa.Array]]

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        return _is_temporal(source_types[0])

    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        return pa.int32()

    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        a = _single(arrays, self.name)
        if pa.types.is_null(a.type):
            return pa.nulls(len(a), pa.int32())
        return type(self)._kernel(_as_timestamp(a)).cast(pa.int32())


def _project_monotone(t: Transform, pred: Predicate, source_type: pa.DataType | None) -> Predicate | None:
    """Projection for an order-preserving (non-decreasing) transform."""
    if not isinstance(pred, Range) or _points(pred) is not None:
        return t._project_points([pred], [source_type])
    ends = [v for v in (pred.lo, pred.hi) if v is not None]
    if not ends:
        return None
    arr = _to_array(ends, source_type)
    if arr is None:
        return None
    mapped = t.apply([arr], len(ends)).to_pylist()
    lo = mapped[0] if pred.lo is not None else None
    hi = mapped[-1] if pred.hi is not None else None
    return Range(lo, True, hi, True)


@dataclass(frozen=True)
class Year(_DatePart):
    """``date_part('year', col0)``: the calendar year (monotone)."""

    name: ClassVar[str] = "year"
    _kernel: ClassVar[Callable[[pa.Array], pa.Array]] = pc.year

    def project(self, pred: Predicate, source_type: pa.DataType | None = None) -> Predicate | None:
        return _project_monotone(self, pred, source_type)


def _unit_indices(pred: Range, source_type: pa.DataType | None, unit: str) -> list[int] | None:
    """Floor indices (in `unit`: "h", "D" or "M") of a bounded Range's ends, for UTC-like types."""
    if pred.lo is None or pred.hi is None:
        return None
    arr = _to_array([pred.lo, pred.hi], source_type)
    if arr is None or not _is_temporal(arr.type):
        return None
    if pa.types.is_timestamp(arr.type) and arr.type.tz not in (None, "UTC", "+00:00", "Z"):
        return None  # local wall-clock cycles need zone rules; do not prune
    ts = _as_timestamp(arr)
    if unit == "M":
        years, months = pc.year(ts).to_pylist(), pc.month(ts).to_pylist()
        return [y * 12 + m - 1 for y, m in zip(years, months, strict=True)]
    ticks = ts.cast(pa.int64()).to_numpy()
    per_second = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[ts.type.unit]
    step = per_second * (3600 if unit == "h" else 86400)
    return (ticks // step).tolist()


class _Cyclic(_DatePart):
    """A date part that wraps around (month of year, day of month, hour of day)."""

    _unit: ClassVar[str]
    _cycle: ClassVar[int]

    def _values_in(self, first: int, last: int) -> list[int]:
        raise NotImplementedError

    def project(self, pred: Predicate, source_type: pa.DataType | None = None) -> Predicate | None:
        if not isinstance(pred, Range) or _points(pred) is not None:
            return self._project_points([pred], [source_type])
        idx = _unit_indices(pred, source_type, self._unit)
        if idx is None:
            return None
        first, last = idx
        if last < first:
            return In(())
        if last - first + 1 >= self._cycle:
            return None
        return In(sorted(set(self._values_in(first, last))))


@dataclass(frozen=True)
class Month(_Cyclic):
    """``date_part('month', col0)``: the month of the year, 1-12."""

    name: ClassVar[str] = "month"
    _kernel: ClassVar[Callable[[pa.Array], pa.Array]] = pc.month
    _unit: ClassVar[str] = "M"
    _cycle: ClassVar[int] = 12

    def _values_in(self, first: int, last: int) -> list[int]:
        return [i % 12 + 1 for i in range(first, last + 1)]


@dataclass(frozen=True)
class Day(_Cyclic):
    """``date_part('day', col0)``: the day of the month, 1-31."""

    name: ClassVar[str] = "day"
    _kernel: ClassVar[Callable[[pa.Array], pa.Array]] = pc.day
    _unit: ClassVar[str] = "D"
    _cycle: ClassVar[int] = 31

    def _values_in(self, first: int, last: int) -> list[int]:
        days = np.arange(first, last + 1).astype("datetime64[D]")
        return pc.day(pa.array(days)).to_pylist()


@dataclass(frozen=True)
class Hour(_Cyclic):
    """``date_part('hour', col0)``: the hour of the day, 0-23 (0 for dates)."""

    name: ClassVar[str] = "hour"
    _kernel: ClassVar[Callable[[pa.Array], pa.Array]] = pc.hour
    _unit: ClassVar[str] = "h"
    _cycle: ClassVar[int] = 24

    def _values_in(self, first: int, last: int) -> list[int]:
        return [i % 24 for i in range(first, last + 1)]


def _is_bucket(value: Any, n: int) -> bool:
    """Whether `value` is one of the buckets 0..n-1 (a bucket is never NULL)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and 0 <= value < n


def _bucket_of(h: pa.Int32Array, n: int) -> pa.Int32Array:
    """``(h & 0x7fffffff) % n`` with NULL hashes in bucket 0, as native does."""
    v = h.to_numpy(zero_copy_only=False) if h.null_count == 0 else h.fill_null(0).to_numpy()
    return pa.array((v & np.int32(_I32_MAX)) % np.int32(n), type=pa.int32())


@dataclass(frozen=True)
class Bucket(Transform):
    """``(murmur3(col0) & 0x7fffffff) % N``; NULL goes to bucket 0 (Lance 14 native)."""

    num_buckets: int
    name: ClassVar[str] = "bucket"

    def __post_init__(self) -> None:
        _check_positive_int(self.num_buckets, "num_buckets")

    def parameters(self) -> dict[str, str]:
        return {"num_buckets": str(self.num_buckets)}

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        return is_hashable(source_types[0])

    def can_produce(self, value: Any) -> bool:
        return _is_bucket(value, self.num_buckets)

    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        return pa.int32()

    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        return _bucket_of(murmur3_32_spark(_single(arrays, self.name)), self.num_buckets)


@dataclass(frozen=True)
class MultiBucket(Transform):
    """``(murmur3_multi(col0, col1, ...) & 0x7fffffff) % N``; all-NULL rows go to bucket 0.

    `murmur3_multi` chains Murmur3 over the non-NULL values (each seeded by the previous hash,
    starting at 0), so a one-column multi_bucket equals bucket.
    """

    num_buckets: int
    name: ClassVar[str] = "multi_bucket"
    arity: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        _check_positive_int(self.num_buckets, "num_buckets")

    def parameters(self) -> dict[str, str]:
        return {"num_buckets": str(self.num_buckets)}

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        return all(is_hashable(t) for t in source_types)

    def can_produce(self, value: Any) -> bool:
        return _is_bucket(value, self.num_buckets)

    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        return pa.int32()

    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        return _bucket_of(murmur3_multi(arrays), self.num_buckets)


@dataclass(frozen=True)
class Truncate(Transform):
    """``left(col0, W)`` for strings, ``col0 - (col0 % W)`` for integers (truncation toward zero)."""

    width: int
    name: ClassVar[str] = "truncate"

    def __post_init__(self) -> None:
        _check_positive_int(self.width, "truncate width", _I64_MAX)

    def parameters(self) -> dict[str, str]:
        return {"width": str(self.width)}

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        t = source_types[0]
        return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)

    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        return source_types[0]

    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        a = _single(arrays, self.name)
        if pa.types.is_string(a.type) or pa.types.is_large_string(a.type):
            return pc.utf8_slice_codeunits(a, 0, self.width)
        if not pa.types.is_integer(a.type):
            if pa.types.is_null(a.type):
                return a
            raise RegionRoutingError(f"truncate cannot cut values of type {a.type}")
        v = pc.fill_null(a, 0).to_numpy()
        wide_t = np.uint64 if pa.types.is_unsigned_integer(a.type) else np.int64
        wide = v.astype(wide_t)
        out = (wide - np.fmod(wide, wide_t(self.width))).astype(v.dtype)
        mask = a.is_null().to_numpy(zero_copy_only=False) if a.null_count else None
        return pa.array(out, type=a.type, mask=mask)

    def project(self, pred: Predicate, source_type: pa.DataType | None = None) -> Predicate | None:
        return _project_monotone(self, pred, source_type)


@dataclass(frozen=True)
class Unsharded(Transform):
    """Every row in one region (value 0). Lance 14's ``unsharded``; not in the spec's table."""

    name: ClassVar[str] = "unsharded"
    arity: ClassVar[int | None] = 0

    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        return pa.int32()

    def can_produce(self, value: Any) -> bool:
        return _is_bucket(value, 1)

    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        if num_rows is None:
            raise RegionRoutingError("unsharded needs num_rows")
        return pa.array(np.zeros(num_rows, dtype=np.int32))

    def project(self, pred: Predicate, source_type: pa.DataType | None = None) -> Predicate | None:
        return None

    def project_sources(
        self, preds: Sequence[Predicate | None], source_types: Sequence[pa.DataType | None] | None = None
    ) -> Predicate | None:
        return None


# --- SQL expressions ------------------------------------------------------------------------------

_VOLATILE = re.compile(
    r"\b(random|uuid|now|current_date|current_time|current_timestamp|localtime|localtimestamp)\b",
    re.IGNORECASE,
)
_HASH_FUNCS = ("murmur3", "murmur3_multi")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _skip_quoted(sql: str, i: int) -> int:
    """Index after the quoted literal or identifier starting at ``sql[i]``."""
    q = sql[i]
    i += 1
    while i < len(sql):
        if sql[i] == q:
            if i + 1 < len(sql) and sql[i + 1] == q:  # doubled quote
                i += 2
                continue
            return i + 1
        i += 1
    raise InvalidRegionSpecError(f"unterminated quote in region expression: {sql!r}")


def _close_paren(sql: str, i: int) -> int:
    """Index of the ')' matching the '(' at ``sql[i]``."""
    depth = 0
    while i < len(sql):
        c = sql[i]
        if c in "'\"":
            i = _skip_quoted(sql, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InvalidRegionSpecError(f"unbalanced parentheses in region expression: {sql!r}")


def _split_args(text: str) -> list[str]:
    """Split a call's argument text at top-level commas."""
    args, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c in "'\"":
            i = _skip_quoted(text, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    args.append(text[start:].strip())
    return [] if args == [""] else args


def _unquoted(sql: str) -> str:
    """`sql` with quoted literals and identifiers blanked out."""
    out, i = [], 0
    while i < len(sql):
        if sql[i] in "'\"":
            j = _skip_quoted(sql, i)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(sql[i])
            i += 1
    return "".join(out)


_EXPRESSION_THREAD = "region-expressions"


def _on_expression_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` run on the one thread that does every DataFusion call of region expressions.

    A DataFusion call blocks on DataFusion's runtime, which panics on a thread that is already
    driving it: a scan or table-function callback of a SQL query that prunes regions. The dedicated
    thread never drives that runtime, so region expressions evaluate the same way (and give the
    same region values) inside and outside a query.
    """
    if threading.current_thread().name.startswith(f"memwal-{_EXPRESSION_THREAD}"):
        return fn(*args)
    return shared_pool(_EXPRESSION_THREAD, 1).submit(fn, *args).result()


class _CompiledExpression:
    """A region expression planned for one input schema, with type-exact murmur3 UDFs.

    DataFusion Python UDFs have one exact signature and DataFusion silently widens arguments to
    it (an int32 column reaches an int64 UDF as int64, changing its hash). So each
    ``murmur3(...)`` / ``murmur3_multi(...)`` call is rewritten to a UDF registered for the exact
    types of its arguments. Build and evaluate it through `_on_expression_thread`.
    """

    def __init__(self, sql: str, schema: pa.Schema) -> None:
        from datafusion import SessionConfig, SessionContext

        # one partition: the plan runs inline in the calling thread, with no task of its own to
        # schedule on DataFusion's runtime
        self.ctx = SessionContext(SessionConfig().with_target_partitions(1))
        self.schema = schema
        self._udfs: dict[tuple[str, tuple[pa.DataType, ...]], str] = {}
        self._empty = pa.RecordBatch.from_pylist([], schema=schema)
        self.sql = self._rewrite(sql)
        self.out_type = self._type_of(self.sql)

    def _frame(self, batch: pa.RecordBatch) -> Any:
        return self.ctx.create_dataframe([[batch]], schema=self.schema)

    def _type_of(self, sql: str) -> pa.DataType:
        return self._frame(self._empty).select_exprs(f"{sql} AS __v").schema().field(0).type

    def _rewrite(self, sql: str) -> str:
        out, i, pos = [], 0, 0
        while i < len(sql):
            c = sql[i]
            if c in "'\"":
                i = _skip_quoted(sql, i)
                continue
            m = _IDENT.match(sql, i) if (c.isalpha() or c == "_") else None
            if m is None:
                i += 1
                continue
            name, j = m.group(0).lower(), m.end()
            while j < len(sql) and sql[j].isspace():
                j += 1
            prev = sql[i - 1] if i else ""
            if name not in _HASH_FUNCS or j >= len(sql) or sql[j] != "(" or prev == ".":
                i = m.end()
                continue
            close = _close_paren(sql, j)
            args = [self._rewrite(a) for a in _split_args(sql[j + 1 : close])]
            if not args or (name == "murmur3" and len(args) != 1):
                need = "one argument" if name == "murmur3" else "arguments"
                raise InvalidRegionSpecError(f"{name} takes {need}")
            udf_name = self._udf(name, tuple(self._type_of(a) for a in args))
            out.append(sql[pos:i])
            out.append(f"{udf_name}({', '.join(args)})")
            i = pos = close + 1
        out.append(sql[pos:])
        return "".join(out)

    def _udf(self, name: str, types: tuple[pa.DataType, ...]) -> str:
        from datafusion import udf

        key = (name, types)
        if key not in self._udfs:
            udf_name = f"__memwal_{name}_{len(self._udfs)}"
            if name == "murmur3":
                fn: Callable[..., pa.Array] = murmur3_32_spark
            else:

                def fn(*arrays: pa.Array) -> pa.Array:
                    return murmur3_multi(arrays)

            self.ctx.register_udf(udf(fn, list(types), pa.int32(), "immutable", udf_name))
            self._udfs[key] = udf_name
        return self._udfs[key]

    def evaluate(self, batch: pa.RecordBatch) -> pa.Array:
        try:
            out = self._frame(batch).select_exprs(f"{self.sql} AS __v").to_arrow_table().column(0)
        except Exception as e:  # DataFusion raises plain Exception
            raise RegionRoutingError(f"region expression failed: {e}") from e
        arr = out.combine_chunks() if out.num_chunks != 1 else out.chunk(0)
        if len(arr) != batch.num_rows:
            raise RegionRoutingError("region expression changed the number of rows")
        return arr


@dataclass(frozen=True)
class Expression(Transform):
    """A DataFusion SQL expression over ``col0``, ``col1``, ... (spec "Region Expression").

    ``murmur3(x)`` and ``murmur3_multi(x, y, ...)`` are available and hash exactly like the bucket
    transforms (NULL in, NULL out). Volatile functions (now(), random(), ...) are rejected. Integer
    arithmetic and hashes (`memwal_df.format.intexpr`) are evaluated with pyarrow, the rest by DataFusion on
    its own thread: both give DataFusion's values, inside a query's callbacks as outside.
    """

    sql: str
    name: ClassVar[str] = "expression"
    arity: ClassVar[int | None] = None
    _cache: dict[tuple[pa.DataType, ...], _CompiledExpression] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    _fast: dict[tuple[pa.DataType, ...], Evaluator | None] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.sql, str) or not self.sql.strip():
            raise InvalidRegionSpecError("a region expression needs SQL text")
        m = _VOLATILE.search(_unquoted(self.sql))
        if m:
            raise InvalidRegionSpecError(f"region expressions must be deterministic; {m.group(1)}() is not")

    def compile(self, source_types: Sequence[pa.DataType]) -> _CompiledExpression:
        """The expression planned for these source types (cached); InvalidRegionSpecError if it fails."""
        key = tuple(source_types)
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                schema = pa.schema([(f"col{i}", t) for i, t in enumerate(key)])
                try:
                    hit = _on_expression_thread(_CompiledExpression, self.sql, schema)
                except InvalidRegionSpecError:
                    raise
                except Exception as e:  # DataFusion reports planning errors as plain Exception
                    raise InvalidRegionSpecError(f"bad region expression {self.sql!r}: {e}") from e
                self._cache[key] = hit
            return hit

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        try:
            self.compile(source_types)
        except InvalidRegionSpecError:
            return False
        return True

    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        return self.compile(source_types).out_type

    def vectorized(self, source_types: Sequence[pa.DataType]) -> Evaluator | None:
        """The expression compiled to pyarrow for these source types (cached), None when it is
        outside `memwal_df.format.intexpr`'s subset and DataFusion evaluates it."""
        key = tuple(source_types)
        with self._lock:
            if key not in self._fast:
                self._fast[key] = compile_int_expression(self.sql, key)
            return self._fast[key]

    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        cols = [a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays]
        fast = self.vectorized([a.type for a in cols])
        if fast is not None:
            n = len(cols[0]) if cols else num_rows or 0
            return as_array(fast(cols, n), n)
        compiled = self.compile([a.type for a in cols])
        batch = pa.RecordBatch.from_arrays(cols, schema=compiled.schema)
        return _on_expression_thread(compiled.evaluate, batch)

    def __str__(self) -> str:
        return f"expression[{self.sql}]"


_TRANSFORMS: dict[str, Callable[[Mapping[str, str]], Transform]] = {
    "identity": lambda p: Identity(),
    "year": lambda p: Year(),
    "month": lambda p: Month(),
    "day": lambda p: Day(),
    "hour": lambda p: Hour(),
    "bucket": lambda p: Bucket(_int_param(p, "num_buckets", "bucket")),
    "multi_bucket": lambda p: MultiBucket(_int_param(p, "num_buckets", "multi_bucket")),
    "truncate": lambda p: Truncate(_int_param(p, "width", "truncate")),
    "unsharded": lambda p: Unsharded(),
}


def transform_from_name(name: str, parameters: Mapping[str, str]) -> Transform:
    """The transform a ``ShardingField.transform`` name and its parameters describe."""
    make = _TRANSFORMS.get(name)
    if make is None:
        raise InvalidRegionSpecError(f"unknown region transform {name!r}; known: {sorted(_TRANSFORMS)}")
    return make(parameters)


# ----------------------------------------------------------------------------------------------
# Result type names (ShardingField.result_type)

_NAMED_TYPES: dict[str, pa.DataType] = {
    "boolean": pa.bool_(),
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint8": pa.uint8(),
    "uint16": pa.uint16(),
    "uint32": pa.uint32(),
    "uint64": pa.uint64(),
    "float16": pa.float16(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "utf8": pa.utf8(),
    "large_utf8": pa.large_utf8(),
    "binary": pa.binary(),
    "large_binary": pa.large_binary(),
    "date32": pa.date32(),
    "date64": pa.date64(),
}
_TYPE_NAMES = {t: n for n, t in _NAMED_TYPES.items()}
_ALIASES = {
    "bool": "boolean",
    "string": "utf8",
    "large_string": "large_utf8",
    "float": "float32",
    "double": "float64",
    "halffloat": "float16",
}
_PARAM_TYPE = re.compile(
    r"^(?:(?P<kind>timestamp|time32|time64|duration)\[(?P<unit>s|ms|us|ns)(?:, tz=(?P<tz>[^\]]+))?\]"
    r"|(?P<dec>decimal128|decimal256)\((?P<p>\d+), ?(?P<s>-?\d+)\))$"
)


def _type_name_or_none(t: pa.DataType) -> str | None:
    if t in _TYPE_NAMES:
        return _TYPE_NAMES[t]
    if pa.types.is_timestamp(t):
        return f"timestamp[{t.unit}]" if t.tz is None else f"timestamp[{t.unit}, tz={t.tz}]"
    if pa.types.is_time(t) or pa.types.is_duration(t) or pa.types.is_decimal(t):
        return str(t)
    return None


def result_type_name(t: pa.DataType) -> str:
    """The ``result_type`` string of an Arrow type (Lance 14's names: "int32", "utf8", "boolean"...)."""
    name = _type_name_or_none(t)
    if name is None:
        raise InvalidRegionSpecError(f"type {t} cannot be a region value")
    return name


def result_arrow_type(name: str) -> pa.DataType:
    """The Arrow type of a ``result_type`` string (inverse of `result_type_name`)."""
    key = _ALIASES.get(name, name)
    if key in _NAMED_TYPES:
        return _NAMED_TYPES[key]
    m = _PARAM_TYPE.match(name)
    if m is None:
        raise InvalidRegionSpecError(f"unknown region result type {name!r}")
    if m.group("dec"):
        make = pa.decimal128 if m.group("dec") == "decimal128" else pa.decimal256
        return make(int(m.group("p")), int(m.group("s")))
    kind, unit, tz = m.group("kind"), m.group("unit"), m.group("tz")
    try:
        if kind == "timestamp":
            return pa.timestamp(unit, tz)
        return {"time32": pa.time32, "time64": pa.time64, "duration": pa.duration}[kind](unit)
    except (ValueError, pa.ArrowException):
        raise InvalidRegionSpecError(f"unknown region result type {name!r}") from None


# ----------------------------------------------------------------------------------------------
# Region values in ShardFieldEntry


def _arrow_type(t: pa.DataType | str) -> pa.DataType:
    return result_arrow_type(t) if isinstance(t, str) else t


def _fixed_width(t: pa.DataType) -> int | None:
    """Bytes per value of a fixed-width, non-nested type (None for others)."""
    if pa.types.is_nested(t) or pa.types.is_null(t) or pa.types.is_boolean(t):
        return None
    try:
        bits = t.bit_width
    except ValueError:
        return None
    return bits // 8 if bits and bits % 8 == 0 else None


def encode_region_value(value: Any, type: pa.DataType | str) -> bytes | None:
    """A region value as ``ShardFieldEntry.value``: the raw little-endian Arrow scalar.

    int32 gives 4 LE bytes, utf8 the UTF-8 bytes, boolean one byte 0/1. None (NULL) gives None:
    leave the entry out.
    """
    t = _arrow_type(type)
    if isinstance(value, pa.Scalar):
        value = value.as_py()
    if value is None:
        return None
    text = pa.types.is_string(t) or pa.types.is_large_string(t)
    if text or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        if isinstance(value, str):
            return value.encode("utf-8")
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        raise RegionRoutingError(f"region value {value!r} does not fit type {t}")
    if pa.types.is_boolean(t):
        return b"\x01" if value else b"\x00"
    width = _fixed_width(t)
    if width is None:
        raise InvalidRegionSpecError(f"type {t} cannot be a region value")
    try:
        arr = pa.array([value], type=t)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        raise RegionRoutingError(f"region value {value!r} does not fit type {t}: {e}") from e
    return arr.buffers()[1].to_pybytes()[:width]


def decode_region_value(data: bytes | None, type: pa.DataType | str) -> Any:
    """Inverse of `encode_region_value` (None for a missing entry)."""
    t = _arrow_type(type)
    if data is None:
        return None
    data = bytes(data)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return data.decode("utf-8")
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return data
    if pa.types.is_boolean(t):
        if len(data) != 1:
            raise InvalidRegionSpecError(f"a boolean region value is one byte, got {len(data)}")
        return data != b"\x00"
    width = _fixed_width(t)
    if width is None:
        raise InvalidRegionSpecError(f"type {t} cannot be a region value")
    if len(data) != width:
        raise InvalidRegionSpecError(f"a {t} region value is {width} bytes, got {len(data)}")
    return pa.Array.from_buffers(t, 1, [None, pa.py_buffer(data)])[0].as_py()


# ----------------------------------------------------------------------------------------------
# Region fields and specs


@dataclass(frozen=True)
class RegionField:
    """One region field: source field ids, a transform (or SQL `Expression`) and its result type.

    `source_names` / `source_types` are filled by `RegionSpec.bind`; they are not stored.
    """

    field_id: str
    source_ids: tuple[int, ...]
    transform: Transform
    result_type: str
    parameters: dict[str, str] = field(default_factory=dict)
    source_names: tuple[str | None, ...] | None = field(default=None, compare=False, repr=False)
    source_types: tuple[pa.DataType | None, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.field_id, str) or not self.field_id:
            raise InvalidRegionSpecError("a region field needs a non-empty field_id")
        object.__setattr__(self, "source_ids", tuple(int(i) for i in self.source_ids))
        _check_arity(self.transform, len(self.source_ids), self.field_id)
        result_arrow_type(self.result_type)  # validates

    @property
    def expression(self) -> str | None:
        """The SQL text of an expression field, else None."""
        return self.transform.sql if isinstance(self.transform, Expression) else None

    @property
    def arrow_result_type(self) -> pa.DataType:
        """`result_type` as an Arrow type."""
        return result_arrow_type(self.result_type)

    def label(self, names: Mapping[int, str] | None = None) -> str:
        """The field named by what it reads, for people: the column of an `identity` field (`id`),
        the SQL text of an expression, else `transform(columns)` (`bucket[4](id)`). `names` maps
        source field ids to column names (default: the names `RegionSpec.bind` recorded; `#ID` for
        an id neither knows)."""
        bound = dict(zip(self.source_ids, self.source_names or (), strict=False))
        cols = [(names or {}).get(i) or bound.get(i) or f"#{i}" for i in self.source_ids]
        if isinstance(self.transform, Expression):
            return self.transform.sql
        if isinstance(self.transform, Identity):
            return cols[0]
        return f"{self.transform}({', '.join(cols)})"

    def apply(self, arrays: Sequence[pa.Array], num_rows: int) -> pa.Array:
        """Region values of the rows whose source columns are `arrays`, as `result_type`."""
        try:
            out = self.transform.apply(arrays, num_rows)
        except pa.ArrowException as e:
            types = [str(a.type) for a in arrays]
            raise RegionRoutingError(
                f"region field {self.field_id!r} cannot route columns of {types}: {e}"
            ) from e
        want = self.arrow_result_type
        if out.type != want:
            try:
                out = out.cast(want)
            except pa.ArrowException as e:
                raise RegionRoutingError(
                    f"region field {self.field_id!r} produced {out.type}, not castable to {want}: {e}"
                ) from e
        return out

    def to_proto(self) -> pb.ShardingField:
        msg = pb.ShardingField(
            field_id=self.field_id, source_ids=list(self.source_ids), result_type=self.result_type
        )
        if isinstance(self.transform, Expression):
            msg.expression = self.transform.sql
        else:
            msg.transform = self.transform.name
        for k, v in self.parameters.items():
            msg.parameters[k] = v
        return msg

    @classmethod
    def from_proto(cls, msg: pb.ShardingField) -> RegionField:
        params = dict(msg.parameters)
        has_t, has_e = msg.HasField("transform"), msg.HasField("expression")
        if has_t == has_e:
            raise InvalidRegionSpecError(
                f"region field {msg.field_id!r} needs exactly one of transform and expression"
            )
        transform = transform_from_name(msg.transform, params) if has_t else Expression(msg.expression)
        return cls(msg.field_id, tuple(msg.source_ids), transform, msg.result_type, params)

    def to_dict(self) -> dict[str, Any]:
        """The field in the shape of ``LanceDataset.mem_wal_index_details()``."""
        return {
            "field_id": self.field_id,
            "source_ids": list(self.source_ids),
            "transform": None if isinstance(self.transform, Expression) else self.transform.name,
            "expression": self.expression,
            "result_type": self.result_type,
            "parameters": dict(self.parameters),
        }


def _check_arity(t: Transform, n: int, field_id: str) -> None:
    want = t.arity
    if (want is None and n < 1) or (want is not None and n != want):
        need = "one or more" if want is None else str(want)
        raise InvalidRegionSpecError(
            f"region field {field_id!r}: {t.name} takes {need} source columns, got {n}"
        )


def _to_array_of(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


@dataclass(frozen=True)
class RegionSpec:
    """A bound region spec: fields over Lance field ids (``ShardingSpec``)."""

    spec_id: int
    fields: tuple[RegionField, ...]

    def __post_init__(self) -> None:
        if isinstance(self.spec_id, bool) or not isinstance(self.spec_id, int) or self.spec_id < 1:
            raise InvalidRegionSpecError(f"spec_id must be a positive integer, got {self.spec_id!r}")
        object.__setattr__(self, "fields", tuple(self.fields))
        if not self.fields:
            raise InvalidRegionSpecError("a region spec needs at least one field")
        ids = [f.field_id for f in self.fields]
        if len(set(ids)) != len(ids):
            raise InvalidRegionSpecError(
                f"duplicate region field ids {ids}; pass field_id= to tell them apart"
            )

    def value_text(self, values: Sequence[Any], names: Mapping[int, str] | None = None) -> str:
        """A region's values labelled with their fields (`RegionField.label`), e.g. `id=2`."""
        return ", ".join(f"{f.label(names)}={v}" for f, v in zip(self.fields, values, strict=True))

    # --- serialization

    def to_proto(self) -> pb.ShardingSpec:
        """The ``ShardingSpec`` message (bytes equal to Lance 14's for its transforms)."""
        return pb.ShardingSpec(spec_id=self.spec_id, fields=[f.to_proto() for f in self.fields])

    @classmethod
    def from_proto(cls, msg: pb.ShardingSpec | bytes) -> RegionSpec:
        """Decode a ``ShardingSpec`` (message or bytes); InvalidRegionSpecError if malformed."""
        if isinstance(msg, bytes | bytearray | memoryview):
            decoded = pb.ShardingSpec()
            decoded.ParseFromString(bytes(msg))
            msg = decoded
        return cls(msg.spec_id, tuple(RegionField.from_proto(f) for f in msg.fields))

    def to_dict(self) -> dict[str, Any]:
        """The spec in the shape of ``LanceDataset.mem_wal_index_details()["sharding_specs"][i]``."""
        return {"spec_id": self.spec_id, "fields": [f.to_dict() for f in self.fields]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RegionSpec:
        """Inverse of `to_dict` (accepts native ``mem_wal_index_details()`` specs)."""
        msg = pb.ShardingSpec(spec_id=int(d["spec_id"]))
        for f in d["fields"]:
            fm = msg.fields.add(
                field_id=f["field_id"],
                source_ids=list(f.get("source_ids") or []),
                result_type=f.get("result_type") or "",
            )
            if f.get("transform") is not None:
                fm.transform = f["transform"]
            if f.get("expression") is not None:
                fm.expression = f["expression"]
            fm.parameters.update(f.get("parameters") or {})
        return cls.from_proto(msg)

    def describe(self) -> dict[str, Any]:
        """Plain-data description: `to_dict` plus column names when bound and a readable form."""
        out = self.to_dict()
        for d, f in zip(out["fields"], self.fields, strict=True):
            if f.source_names is not None:
                d["columns"] = list(f.source_names)
            cols = ", ".join(
                n or f"#{i}"
                for n, i in zip(f.source_names or [None] * len(f.source_ids), f.source_ids, strict=True)
            )
            d["display"] = f"{f.transform}({cols})"
        return out

    @property
    def num_regions(self) -> int | None:
        """How many regions the spec can produce, when bounded (bucket: N, unsharded: 1), else None."""
        total = 1
        for f in self.fields:
            if isinstance(f.transform, Bucket | MultiBucket):
                total *= f.transform.num_buckets
            elif not isinstance(f.transform, Unsharded):
                return None
        return total

    def reads_only(self, field_ids: Iterable[int]) -> bool:
        """Whether every source column of the spec is among `field_ids` (e.g. the primary key's, so
        that a key alone can be routed)."""
        allowed = set(field_ids)
        return all(sid in allowed for f in self.fields for sid in f.source_ids)

    # --- binding and evaluation

    def bind(self, schema_field_ids: Mapping[str, int], schema: pa.Schema) -> RegionSpec:
        """Record the current column name and type of every source id, and check the transforms.

        A source id missing from the schema (a dropped column) stays unresolved and reads as NULL.
        This binds a stored spec as it is, also one made elsewhere over non-key columns (writers
        check those: `Table.check_writable`); new specs bind through `UnboundRegionSpec.bind`.
        """
        by_id = {fid: name for name, fid in schema_field_ids.items()}
        fields = []
        for f in self.fields:
            names = tuple(by_id.get(sid) for sid in f.source_ids)
            types = tuple(schema.field(n).type if n in schema.names else None for n in names)
            known = [t for t in types if t is not None]
            if len(known) == len(types) and not f.transform.can_transform(known):
                raise InvalidRegionSpecError(
                    f"region field {f.field_id!r}: {f.transform} cannot take columns of type {list(known)}"
                )
            fields.append(replace(f, source_names=names, source_types=types))
        return RegionSpec(self.spec_id, tuple(fields))

    def evaluate(self, data: pa.Table | pa.RecordBatch, field_ids: Mapping[str, int]) -> list[pa.Array]:
        """One region-value array per field for the rows of `data`.

        `field_ids` maps the table's column names to Lance field ids. A source id that is not in it
        (the column was dropped) reads as NULL; a mapped column missing from `data` is an error.
        """
        by_id = {fid: name for name, fid in field_ids.items()}
        n = data.num_rows
        out = []
        for f in self.fields:
            arrays = []
            for i, sid in enumerate(f.source_ids):
                name = by_id.get(sid)
                if name is None:
                    arrays.append(pa.nulls(n, self._missing_type(f, i)))
                    continue
                if name not in data.schema.names:
                    raise RegionRoutingError(
                        f"region field {f.field_id!r} reads column {name!r}, which the data lacks"
                    )
                arrays.append(_to_array_of(data.column(name)))
            out.append(f.apply(arrays, n))
        return out

    @staticmethod
    def _missing_type(f: RegionField, i: int) -> pa.DataType:
        if f.source_types is not None and f.source_types[i] is not None:
            return f.source_types[i]
        if isinstance(f.transform, Identity):
            return f.arrow_result_type
        return pa.null()

    # --- pruning

    def prune(
        self,
        region_values: Iterable[Sequence[Any]],
        predicates_by_column: Mapping[str | int, Predicate | Sequence[Predicate]],
        field_ids: Mapping[str, int] | None = None,
    ) -> list[tuple[Any, ...]]:
        """The region value tuples (one value per field, as decoded) that may hold matching rows.

        `predicates_by_column` maps a column name (resolved through `field_ids`, else the names
        recorded by `bind`) or a Lance field id to predicates that all hold (AND).
        """
        by_source: dict[int, list[Predicate]] = {}
        for key, preds in predicates_by_column.items():
            sid = self._source_id(key, field_ids)
            if sid is None:
                continue
            items = [preds] if isinstance(preds, Eq | In | Range) else list(preds)
            by_source.setdefault(sid, []).extend(items)
        checks = [self._field_checks(f, by_source) for f in self.fields]
        kept = []
        for values in region_values:
            values = tuple(values)
            if len(values) != len(self.fields):
                raise RegionRoutingError(f"expected {len(self.fields)} region values, got {len(values)}")
            if all(p.test(v) for v, ps in zip(values, checks, strict=True) for p in ps):
                kept.append(values)
        return kept

    def _source_id(self, key: str | int, field_ids: Mapping[str, int] | None) -> int | None:
        if isinstance(key, int):
            return key
        if field_ids is not None:
            return field_ids.get(key)
        for f in self.fields:
            for name, sid in zip(f.source_names or (), f.source_ids, strict=False):
                if name == key:
                    return sid
        return None

    def _field_checks(self, f: RegionField, by_source: Mapping[int, list[Predicate]]) -> list[Predicate]:
        types = list(f.source_types) if f.source_types is not None else [None] * len(f.source_ids)
        if len(f.source_ids) == 1:
            projected = (f.transform.project(p, types[0]) for p in by_source.get(f.source_ids[0], []))
            return [p for p in projected if p is not None]
        per_source: list[Predicate | None] = []
        for sid in f.source_ids:
            allowed: list[Any] | None = None
            for p in by_source.get(sid, []):
                pts = _points(p)
                if pts is not None:
                    if allowed is not None:
                        pts = [v for v in allowed if any(_same(v, x) for x in pts)]
                    allowed = pts
            per_source.append(None if allowed is None else In(allowed))
        if not per_source or any(p is None for p in per_source):
            return []
        projected = f.transform.project_sources(per_source, types)
        return [] if projected is None else [projected]


# ----------------------------------------------------------------------------------------------
# Unbound specs: what the public constructors build, over column names


@dataclass(frozen=True)
class _UnboundField:
    field_id: str
    columns: tuple[str, ...]
    transform: Transform
    result_type: str | None  # None: derived from the source types at bind time


@dataclass(frozen=True)
class UnboundRegionSpec:
    """A region spec over column names; `bind` resolves them to Lance field ids.

    Combine single-field specs with ``+`` (give each a distinct ``field_id``).
    """

    fields: tuple[_UnboundField, ...]
    spec_id: int = DEFAULT_SPEC_ID

    def __add__(self, other: UnboundRegionSpec) -> UnboundRegionSpec:
        return UnboundRegionSpec(self.fields + other.fields, self.spec_id)

    def bind(
        self, schema_field_ids: Mapping[str, int], schema: pa.Schema, *, primary_key: Sequence[str]
    ) -> RegionSpec:
        """The spec over the Lance field ids of `schema`; InvalidRegionSpecError on unknown columns or
        columns a transform cannot take, NonKeyRegionColumnError on columns outside `primary_key`."""
        fields = []
        for u in self.fields:
            missing = [c for c in u.columns if c not in schema_field_ids or c not in schema.names]
            if missing:
                raise InvalidRegionSpecError(f"region field {u.field_id!r}: unknown columns {missing}")
            types = [schema.field(c).type for c in u.columns]
            if not u.transform.can_transform(types):
                raise InvalidRegionSpecError(
                    f"region field {u.field_id!r}: {u.transform} cannot take columns {list(u.columns)} "
                    f"of type {[str(t) for t in types]}"
                )
            result = u.result_type or result_type_name(u.transform.result_type(types))
            fields.append(
                RegionField(
                    u.field_id,
                    tuple(schema_field_ids[c] for c in u.columns),
                    u.transform,
                    result,
                    u.transform.parameters(),
                    source_names=u.columns,
                    source_types=tuple(types),
                )
            )
        bound = RegionSpec(self.spec_id, tuple(fields))
        check_key_only(bound, primary_key, schema_field_ids)
        return bound


def non_key_columns(spec: RegionSpec, primary_key: Sequence[str], field_ids: Mapping[str, int]) -> list[str]:
    """The source columns of `spec` outside `primary_key` (`field_ids`: column name -> Lance field id;
    a source id no column has is named by its id)."""
    key_ids = {field_ids[c] for c in primary_key if c in field_ids}
    names = {fid: name for name, fid in field_ids.items()}
    outside = dict.fromkeys(sid for f in spec.fields for sid in f.source_ids if sid not in key_ids)
    return [names.get(sid, f"field id {sid}") for sid in outside]


def check_key_only(spec: RegionSpec, primary_key: Sequence[str], field_ids: Mapping[str, int]) -> None:
    """Raise NonKeyRegionColumnError unless every source column of `spec` is a primary-key column.
    The spec then assigns each key exactly one region, whatever the row's other columns hold."""
    outside = non_key_columns(spec, primary_key, field_ids)
    if outside:
        raise NonKeyRegionColumnError(non_key_message(outside, primary_key))


def non_key_message(columns: Sequence[str], primary_key: Sequence[str]) -> str:
    """Why a region spec over `columns` (outside `primary_key`) is refused, and what to do."""
    return (
        f"the region spec reads {list(columns)}, which are not primary-key columns {list(primary_key)}: "
        "a key must map to exactly one region, and an upsert that changed such a column would put the "
        "key into a second region (duplicate rows, stale reads, merge-order-dependent results). "
        "Put the columns into the primary key, or build the region spec over primary-key columns"
    )


def _one(
    field_id: str, columns: Sequence[str], transform: Transform, result_type: str | None = None
) -> UnboundRegionSpec:
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise InvalidRegionSpecError(f"columns must be a list of column names, got {columns!r}")
    columns = list(columns)
    _check_arity(transform, len(columns), field_id)
    if not isinstance(field_id, str) or not field_id:
        raise InvalidRegionSpecError("field_id must be a non-empty string")
    return UnboundRegionSpec((_UnboundField(field_id, tuple(columns), transform, result_type),))


def bucket(column: str, num_buckets: int, *, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """Hash `column` into `num_buckets` regions, exactly as Lance 14 (1 <= num_buckets <= 1024)."""
    _check_positive_int(num_buckets, "num_buckets", MAX_NUM_BUCKETS)
    return _one(field_id, [column], Bucket(int(num_buckets)))


def multi_bucket(
    columns: Sequence[str], num_buckets: int, *, field_id: str = DEFAULT_FIELD_ID
) -> UnboundRegionSpec:
    """Hash several columns together into `num_buckets` regions (NULLs skipped)."""
    _check_positive_int(num_buckets, "num_buckets", MAX_NUM_BUCKETS)
    return _one(field_id, columns, MultiBucket(int(num_buckets)))


def identity(column: str, *, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """One region per distinct value of `column`."""
    return _one(field_id, [column], Identity())


def year(column: str, *, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """One region per calendar year of a date/timestamp column."""
    return _one(field_id, [column], Year())


def month(column: str, *, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """One region per month of the year (1-12) of a date/timestamp column."""
    return _one(field_id, [column], Month())


def day(column: str, *, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """One region per day of the month (1-31) of a date/timestamp column."""
    return _one(field_id, [column], Day())


def hour(column: str, *, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """One region per hour of the day (0-23) of a timestamp column."""
    return _one(field_id, [column], Hour())


def truncate(column: str, width: int, *, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """Regions by the first `width` characters of a string, or integers cut down to multiples of `width`."""
    _check_positive_int(width, "truncate width", _I64_MAX)
    return _one(field_id, [column], Truncate(int(width)))


def expression(
    sql: str, columns: Sequence[str], result_type: pa.DataType | str, *, field_id: str = DEFAULT_FIELD_ID
) -> UnboundRegionSpec:
    """Regions by a DataFusion SQL expression over ``col0``.. (= `columns`), cast to `result_type`."""
    name = result_type if isinstance(result_type, str) else result_type_name(result_type)
    result_arrow_type(name)
    return _one(field_id, columns, Expression(sql), name)


def unsharded(*, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """Every row in a single region (Lance 14's ``unsharded``)."""
    return _one(field_id, [], Unsharded())


# ----------------------------------------------------------------------------------------------
# Lance field ids


def lance_field_ids(ds_or_schema: Any) -> dict[str, int]:
    """The Lance field id of each top-level column.

    Accepts a `lance.LanceDataset` (ids as stored; a dropped column's id is simply absent and never
    reused), a `lance.schema.LanceSchema`, or a `pyarrow.Schema` (ids as Lance would assign them to
    a new dataset: depth-first pre-order, so nested children take ids too).
    """
    from lance.schema import LanceSchema

    if isinstance(ds_or_schema, pa.Schema):
        schema = LanceSchema.from_pyarrow(ds_or_schema)
    elif isinstance(ds_or_schema, LanceSchema):
        schema = ds_or_schema
    elif hasattr(ds_or_schema, "lance_schema"):
        schema = ds_or_schema.lance_schema
    else:
        raise TypeError(f"expected a LanceDataset, LanceSchema or pyarrow.Schema, got {type(ds_or_schema)!r}")
    return {f.name(): f.id() for f in schema.fields()}
