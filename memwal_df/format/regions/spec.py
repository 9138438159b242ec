"""Region specs (Lance 14: "sharding specs"): how rows map to regions, and how filters prune regions.

A spec is a list of region fields. Each field turns source columns, referenced by Lance field id, into
one region value, either through a well-known transform (`transforms`) or a DataFusion SQL expression
over ``col0``, ``col1``, ... (`sql_expression`) (spec "Region Spec"). `RegionSpec` is the stored form,
bound to field ids; the builders (`bucket`, `identity`, ...) make an `UnboundRegionSpec` over column
names. Native Lance 14 writes ``field_id="bucket"`` for every transform; the builders default to that.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import pyarrow as pa

from memwal_df.errors import InvalidRegionSpecError, NonKeyRegionColumnError, RegionRoutingError
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.predicates import Eq, In, Predicate, Range, named_values, same_value
from memwal_df.format.regions.sql_expression import Expression
from memwal_df.format.regions.transforms import (
    MAX_TRUNCATE_WIDTH,
    Bucket,
    Day,
    Hour,
    Identity,
    Month,
    MultiBucket,
    Transform,
    Truncate,
    Unsharded,
    Year,
    check_positive_int,
    transform_from_name,
)
from memwal_df.format.regions.values import result_arrow_type, result_type_name

__all__ = [
    "DEFAULT_FIELD_ID",
    "DEFAULT_SPEC_ID",
    "MAX_NUM_BUCKETS",
    "RegionField",
    "RegionSpec",
    "UnboundRegionField",
    "UnboundRegionSpec",
    "bucket",
    "check_key_only",
    "day",
    "expression",
    "hour",
    "identity",
    "lance_field_ids",
    "month",
    "multi_bucket",
    "non_key_columns",
    "non_key_message",
    "truncate",
    "unsharded",
    "year",
]

DEFAULT_FIELD_ID = "bucket"  # what Lance 14 writes for every transform
DEFAULT_SPEC_ID = 1
MAX_NUM_BUCKETS = 1024  # Lance 14's initialize_mem_wal limit; `bucket()` enforces it

_ColumnKey = TypeVar("_ColumnKey", bound=str | int)  # a column name or a Lance field id


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
        predicates_by_column: Mapping[_ColumnKey, Predicate | Sequence[Predicate]],
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
                pts = named_values(p)
                if pts is not None:
                    if allowed is not None:
                        pts = [v for v in allowed if any(same_value(v, x) for x in pts)]
                    allowed = pts
            per_source.append(None if allowed is None else In(allowed))
        if not per_source or any(p is None for p in per_source):
            return []
        combined = f.transform.project_sources(per_source, types)
        return [] if combined is None else [combined]


# ----------------------------------------------------------------------------------------------
# Unbound specs: what the public constructors build, over column names


@dataclass(frozen=True)
class UnboundRegionField:
    """One field of an `UnboundRegionSpec`: a transform of columns named by their names."""

    field_id: str
    columns: tuple[str, ...]
    transform: Transform
    result_type: str | None  # None: derived from the source types at bind time


@dataclass(frozen=True)
class UnboundRegionSpec:
    """A region spec over column names; `bind` resolves them to Lance field ids.

    Combine single-field specs with ``+`` (give each a distinct ``field_id``).
    """

    fields: tuple[UnboundRegionField, ...]
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
    return UnboundRegionSpec((UnboundRegionField(field_id, tuple(columns), transform, result_type),))


def bucket(column: str, num_buckets: int, *, field_id: str = DEFAULT_FIELD_ID) -> UnboundRegionSpec:
    """Hash `column` into `num_buckets` regions, exactly as Lance 14 (1 <= num_buckets <= 1024)."""
    check_positive_int(num_buckets, "num_buckets", MAX_NUM_BUCKETS)
    return _one(field_id, [column], Bucket(int(num_buckets)))


def multi_bucket(
    columns: Sequence[str], num_buckets: int, *, field_id: str = DEFAULT_FIELD_ID
) -> UnboundRegionSpec:
    """Hash several columns together into `num_buckets` regions (NULLs skipped)."""
    check_positive_int(num_buckets, "num_buckets", MAX_NUM_BUCKETS)
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
    check_positive_int(width, "truncate width", MAX_TRUNCATE_WIDTH)
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
