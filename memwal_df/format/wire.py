"""Protobuf wire-format varints, for the hand-read and hand-written messages pylance does not expose."""

from __future__ import annotations


def encode_varint(n: int) -> bytes:
    """Protobuf base-128 varint of `n` (negative values as their 64-bit two's complement)."""
    n &= (1 << 64) - 1  # negative int32 values are sign-extended to 10 bytes, as protobuf does
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(data: bytes, i: int) -> tuple[int, int]:
    """(value, next offset) of the protobuf varint at `data[i]`."""
    value = shift = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i
