"""The checksum sidecar of a flushed generation: `_memwal_checksums.json` in the generation directory.

memwal_df writes it last, after every other file of the directory (data, deletion vectors,
manifests, transactions, `bloom_filter.bin`, `_pk_index/`, the maintained indexes in `_indices/`)
and before the directory is synced and a region manifest names it. Lance never opens it: a Lance
dataset is found through `_versions/`, and the other top-level names are ignored.

Format: one JSON object written canonically (sorted keys, no white space):
`{"algorithm":"crc32","files":{PATH:[SIZE,CRC],...},"format":1,"self_crc32":C}`, where PATH is
relative to the generation directory, CRC is zlib's CRC-32 of the file, and C is the CRC-32 of the
same canonical JSON without `self_crc32`, so damage to the sidecar itself is detected as well.

Guarantees: `verify_generation` returns `VERIFIED` only when the directory holds exactly the files
the sidecar lists, each with its size and checksum; it returns `UNCHECKED` for a directory without
a sidecar (written by Lance, or before memwal_df wrote one), `GONE` for a directory that no longer
exists (garbage-collected), and raises `CorruptGenerationError` naming the file otherwise.
`verify_generation_once` verifies a directory once per process (storage URI + path) and, like
every reader cache, relies on a generation directory never changing once a manifest names it.
`check_rows` is what can be checked of a generation without a sidecar once its rows are read.
"""

from __future__ import annotations

import json
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa

from memwal_df.errors import CorruptGenerationError, NotFoundError
from memwal_df.format import layout
from memwal_df.format.storage import Storage

FORMAT = 1
ALGORITHM = "crc32"  # zlib's CRC-32: ~3 GB/s here, against ~0.7 GB/s for blake2b (docs/performance.md)
Outcome = Literal["verified", "unchecked", "gone"]
VERIFIED: Outcome = "verified"
UNCHECKED: Outcome = "unchecked"
GONE: Outcome = "gone"
_CAPACITY = 1 << 16  # directories remembered as verified; a forgotten one is verified again


def checksum(data: bytes | memoryview) -> int:
    """The checksum the sidecar records for a file's bytes."""
    return zlib.crc32(data)


def _canonical(body: Mapping[str, object]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class GenerationChecksums:
    """Size and checksum of every file of a generation directory, by path relative to it."""

    files: Mapping[str, tuple[int, int]]

    def encode(self) -> bytes:
        body: dict[str, object] = {
            "algorithm": ALGORITHM,
            "files": {p: [size, crc] for p, (size, crc) in sorted(self.files.items())},
            "format": FORMAT,
        }
        return _canonical({**body, "self_crc32": checksum(_canonical(body))})

    @classmethod
    def decode(cls, data: bytes) -> GenerationChecksums:
        """The sidecar's content; ValueError saying why when it is damaged or of another format."""
        try:
            found = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"it is not JSON ({e})") from None
        if not isinstance(found, dict) or not isinstance(found.get("self_crc32"), int):
            raise ValueError("it has no self_crc32")
        claimed = found.pop("self_crc32")
        if checksum(_canonical(found)) != claimed:
            raise ValueError("its own checksum does not match")
        if found.get("format") != FORMAT or found.get("algorithm") != ALGORITHM:
            raise ValueError(f"unknown format {found.get('format')!r} / {found.get('algorithm')!r}")
        files = found.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v) for v in files.values()
        ):
            raise ValueError("its file list is malformed")
        sums = cls({str(p): (v[0], v[1]) for p, v in files.items()})
        if sums.encode() != bytes(data):  # every byte accounted for (e.g. no repeated JSON key)
            raise ValueError("it is not as written (not canonical)")
        return sums


def sidecar_path(rel: str) -> str:
    """The sidecar of the generation directory `rel` (relative to the table root)."""
    return f"{rel}/{layout.CHECKSUMS_FILE}"


def write_checksums(storage: Storage, rel: str) -> GenerationChecksums:
    """Read back every file under the generation directory `rel` and write the sidecar listing them."""
    sidecar = sidecar_path(rel)
    files = {}
    for path in storage.list(rel):
        if path != sidecar:
            data = storage.get(path)
            files[path[len(rel) + 1 :]] = (len(data), checksum(data))
    sums = GenerationChecksums(files)
    storage.put(sidecar, sums.encode())
    return sums


def verify_generation(storage: Storage, region_id: uuid.UUID, generation: int, rel: str) -> Outcome:
    """Check the generation directory `rel` against its sidecar (see the module docstring)."""
    name = f"generation {generation} of region {region_id}"

    def corrupt(what: str, path: str) -> CorruptGenerationError:
        return CorruptGenerationError(f"{name} is corrupt: {what}", path, region_id, generation)

    listed = storage.list(rel)
    if not listed:
        return GONE
    sidecar = sidecar_path(rel)
    if sidecar not in listed:
        return UNCHECKED
    try:
        sums = GenerationChecksums.decode(storage.get(sidecar))
    except NotFoundError:
        return GONE if not storage.list(rel) else UNCHECKED
    except ValueError as e:
        raise corrupt(f"its checksum file cannot be read: {e}", sidecar) from None
    present = {p[len(rel) + 1 :] for p in listed if p != sidecar}
    if extra := sorted(present - set(sums.files)):
        raise corrupt("a file its checksum file does not list", f"{rel}/{extra[0]}")
    for name_in_dir, (size, crc) in sorted(sums.files.items()):
        path = f"{rel}/{name_in_dir}"
        try:
            data = storage.get(path)
        except NotFoundError:
            if not storage.list(rel):
                return GONE  # garbage-collected while it was checked
            raise corrupt("a file its checksum file lists is missing", path) from None
        if len(data) != size:
            raise corrupt(f"{len(data)} bytes where {size} were written", path)
        if (found := checksum(data)) != crc:
            raise corrupt(f"checksum {found:08x} where {crc:08x} was written", path)
    return VERIFIED


class _Verified:
    """The outcome for generation directories (storage URI, path) found verified or unchecked, least
    recently used forgotten beyond `_CAPACITY`. Thread-safe; racing readers may verify a directory
    twice."""

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[str, str], Outcome] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Outcome | None:
        with self._lock:
            found = self._seen.get(key)
            if found is not None:
                self._seen.move_to_end(key)
            return found

    def add(self, key: tuple[str, str], outcome: Outcome) -> None:
        with self._lock:
            self._seen[key] = outcome
            while len(self._seen) > _CAPACITY:
                self._seen.popitem(last=False)


_VERIFIED = _Verified()


def verify_generation_once(storage: Storage, region_id: uuid.UUID, generation: int, rel: str) -> Outcome:
    """`verify_generation`, once per process for each directory it found intact (or without a
    sidecar); a directory found gone or corrupt is checked again on the next call."""
    key = (storage.uri, rel)
    if (known := _VERIFIED.get(key)) is not None:
        return known
    outcome = verify_generation(storage, region_id, generation, rel)
    if outcome != GONE:
        _VERIFIED.add(key, outcome)
    return outcome


def check_rows(
    rows: pa.Table,
    physical_rows: int,
    listed_rows: int,
    primary_key: Sequence[str],
    region_id: uuid.UUID,
    generation: int,
    rel: str,
) -> None:
    """What can be checked of a generation without a sidecar, from the rows it reads (`rows`, the
    visible ones) and the physical rows of its fragments: that count against `listed_rows` (its
    region manifest entry's `physical_rows`; 0: not recorded) and no primary key twice.
    `CorruptGenerationError` naming the directory if either fails."""
    name = f"generation {generation} of region {region_id}"
    if listed_rows and physical_rows != listed_rows:
        raise CorruptGenerationError(
            f"{name} is corrupt: {physical_rows} rows where its region manifest lists {listed_rows}",
            rel,
            region_id,
            generation,
        )
    keys = rows.select(list(primary_key))
    distinct = keys.group_by(list(primary_key)).aggregate([]).num_rows if rows.num_rows else 0
    if distinct != rows.num_rows:
        raise CorruptGenerationError(
            f"{name} is corrupt: {rows.num_rows - distinct} row(s) repeat a primary key of another row",
            rel,
            region_id,
            generation,
        )
