"""Maintained indexes: the base indexes a writer keeps for its MemTables and writes into generations.

`resolve_maintained_indexes(details, base, storage)` resolves the MemWAL index's `maintained_indexes` (every
base index when `maintain_all_indexes`, as Lance's default) against the base's `describe_indices()`
at writer open. Each resolved `MaintainedIndex` carries what a level needs to index alike:

* vector (`IVF_PQ`, `IVF_FLAT`): the metric and the base index's IVF centroids (and PQ codebook), read
  from the index files (`_indices/{uuid}/index.idx` global buffer 1: the IVF message, field 4 the
  centroids tensor; `auxiliary.idx` global buffer 2: the codebook tensor, `(sub_vectors * 256, sub_dim)`
  row-major = `(sub_vectors, 256, sub_dim)`; checked in tests by rebuilding with them and comparing);
* inverted: the base index's tokenizer parameters (`describe_indices()` details);
* scalar (`BTree`, `Bitmap`): the index type.

Other index types (HNSW, SQ, RabitQ vector indexes, NGram, ZoneMap, ...) are not maintained: Lance 14
gives no way to reuse their trained parameters, and an index trained on a generation alone would
rank differently from the base's. A writer builds them on each flushed generation
(`memwal_df.write.generation_indexes`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import lance
import numpy as np

from memwal_df.format.base_manifest import read_index_section
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.format.wire import read_varint

__all__ = ["MaintainedIndex", "ScalarIndexType", "resolve_maintained_indexes"]

log = logging.getLogger(__name__)

Kind = Literal["vector", "inverted", "scalar"]
ScalarIndexType = Literal["INVERTED", "BTREE", "BITMAP"]  # the type of an "inverted" or "scalar" index
_VECTOR_TYPES = ("IVF_PQ", "IVF_FLAT")
_SCALAR_TYPES: dict[str, ScalarIndexType] = {"btree": "BTREE", "bitmap": "BITMAP"}
_FLOAT32 = 2  # lance.index.pb.Tensor.DataType
# Inverted-index settings that `create_scalar_index` takes back (the rest of the details are derived).
_INVERTED_PARAMS = (
    "base_tokenizer",
    "language",
    "with_position",
    "max_token_length",
    "lower_case",
    "stem",
    "remove_stop_words",
    "ascii_folding",
    "split_identifiers",
    "split_on_numerics",
    "preserve_original",
    "min_ngram_length",
    "max_ngram_length",
    "prefix_only",
)


@dataclass(frozen=True, eq=False)
class MaintainedIndex:
    """One base index that every level maintains (see the module docstring)."""

    name: str
    column: str
    kind: Kind
    index_type: Literal["IVF_PQ", "IVF_FLAT"] | ScalarIndexType  # Lance's create_index type
    metric: str | None = None
    centroids: np.ndarray | None = None  # (partitions, dim) float32
    codebook: np.ndarray | None = None  # (sub_vectors, 256, sub_dim) float32
    params: dict[str, Any] = field(default_factory=dict)  # inverted: tokenizer settings


def resolve_maintained_indexes(
    details: pb.MemWalIndexDetails, base: lance.LanceDataset, storage: Storage
) -> tuple[MaintainedIndex, ...]:
    """The maintained indexes of the table, resolved against the base version `base`."""
    wanted = None if details.maintain_all_indexes else set(details.maintained_indexes)
    described = [d for d in base.describe_indices() if wanted is None or d.name in wanted]
    if not described:
        return ()
    _, entries = read_index_section(storage, base.version)
    uuids = {e.name: str(uuid.UUID(bytes=e.uuid.uuid)) for e in entries}
    out = []
    for d in described:
        if len(d.field_names) != 1:
            continue
        resolved = _resolve(d, storage, uuids.get(d.name))
        if resolved is None:
            log.info("index %s (%s) is not maintained by memwal_df's writers", d.name, d.index_type)
        else:
            out.append(resolved)
    return tuple(out)


def _resolve(d: Any, storage: Storage, index_uuid: str | None) -> MaintainedIndex | None:
    column, details = d.field_names[0], dict(d.details or {})
    if "VectorIndexDetails" in d.type_url:
        if d.index_type not in _VECTOR_TYPES or index_uuid is None:
            return None
        root = f"_indices/{index_uuid}"
        if "index.idx" not in storage.list_dir(root):  # Lance 14 writes no files for a tiny table
            return None
        centroids = _ivf_centroids(_global_buffer(storage, f"{root}/index.idx", 1))
        codebook = None
        if d.index_type == "IVF_PQ":
            sub_vectors = int(details["compression"]["num_sub_vectors"])
            flat = _tensor(_global_buffer(storage, f"{root}/auxiliary.idx", 2))
            codebook = flat.reshape(sub_vectors, -1, centroids.shape[1] // sub_vectors)
        metric = str(details.get("metric_type") or "l2").lower()
        return MaintainedIndex(d.name, column, "vector", d.index_type, metric, centroids, codebook)
    kind = d.index_type.lower()
    if kind == "inverted":
        params = {k: details[k] for k in _INVERTED_PARAMS if details.get(k) is not None}
        return MaintainedIndex(d.name, column, "inverted", "INVERTED", params=params)
    if kind in _SCALAR_TYPES:
        return MaintainedIndex(d.name, column, "scalar", _SCALAR_TYPES[kind])
    return None


# ------------------------------------------------------------------------------------------------
# Index files: Lance's `Tensor` and `Ivf` protobuf messages, decoded by hand (their .proto is not
# part of memwal_df's generated modules).


def _global_buffer(storage: Storage, path: str, number: int) -> bytes:
    from lance.file import LanceFileReader

    reader = LanceFileReader(storage.child_uri(path), storage_options=storage.storage_options or None)
    return bytes(reader.read_global_buffer(number))


def _fields(data: bytes) -> dict[int, Any]:
    """The fields of a protobuf message (varints and length-delimited ones; the last of a repeated)."""
    out: dict[int, Any] = {}
    i = 0
    while i < len(data):
        key, i = read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            out[number], i = read_varint(data, i)
        elif wire == 2:
            length, i = read_varint(data, i)
            out[number] = data[i : i + length]
            i += length
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire} in a Lance index file")
    return out


def _tensor(data: bytes) -> np.ndarray:
    """A `Tensor {data_type = 1; repeated uint32 shape = 2 (packed); bytes data = 3}` of float32."""
    f = _fields(data)
    if f.get(1, 0) != _FLOAT32:
        raise ValueError(f"index tensor of data type {f.get(1)}, expected float32")
    shape, packed, i = [], f[2], 0
    while i < len(packed):
        n, i = read_varint(packed, i)
        shape.append(n)
    return np.frombuffer(f[3], dtype="<f4").reshape(shape).copy()


def _ivf_centroids(data: bytes) -> np.ndarray:
    """The centroids tensor (field 4) of Lance's `Ivf` message."""
    return _tensor(_fields(data)[4])
