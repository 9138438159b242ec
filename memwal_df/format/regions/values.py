"""Region value types and bytes: the ``result_type`` names of ``ShardingField`` and the value codec of
``ShardFieldEntry`` (the raw little-endian Arrow scalar), as Lance 14 writes them.
"""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa

from memwal_df.errors import InvalidRegionSpecError, RegionRoutingError

__all__ = [
    "decode_region_value",
    "encode_non_null_region_value",
    "encode_region_value",
    "result_arrow_type",
    "result_type_name",
    "result_type_name_or_none",
]

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


def result_type_name_or_none(t: pa.DataType) -> str | None:
    """The ``result_type`` string of an Arrow type, None when it cannot be a region value."""
    if t in _TYPE_NAMES:
        return _TYPE_NAMES[t]
    if pa.types.is_timestamp(t):
        return f"timestamp[{t.unit}]" if t.tz is None else f"timestamp[{t.unit}, tz={t.tz}]"
    if pa.types.is_time(t) or pa.types.is_duration(t) or pa.types.is_decimal(t):
        return str(t)
    return None


def result_type_name(t: pa.DataType) -> str:
    """The ``result_type`` string of an Arrow type (Lance 14's names: "int32", "utf8", "boolean"...)."""
    name = result_type_name_or_none(t)
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
    data: bytes = arr.buffers()[1].to_pybytes()
    return data[:width]


def encode_non_null_region_value(value: Any, type: pa.DataType | str) -> bytes:
    """`encode_region_value` of a value known not to be NULL; a NULL `pa.Scalar` raises TypeError."""
    encoded = encode_region_value(value, type)
    if encoded is None:
        raise TypeError(f"region value {value!r} is NULL")
    return encoded


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
