"""Partial-column and conditional writes: their input, their condition, and the merge of each incoming
row with the current row of its key into the full row that is written.

A region writer has exactly one writer, so it can read the current rows of a put's keys and write the
merged full rows with no other write of the region in between (`WalCommitter.exclusive`). The
current rows come from a `CurrentRows` lookup that the layer building writers injects (the read path's
batched point lookups over the writer's MemTables, its region's unmerged generations and the base).

Semantics (`merge`): rows apply in input order, a key given twice sees its earlier row; a carried
column takes the given value (an explicit NULL sets NULL); a missing column keeps the current row's
value, or is NULL for a key without a live row (absent or deleted) — `MissingValueError` if that column
is not nullable, and nothing of the put is applied. `insert_if_absent` applies a row only where its key
has no live row; `if_match` only where the key has a live row whose compared columns equal the
expected values (NULL equals NULL). The result is written as ordinary full rows, so the WAL,
generations, readers and the merger see nothing new.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import (
    InvalidConditionError,
    MissingColumnsError,
    MissingValueError,
    SchemaMismatchError,
)
from memwal_df.format.pk_index import pk_index_key
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.schema import (
    TableSchema,
    check_columns,
    check_keys,
    check_not_null,
    conform,
    convert_values,
    to_table,
    upsert_rows,
)
from memwal_df.write.newest_rows import Found

Mode = Literal["upsert", "insert_if_absent", "if_match"]


@dataclass(frozen=True)
class BaseRows:
    """The base table's live rows (`columns`, the key among them) of every key of a write that the base
    holds at `version`, read at once for all the write's regions while they read their own levels: a
    key of the write without a row here has none in that version."""

    version: int
    columns: tuple[str, ...]
    pending: Future[pa.Table | None]  # None: that version could not be read

    def rows(self) -> pa.Table | None:
        """The rows, once read (None if the version could not be read)."""
        return self.pending.result()


class CurrentRows(Protocol):
    """The live rows (`columns` only, the key among them) of the keys in `keys` in one region's stored
    levels: the generations `manifest` lists that are not merged into the base yet, except the `held`
    ones (generations whose rows the writer holds in memory and looked the keys up in already), then
    the base table; a deleted or absent key has no row. The writer asks only for the keys none of
    its MemTables holds."""

    def __call__(
        self,
        region_id: uuid.UUID,
        manifest: pb.ShardManifest,
        held: Collection[int],
        keys: pa.Table,
        columns: Sequence[str],
        base: BaseRows | None = None,
    ) -> Found:
        """The rows (`Found`: one answer per key of `keys`); `base` (from `base_rows`, for a superset of
        `keys` and `columns`) answers for the base table when the lookup reads that base version, else
        the lookup reads the base itself."""
        ...

    def base_rows(self, keys: pa.Table, columns: Sequence[str]) -> BaseRows:
        """The base table's live rows of `keys` (`columns` only) in its open version, read in one go
        in the background."""
        ...


@dataclass(frozen=True)
class Applied:
    """Which rows of a conditional write were applied: `mask` (one bool per input row, input order)
    and `keys` (the primary-key columns of the applied rows, input order)."""

    mask: np.ndarray
    keys: pa.Table

    @property
    def count(self) -> int:
        """How many rows were applied."""
        return int(self.mask.sum())

    @staticmethod
    def combine(ts: TableSchema, parts: Sequence[tuple[np.ndarray, Applied]], num_rows: int) -> Applied:
        """The result of a write whose rows at `positions` (ascending per part) gave each part's result."""
        mask = np.zeros(num_rows, dtype=bool)
        keys: list[pa.Table] = []
        order: list[np.ndarray] = []
        for positions, part in parts:
            mask[positions] = part.mask
            keys.append(part.keys)
            order.append(positions[part.mask])
        if not keys:
            return Applied(mask, ts.key_schema.empty_table())
        table = pa.concat_tables(keys)
        return Applied(mask, table.take(pa.array(np.argsort(np.concatenate(order), kind="stable"))))


@dataclass(frozen=True)
class Condition:
    """When a row of a write applies: always (`upsert`), where its key has no live row
    (`insert_if_absent`), or where the live row's columns equal `expected` (`if_match`; one array per
    compared column, aligned with the write's rows)."""

    mode: Mode = "upsert"
    expected: dict[str, pa.Array] = field(default_factory=dict)

    def slice(self, offset: int, length: int) -> Condition:
        return Condition(self.mode, {c: a.slice(offset, length) for c, a in self.expected.items()})

    def take(self, positions: np.ndarray) -> Condition:
        if not self.expected:
            return self
        idx = pa.array(positions)
        return Condition(self.mode, {c: a.take(idx) for c, a in self.expected.items()})


def put_condition(ts: TableSchema, if_match: Mapping[str, Any] | None, num_rows: int) -> Condition:
    """The condition of `put(data, if_match=...)` (None: unconditional): each column name maps to the
    expected value of the current row's column, a scalar for every row or a sequence/array with one
    value per input row. `InvalidConditionError` for an unknown or key column, a value of another type
    or length."""
    if if_match is None:
        return Condition()
    if not if_match:
        raise InvalidConditionError("if_match needs at least one column -> expected value")
    expected = {}
    for name, value in if_match.items():
        if name not in ts.schema.names or name in ts.primary_key:
            what = "a primary-key column" if name in ts.primary_key else "not a column of the table"
            raise InvalidConditionError(
                f"if_match column {name!r} is {what}; the table has {ts.schema.names}"
            )
        expected[name] = _expected_array(ts.schema.field(name), value, num_rows)
    return Condition("if_match", expected)


def _expected_array(f: pa.Field, value: Any, num_rows: int) -> pa.Array:
    try:
        if isinstance(value, pa.Array | pa.ChunkedArray | list | tuple | np.ndarray):
            arr = value if isinstance(value, pa.Array | pa.ChunkedArray) else pa.array(value)
            if len(arr) != num_rows:
                raise InvalidConditionError(
                    f"if_match[{f.name!r}] has {len(arr)} values for {num_rows} rows "
                    "(give one per row, or a scalar)"
                )
            return convert_values(arr, f).combine_chunks()
        return convert_values(pa.repeat(pa.scalar(value), num_rows), f).combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError) as e:
        raise InvalidConditionError(f"if_match[{f.name!r}] is not a value of type {f.type}: {e}") from e
    except SchemaMismatchError as e:  # the rules of whole-row input (docs/writing.md, "Types")
        raise InvalidConditionError(f"if_match[{f.name!r}] is not a value of type {f.type}: {e}") from e


def partial_schema(ts: TableSchema, names: Sequence[str]) -> pa.Schema:
    """The schema of partial rows with the columns `names`: every primary-key column and any subset of
    the others, in the table's column order. `MissingColumnsError` without a key column,
    `SchemaMismatchError` for an unknown or duplicate column."""
    missing = tuple(c for c in ts.primary_key if c not in names)
    if missing:
        raise MissingColumnsError(
            f"a partial write needs every primary-key column; the data lacks {list(missing)}", missing
        )
    target = pa.schema([f for f in ts.schema if f.name in names])
    check_columns(names, target)
    return target


def partial_rows(ts: TableSchema, data: pa.Table) -> pa.Table:
    """Rows of a partial write conformed to `partial_schema` (lossless types), keys not NULL, no NULL
    in a non-nullable carried column."""
    if data.num_columns == 0 and data.num_rows == 0:
        return ts.key_schema.empty_table()
    table = conform(data, partial_schema(ts, data.column_names))
    check_keys(table, ts.primary_key)
    check_not_null(table)
    return table


def chunks(
    ts: TableSchema, table: pa.Table, partial: bool, condition: Condition, max_rows: int
) -> Iterator[tuple[int, pa.Table, Condition]]:
    """(offset, conformed rows, their condition) per chunk of at most `max_rows` rows of a partial
    (`partial_rows`) or whole-row (`upsert_rows`) write, each chunk checked as it is reached."""
    for offset in range(0, table.num_rows, max_rows):
        chunk = table.slice(offset, max_rows)
        rows = partial_rows(ts, chunk) if partial else upsert_rows(ts, chunk)
        yield offset, rows, condition.slice(offset, rows.num_rows)


ChunkWrite = Callable[[pa.Table, Condition], list[tuple[np.ndarray, Applied]]]
"""A writer's step of a partial or conditional write: one conformed chunk and its condition applied,
answered per part as (positions in the chunk, ascending; which of those rows applied)."""


def put_merged(
    ts: TableSchema,
    data: Any,
    partial: bool,
    if_match: Mapping[str, Any] | None,
    max_rows: int,
    write: ChunkWrite,
) -> Applied | None:
    """`put(data, partial=..., if_match=...)` when partial or conditional (`write_merged` under
    `put_condition`): which rows applied if `if_match` is given, else None."""
    table = to_table(data)
    condition = put_condition(ts, if_match, table.num_rows)
    applied = write_merged(ts, table, partial, condition, max_rows, write)
    return applied if if_match is not None else None


def write_merged(
    ts: TableSchema, data: Any, partial: bool, condition: Condition, max_rows: int, write: ChunkWrite
) -> Applied:
    """A partial or conditional write of `data` (any accepted input): each chunk of `chunks`, checked
    as it is reached, applied by `write`; which rows applied, in input order. A chunk that raises
    stops the write: the chunks before it stay applied."""
    table = to_table(data)
    parts: list[tuple[np.ndarray, Applied]] = []
    for offset, rows, cond in chunks(ts, table, partial, condition, max_rows):
        parts += [(offset + positions, applied) for positions, applied in write(rows, cond)]
    return Applied.combine(ts, parts, table.num_rows)


def encoded_keys(rows: pa.Table, primary_key: Sequence[str]) -> pa.Array:
    """One comparable array of the rows' keys (Lance's `_pk_index` encoding)."""
    return pk_index_key([rows.column(c).combine_chunks() for c in primary_key])


def needed_columns(ts: TableSchema, rows: pa.Table, condition: Condition) -> list[str]:
    """The columns of the current rows a merge reads: the key, the columns `rows` do not carry (to
    fill them) and the compared ones."""
    carried = set(rows.column_names)
    wanted = {f.name for f in ts.schema if f.name not in carried} | set(condition.expected)
    return [f.name for f in ts.schema if f.name in ts.primary_key or f.name in wanted]


def merge(
    ts: TableSchema, rows: pa.Table, condition: Condition, current: Found, keys: pa.Array | None = None
) -> tuple[pa.Table, np.ndarray]:
    """(the full rows to write, in input order; which input rows apply) for `rows` (`partial_rows`, or
    full rows) given `current` (the live rows of their keys, one answer per row, at least the
    `needed_columns`; `keys`: the rows' `encoded_keys`, when the caller has them). Rows of a key given
    several times are applied in rounds, one occurrence per round, each round seeing the rows the
    earlier ones applied; a put without repeated keys is one round of vectorized takes."""
    pk = ts.primary_key
    keys = encoded_keys(rows, pk) if keys is None else keys
    applied = np.zeros(rows.num_rows, dtype=bool)
    written: list[pa.Table] = []
    positions: list[np.ndarray] = []
    rounds = _rounds(keys)
    state: tuple[pa.Table, pa.Array] | None = None  # from the second round: the live rows and their keys
    for r, idx in enumerate(rounds):
        at = pa.array(idx)
        chunk, asked = (rows, keys) if len(idx) == rows.num_rows else (rows.take(at), keys.take(at))
        if state is None:  # the first round: the current rows as found
            sub = current.at if len(idx) == len(current.at) else current.at[idx]
            now = current.rows.take(pa.array(sub, mask=sub < 0))
            exists = sub >= 0
        else:
            found = pc.index_in(asked, value_set=state[1])
            exists = found.is_valid().to_numpy(zero_copy_only=False)
            now = state[0].take(found)
        ok = _applies(condition, idx, now, exists)
        if ok.any():
            if not ok.all():
                keep = pa.array(ok)
                chunk, now = chunk.filter(keep), now.filter(keep)
            full = _fill(ts, chunk, now, exists[ok])
            applied[idx[ok]] = True
            written.append(full)
            positions.append(idx[ok])
        if r + 1 < len(rounds):  # the next round sees the rows applied so far
            if state is None:
                live = current.live()
                state = (live, encoded_keys(live, pk))
            if ok.any():
                live, live_keys = state
                replaced = pc.is_in(live_keys, value_set=encoded_keys(full, pk))
                live = pa.concat_tables([live.filter(pc.invert(replaced)), full.select(live.column_names)])
                state = (live, encoded_keys(live, pk))
    if not written:
        return ts.schema.empty_table(), applied
    out = pa.concat_tables(written)
    if len(written) > 1:
        out = out.take(pa.array(np.argsort(np.concatenate(positions), kind="stable")))
    return out, applied


def _rounds(keys: pa.Array) -> list[np.ndarray]:
    """Row positions grouped by occurrence: round r holds the (r+1)-th row of every key given more
    than r times, ascending. One round when no key repeats."""
    n = len(keys)
    if pc.count_distinct(keys).as_py() == n:
        return [np.arange(n)]
    codes = pc.dictionary_encode(keys).indices.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    sorted_codes = codes[order]
    starts = np.r_[True, sorted_codes[1:] != sorted_codes[:-1]]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - group_start
    return [np.flatnonzero(rank == r) for r in range(int(rank.max()) + 1)]


def _applies(condition: Condition, idx: np.ndarray, now: pa.Table, exists: np.ndarray) -> np.ndarray:
    """Which rows (positions `idx` of the write, current rows `now`) the condition lets through."""
    if condition.mode == "upsert":
        return np.ones(len(idx), dtype=bool)
    if condition.mode == "insert_if_absent":
        return ~exists
    ok = exists.copy()
    at = pa.array(idx)
    for name, expected in condition.expected.items():
        want, got = expected.take(at), now.column(name).combine_chunks()
        same = pc.fill_null(pc.equal(got, want), False)
        both_null = pc.and_(pc.is_null(got), pc.is_null(want))
        ok &= pc.or_(same, both_null).to_numpy(zero_copy_only=False)
    return ok


def _fill(ts: TableSchema, rows: pa.Table, now: pa.Table, exists: np.ndarray) -> pa.Table:
    """Full rows: the carried columns of `rows`, the others from `now` (NULL where no row exists)."""
    columns = []
    for f in ts.schema:
        if f.name in rows.column_names:
            columns.append(rows.column(f.name))
            continue
        if not f.nullable and not exists.all():
            bad = encoded_keys(rows, ts.primary_key).filter(pa.array(~exists))
            raise MissingValueError(
                f"column {f.name!r} is not nullable and the partial write does not carry it, so it "
                f"cannot create the {len(bad)} key(s) without a live row (first: {bad[0].as_py()!r}); "
                "nothing of the write was applied",
                (f.name,),
            )
        columns.append(now.column(f.name))
    return pa.Table.from_arrays(columns, schema=ts.schema)
