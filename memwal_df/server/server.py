"""The Flight SQL server: pyarrow's `FlightServerBase` with the Flight SQL commands dispatched to
the query engine (`queries`), the writes (`ingest`) and the metadata answers (`catalog`).

- GetFlightInfo / GetSchema: `CommandStatementQuery`, `CommandPreparedStatementQuery` and the
  metadata commands. A query is planned here (its snapshot is taken when its stream starts) and its
  ticket is a one-use handle; a metadata command's ticket is the command itself.
- DoGet: a ticket's result: a small one computed whole and sent as one table, a larger one
  streamed batch by batch.
- DoPut: `CommandStatementIngest`, `CommandStatementUpdate`, `CommandPreparedStatementUpdate`
  (writes, answered with `DoPutUpdateResult` once acknowledged) and `CommandPreparedStatementQuery`
  (parameter binding).
- DoAction: `CreatePreparedStatement`, `ClosePreparedStatement`; transactions, Substrait and
  cancellation are refused as UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from memwal_df.server import catalog
from memwal_df.server.auth import MIDDLEWARE_KEY, Auth, Caller, caller_of
from memwal_df.server.ingest import Writes, read_stream
from memwal_df.server.limits import Limits
from memwal_df.server.protocol import decode, decode_as, pack, sql
from memwal_df.server.queries import Engine, Prepared
from memwal_df.server.status import InvalidRequest, PermissionDenied, Unimplemented, guarded

__all__ = ["ACTIONS", "FlightSqlServer"]

ACTIONS = [
    ("CreatePreparedStatement", "Prepare a SQL statement (ActionCreatePreparedStatementRequest)"),
    ("ClosePreparedStatement", "Close a prepared statement (ActionClosePreparedStatementRequest)"),
]
_UNSUPPORTED_ACTIONS = {
    "BeginTransaction": "transactions are not supported: every write commits on its own",
    "EndTransaction": "transactions are not supported: every write commits on its own",
    "BeginSavepoint": "savepoints are not supported: every write commits on its own",
    "EndSavepoint": "savepoints are not supported: every write commits on its own",
    "CreatePreparedSubstraitPlan": "Substrait plans are not supported: send SQL",
    "CancelQuery": "query cancellation is not supported: stop reading the stream",
    "CancelFlightInfo": "query cancellation is not supported: stop reading the stream",
    "RenewFlightEndpoint": "endpoint renewal is not supported",
}


class FlightSqlServer(flight.FlightServerBase):
    def __init__(
        self,
        location: str,
        *,
        engine: Engine,
        writes: Writes,
        auth: Auth,
        limits: Limits,
        tls_certificates: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(location, tls_certificates=tls_certificates or [], middleware={MIDDLEWARE_KEY: auth})
        self.engine = engine
        self.writes = writes
        self.limits = limits

    # ------------------------------------------------------------------ GetFlightInfo / GetSchema

    def _command(self, descriptor: flight.FlightDescriptor) -> Any:
        if descriptor.descriptor_type != flight.DescriptorType.CMD:
            raise InvalidRequest("this server takes command descriptors (Flight SQL commands), not paths")
        return decode(descriptor.command)

    @guarded
    def get_flight_info(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor) -> Any:
        caller = caller_of(context)
        command = self._command(descriptor)
        if isinstance(command, sql.CommandStatementQuery):
            schema, ticket = self.engine.start(self._statement(command), caller)
        elif isinstance(command, sql.CommandPreparedStatementQuery):
            handle = command.prepared_statement_handle
            schema, ticket = self.engine.start(self._statement(command), caller, handle)
        elif isinstance(command, sql.CommandGetTables) or type(command) in catalog.SCHEMAS:
            schema, ticket = catalog.schema_of(command), pack(command)
        else:
            raise InvalidRequest(_not_a_query(command))
        endpoint = flight.FlightEndpoint(ticket, [])
        return flight.FlightInfo(schema, descriptor, [endpoint], -1, -1)

    @guarded
    def get_schema(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor) -> Any:
        caller = caller_of(context)
        command = self._command(descriptor)
        if isinstance(command, sql.CommandStatementQuery | sql.CommandPreparedStatementQuery):
            return flight.SchemaResult(self.engine.schema(self._statement(command), caller))
        if isinstance(command, sql.CommandGetTables) or type(command) in catalog.SCHEMAS:
            return flight.SchemaResult(catalog.schema_of(command))
        raise InvalidRequest(_not_a_query(command))

    def _statement(self, command: Any) -> Prepared:
        if isinstance(command, sql.CommandStatementQuery):
            if command.HasField("transaction_id"):
                raise Unimplemented(_UNSUPPORTED_ACTIONS["BeginTransaction"])
            return self.engine.prepare(command.query)
        handle = command.prepared_statement_handle
        return self.engine.prepared.get(handle)

    # ------------------------------------------------------------------ DoGet

    @guarded
    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> Any:
        caller_of(context)
        message = decode(ticket.ticket, "ticket")
        if isinstance(message, sql.TicketStatementQuery):
            result = self.engine.fetch(message.statement_handle)
            if isinstance(result, pa.Table):  # a small result, computed whole
                return flight.RecordBatchStream(result)
            schema, batches = result
            return flight.GeneratorStream(schema, batches)
        if isinstance(message, sql.CommandGetTables) or type(message) in catalog.SCHEMAS:
            table = catalog.answer(message, self.engine.ctx, self.engine.primary_keys, self.engine.sql_info)
            return flight.RecordBatchStream(table)
        raise InvalidRequest(f"the ticket holds a {type(message).DESCRIPTOR.name}, which is not a ticket")

    # ------------------------------------------------------------------ DoPut

    @guarded
    def do_put(
        self,
        context: flight.ServerCallContext,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        caller = caller_of(context)
        command = self._command(descriptor)
        if isinstance(command, sql.CommandPreparedStatementQuery):  # parameter binding
            params = read_stream(reader, self.limits.max_request_bytes, "the bound parameters")
            self.engine.bind(command.prepared_statement_handle, params)
            result = sql.DoPutPreparedStatementResult(
                prepared_statement_handle=command.prepared_statement_handle
            )
            writer.write(pa.py_buffer(result.SerializeToString()))
            return
        if isinstance(command, sql.CommandStatementIngest):
            count = self._ingest(command, reader, caller)
        elif isinstance(command, sql.CommandStatementUpdate):
            if command.HasField("transaction_id"):
                raise Unimplemented(_UNSUPPORTED_ACTIONS["BeginTransaction"])
            _drain(reader)
            count = self.engine.update(self.engine.prepare(command.query), None, caller)
        elif isinstance(command, sql.CommandPreparedStatementUpdate):
            prepared = self.engine.prepared.get(command.prepared_statement_handle)
            params = read_stream(reader, self.limits.max_request_bytes, "the bound parameters")
            count = self.engine.update(prepared, params if params.num_columns else None, caller)
        else:
            raise InvalidRequest(f"{type(command).DESCRIPTOR.name} is not a DoPut command")
        writer.write(pa.py_buffer(sql.DoPutUpdateResult(record_count=count).SerializeToString()))

    def _ingest(self, command: sql.CommandStatementIngest, reader: Any, caller: Caller) -> int:
        if not caller.can_write:
            raise PermissionDenied("this token is read-only: it cannot ingest")
        options = command.table_definition_options
        exists = sql.CommandStatementIngest.TableDefinitionOptions
        served = self.writes.served(command.table)
        if command.temporary:
            raise Unimplemented("temporary tables are not supported: ingest into a served table")
        if command.HasField("transaction_id"):
            raise Unimplemented(_UNSUPPORTED_ACTIONS["BeginTransaction"])
        if served is None:
            names = sorted(self.writes.tables)
            raise InvalidRequest(
                f"no served table {command.table[:200]!r}: this server writes to {names}; "
                "it does not create tables"
                if options.if_not_exist == exists.TABLE_NOT_EXIST_OPTION_CREATE
                else f"no served table {command.table[:200]!r}: this server writes to {names}"
            )
        if options.if_exists == exists.TABLE_EXISTS_OPTION_FAIL:
            raise InvalidRequest(f"table {served.name!r} exists (ingest mode 'create'): use mode 'append'")
        if options.if_exists == exists.TABLE_EXISTS_OPTION_REPLACE:
            raise Unimplemented(
                "ingest mode 'replace' is not supported: use 'append' (upserts by primary key)"
            )
        rows = read_stream(reader, self.limits.max_request_bytes, "the ingested data")
        mode = command.options.get("memwal.write_mode") or caller.write_mode
        return self.engine.write(lambda: self.writes.apply(served, rows, mode))

    # ------------------------------------------------------------------ DoAction

    @guarded
    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[Any]:
        caller_of(context)
        kind = action.type
        body = action.body.to_pybytes() if action.body is not None else b""
        if kind == "CreatePreparedStatement":
            request = decode_as(body, sql.ActionCreatePreparedStatementRequest, "action body")
            if request.HasField("transaction_id"):
                raise Unimplemented(_UNSUPPORTED_ACTIONS["BeginTransaction"])
            result = self.engine.create_prepared(request.query)
            return iter([flight.Result(pa.py_buffer(pack(result)))])
        if kind == "ClosePreparedStatement":
            closing = decode_as(body, sql.ActionClosePreparedStatementRequest, "action body")
            self.engine.close_prepared(closing.prepared_statement_handle)
            return iter([])
        if kind in _UNSUPPORTED_ACTIONS:
            raise Unimplemented(_UNSUPPORTED_ACTIONS[kind])
        raise Unimplemented(f"unknown action {kind[:100]!r}: this server offers {[a for a, _ in ACTIONS]}")

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return ACTIONS


def _not_a_query(command: Any) -> str:
    name = type(command).DESCRIPTOR.name
    if isinstance(
        command, sql.CommandStatementIngest | sql.CommandStatementUpdate | sql.CommandPreparedStatementUpdate
    ):
        return f"{name} is a write: send it with DoPut"
    if isinstance(command, sql.CommandStatementSubstraitPlan):
        return "Substrait plans are not supported: send SQL"
    return f"{name} is not a query command"


def _drain(reader: Any) -> None:
    """Read whatever a client sent on a DoPut that carries no data (a CommandStatementUpdate)."""
    try:
        while True:
            reader.read_chunk()
    except StopIteration:
        return
