"""MemWalTable: a MemWAL table as a `pyarrow.dataset.Dataset` that DataFusion scans.

DataFusion 54 calls `scanner(columns=, filter=)` while planning (for the projected schema),
`get_fragments(filter)` once per query, and `fragment.scanner(schema, columns=, filter=,
batch_size=)` / `to_batches()` per partition on its worker threads. `get_fragments` takes the query's
read snapshot and plans it; each fragment runs one operator tree. Pushed filters are marked Exact by
DataFusion, so every fragment applies the whole filter.

Guarantees: every query sees one snapshot (the base version and region manifests read when it was
planned); rows are the newest live version of each key; nothing blocks on DataFusion from inside a
callback.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds

from memwal_df.errors import raised_into_sql
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.table_handle import TableHandle
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.filter import FilterExec
from memwal_df.read.exec.union import UnionExec
from memwal_df.read.expr.expression_tree import Call, Field, Literal, Node, decode
from memwal_df.read.expr.predicate import check_filter, column_predicates, key_lookups, referenced_columns
from memwal_df.read.lookup.planner import plan_point_lookup
from memwal_df.read.lsm.snapshot import ReadSnapshot, check_consistency, take_snapshot
from memwal_df.read.scan.planner import Partition, plan_scan

if TYPE_CHECKING:
    from memwal_df.write.region_writer import RegionWriter
    from memwal_df.write.table_writer import TableWriter


_SET_OPERATIONS = frozenset({"and", "and_kleene", "or", "or_kleene"})


def selects_keys_only(node: Node | None, key_schema: pa.Schema) -> bool:
    """Whether a filter is built only of `key = literal` and `key IN (...)` (literals of the key
    column's type), AND and OR: a row then matches it exactly when its key is among the keys
    `key_lookups` derives from it, so a point lookup of those keys needs no filter on top."""
    if not isinstance(node, Call):
        return False
    if node.function in _SET_OPERATIONS:
        return len(node.args) == 2 and all(selects_keys_only(a, key_schema) for a in node.args)
    if node.function == "equal" and len(node.args) == 2:
        column, literal = node.args if isinstance(node.args[0], Field) else node.args[::-1]
        found = literal.type if isinstance(literal, Literal) else None
    elif node.function == "is_in" and len(node.args) == 1:
        column, value_set = node.args[0], node.options.get("value_set")
        found = value_set.type if isinstance(value_set, pa.Array) else None
    else:
        return False
    if not isinstance(column, Field) or column.path or column.name not in key_schema.names:
        return False
    return bool(found == key_schema.field(column.name).type)


def _decoded(filter: Any, key_schema: pa.Schema) -> Node | None:
    """The pushed filter's tree (decoded once per query), None without one or when pyarrow cannot
    serialize it (then no point lookup is planned)."""
    if filter is None:
        return None
    if (equality := _key_equality(filter, key_schema)) is not None:
        return equality
    try:
        return decode(filter)
    except ValueError:
        return None


_KEY_EQUALITY = re.compile(r"\((\w+) == (-?\d+)\)")


def _key_equality(filter: Any, key_schema: pa.Schema) -> Node | None:
    """The tree of `integer key == literal`, the usual point lookup, read from the expression's text
    and confirmed by comparing the expressions (so the literal's type is the key's): much cheaper
    than `decode`. None for any other filter."""
    match = _KEY_EQUALITY.fullmatch(str(filter))
    if match is None or match[1] not in key_schema.names:
        return None
    t = key_schema.field(match[1]).type
    if not pa.types.is_integer(t):
        return None
    try:
        scalar = pa.scalar(int(match[2]), t)
    except (pa.ArrowInvalid, OverflowError):
        return None
    if not filter.equals(pc.field(match[1]) == scalar):
        return None
    return Call("equal", (Field(match[1]), Literal(scalar.as_py(), t, scalar)), {}, None)


def _key_table(keys: list[tuple[Any, ...]], key_schema: pa.Schema) -> pa.Table:
    """Key tuples as a table of the key columns (built column by column, not row by row)."""
    columns = list(zip(*keys, strict=True)) or [() for _ in key_schema]
    arrays = [pa.array(c, f.type) for c, f in zip(columns, key_schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=key_schema)


class _Scanner:
    """What DataFusion expects of a scanner: `projected_schema` and `to_batches()`."""

    def __init__(self, schema: pa.Schema, batches: Iterator[pa.RecordBatch] | None) -> None:
        self.projected_schema = schema
        self._batches = batches

    def to_batches(self) -> Iterator[pa.RecordBatch]:
        """The rows, for DataFusion (`errors.raised_into_sql`)."""
        with raised_into_sql():
            yield from self.rows()

    def rows(self) -> Iterator[pa.RecordBatch]:
        if self._batches is None:
            raise RuntimeError("a planning scanner holds no data: scan the fragments")
        for b in self._batches:
            yield b if b.schema.equals(self.projected_schema) else b.cast(self.projected_schema)

    def to_reader(self) -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(self.projected_schema, self.to_batches())

    def to_table(self) -> pa.Table:
        return pa.Table.from_batches(list(self.to_batches()), schema=self.projected_schema)


class MemWalFragment:
    """One partition of a query."""

    def __init__(self, owner: MemWalTable, partition: Partition) -> None:
        self._owner = owner
        self.partition = partition

    def scanner(
        self,
        schema: pa.Schema | None = None,
        columns: Sequence[str] | None = None,
        filter: Any = None,
        batch_size: int | None = None,
        **_: Any,
    ) -> _Scanner:
        """The partition's scanner, for DataFusion (`errors.raised_into_sql`)."""
        with raised_into_sql():
            return self.open(columns)

    def open(self, columns: Sequence[str] | None = None) -> _Scanner:
        """The scanner of the partition's rows (the projection `columns`, default every column)."""
        projected = self._owner._projected(columns)
        node = self.partition.make(projected.names)
        return _Scanner(projected, node.execute())


class MemWalTable(pds.Dataset):
    """A MemWAL table for DataFusion: `ctx.register_table("t", MemWalTable(uri))`.

    `consistency="latest"` (the default) reads the base table's latest version and every region's
    latest manifest at planning time, so every generation flushed before the query is visible.
    `consistency="snapshot"` takes the region states from the MemWAL index's region snapshot of that
    base version instead (one read, no manifest read): what the last `build_index` saw, minus what is
    merged since (see docs/reading.md "Consistency modes"). Any other mode raises
    `InvalidConfigError`. With `writer=` (a table or region writer of this process) the writer's
    unflushed MemTables are read too: a query then sees every write that writer has acknowledged."""

    def __init__(
        self,
        uri: str | TableHandle,
        storage_options: dict[str, str] | None = None,
        consistency: str = "latest",
        writer: TableWriter | RegionWriter | None = None,
    ) -> None:
        # pds.Dataset.__init__ is not called: this object has no C++ dataset behind it.
        self.table = uri if isinstance(uri, TableHandle) else TableHandle(uri, storage_options)
        self.consistency = check_consistency(consistency)
        self.writer = writer
        self._schema = self.table.schema.schema

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def specs(self) -> dict[int, RegionSpec]:
        """The table's region specs by spec id."""
        return self.table.specs

    def read_snapshot(self) -> ReadSnapshot:
        """Every level a query of this table reads now: its consistency mode, plus the writer's
        MemTables."""
        return take_snapshot(self.table, self.consistency, self.writer)

    def _check(self, filter: Any) -> None:
        """A filter given through the Python API (DataFusion checks its own before pushing them)."""
        if isinstance(filter, pc.Expression):
            check_filter(filter, self._schema)

    def _projected(self, columns: Sequence[str] | None) -> pa.Schema:
        if columns is None:
            return self._schema
        return pa.schema([self._schema.field(c) for c in columns])

    def scanner(self, columns: Sequence[str] | None = None, filter: Any = None, **_: Any) -> _Scanner:
        """The planning-time scanner DataFusion asks for (schema only)."""
        return _Scanner(self._projected(columns), None)

    def get_fragments(self, filter: Any = None) -> list[MemWalFragment]:
        """Take the query's snapshot and plan it: one fragment per partition. For DataFusion: a
        memwal_df error is raised as `errors.raised_into_sql` gives it; `to_table` raises it as it is."""
        with raised_into_sql():
            return [MemWalFragment(self, p) for p in self._plan(filter)]

    def _plan(self, filter: Any) -> list[Partition]:
        """Point lookup when the filter pins the primary key to a finite set, else a scan."""
        if isinstance(filter, pa.Scalar):  # DataFusion folded the filter to a constant
            if filter.as_py() is True:
                filter = None
            else:
                return [Partition("no rows (the filter is never true)", lambda cols: UnionExec([]))]
        ts = self.table.schema
        node = _decoded(filter, ts.key_schema)  # decoded once: the tree is handed on below
        keys = key_lookups(node, ts.primary_key)
        if keys is None:
            return plan_scan(self.read_snapshot(), self.specs, filter, column_predicates(node))
        snapshot = take_snapshot(
            self.table,
            self.consistency,
            self.writer,
            keys=_key_table(keys, ts.key_schema),
        )
        # The snapshot holds the keys conformed and deduplicated: handing that very table on spares
        # the plan both steps and its check that the snapshot was taken for them.
        key_table = snapshot.lookup_keys
        assert key_table is not None
        spec, field_ids = self.table.spec, snapshot.schema.field_ids  # as of the snapshot
        if selects_keys_only(node, ts.key_schema):

            def lookup(columns: Sequence[str]) -> ExecNode:
                return plan_point_lookup(snapshot, spec, field_ids, key_table, columns)

            return [Partition(f"point lookup of {len(keys)} keys", lookup)]
        needed = sorted(referenced_columns(node))

        def make(columns: Sequence[str]) -> ExecNode:
            read = list(dict.fromkeys([*columns, *needed]))
            lookup = plan_point_lookup(snapshot, spec, field_ids, key_table, read)
            return FilterExec(lookup, filter, columns)

        return [Partition(f"point lookup of {len(keys)} keys", make)]

    def explain(self, filter: Any = None, columns: Sequence[str] | None = None) -> str:
        """The operator tree a query with this filter and projection gets, one partition per block.
        `InvalidFilterError` for a filter that is not a condition on the table's rows."""
        self._check(filter)
        cols = self._projected(columns).names
        lines = []
        for p in self._plan(filter):
            lines.extend(p.make(cols).explain())
        return "\n".join(lines)

    def to_table(self, columns: Sequence[str] | None = None, filter: Any = None) -> pa.Table:
        """The rows a query would return (without DataFusion). `InvalidFilterError` for a filter
        that is not a condition on the table's rows (an unknown column, a value of another type)."""
        self._check(filter)
        projected = self._projected(columns)
        batches = [b for p in self._plan(filter) for b in MemWalFragment(self, p).open(columns).rows()]
        return pa.Table.from_batches(batches, schema=projected)
