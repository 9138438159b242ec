"""Region transforms: the well-known region expressions of a region field (spec "Region Transform").

Transforms follow pyiceberg's shape: ``apply`` evaluates a batch, ``project`` turns a predicate on the
source column into a predicate on region values (None when it cannot prune). `transform_from_name`
reads the ``ShardingField.transform`` name; SQL expressions are `sql_expression.Expression`.

Where Lance 14's native implementation and the spec text disagree, this module follows native:

* ``bucket`` is ``(murmur3(x) & 0x7fffffff) % N``, not ``abs(murmur3(x)) % N``;
* ``bucket`` sends NULL to bucket 0 (native hashes a NULL as the seed, 0);
* murmur3 hashes a value at its Arrow width, so ``int32(5)`` and ``int64(5)`` land in different
  buckets (the spec asks for type-promotion resistance).

``year``, ``month``, ``day`` and ``hour`` are the spec's ``date_part`` values: the calendar year, the
month of the year (1-12), the day of the month (1-31) and the hour of the day (0-23), in the
timestamp's own time zone.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidRegionSpecError, RegionRoutingError
from memwal_df.format.murmur3 import is_hashable, murmur3_32_spark, murmur3_multi
from memwal_df.format.regions.predicates import Eq, In, Predicate, Range, named_values
from memwal_df.format.regions.values import result_type_name_or_none

__all__ = [
    "MAX_TRUNCATE_WIDTH",
    "Bucket",
    "Day",
    "Hour",
    "Identity",
    "Month",
    "MultiBucket",
    "Transform",
    "Truncate",
    "Unsharded",
    "Year",
    "check_positive_int",
    "transform_from_name",
]

MAX_TRUNCATE_WIDTH = (1 << 63) - 1  # int64's maximum
_I32_MAX = 0x7FFFFFFF
_MAX_POINTS = 4096  # largest Eq/In cross product a projection enumerates


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
        named = [named_values(p) for p in preds]
        value_lists = [v for v in named if v is not None]
        if not value_lists or len(value_lists) != len(named):
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
    return bool(pa.types.is_date32(t) or pa.types.is_date64(t) or pa.types.is_timestamp(t))


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


def check_positive_int(value: Any, what: str, upper: int = _I32_MAX) -> None:
    """Raise InvalidRegionSpecError unless `value` is an integer (not a bool) in [1, `upper`]."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value <= upper:
        raise InvalidRegionSpecError(f"{what} must be an integer in [1, {upper}], got {value!r}")


@dataclass(frozen=True)
class Identity(Transform):
    """``col0``: the source value itself."""

    name: ClassVar[str] = "identity"

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        return result_type_name_or_none(source_types[0]) is not None and not pa.types.is_null(source_types[0])

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
    if not isinstance(pred, Range) or named_values(pred) is not None:
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
    cycles: list[int] = (ticks // step).tolist()
    return cycles


class _Cyclic(_DatePart):
    """A date part that wraps around (month of year, day of month, hour of day)."""

    _unit: ClassVar[str]
    _cycle: ClassVar[int]

    def _values_in(self, first: int, last: int) -> list[int]:
        raise NotImplementedError

    def project(self, pred: Predicate, source_type: pa.DataType | None = None) -> Predicate | None:
        if not isinstance(pred, Range) or named_values(pred) is not None:
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
        values: list[int] = pc.day(pa.array(days)).to_pylist()
        return values


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
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(0 <= value < n)


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
        check_positive_int(self.num_buckets, "num_buckets")

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
        check_positive_int(self.num_buckets, "num_buckets")

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
        check_positive_int(self.width, "truncate width", MAX_TRUNCATE_WIDTH)

    def parameters(self) -> dict[str, str]:
        return {"width": str(self.width)}

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        t = source_types[0]
        return bool(pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t))

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
