"""Statements as the server runs them: planned with DataFusion on the server's `SessionContext`
(queries, with bound parameters) or handed to the writes (`INSERT` / `DELETE` on a served table),
within the server's limits: query slots, the query timeout, the result size.

A query is planned when the client asks for its FlightInfo and runs when it fetches the ticket;
its MemWAL snapshot (every write acknowledged before) is taken as its stream starts. A prepared
query without parameters is planned when it is prepared, and its first run uses that plan if no
write or statement changed anything since (the server counts them: `Engine.changes`); any later
run, and a run after a change, plans it again. A result that fits in a few batches is computed
when the ticket is fetched and sent as one table; a larger one is streamed batch by batch.

A point get on a served table (`SELECT ... FROM t WHERE pk = v`, `point_get`) is not planned by
DataFusion at all: its schema comes from the table's, and the table's point lookup reads its rows
when the ticket is fetched.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import datafusion
import pyarrow as pa

from memwal_df.server.auth import Caller
from memwal_df.server.catalog import PrimaryKeys
from memwal_df.server.handles import Handles
from memwal_df.server.ingest import ServedTable, Writes, insert_parameter_schema, parameter_sets
from memwal_df.server.limits import Deadline, Limits, Slots
from memwal_df.server.point_get import Lookup, PointGet, shape_of
from memwal_df.server.protocol import pack, schema_bytes, sql
from memwal_df.server.statements import Delete, Insert, Query, Statement, number_placeholders, parse, tokens
from memwal_df.server.status import InvalidRequest, PermissionDenied, TooLarge, guarded_stream

__all__ = ["Engine", "Prepared"]

# First words of statements that return rows and change nothing: planned when prepared.
_QUERY_WORDS = {"SELECT", "WITH", "VALUES", "EXPLAIN", "SHOW", "DESCRIBE", "DESC", "TABLE"}
_REFUSED_BY_OPTIONS = ("DDL not supported", "DML not supported", "Statement not supported")
COUNT_SCHEMA = pa.schema([pa.field("count", pa.uint64(), nullable=False)])
# A result of at most this many bytes and batches is computed when its ticket is fetched and sent as
# one table; a larger one streams batch by batch after them.
SMALL_RESULT_BYTES = 1 << 20
SMALL_RESULT_BATCHES = 16
# SQL texts up to this long are classified once and remembered (`classify`), at most this many.
_CLASSIFIED_CHARS = 4096
_CLASSIFIED_TEXTS = 1024
# Plans of prepared queries kept for their first run: at most this many, for at most this long.
_PLANS = 1024
_PLAN_TTL_S = 60.0


@dataclass(frozen=True)
class Prepared:
    """A statement: its SQL (placeholders numbered), what it is, how many parameters it takes, and
    the parameters bound to it (one row per parameter set)."""

    sql: str
    statement: Statement
    parameters: int
    params: pa.Table | None = None
    returns_rows: bool = False  # a query that changes nothing: planned when prepared
    point_get: PointGet | None = None  # its shape, when it is a point get


def classify(text: str) -> Prepared:
    """`text` as a statement without parameters bound: its placeholders numbered, what statement it
    is, how many parameters it takes, whether it is a query that returns rows and changes nothing,
    and its point-get shape. Short texts are remembered: a client that sends the same SQL again is
    not tokenized again."""
    if len(text) > _CLASSIFIED_CHARS:
        return _classify(text)
    return _classified(text)


def _classify(text: str) -> Prepared:
    numbered, count = number_placeholders(text)
    statement = parse(numbered)
    returns_rows, point_get = False, None
    if isinstance(statement, Query):
        toks = tokens(statement.sql)
        first = toks[0]
        returns_rows = first.upper in _QUERY_WORDS or first.text == "("
        point_get = shape_of(toks) if first.upper == "SELECT" else None  # tokenized once for both
    return Prepared(numbered, statement, count, returns_rows=returns_rows, point_get=point_get)


_classified = functools.lru_cache(maxsize=_CLASSIFIED_TEXTS)(_classify)


@dataclass(frozen=True)
class _Plan:
    frame: datafusion.DataFrame
    changes: int  # `Engine.changes` before it was planned


@dataclass(frozen=True)
class _Ticket:
    schema: pa.Schema
    deadline: Deadline
    frame: datafusion.DataFrame | None = None  # run when fetched
    rows: pa.Table | None = None  # already computed
    lookup: Lookup | None = None  # a point get, run when fetched


class Engine:
    def __init__(
        self,
        ctx: datafusion.SessionContext,
        writes: Writes,
        limits: Limits,
        primary_keys: PrimaryKeys,
        sql_info: dict[int, object],
        allow_ddl: bool,
    ) -> None:
        self.ctx = ctx
        self.writes = writes
        self.limits = limits
        self.primary_keys = primary_keys
        self.sql_info = sql_info
        self.allow_ddl = allow_ddl
        self.prepared: Handles[Prepared] = Handles(
            "prepared statement", limits.max_open_statements, limits.statement_ttl_s
        )
        self._tickets: Handles[_Ticket] = Handles(
            "query ticket", limits.max_open_statements, limits.statement_ttl_s
        )
        self._queries = Slots("query", limits.max_concurrent_queries, limits.queue_timeout_s)
        self._writes = Slots("write", limits.max_concurrent_writes, limits.queue_timeout_s)
        # Plans of prepared queries for their first run, by statement handle: a cache.
        self._plans: Handles[_Plan] = Handles(
            "prepared plan",
            min(_PLANS, limits.max_open_statements),
            min(_PLAN_TTL_S, limits.statement_ttl_s),
            evict=True,
        )
        self._changes_lock = threading.Lock()
        self._statements = 0  # writes and statements run here that may change what a plan holds

    @property
    def changes(self) -> int:
        """A count that has grown whenever what a query reads may have changed: the writes and
        statements the server ran, and the writes of the served tables' writers (also those an
        embedding program makes through `Server.tables[name].writer`)."""
        return self._statements + sum(s.writer.write_count for s in self.writes.tables.values())

    def _changed(self) -> None:
        """Count a write or statement that may have changed what a query reads (called once it is
        applied, before it is acknowledged): plans made before it are not used after it."""
        with self._changes_lock:
            self._statements += 1

    # ------------------------------------------------------------------ statements

    def prepare(self, text: str) -> Prepared:
        return classify(text)

    def _point_get(self, prepared: Prepared) -> tuple[PointGet, ServedTable] | None:
        """The point get `prepared` is, on the served table it names."""
        get = prepared.point_get
        served = self.writes.served(get.table) if get is not None else None
        return None if get is None or served is None else (get, served)

    def _lookup(self, prepared: Prepared) -> Lookup | None:
        """The lookup answering `prepared` with its bound parameters, when it is a point get."""
        found = self._point_get(prepared)
        return None if found is None else found[0].lookup(found[1], prepared.params)

    def create_prepared(self, text: str) -> sql.ActionCreatePreparedStatementResult:
        """`CreatePreparedStatement`: the statement registered, with its result schema when it is a
        query DataFusion can plan before its parameters are bound. The plan of a query without
        parameters is kept for its first run (`start`)."""
        prepared = self.prepare(text)
        result = sql.ActionCreatePreparedStatementResult()
        plan = None
        found = self._point_get(prepared)
        point_schema = None if found is None else found[0].result_schema(found[1])
        if point_schema is not None:
            result.dataset_schema = schema_bytes(point_schema)
            result.is_update = False
        elif prepared.returns_rows:
            changes = self.changes
            try:
                frame = self._sql(prepared.sql, None, allow=False)
                result.dataset_schema = schema_bytes(frame.schema())
            except PermissionDenied:
                raise
            except Exception:
                if prepared.parameters == 0:
                    raise  # bad SQL: say so now
            else:
                if prepared.parameters == 0:
                    plan = _Plan(frame, changes)
            result.is_update = False
        else:
            result.is_update = True
        if (parameters := self._parameter_schema(prepared)) is not None:
            result.parameter_schema = schema_bytes(parameters)
        handle = self.prepared.add(prepared)
        if plan is not None:
            self._plans.put(handle, plan)
        result.prepared_statement_handle = handle
        return result

    def _parameter_schema(self, prepared: Prepared) -> pa.Schema | None:
        """The types of a statement's placeholders where the server knows them: a point get's (the
        key's type) and those of `INSERT INTO served VALUES ($1, ..., $n)` (the columns' types)."""
        if (found := self._point_get(prepared)) is not None:
            return found[0].parameter_schema(found[1])
        s = prepared.statement
        if isinstance(s, Insert) and (served := self.writes.served(s.table)) is not None:
            return insert_parameter_schema(served, s)
        return None

    def close_prepared(self, handle: bytes) -> None:
        self._plans.discard(handle)
        self.prepared.pop(handle)

    def _planned(self, handle: bytes | None, prepared: Prepared) -> datafusion.DataFrame | None:
        """The plan made when the statement was prepared, for its first run without parameters, if
        nothing changed since it was made (None: plan it now)."""
        if handle is None:
            return None
        plan = self._plans.discard(handle)  # used once
        if plan is None or prepared.params is not None or plan.changes != self.changes:
            return None
        return plan.frame

    def bind(self, handle: bytes, params: pa.Table) -> None:
        prepared = self.prepared.get(handle)
        if params.num_rows > self.limits.max_parameter_sets:
            raise TooLarge(
                f"{params.num_rows} parameter sets are over the server's limit of "
                f"{self.limits.max_parameter_sets}"
            )
        if prepared.parameters and params.num_columns != prepared.parameters:
            raise InvalidRequest(
                f"the statement takes {prepared.parameters} parameters, {params.num_columns} were bound"
            )
        self.prepared.replace(handle, replace(prepared, params=params))

    def _served_write(self, prepared: Prepared) -> bool:
        s = prepared.statement
        return isinstance(s, Insert | Delete) and self.writes.served(s.table) is not None

    # ------------------------------------------------------------------ queries

    def schema(self, prepared: Prepared, caller: Caller) -> pa.Schema:
        if self._served_write(prepared):
            return COUNT_SCHEMA
        if (found := self._point_get(prepared)) is not None and (
            point_schema := found[0].result_schema(found[1])
        ) is not None:
            return point_schema
        with self._queries.held():
            return self._frame(prepared, caller).schema()

    def start(
        self, prepared: Prepared, caller: Caller, handle: bytes | None = None
    ) -> tuple[pa.Schema, bytes]:
        """Plan a statement sent as a query (`handle`: its prepared statement's, if it is one); its
        schema and the ticket that fetches its result. A write to a served table (`INSERT` /
        `DELETE` sent as a query) is applied here, and its result is its affected row count."""
        deadline = Deadline(self.limits.query_timeout_s)
        if self._served_write(prepared):
            count = self.update(prepared, prepared.params, caller)
            rows = pa.table({"count": pa.array([count], pa.uint64())}, schema=COUNT_SCHEMA)
            ticket = _Ticket(COUNT_SCHEMA, deadline, rows=rows)
        elif (lookup := self._lookup(prepared)) is not None:
            ticket = _Ticket(lookup.schema, deadline, lookup=lookup)
        else:
            sets = parameter_sets(prepared.params)
            with self._queries.held():
                if len(sets) == 1:
                    frame = self._planned(handle, prepared)
                    if frame is None:
                        try:
                            frame = self._frame(prepared, caller, sets[0])
                        finally:
                            if not prepared.returns_rows:  # DDL, SET, DML: run by planning them
                                self._changed()
                    ticket = _Ticket(frame.schema(), deadline, frame=frame)
                else:  # several parameter sets: one run each, results concatenated
                    parts = []
                    try:
                        for values in sets:
                            parts.append(self._frame(prepared, caller, values).to_arrow_table())
                            deadline.check()
                    finally:
                        if not prepared.returns_rows:
                            self._changed()
                    rows = pa.concat_tables(parts, promote_options="permissive")
                    ticket = _Ticket(rows.schema, deadline, rows=rows)
        ticket_handle = self._tickets.add(ticket)
        return ticket.schema, pack(sql.TicketStatementQuery(statement_handle=ticket_handle))

    def fetch(self, handle: bytes) -> pa.Table | tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """The result of a ticket (each ticket is fetched once), within the limits: the whole result
        when it fits in `SMALL_RESULT_BATCHES` batches of `SMALL_RESULT_BYTES` in all, else its
        schema and a stream of its batches (those already computed first)."""
        ticket = self._tickets.pop(handle)
        stream = self._stream(ticket)
        head: list[pa.RecordBatch] = []
        size = 0
        for batch in stream:
            head.append(batch)
            size += batch.nbytes
            if size > SMALL_RESULT_BYTES or len(head) >= SMALL_RESULT_BATCHES:
                return ticket.schema, guarded_stream(itertools.chain(head, stream))
        return pa.Table.from_batches(head, schema=ticket.schema)

    def _stream(self, ticket: _Ticket) -> Iterator[pa.RecordBatch]:
        limit, total = self.limits.max_result_bytes, 0
        with self._queries.held():
            for batch in self._batches(ticket):
                ticket.deadline.check()
                total += batch.nbytes
                if total > limit:
                    raise TooLarge(
                        f"the result is over the server's result size limit of {limit} bytes: "
                        "add a LIMIT, select fewer columns or narrow the WHERE"
                    )
                if not batch.schema.equals(ticket.schema):
                    batch = pa.RecordBatch.from_arrays(batch.columns, schema=ticket.schema)
                yield batch

    def _batches(self, ticket: _Ticket) -> Iterator[pa.RecordBatch]:
        if ticket.rows is not None:
            yield from ticket.rows.to_batches()
            return
        if ticket.lookup is not None:
            yield from ticket.lookup.run().to_batches()
            return
        assert ticket.frame is not None
        for batch in ticket.frame.execute_stream():
            yield batch.to_pyarrow()

    def _frame(
        self, prepared: Prepared, caller: Caller, values: dict[str, Any] | None = None
    ) -> datafusion.DataFrame:
        if isinstance(prepared.statement, Insert | Delete) and not caller.can_write:
            raise PermissionDenied("this token is read-only: it cannot write")
        return self._sql(
            prepared.sql, values or None, allow=self.allow_ddl and caller.can_write, caller=caller
        )

    def _sql(
        self, text: str, values: dict[str, Any] | None, *, allow: bool, caller: Caller | None = None
    ) -> datafusion.DataFrame:
        options = (
            datafusion.SQLOptions().with_allow_ddl(allow).with_allow_dml(allow).with_allow_statements(allow)
        )
        try:
            return self.ctx.sql(text, options, param_values=values)
        except Exception as e:  # noqa: BLE001 - DataFusion's errors are plain exceptions
            if any(refusal in str(e) for refusal in _REFUSED_BY_OPTIONS):
                raise PermissionDenied(self._refusal(caller, str(e).splitlines()[0])) from None
            raise

    def _refusal(self, caller: Caller | None, reason: str) -> str:
        if caller is not None and not caller.can_write:
            return f"this token is read-only: it cannot run DDL, DML or SET statements ({reason})"
        if caller is None:
            return f"a prepared query may not be DDL, DML or SET ({reason}): send it as a statement"
        return (
            f"this server runs no DDL, DML on DataFusion tables or SET statements ({reason}): "
            "start it with --allow-ddl"
        )

    # ------------------------------------------------------------------ writes

    def update(self, prepared: Prepared, params: pa.Table | None, caller: Caller) -> int:
        """Run a statement sent as an update: its affected row count (-1 when unknown)."""
        s = prepared.statement
        if isinstance(s, Insert | Delete) and (served := self.writes.served(s.table)) is not None:
            if not caller.can_write:
                raise PermissionDenied("this token is read-only: it cannot write")
            if isinstance(s, Insert):
                return self.write(lambda: self.writes.insert(served, s, params, caller.write_mode))
            return self.write(lambda: self.writes.delete(served, s, params))
        if isinstance(s, Insert | Delete) and not caller.can_write:
            raise PermissionDenied("this token is read-only: it cannot write")
        if isinstance(s, Delete):
            raise InvalidRequest(
                f"no served table {s.table[:200]!r}: this server deletes from {sorted(self.writes.tables)}"
            )
        with self._queries.held():
            total = -1
            try:
                for values in parameter_sets(params):
                    rows = self._sql(
                        prepared.sql, values or None, allow=self.allow_ddl and caller.can_write, caller=caller
                    ).to_arrow_table()
                    if rows.column_names == ["count"] and rows.num_rows == 1:  # DataFusion's DML answer
                        total = max(total, 0) + int(rows.column(0)[0].as_py())
            finally:
                if not prepared.returns_rows:
                    self._changed()
            return total

    def write(self, apply: Callable[[], int]) -> int:
        """Apply a write to a served table in a write slot; counted as a change once applied (also
        when it failed: part of it may be written)."""
        with self._writes.held():
            try:
                return apply()
            finally:
                self._changed()
