"""Vectorized Spark-style Murmur3_x86_32, as Lance 14 uses it for MemWAL bucket sharding.

The block function is standard Murmur3_x86_32 (seed 0). Two things make it "Spark-style" and
differ from `mmh3`/the reference C code:

* tail bytes (``len % 4``) are each sign-extended to an i32 and mixed one at a time through the full
  ``k1``/``h1`` round, instead of being packed into one last ``k1``;
* values are hashed as fixed-width integers, not as their bytes.  Which width depends on the Arrow
  type, exactly as Lance's native ``evaluate_sharding_spec`` does it:

  ======================================================  =====================================
  Arrow type                                              hashed as
  ======================================================  =====================================
  bool                                                    i32 0 / 1
  int8, int16, int32, date32, time32                      i32 (sign-extended)
  uint8, uint16, uint32                                   i32 (zero-extended / same bits)
  int64, uint64, timestamp (any unit/tz), time64          i64 (low word, then high word)
  float32                                                 i32 bits; ±0 → 0, NaN → 0x7fc00000
  float64                                                 i64 bits; ±0 → 0, NaN → 0x7ff8…0
  utf8, large_utf8                                        UTF-8 bytes
  ======================================================  =====================================

  memwal_df also hashes binary, large_binary, string_view, binary_view (as bytes), date64 and
  duration (as i64) and dictionary arrays (by value).  Native Lance rejects those types.

Nulls hash to NULL here; the bucket transform maps them to bucket 0 like native does (native returns
the seed, 0, for a null row).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import RegionRoutingError

__all__ = ["is_hashable", "is_native_bucket_type", "murmur3_32_spark", "murmur3_multi"]

_U32 = np.uint32
_C1, _C2 = _U32(0xCC9E2D51), _U32(0x1B873593)
_F1, _F2 = _U32(0x85EBCA6B), _U32(0xC2B2AE35)
_F1_INV, _F2_INV = _U32(pow(0x85EBCA6B, -1, 1 << 32)), _U32(pow(0xC2B2AE35, -1, 1 << 32))
_H5, _HADD = _U32(5), _U32(0xE6546B64)
_F32_NAN, _F64_NAN = _U32(0x7FC00000), np.uint64(0x7FF8000000000000)

# Rows with more 4-byte blocks than this keep going column by column only while at least
# _ROWWISE_BELOW rows are still active; the last few long values are finished one by one.
_ROWWISE_BELOW = 256
_ROWWISE_MIN_BLOCKS = 64


# --- the Murmur3 rounds on uint32 numpy arrays (wrapping arithmetic) -----------------------------


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    """Rotate left in place (`x` must be a scratch array)."""
    t = x >> _U32(32 - r)
    x <<= _U32(r)
    x |= t
    return x


def _mix_k1(k: np.ndarray) -> np.ndarray:
    k = _rotl(k * _C1, 15)
    k *= _C2
    return k


def _mix_h1(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    h = _rotl(h ^ k, 13)
    h *= _H5
    h += _HADD
    return h


def _fmix(h: np.ndarray, length: np.ndarray | int) -> np.ndarray:
    h = np.bitwise_xor(h, np.asarray(length, dtype=_U32))
    h ^= h >> _U32(16)
    h *= _F1
    h ^= h >> _U32(13)
    h *= _F2
    h ^= h >> _U32(16)
    return h


def _fmix_inverse(h: np.ndarray) -> np.ndarray:
    """Undo `_fmix` without the length xor (every step is a bijection on u32)."""
    h = h ^ (h >> _U32(16))
    h = h * _F2_INV
    h = h ^ (h >> _U32(13)) ^ (h >> _U32(26))
    h = h * _F1_INV
    return h ^ (h >> _U32(16))


# --- the same rounds on Python integers: few values (point lookups route one key) -------------------

_SCALAR_ROWS = 8  # up to this many values, Python integers beat numpy's per-call overhead
_M32 = 0xFFFFFFFF


def _mix_k1_int(k: int) -> int:
    k = (k * 0xCC9E2D51) & _M32
    k = ((k << 15) | (k >> 17)) & _M32
    return (k * 0x1B873593) & _M32


def _mix_h1_int(h: int, k: int) -> int:
    h ^= k
    h = ((h << 13) | (h >> 19)) & _M32
    return (h * 5 + 0xE6546B64) & _M32


def _fmix_int(h: int, length: int) -> int:
    h ^= length
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _hash_words_int(words: np.ndarray, seed: np.ndarray, per_value: int) -> np.ndarray:
    """`per_value` u32 words per value (little end first), each value hashed on Python integers."""
    out = []
    for value, h in zip(words.reshape(-1, per_value).tolist(), seed.tolist(), strict=True):
        for k in value:
            h = _mix_h1_int(h, _mix_k1_int(k))
        out.append(_fmix_int(h, 4 * per_value))
    return np.array(out, dtype=_U32)


def _hash_int(v: np.ndarray, seed: np.ndarray) -> np.ndarray:
    if len(v) <= _SCALAR_ROWS:
        return _hash_words_int(v.astype(_U32, copy=False), seed, 1)
    return _fmix(_mix_h1(seed, _mix_k1(v)), 4)


def _hash_long(v: np.ndarray, seed: np.ndarray) -> np.ndarray:
    v = v.view(np.uint64)
    if len(v) <= _SCALAR_ROWS:
        return _hash_words_int(v.astype("<u8", copy=False).view("<u4"), seed, 2)
    low = (v & np.uint64(0xFFFFFFFF)).astype(_U32)
    high = (v >> np.uint64(32)).astype(_U32)
    return _fmix(_mix_h1(_mix_h1(seed, _mix_k1(low)), _mix_k1(high)), 8)


def _hash_bytes(offsets: np.ndarray, data: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """Hash variable-length values ``data[offsets[i]:offsets[i+1]]``.

    Block j of every row is mixed in one vectorized step over the rows that still have a block j
    (a padded block matrix, walked column by column, never materialised).  The active set only
    shrinks, so the total work is the number of blocks.  Tail bytes take at most three masked steps.
    """
    starts = offsets[:-1].astype(np.int64)
    lengths = offsets[1:].astype(np.int64) - starts
    nblocks = lengths >> 2
    h = seed.copy()
    idx = np.flatnonzero(nblocks)
    if idx.size:
        # words[p] is the little-endian u32 starting at byte p (an unaligned, overlapping view).
        words = np.ndarray((data.size - 3,), dtype="<u4", buffer=data, strides=(1,))
        pos, nb, hh = starts[idx], nblocks[idx], h[idx]
        j = 0
        while idx.size:
            if idx.size < _ROWWISE_BELOW and int(nb.max()) - j > _ROWWISE_MIN_BLOCKS:
                h[idx] = _finish_rowwise(data, pos, (nb - j) * 4, hh)
                break
            hh = _mix_h1(hh, _mix_k1(words[pos]))
            pos += 4
            j += 1
            done = nb <= j
            if done.any():
                h[idx[done]] = hh[done]
                keep = ~done
                idx, pos, nb, hh = idx[keep], pos[keep], nb[keep], hh[keep]
    tail_start = starts + (nblocks << 2)
    tails = lengths & 3
    for t in range(3):
        rows = np.flatnonzero(tails > t)
        if not rows.size:
            break
        if rows.size == h.size:  # every row has this tail byte: no gather/scatter of h
            h = _mix_h1(h, _mix_k1(data[tail_start + t].view(np.int8).astype(np.int32).view(_U32)))
            continue
        byte = data[tail_start[rows] + t].view(np.int8).astype(np.int32).view(_U32)
        h[rows] = _mix_h1(h[rows], _mix_k1(byte))
    return _fmix(h, lengths.astype(_U32))


def _finish_rowwise(data: np.ndarray, pos: np.ndarray, nbytes: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Mix the remaining full blocks of a few long values, using mmh3 for the block loop.

    mmh3 seeded with the running state runs the same block rounds and then ``fmix(h ^ len)``,
    which is invertible, so the block state can be recovered exactly.
    """
    import mmh3

    out = np.empty(len(pos), dtype=_U32)
    for i, (p, n, s) in enumerate(zip(pos.tolist(), nbytes.tolist(), h.tolist(), strict=True)):
        out[i] = mmh3.hash(data[p : p + n].tobytes(), s, signed=False)
    return _fmix_inverse(out) ^ nbytes.astype(_U32)


# --- Arrow type dispatch --------------------------------------------------------------------------


def _values(arr: pa.Array, dtype: str) -> np.ndarray:
    """The fixed-width value buffer of `arr` as numpy (zero copy; null slots hold garbage)."""
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.zeros(len(arr), dtype=dtype)
    return np.frombuffer(buf, dtype=dtype, count=arr.offset + len(arr))[arr.offset :]


def _kind(t: pa.DataType) -> str | None:
    """How values of `t` are hashed: "int", "long", "f32", "f64", "bytes", "bool" (None: unsupported)."""
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_int32(t):
        return "int"
    if pa.types.is_uint8(t) or pa.types.is_uint16(t) or pa.types.is_uint32(t):
        return "int"
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return "int"
    if pa.types.is_int64(t) or pa.types.is_uint64(t) or pa.types.is_timestamp(t) or pa.types.is_time64(t):
        return "long"
    if pa.types.is_date64(t) or pa.types.is_duration(t):
        return "long"
    if pa.types.is_float32(t):
        return "f32"
    if pa.types.is_float64(t):
        return "f64"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "bytes"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "bytes"
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_null(t):
        return "null"
    return None


def is_hashable(t: pa.DataType) -> bool:
    """Whether `murmur3_32_spark` accepts arrays of type `t`."""
    return _kind(t) is not None


def is_native_bucket_type(t: pa.DataType) -> bool:
    """Whether Lance 14's native bucket sharding accepts type `t` (a subset of `is_hashable`)."""
    if pa.types.is_dictionary(t) or pa.types.is_date64(t) or pa.types.is_duration(t):
        return False
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    return _kind(t) in ("bool", "int", "long", "f32", "f64")


def _hash_into(arr: pa.Array, seed: np.ndarray) -> np.ndarray:
    """Hash every slot of `arr` with per-row seeds (null slots give garbage; callers mask them)."""
    t = arr.type
    kind = _kind(t)
    if kind is None:
        raise RegionRoutingError(f"cannot hash values of type {t}")
    if kind == "null":
        return seed.copy()
    if pa.types.is_dictionary(t):
        return _hash_into(arr.dictionary_decode(), seed)
    if kind == "bool":
        v = pc.fill_null(arr, False).to_numpy(zero_copy_only=False).astype(_U32)
        return _hash_int(v, seed)
    if kind == "int":
        width = t.bit_width
        if pa.types.is_unsigned_integer(t):
            v = _values(arr, f"<u{width // 8}").astype(_U32)
        else:
            v = _values(arr, f"<i{width // 8}").astype(np.int32).view(_U32)
        return _hash_int(v, seed)
    if kind == "long":
        return _hash_long(_values(arr, "<u8"), seed)
    if kind == "f32":
        f = _values(arr, "<f4")
        bits = f.view(_U32).copy()
        bits[f == 0] = 0
        bits[np.isnan(f)] = _F32_NAN
        return _hash_int(bits, seed)
    if kind == "f64":
        f = _values(arr, "<f8")
        bits64 = f.view(np.uint64).copy()
        bits64[f == 0] = 0
        bits64[np.isnan(f)] = _F64_NAN
        return _hash_long(bits64, seed)
    # variable length
    if pa.types.is_string_view(t):
        arr = arr.cast(pa.large_string())
    elif pa.types.is_binary_view(t):
        arr = arr.cast(pa.large_binary())
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    offsets = _offsets(arr, "<i8" if large else "<i4")
    data_buf = arr.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    if data.size < 4:  # room for the overlapping u32 view
        data = np.concatenate([data, np.zeros(4, np.uint8)])
    return _hash_bytes(offsets, data, seed)


def _offsets(arr: pa.Array, dtype: str) -> np.ndarray:
    buf = arr.buffers()[1]
    if buf is None:
        return np.zeros(len(arr) + 1, dtype=np.int64)
    return np.frombuffer(buf, dtype=dtype, count=arr.offset + len(arr) + 1)[arr.offset :]


def _as_array(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        return arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return arr


def _valid(arr: pa.Array) -> np.ndarray | None:
    if arr.null_count == 0:
        return None
    if pa.types.is_null(arr.type):
        return np.zeros(len(arr), dtype=bool)
    return arr.is_valid().to_numpy(zero_copy_only=False)


def murmur3_32_spark(arr: pa.Array | pa.ChunkedArray) -> pa.Int32Array:
    """Spark-style Murmur3_x86_32 (seed 0) of every value; NULL where the input is NULL.

    Raises `RegionRoutingError` for types it cannot hash (see the module docs for the table).
    """
    arr = _as_array(arr)
    h = _hash_into(arr, np.zeros(len(arr), dtype=_U32))
    valid = _valid(arr)
    return pa.array(h.view(np.int32), type=pa.int32(), mask=None if valid is None else ~valid)


def murmur3_multi(arrays: Sequence[pa.Array | pa.ChunkedArray]) -> pa.Int32Array:
    """Murmur3 across several columns: each non-NULL value is hashed with the previous hash as seed.

    The chain starts at seed 0 and skips NULL values (Spark's ``hash(c0, c1, …)`` with seed 0),
    so ``murmur3_multi([c]) == murmur3_32_spark(c)``.  NULL only where every input is NULL.
    """
    if not arrays:
        raise RegionRoutingError("murmur3_multi needs at least one column")
    cols = [_as_array(a) for a in arrays]
    n = len(cols[0])
    if any(len(c) != n for c in cols):
        raise RegionRoutingError("murmur3_multi columns differ in length")
    h = np.zeros(n, dtype=_U32)
    any_valid = np.zeros(n, dtype=bool)
    for c in cols:
        nh = _hash_into(c, h)
        valid = _valid(c)
        if valid is None:
            h, any_valid[:] = nh, True
        else:
            h = np.where(valid, nh, h)
            any_valid |= valid
    return pa.array(h.view(np.int32), type=pa.int32(), mask=None if any_valid.all() else ~any_valid)
