"""The write-ahead log of a region: one Arrow IPC stream file per WAL entry, positions from 1.

An entry holds one or more record batches of stored rows (`rows.wal_schema`: the table's columns
plus `_tombstone: bool not null`), with schema metadata `{"generation": g, "writer_epoch": e}`
(decimal strings). A fence sentinel entry has an empty schema, no batches and metadata
`{"fence_sentinel": "true", "writer_epoch": e}`; replay skips it. Entries are published with
put-if-not-exists, so position N+1 never exists before N and a writer that finds its position taken
knows a newer writer fenced it.

Checksums: every entry memwal_df writes carries the key `memwal_df.crc32` in the custom metadata of
its last IPC message: the last record batch message of a data entry (message-level metadata, which
Arrow readers, Lance's included, do not attach to the batch), the schema message of a fence sentinel
(its schema metadata). The value is ten decimal digits, zlib's CRC-32 of the whole entry as written
with those ten digits set to `0`: the schema message (field names, types, field metadata,
`generation`, `writer_epoch`), every dictionary and record batch message (headers and bodies) and
the end-of-stream marker. A data entry's schema metadata stays exactly Lance's: Lance 14.0.2's
replay refuses a batch whose schema metadata has any key besides `generation` and `writer_epoch`
(seen on tables without nested columns). An entry without the key (written by Lance's native
writer or an older memwal_df) is unchecked: it is decoded as it stands.

Guarantees: `decode_entry` either returns the exact batches that were encoded or raises
`CorruptWalEntryError` naming the file; it never returns part of an entry. For a checked entry
"exact" covers every byte, with two exceptions: a change that keeps the CRC-32 (a chance of 2^-32
for random damage), and damage that removes both the key's listing and its bytes from the last
message's header (the entry then reads as unchecked). Damage to the key's name, its value, or
either one of its listing and its bytes raises. The key never reaches the caller: batches do not
carry message metadata, and a sentinel returns no schema.
"""

from __future__ import annotations

import re
import struct
import uuid
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc as ipc

from memwal_df.errors import CorruptWalEntryError, NotFoundError
from memwal_df.format import layout
from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.storage import Blob, Storage

GENERATION_KEY = b"generation"
EPOCH_KEY = b"writer_epoch"
SENTINEL_KEY = b"fence_sentinel"
CHECKSUM_KEY = b"memwal_df.crc32"
_KNOWN_KEYS = frozenset({GENERATION_KEY, EPOCH_KEY, SENTINEL_KEY, CHECKSUM_KEY})
_CHECKSUM_DIGITS = 10  # the largest CRC-32, 4294967295, has ten digits
_PLACEHOLDER = b"0" * _CHECKSUM_DIGITS
_CHECKSUM_RE = re.compile(rb"[0-9]{%d}" % _CHECKSUM_DIGITS)
_CONTINUATION = b"\xff\xff\xff\xff"
_EOS = _CONTINUATION + b"\x00\x00\x00\x00"
_DECIMAL_RE = re.compile(rb"[0-9]{1,20}")
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class WalEntry:
    """A decoded WAL entry. `batches` is empty for a fence sentinel."""

    position: int
    writer_epoch: int
    generation: int | None
    batches: tuple[pa.RecordBatch, ...]
    is_sentinel: bool

    @property
    def num_rows(self) -> int:
        return sum(b.num_rows for b in self.batches)


def _framed(text: bytes) -> bytes:
    """`text` as a string of a FlatBuffers message header: u32 length (little-endian), bytes, NUL."""
    return len(text).to_bytes(4, "little") + text + b"\x00"


def _header_span(data: bytes | memoryview, start: int) -> tuple[int, int]:
    """The FlatBuffers header of the IPC message at `start` (after its continuation marker and
    length prefix), as offsets into `data`."""
    if data[start : start + 4] == _CONTINUATION:
        start += 4
    (length,) = struct.unpack_from("<i", data, start)
    return start + 4, start + 4 + max(length, 0)


def _message_spans(data: bytes | memoryview) -> list[tuple[int, int]]:
    """The (start, end) offsets of every message of the IPC stream in `data`, up to its end-of-stream
    marker or the first message that cannot be read.

    The stream is complete only if exactly an end-of-stream marker follows its last message. Checking
    that `data` merely ends with the marker's bytes is not enough: a batch body can end with the same
    8 bytes (32 set `_tombstone` bits, then padding), and a stream cut right after such a batch would
    pass for a whole entry holding fewer batches."""
    source = pa.BufferReader(pa.py_buffer(data))
    messages = ipc.MessageReader.open_stream(source)
    spans = []
    start = 0
    while True:
        try:
            message = messages.read_next_message()
        except StopIteration:
            break
        if message is None:
            break
        spans.append((start, source.tell()))
        start = source.tell()
    return spans


def _stream(schema: pa.Schema, batches: Sequence[pa.RecordBatch], checksum: bytes) -> tuple[memoryview, int]:
    """An IPC stream of `batches` (none: a fence sentinel) whose last message carries `checksum` as
    the checksum key's value, as a writable view, and the offset of its last record batch message
    unless dictionary messages come first (then 0; a sentinel's only message starts there too)."""
    sink = pa.BufferOutputStream()
    if not batches:
        schema = schema.with_metadata({**(schema.metadata or {}), CHECKSUM_KEY: checksum})
    with ipc.new_stream(sink, schema) as w:
        for b in batches[:-1]:
            w.write_batch(b)
        before = sink.tell()  # the writer writes the schema message with the first batch
        if batches:
            w.write_batch(batches[-1], custom_metadata={CHECKSUM_KEY: checksum})
    data = memoryview(sink.getvalue()).cast("B")
    if batches and before == 0:
        before = _header_span(data, 0)[1]  # a schema message has no body
    return data, before


def _sealed(schema: pa.Schema, batches: Sequence[pa.RecordBatch]) -> memoryview:
    """The entry of `batches` (none: a fence sentinel) with its checksum.

    The placeholder's bytes, framed as a string, occur once in the last message's header: a batch
    message header holds no other string and no number that large, a sentinel's schema only its
    fixed keys."""
    data, start = _stream(schema, batches, _PLACEHOLDER)
    framed = _framed(_PLACEHOLDER)
    for attempt in range(2):
        if attempt:  # dictionary messages came first: find the last message
            start = _message_spans(data)[-1][0]
        begin, end = _header_span(data, start)
        header = bytes(data[begin:end])
        at = header.find(framed)
        if at != -1 and header.find(framed, at + 1) == -1:
            break
    else:
        raise AssertionError("cannot locate the checksum in the last message of a WAL entry")
    digits = begin + at + 4
    data[digits : digits + _CHECKSUM_DIGITS] = b"%010d" % zlib.crc32(data)
    return data


def encode_entry(batches: Sequence[pa.RecordBatch], writer_epoch: int, generation: int) -> memoryview:
    """Serialize data batches (already in WAL schema) as one WAL entry, an Arrow IPC stream (a
    zero-copy view of the encoded bytes) whose last batch message carries the entry's checksum."""
    if not batches:
        raise ValueError("a data WAL entry needs at least one batch")
    schema = batches[0].schema.with_metadata(
        {GENERATION_KEY: str(generation).encode(), EPOCH_KEY: str(writer_epoch).encode()}
    )
    return _sealed(schema, batches)


def encode_fence_sentinel(writer_epoch: int) -> bytes:
    """The fence sentinel a claiming writer writes at the first free position, with its checksum."""
    schema = pa.schema([]).with_metadata({SENTINEL_KEY: b"true", EPOCH_KEY: str(writer_epoch).encode()})
    return _sealed(schema, ()).tobytes()


def _u64(value: bytes, what: str) -> int:
    """A decimal u64 as Lance writes it (`"7"`); int() alone would also take `" 7"`, `"1_0"`, `"-1"`."""
    if not _DECIMAL_RE.fullmatch(value) or int(value) > _U64_MAX:
        raise ValueError(f"invalid {what} {value!r}")
    return int(value)


def _occurrences(schema: pa.Schema, text: bytes) -> int:
    """How many of the strings `schema` declares (field names, metadata keys and values, at every
    depth) are `text`."""

    def in_metadata(meta: dict[bytes, bytes] | None) -> int:
        return sum((k == text) + (v == text) for k, v in (meta or {}).items())

    def in_field(f: pa.Field) -> int:
        t = f.type
        children = [t.field(i) for i in range(t.num_fields)]
        return (f.name.encode() == text) + in_metadata(f.metadata) + sum(map(in_field, children))

    return in_metadata(schema.metadata) + sum(map(in_field, schema))


def _is_text(value: bytes) -> bool:
    """Whether a metadata key or value is text as writers write it: UTF-8 without control characters."""
    try:
        return value.decode().isprintable()
    except UnicodeDecodeError:
        return False


def _resembles_checksum_key(key: bytes, value: bytes) -> bool:
    """Whether an unknown metadata key is the checksum key with damaged bytes: a key holding a value
    of the checksum's form or containing the checksum key, or one of its length with at most half
    of its bytes changed."""
    if key in _KNOWN_KEYS:
        return False
    if _CHECKSUM_RE.fullmatch(value) or CHECKSUM_KEY in key:
        return True
    if len(key) != len(CHECKSUM_KEY):
        return False
    return sum(a != b for a, b in zip(key, CHECKSUM_KEY, strict=True)) <= len(key) // 2


def _checksum_error(
    data: bytes, last: tuple[int, int], carried: dict[bytes, bytes] | None, schema: pa.Schema | None
) -> str | None:
    """Why the entry `data` fails its checksum, or None when it passes or has none. `last` is the
    header of its last message, `carried` that message's custom metadata; `schema` is the entry's
    schema when the last message is its schema message (a sentinel), whose strings may include the
    key's bytes."""
    value = (carried or {}).get(CHECKSUM_KEY)
    if value is None:
        if schema is None and carried is not None:  # only memwal_df gives a batch message metadata
            return f"has batch metadata without a checksum {carried!r}"
        carried = carried or {}
        if not all(k and _is_text(k) and _is_text(v) for k, v in carried.items()):
            return f"has damaged metadata {carried!r}"
        if any(_resembles_checksum_key(k, v) for k, v in carried.items()):
            return "has a damaged checksum key"
        legitimate = 0 if schema is None else _occurrences(schema, CHECKSUM_KEY)
        if data.count(_framed(CHECKSUM_KEY), *last) > legitimate:
            return "has a checksum key its metadata no longer lists"
        return None
    if not _CHECKSUM_RE.fullmatch(value) or int(value) > 0xFFFFFFFF:
        return f"has an invalid checksum {value!r}"
    at = data.find(_framed(value), *last)
    if at == -1:
        return "has a checksum that is not in its last message"
    view, digits = memoryview(data), at + 4
    crc = zlib.crc32(view[:digits])
    crc = zlib.crc32(_PLACEHOLDER, crc)
    crc = zlib.crc32(view[digits + _CHECKSUM_DIGITS :], crc)
    if crc != int(value):
        return f"fails its checksum (stored {int(value)}, computed {crc})"
    return None


def decode_entry(data: Blob, position: int, path: str) -> WalEntry:
    """Decode one WAL entry, verifying its checksum when it has one before its rows are checked or
    returned; any malformation or checksum mismatch raises CorruptWalEntryError naming `path`."""
    data = data if isinstance(data, bytes) else bytes(data)

    def corrupt(why: str) -> CorruptWalEntryError:
        return CorruptWalEntryError(f"WAL entry {position} {why}", path)

    if not data.endswith(_EOS):
        raise corrupt("is truncated (no end-of-stream marker)")
    try:
        spans = _message_spans(data)
        if not spans or data[spans[-1][1] :] != _EOS:
            raise corrupt(
                "is truncated or has trailing bytes (no end-of-stream marker after the last message)"
            )
        reader = ipc.open_stream(pa.py_buffer(data))
        schema = reader.schema
        meta = dict(schema.metadata or {})
        batches: list[pa.RecordBatch] = []
        carried: dict[bytes, bytes] | None = meta
        while True:
            try:
                batch, custom = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                break
            batches.append(batch)
            carried = None if custom is None else dict(custom)
        last = _header_span(data, spans[-1][0])
        if (why := _checksum_error(data, last, carried, None if batches else schema)) is not None:
            raise corrupt(why)
        for b in batches:
            b.validate(full=True)
        names = schema.names
        tombstone_type = schema.field(TOMBSTONE).type if TOMBSTONE in names else None
    except CorruptWalEntryError:
        raise
    except Exception as e:  # whatever pyarrow raises on malformed bytes (ArrowInvalid, UTF-8 errors ...)
        raise corrupt(f"cannot be decoded ({type(e).__name__}: {e})") from e
    if not batches:
        meta.pop(CHECKSUM_KEY, None)
    if EPOCH_KEY not in meta:
        raise corrupt("has no writer_epoch")
    try:
        epoch = _u64(meta[EPOCH_KEY], "writer_epoch")
        generation = _u64(meta[GENERATION_KEY], "generation") if GENERATION_KEY in meta else None
    except ValueError as e:
        raise corrupt(f"has an {e}") from e
    if meta.get(SENTINEL_KEY) == b"true":
        if batches:
            raise corrupt("is a fence sentinel that carries data")
        return WalEntry(position, epoch, None, (), True)
    if tombstone_type is None:
        raise corrupt(f"has no {TOMBSTONE} column")
    if tombstone_type != pa.bool_():
        raise corrupt(f"has a {TOMBSTONE} column of type {tombstone_type}, not bool")
    if not batches:
        raise corrupt("holds no record batch (writers never write an empty data entry)")
    return WalEntry(position, epoch, generation, tuple(batches), False)


class Wal:
    """The WAL of one region on a storage backend."""

    def __init__(self, storage: Storage, region_id: uuid.UUID) -> None:
        self.storage = storage
        self.region_id = region_id

    def path(self, position: int) -> str:
        return layout.wal_path(self.region_id, position)

    def append(self, position: int, data: Blob) -> bool:
        """Publish an encoded entry at `position`; False when that position is already taken."""
        if position < 1:
            raise ValueError(f"WAL positions start at 1, got {position}")
        return self.storage.put_if_not_exists(self.path(position), data)

    def read(self, position: int) -> WalEntry | None:
        """The entry at `position`, or None if there is none."""
        path = self.path(position)
        try:
            data = self.storage.get(path)
        except NotFoundError:
            return None
        return decode_entry(data, position, path)

    def exists(self, position: int) -> bool:
        return self.storage.exists(self.path(position))

    def stored_positions(self) -> list[int]:
        """The positions of every entry file under the region's WAL directory, ascending (one
        listing; gaps included as they are)."""
        try:
            names = self.storage.list_dir(f"{layout.region_dir(self.region_id)}/{layout.WAL_DIR}")
        except NotFoundError:
            return []
        return sorted(p for n in names if n.endswith(".arrow") and (p := layout.parse_bitrev64_name(n)))

    def scan(self, start: int) -> Iterator[WalEntry]:
        """Entries from `start` upward, in order, until the first missing position."""
        position = start
        while (entry := self.read(position)) is not None:
            yield entry
            position += 1

    def has_data_after(self, position: int) -> bool:
        """Whether an entry with rows exists after `position` (sentinels and row-less entries, which a
        replay turns into nothing to flush, do not count)."""
        return any(e.num_rows for e in self.scan(position + 1))

    def last_position(self, start: int) -> int:
        """The highest existing position at or after `start` - 1, probing forward with HEAD requests."""
        position = start
        while self.exists(position):
            position += 1
        return position - 1
