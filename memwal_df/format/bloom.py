"""Primary-key bloom filter of a flushed generation (``bloom_filter.bin``), byte-compatible with Lance 14.

Lance's MemTable keeps one split-block bloom filter (SBBF, the Parquet layout) of the primary keys it
holds, tombstones included, and a flush writes it raw as ``bloom_filter.bin``: 1024 blocks of eight
little-endian ``u32`` words, 32768 bytes, no header. The filter is not keyed by xxHash as Parquet's
is: each row's hash is Rust's ``DefaultHasher::new()`` (SipHash-1-3, keys 0/0) over the Rust ``Hash``
byte stream of the key columns (see `hash_primary_keys`).

Everything here is vectorized with numpy: SipHash runs one block index at a time over all rows.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["BloomFilter", "hash_primary_keys", "siphash13"]

_U64 = np.uint64
_LE_U64 = np.dtype("<u8")
_LE_U32 = np.dtype("<u4")
_LE_I32 = np.dtype("<i4")
_LE_I64 = np.dtype("<i8")

# SipHash initialisation constants ("somepseudorandomlygeneratedbytes").
_SIP_C0 = 0x736F6D6570736575
_SIP_C1 = 0x646F72616E646F6D
_SIP_C2 = 0x6C7967656E657261
_SIP_C3 = 0x7465646279746573

# The Parquet SBBF salts, one per word of a block.
_SALT = np.array(
    [0x47B6137B, 0x44974D91, 0x8824AD5B, 0xA2B7289D, 0x705495C7, 0x2DF1424B, 0x9EFC4947, 0x5C6BFB31],
    dtype=np.uint32,
)
_SALT.flags.writeable = False
_SALT_INTS = _SALT.tolist()

# Rows hashed per pass: keeps the temporaries cache-sized (measured best of 4K..1M rows).
_CHUNK_ROWS = 1 << 14
# Up to this many rows (hashes), hashing and filter checks on Python integers beat the vectorized
# code, whose per-call numpy overhead dominates small inputs.
_SCALAR_ROWS = 8
_M64 = (1 << 64) - 1


# --------------------------------------------------------------------------------------------------
# SipHash-1-3 over many messages at once
# --------------------------------------------------------------------------------------------------


def _rotl(x: np.ndarray, bits: int, tmp: np.ndarray) -> None:
    """Rotate the uint64 array ``x`` left by ``bits`` in place (``tmp`` is same-shaped scratch)."""
    np.left_shift(x, _U64(bits), out=tmp)
    np.right_shift(x, _U64(64 - bits), out=x)
    np.bitwise_or(x, tmp, out=x)


def _sip_round(v0: np.ndarray, v1: np.ndarray, v2: np.ndarray, v3: np.ndarray, tmp: np.ndarray) -> None:
    """One SipRound over all lanes, in place (uint64 addition wraps)."""
    np.add(v0, v1, out=v0)
    _rotl(v1, 13, tmp)
    np.bitwise_xor(v1, v0, out=v1)
    _rotl(v0, 32, tmp)
    np.add(v2, v3, out=v2)
    _rotl(v3, 16, tmp)
    np.bitwise_xor(v3, v2, out=v3)
    np.add(v0, v3, out=v0)
    _rotl(v3, 21, tmp)
    np.bitwise_xor(v3, v0, out=v3)
    np.add(v2, v1, out=v2)
    _rotl(v1, 17, tmp)
    np.bitwise_xor(v1, v2, out=v1)
    _rotl(v2, 32, tmp)


def _sip_round_scalar(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    """One SipRound on Python integers (the same steps as `_sip_round`, each mod 2^64)."""
    v0 = (v0 + v1) & _M64
    v1 = ((v1 << 13 | v1 >> 51) & _M64) ^ v0
    v0 = (v0 << 32 | v0 >> 32) & _M64
    v2 = (v2 + v3) & _M64
    v3 = ((v3 << 16 | v3 >> 48) & _M64) ^ v2
    v0 = (v0 + v3) & _M64
    v3 = ((v3 << 21 | v3 >> 43) & _M64) ^ v0
    v2 = (v2 + v1) & _M64
    v1 = ((v1 << 17 | v1 >> 47) & _M64) ^ v2
    v2 = (v2 << 32 | v2 >> 32) & _M64
    return v0, v1, v2, v3


def _siphash_blocks(blocks: list[int], k0: int, k1: int) -> int:
    """SipHash-1-3 of one message given as its u64 blocks (the last one holding the tail bytes and the
    length byte), on Python integers."""
    v0, v1, v2, v3 = k0 ^ _SIP_C0, k1 ^ _SIP_C1, k0 ^ _SIP_C2, k1 ^ _SIP_C3
    for m in blocks:
        v0, v1, v2, v3 = _sip_round_scalar(v0, v1, v2, v3 ^ m)
        v0 ^= m
    v2 ^= 0xFF
    for _ in range(3):
        v0, v1, v2, v3 = _sip_round_scalar(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def _siphash_bytes(message: bytes) -> int:
    """SipHash-1-3 (keys 0/0) of one message, on Python integers."""
    n = len(message)
    padded = message + bytes(8 - n % 8)
    blocks = list(struct.unpack(f"<{len(padded) // 8}Q", padded))
    blocks[-1] |= (n & 0xFF) << 56
    return _siphash_blocks(blocks, 0, 0)


class _Messages:
    """Row messages laid out for hashing: row r owns ``nblocks[r]`` zero-padded 8-byte blocks.

    Row r starts at block ``start[r]`` of ``buf`` (viewed as little-endian u64); its last block is the
    SipHash final block, holding the ``length % 8`` tail bytes, to which `_siphash_rows` adds the length
    byte. Writers fill ``buf`` (uint8) at byte offsets ``8 * start[r] + k``.
    """

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths.astype(np.int64, copy=False)
        self.nblocks = self.lengths // 8 + 1
        self.start = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(self.nblocks[:-1], out=self.start[1:])
        self.buf = np.zeros(int(self.nblocks.sum()) * 8, dtype=np.uint8)


def _siphash_rows(msgs: _Messages, k0: int, k1: int) -> np.ndarray:
    """SipHash-1-3 (64-bit output) of every row of ``msgs`` under the key (k0, k1)."""
    n = len(msgs.lengths)
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    blocks = msgs.buf.view(_LE_U64)
    last = msgs.start + msgs.nblocks - 1
    blocks[last] |= (msgs.lengths & 0xFF).astype(np.uint64) << _U64(56)
    if n <= _SCALAR_ROWS:
        for r, (first, end) in enumerate(zip(msgs.start.tolist(), (last + 1).tolist(), strict=True)):
            out[r] = _siphash_blocks(blocks[first:end].tolist(), k0, k1)
        return out

    v0 = np.full(n, k0 ^ _SIP_C0, dtype=np.uint64)
    v1 = np.full(n, k1 ^ _SIP_C1, dtype=np.uint64)
    v2 = np.full(n, k0 ^ _SIP_C2, dtype=np.uint64)
    v3 = np.full(n, k1 ^ _SIP_C3, dtype=np.uint64)
    tmp = np.empty(n, dtype=np.uint64)
    nb_min = int(msgs.nblocks.min())
    nb_max = int(msgs.nblocks.max())

    with np.errstate(over="ignore"):
        if nb_min == nb_max:
            # Every message has the same block count: a (rows, blocks) matrix, one column per step.
            matrix = blocks.reshape(n, nb_max)
            for j in range(nb_max):
                m = matrix[:, j]
                np.bitwise_xor(v3, m, out=v3)
                _sip_round(v0, v1, v2, v3, tmp)
                np.bitwise_xor(v0, m, out=v0)
            order = None
        else:
            # Lanes sorted by block count (longest first): at step j the rows that still have a
            # block j are a prefix, so the state update works on contiguous views and the total work
            # is the total number of blocks, however skewed the lengths are.
            nb = msgs.nblocks
            order = np.argsort(-nb, kind="stable")
            nb_sorted_neg = -nb[order]
            start_sorted = msgs.start[order]
            for j in range(nb_max):
                cnt = int(np.searchsorted(nb_sorted_neg, -j, side="left"))
                m = blocks[start_sorted[:cnt] + j]
                a0, a1, a2, a3 = v0[:cnt], v1[:cnt], v2[:cnt], v3[:cnt]
                np.bitwise_xor(a3, m, out=a3)
                _sip_round(a0, a1, a2, a3, tmp[:cnt])
                np.bitwise_xor(a0, m, out=a0)
        np.bitwise_xor(v2, _U64(0xFF), out=v2)
        for _ in range(3):
            _sip_round(v0, v1, v2, v3, tmp)
        np.bitwise_xor(v0, v1, out=v0)
        np.bitwise_xor(v0, v2, out=v0)
        np.bitwise_xor(v0, v3, out=v0)
    if order is None:
        return v0
    out[order] = v0
    return out


def _scatter_bytes(
    buf: np.ndarray, dest: np.ndarray, data: np.ndarray, src: np.ndarray, lens: np.ndarray
) -> None:
    """Copy ``data[src[i]:src[i]+lens[i]]`` to ``buf[dest[i]:dest[i]+lens[i]]`` for every i, vectorized."""
    total = int(lens.sum())
    if total == 0:
        return
    lens = lens.astype(np.int64, copy=False)
    first = np.cumsum(lens) - lens  # exclusive prefix sum: where run i starts in the flat copy
    idx = np.arange(total, dtype=np.int64)
    where = np.repeat(dest - first, lens)
    where += idx
    if int(src[0]) + total <= len(data) and np.array_equal(src[1:], src[:-1] + lens[:-1]):
        buf[where] = data[int(src[0]) : int(src[0]) + total]  # the runs are back to back in data
    else:
        pick = np.repeat(src - first, lens)
        pick += idx
        buf[where] = data[pick]


def siphash13(data: np.ndarray | bytes, offsets: np.ndarray, *, k0: int = 0, k1: int = 0) -> np.ndarray:
    """SipHash-1-3 of each message ``data[offsets[i]:offsets[i+1]]``; uint64, one hash per message.

    With the default keys (0, 0) this is Rust's ``DefaultHasher::new()`` fed those bytes.
    """
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes | bytearray) else data
    raw = np.asarray(raw, dtype=np.uint8).ravel()
    offs = np.asarray(offsets, dtype=np.int64).ravel()
    if offs.size == 0:
        raise ValueError("offsets must hold at least one entry")
    lens = np.diff(offs)
    if (lens < 0).any() or offs[0] < 0 or offs[-1] > raw.size:
        raise ValueError("offsets must be non-decreasing and within data")
    if not (0 <= k0 < 1 << 64 and 0 <= k1 < 1 << 64):
        raise ValueError("SipHash keys must be unsigned 64-bit integers")
    msgs = _Messages(lens)
    _scatter_bytes(msgs.buf, msgs.start * 8, raw, offs[:-1], lens)
    return _siphash_rows(msgs, k0, k1)


# --------------------------------------------------------------------------------------------------
# The Rust `Hash` stream of a primary key
# --------------------------------------------------------------------------------------------------

_Writer = Callable[[np.ndarray, np.ndarray], None]


def _physical_validity(arr: pa.Array) -> np.ndarray | None:
    """Per-row validity from the array's own validity bitmap, as arrow-rs ``Array::is_null`` sees it.

    Returns None when every row counts as valid. Arrays without a bitmap (null type, unions, run-end
    encoded) count as valid, as in arrow-rs.
    """
    bitmap = arr.buffers()[0]
    if bitmap is None or arr.null_count == 0:
        return None
    n, off = len(arr), arr.offset
    raw = np.frombuffer(bitmap, dtype=np.uint8, count=(off + n + 7) // 8)
    bits = np.unpackbits(raw[off // 8 :], bitorder="little")
    return bits[off % 8 : off % 8 + n].astype(bool)


def _fixed_values(arr: pa.Array, dtype: np.dtype) -> np.ndarray:
    """The value buffer of a fixed-width array (offset applied), as little-endian ``dtype``."""
    n, off = len(arr), arr.offset
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=off + n)[off:]


def _var_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, start offsets, lengths) of a 32-bit-offset utf8/binary array."""
    n, off = len(arr), arr.offset
    offsets = np.frombuffer(arr.buffers()[1], dtype=_LE_I32, count=off + n + 1)[off:].astype(np.int64)
    data_buf = arr.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    return data, offsets[:-1], np.diff(offsets)


def _encode_column(arr: pa.Array) -> tuple[np.ndarray, _Writer]:
    """Bytes one column adds to each row's message: (segment length per row, writer).

    The writer puts the segment of row r at byte ``pos[r]`` of the buffer. Segment = ``u8 is_null``,
    then for valid rows the Rust ``Hash`` of the value: Int32/Int64 as LE bytes, Utf8 as its bytes plus
    0xff, Binary as a LE u64 length plus its bytes. Lance hashes no other type: they add only the flag.
    """
    n = len(arr)
    valid = _physical_validity(arr)
    t = arr.type

    def flags(buf: np.ndarray, pos: np.ndarray) -> None:
        if valid is not None:
            buf[pos[~valid]] = 1

    def sel(x: np.ndarray) -> np.ndarray:
        return x if valid is None else x[valid]

    if pa.types.is_int32(t) or pa.types.is_int64(t):
        width = 4 if pa.types.is_int32(t) else 8
        values = _fixed_values(arr, _LE_I32 if width == 4 else _LE_I64)
        seg = np.full(n, 1 + width, dtype=np.int64)
        if valid is not None:
            seg[~valid] = 1

        def write_fixed(buf: np.ndarray, pos: np.ndarray) -> None:
            flags(buf, pos)
            dest = (sel(pos) + 1)[:, None] + np.arange(width)
            buf[dest] = sel(values).view(np.uint8).reshape(-1, width)

        return seg, write_fixed

    if pa.types.is_string(t) or pa.types.is_binary(t):
        is_str = pa.types.is_string(t)
        data, starts, lens = _var_parts(arr)
        prefix = 0 if is_str else 8  # binary: u64 length prefix; utf8: 0xff terminator after
        seg = 1 + prefix + lens + (1 if is_str else 0)
        if valid is not None:
            seg[~valid] = 1

        def write_var(buf: np.ndarray, pos: np.ndarray) -> None:
            flags(buf, pos)
            vpos, vlens = sel(pos) + 1, sel(lens)
            if not is_str:
                dest = vpos[:, None] + np.arange(8)
                buf[dest] = vlens.astype(_LE_U64).view(np.uint8).reshape(-1, 8)
            _scatter_bytes(buf, vpos + prefix, data, sel(starts), vlens)
            if is_str:
                buf[vpos + vlens] = 0xFF

        return seg, write_var

    def write_flag_only(buf: np.ndarray, pos: np.ndarray) -> None:
        flags(buf, pos)

    return np.ones(n, dtype=np.int64), write_flag_only


def _as_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array, extension types unwrapped to their storage (arrow-rs sees the storage)."""
    if isinstance(column, pa.ChunkedArray):  # combine_chunks copies even a single chunk
        arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    else:
        arr = column
    while isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    return arr


def _value_bytes(t: pa.DataType) -> Callable[[Any], bytes] | None:
    """How a valid value of type `t` enters a row's Hash stream (None: it does not)."""
    if pa.types.is_int32(t):
        return lambda v: int(v).to_bytes(4, "little", signed=True)
    if pa.types.is_int64(t):
        return lambda v: int(v).to_bytes(8, "little", signed=True)
    if pa.types.is_string(t):
        return lambda v: v.encode("utf-8") + b"\xff"
    if pa.types.is_binary(t):
        return lambda v: len(v).to_bytes(8, "little") + v
    return None


def _row_streams(arrays: Sequence[pa.Array]) -> list[bytes]:
    """Each row's Rust `Hash` stream over `arrays` (the bytes `_encode_column` lays out), built on
    Python objects: for a few rows, where numpy's per-call overhead dominates."""
    streams = [bytearray() for _ in range(len(arrays[0]))]
    for arr in arrays:
        valid = _physical_validity(arr)
        encode = _value_bytes(arr.type)
        values = arr.to_pylist() if encode is not None else []
        for r, stream in enumerate(streams):
            if valid is not None and not valid[r]:
                stream.append(1)
                continue
            stream.append(0)
            if encode is not None:
                stream += encode(values[r])
    return [bytes(s) for s in streams]


def hash_primary_keys(columns: Sequence[pa.Array | pa.ChunkedArray]) -> np.ndarray:
    """Lance's primary-key row hash: uint64, one per row.

    Rust ``DefaultHasher::new()`` (SipHash-1-3, keys 0/0) over the concatenated Rust ``Hash`` streams of
    the key columns, in primary-key order. Per column: ``u8 is_null``; if not null, Int32 -> 4 LE bytes,
    Int64 -> 8 LE bytes, Utf8 -> bytes + 0xff, Binary -> u64 LE length + bytes. Any other type adds only
    the null flag, so all its keys share one hash. (Lance 14 accepts Int8/16/32/64, UInt8/16/32/64,
    Boolean, Utf8/LargeUtf8 and Binary/LargeBinary keys; of these only the four above hash by value.)
    """
    if len(columns) == 0:
        raise ValueError("a primary key needs at least one column")
    arrays = [_as_array(c) for c in columns]
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError("primary-key columns must all have the same length")
    if n <= _SCALAR_ROWS:
        return np.array([_siphash_bytes(m) for m in _row_streams(arrays)], dtype=np.uint64)
    out = np.empty(n, dtype=np.uint64)
    for lo in range(0, n, _CHUNK_ROWS):
        hi = min(n, lo + _CHUNK_ROWS)
        parts = [_encode_column(a.slice(lo, hi - lo)) for a in arrays]
        msgs = _Messages(sum((seg for seg, _ in parts), start=np.zeros(hi - lo, dtype=np.int64)))
        pos = msgs.start * 8
        for seg, write in parts:
            write(msgs.buf, pos)
            pos = pos + seg
        out[lo:hi] = _siphash_rows(msgs, 0, 0)
    return out


# --------------------------------------------------------------------------------------------------
# Split-block bloom filter
# --------------------------------------------------------------------------------------------------


class BloomFilter:
    """Lance's PK split-block bloom filter: 1024 blocks of 8 u32 words (32768 bytes), Parquet salts.

    A hash h selects block ``((h >> 32) * 1024) >> 32`` and, in word i of it, bit
    ``((h mod 2^32) * SALT[i] mod 2^32) >> 27``. Never gives a false negative.
    """

    NUM_BYTES: int = 32768
    NUM_BLOCKS: int = NUM_BYTES // 32
    SALT: np.ndarray = _SALT

    __slots__ = ("_words",)

    def __init__(self) -> None:
        """An empty filter (no bit set); same as `BloomFilter.empty`."""
        self._words = np.zeros((self.NUM_BLOCKS, 8), dtype=np.uint32)

    @classmethod
    def empty(cls) -> BloomFilter:
        """A filter with no key in it."""
        return cls()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray) -> BloomFilter:
        """Load a ``bloom_filter.bin`` image; ValueError unless it is exactly `NUM_BYTES` long."""
        view = memoryview(data).cast("B")
        if view.nbytes != cls.NUM_BYTES:
            raise ValueError(f"bloom filter must be {cls.NUM_BYTES} bytes, got {view.nbytes}")
        bf = cls()
        bf._words = np.frombuffer(view, dtype=_LE_U32).astype(np.uint32).reshape(cls.NUM_BLOCKS, 8)
        return bf

    def to_bytes(self) -> bytes:
        """The ``bloom_filter.bin`` image: blocks in order, each 8 little-endian u32 words."""
        return self._words.astype(_LE_U32, copy=False).tobytes()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BloomFilter):
            return NotImplemented
        return bool(np.array_equal(self._words, other._words))

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"BloomFilter(bits_set={int(np.count_nonzero(self._bits()))})"

    def _block_bits(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each hash: its block (int32, n) and the bit it sets in each of the block's 8 words
        (uint32, (n, 8))."""
        h = np.asarray(hashes, dtype=np.uint64).ravel()
        block = (((h >> _U64(32)) * _U64(self.NUM_BLOCKS)) >> _U64(32)).astype(np.int32)
        x = (h & _U64(0xFFFFFFFF)).astype(np.uint32)
        with np.errstate(over="ignore"):
            bit = (x[:, None] * self.SALT[None, :]) >> np.uint32(27)  # u32 product wraps mod 2^32
        return block, bit

    def _bit_index(self, hashes: np.ndarray) -> np.ndarray:
        """(n, 8) int32: for each hash, the 8 bits it sets, as bit numbers in the little-endian image."""
        block, bit = self._block_bits(hashes)
        # Word i of block b is u32 number 8*b + i, i.e. bits 32*(8*b + i) .. +31 of the image.
        first = block[:, None] * 256 + np.arange(0, 256, 32, dtype=np.int32)
        return first + bit.astype(np.int32)

    def _bits(self) -> np.ndarray:
        """The filter as one bool per bit of its little-endian image."""
        return np.unpackbits(self._words.astype(_LE_U32, copy=False).view(np.uint8), bitorder="little")

    def insert_hashes(self, hashes: np.ndarray) -> None:
        """Add precomputed 64-bit key hashes (e.g. from `hash_primary_keys`)."""
        idx = self._bit_index(hashes)
        if idx.size == 0:
            return
        bits = np.zeros(self.NUM_BYTES * 8, dtype=bool)
        bits[idx.ravel()] = True  # a scatter of constants: duplicate keys are harmless
        added = np.packbits(bits, bitorder="little").view(_LE_U32).reshape(self.NUM_BLOCKS, 8)
        np.bitwise_or(self._words, added, out=self._words)

    def contains_hashes(self, hashes: np.ndarray) -> np.ndarray:
        """Bool per hash: False means certainly never inserted. Reads only the hashes' blocks."""
        if len(hashes) <= _SCALAR_ROWS:  # a point lookup: Python integers beat numpy's call overhead
            return np.array([self._contains_one(h) for h in np.asarray(hashes).tolist()], dtype=bool)
        block, bit = self._block_bits(hashes)
        return ((self._words[block] >> bit) & np.uint32(1)).all(axis=1)

    def _contains_one(self, h: int) -> bool:
        """`contains_hashes` of one hash (the same block and bits as `_block_bits`)."""
        words = self._words[((h >> 32) * self.NUM_BLOCKS) >> 32].tolist()
        x = h & 0xFFFFFFFF
        return all(
            w >> (((x * salt) & 0xFFFFFFFF) >> 27) & 1 for w, salt in zip(words, _SALT_INTS, strict=True)
        )

    def insert_keys(self, columns: Sequence[pa.Array | pa.ChunkedArray]) -> None:
        """Add the primary keys given as columns (in primary-key order)."""
        self.insert_hashes(hash_primary_keys(columns))

    def might_contain(self, columns: Sequence[pa.Array | pa.ChunkedArray]) -> np.ndarray:
        """Bool per row: False means the key is certainly not in the filter."""
        return self.contains_hashes(hash_primary_keys(columns))
