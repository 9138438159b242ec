"""Flight SQL on the wire: the commands a client packs into a `google.protobuf.Any` (in a
`FlightDescriptor`'s command, a `Ticket` or an `Action` body), decoded by their type URL, and the
messages and Arrow IPC schemas the server answers with.

The messages are Apache Arrow's `format/FlightSql.proto` (`protos/FlightSql.proto`), compiled into
`memwal_df/server/proto/` by `make protos`.
"""

from __future__ import annotations

from typing import TypeVar

import pyarrow as pa
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message

from memwal_df.server.proto import FlightSql_pb2 as sql
from memwal_df.server.status import InvalidRequest, Unimplemented

__all__ = ["TYPE_PREFIX", "decode", "decode_as", "pack", "schema_bytes", "sql"]

TYPE_PREFIX = "type.googleapis.com/arrow.flight.protocol.sql."

# Every message a client may send, by its type URL; anything else is refused by name.
_KNOWN: dict[str, type[Message]] = {
    TYPE_PREFIX + cls.DESCRIPTOR.name: cls
    for cls in (
        sql.CommandStatementQuery,
        sql.CommandStatementUpdate,
        sql.CommandStatementIngest,
        sql.CommandPreparedStatementQuery,
        sql.CommandPreparedStatementUpdate,
        sql.TicketStatementQuery,
        sql.CommandGetSqlInfo,
        sql.CommandGetCatalogs,
        sql.CommandGetDbSchemas,
        sql.CommandGetTables,
        sql.CommandGetTableTypes,
        sql.CommandGetPrimaryKeys,
        sql.CommandGetExportedKeys,
        sql.CommandGetImportedKeys,
        sql.CommandGetCrossReference,
        sql.CommandGetXdbcTypeInfo,
        sql.CommandStatementSubstraitPlan,
        sql.ActionCreatePreparedStatementRequest,
        sql.ActionClosePreparedStatementRequest,
        sql.ActionCreatePreparedSubstraitPlanRequest,
        sql.ActionBeginTransactionRequest,
        sql.ActionEndTransactionRequest,
        sql.ActionBeginSavepointRequest,
        sql.ActionEndSavepointRequest,
        sql.ActionCancelQueryRequest,
    )
}

M = TypeVar("M", bound=Message)


def decode(data: bytes, what: str = "command") -> Message:
    """The Flight SQL message packed in `data` (a serialized `google.protobuf.Any`)."""
    envelope = any_pb2.Any()
    try:
        envelope.ParseFromString(data)
    except (DecodeError, RuntimeError) as e:
        raise InvalidRequest(f"the {what} is not a protobuf Any holding a Flight SQL message ({e})") from None
    if not envelope.type_url:
        raise InvalidRequest(f"the {what} is not a protobuf Any holding a Flight SQL message (no type URL)")
    cls = _KNOWN.get(envelope.type_url)
    if cls is None:
        if envelope.type_url.startswith(TYPE_PREFIX):
            name = envelope.type_url[len(TYPE_PREFIX) :]
            raise Unimplemented(f"Flight SQL message {name!r} is not supported by this server")
        raise InvalidRequest(f"the {what} has type URL {envelope.type_url[:200]!r}: not a Flight SQL message")
    message = cls()
    try:
        message.ParseFromString(envelope.value)
    except (DecodeError, RuntimeError) as e:
        raise InvalidRequest(f"the {what} holds a malformed {cls.DESCRIPTOR.name} ({e})") from None
    return message


def decode_as(data: bytes, cls: type[M], what: str) -> M:
    """The message of type `cls` packed in `data`; any other message is refused."""
    message = decode(data, what)
    if not isinstance(message, cls):
        raise InvalidRequest(
            f"the {what} holds a {type(message).DESCRIPTOR.name}, not a {cls.DESCRIPTOR.name}"
        )
    return message


def pack(message: Message) -> bytes:
    """`message` packed in a serialized `google.protobuf.Any` with its Flight SQL type URL."""
    envelope = any_pb2.Any()
    envelope.Pack(message, type_url_prefix="type.googleapis.com/")
    return envelope.SerializeToString()


def schema_bytes(schema: pa.Schema) -> bytes:
    """`schema` as an encapsulated Arrow IPC Schema message (Flight SQL's `dataset_schema` etc.)."""
    return bytes(schema.serialize().to_pybytes())
