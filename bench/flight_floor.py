"""A Flight SQL server that does no work: every query is answered at once with the same one-row
table, every prepared statement is accepted without looking at its SQL. `bench/serve.py` runs it as
a child process and times the same client calls against it, so that its report shows the floor that
the protocol, gRPC and the client set on any server's latency on this machine.

    python bench/flight_floor.py    # prints its URL, serves until killed
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from memwal_df.server import catalog
from memwal_df.server.protocol import decode, pack, schema_bytes, sql

DIM = 32
ROW = pa.table(
    {
        "id": pa.array([1], pa.int64()),
        "name": pa.array(["n1"]),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(DIM, np.float32)), DIM),
    }
)


class FloorServer(flight.FlightServerBase):
    """Answers CreatePreparedStatement, parameter binding, GetFlightInfo and DoGet with constants,
    metadata calls with empty results."""

    def get_flight_info(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        command = decode(descriptor.command)
        if type(command) in catalog.SCHEMAS or isinstance(command, sql.CommandGetTables):
            # Metadata (a client asks for SqlInfo when it connects): empty, of the right schema.
            schema, ticket = catalog.schema_of(command), pack(command)
        else:
            schema, ticket = ROW.schema, pack(sql.TicketStatementQuery(statement_handle=b"t"))
        return flight.FlightInfo(schema, descriptor, [flight.FlightEndpoint(ticket, [])], -1, -1)

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        command = decode(ticket.ticket, "ticket")
        if isinstance(command, sql.TicketStatementQuery):
            return flight.RecordBatchStream(ROW)
        return flight.RecordBatchStream(catalog.schema_of(command).empty_table())

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        command = decode(descriptor.command)
        reader.read_all()
        if isinstance(command, sql.CommandPreparedStatementQuery):
            handle = command.prepared_statement_handle
            bound = sql.DoPutPreparedStatementResult(prepared_statement_handle=handle)
            writer.write(pa.py_buffer(bound.SerializeToString()))
        else:
            writer.write(pa.py_buffer(sql.DoPutUpdateResult(record_count=1).SerializeToString()))

    def do_action(self, context: Any, action: flight.Action) -> list[flight.Result]:
        if action.type == "CreatePreparedStatement":
            result = sql.ActionCreatePreparedStatementResult(
                prepared_statement_handle=b"p", dataset_schema=schema_bytes(ROW.schema)
            )
            return [flight.Result(pa.py_buffer(pack(result)))]
        return []


def main() -> int:
    server = FloorServer("grpc://127.0.0.1:0")
    print(f"grpc://127.0.0.1:{server.port}", flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
