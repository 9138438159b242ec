"""The storage layout of a MemWAL table: every path memwal_df reads or writes, relative to the table root.

```
_mem_wal/{region_uuid}/manifest/{bitrev64(version)}.binpb   region manifest versions (from 1)
_mem_wal/{region_uuid}/manifest/version_hint.json            {"version":N}
_mem_wal/{region_uuid}/wal/{bitrev64(position)}.arrow         WAL entries (from 1)
_mem_wal/{region_uuid}/{hex8}_gen_{g}/                        flushed generation (a Lance table)
_mem_wal/{region_uuid}/{hex8}_gen_{g}/_memwal_checksums.json  its files' sizes and checksums
_mem_wal/{region_uuid}/quarantine/                            files a repair set aside
_mem_wal/_entry_lease/{epoch:020}.json                        MemWAL index-entry writer lease
_mem_wal/_write_leases/{job}/{region_uuid}/{epoch:020}.json   a Spark write job's region leases
_mem_wal/_writer_leases/{region_uuid}/{epoch:020}.json       the lease of a region's writer
_mem_wal/_streams/{query_uuid}/{batch:020}.json               a committed micro-batch of a Spark stream
_mem_wal/_consumers/{consumer_id}.json                        a change-feed consumer's offsets
```
Bit-reversed names spread sequential numbers across the key space (S3 partitions).
"""

from __future__ import annotations

import functools
import re
import uuid

from memwal_df.errors import InvalidArgumentError

MEM_WAL_DIR = "_mem_wal"
NOT_BASE = (MEM_WAL_DIR,)  # top-level entries of a table's directory that are not the base table's
ENTRY_LEASE_DIR = f"{MEM_WAL_DIR}/_entry_lease"  # not a region: region_ids() skips non-UUID names
WRITE_LEASE_DIR = f"{MEM_WAL_DIR}/_write_leases"  # (neither)
WRITER_LEASE_DIR = f"{MEM_WAL_DIR}/_writer_leases"  # (neither)
STREAMS_DIR = f"{MEM_WAL_DIR}/_streams"  # (neither)
CONSUMER_DIR = f"{MEM_WAL_DIR}/_consumers"  # (neither)
MANIFEST_DIR = "manifest"
WAL_DIR = "wal"
VERSION_HINT = "version_hint.json"
BLOOM_FILTER_FILE = "bloom_filter.bin"
CHECKSUMS_FILE = "_memwal_checksums.json"  # a generation's checksum sidecar (`format.checksums`)
PK_INDEX_DIR = "_pk_index"

# Matched with fullmatch: `$` would also accept a trailing newline. ASCII digits only (`\d` and int()
# accept any Unicode digit), and no leading zero, so that a name parses to exactly one generation and
# back to the same name.
_GEN_DIR_RE = re.compile(r"([0-9a-f]{8})_gen_(0|[1-9][0-9]*)")
_BITREV_RE = re.compile(r"([01]{64})\.(arrow|binpb)")
_HEX8_RE = re.compile(r"[0-9a-f]{8}")
_U64_MAX = (1 << 64) - 1


def bitrev64_name(n: int, ext: str) -> str:
    """File name of `n`: its 64-bit binary form reversed, then `.ext` (Lance: `{:064b}` of reverse_bits)."""
    if not 0 <= n < 1 << 64:
        raise ValueError(f"{n} does not fit in 64 bits")
    return format(n, "064b")[::-1] + "." + ext


def parse_bitrev64_name(name: str) -> int | None:
    """The number a bit-reversed file name stands for, or None if `name` is not one."""
    m = _BITREV_RE.fullmatch(name)
    return int(m.group(1)[::-1], 2) if m else None


def parse_region_id(value: object, argument: str = "region_id") -> uuid.UUID:
    """`value` (a UUID, or its text) as a region id; `InvalidArgumentError` naming `argument` if it
    is not one."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise InvalidArgumentError(
            f"{argument} must be a region id, a UUID (`table.region_ids()` and `memwal status` list "
            f"them), got {value!r}"
        ) from None


@functools.lru_cache(maxsize=1 << 14)
def region_dir(region_id: uuid.UUID | str) -> str:
    return f"{MEM_WAL_DIR}/{uuid.UUID(str(region_id))}"


def write_lease_dir(job: str, region_id: uuid.UUID | str | None = None) -> str:
    """The lease directory of `region_id` in write job `job` (without a region: the job's)."""
    job_dir = f"{WRITE_LEASE_DIR}/{job}"
    return job_dir if region_id is None else f"{job_dir}/{uuid.UUID(str(region_id))}"


def writer_lease_dir(region_id: uuid.UUID | str) -> str:
    """The lease directory of the writer of `region_id` (`memwal_df.write.writer_lease`)."""
    return f"{WRITER_LEASE_DIR}/{uuid.UUID(str(region_id))}"


def stream_dir(query: uuid.UUID | str) -> str:
    """The directory of streaming query `query`'s committed micro-batches."""
    return f"{STREAMS_DIR}/{uuid.UUID(str(query))}"


def consumer_path(consumer_id: str) -> str:
    """The record of change-feed consumer `consumer_id` (checked by `memwal_df.format.consumers`)."""
    return f"{CONSUMER_DIR}/{consumer_id}.json"


def expired_consumer_path(consumer_id: str) -> str:
    """The empty marker GC leaves in place of a stale consumer record it removed."""
    return f"{CONSUMER_DIR}/{consumer_id}.expired"


def manifest_path(region_id: uuid.UUID | str, version: int) -> str:
    return f"{region_dir(region_id)}/{MANIFEST_DIR}/{bitrev64_name(version, 'binpb')}"


def version_hint_path(region_id: uuid.UUID | str) -> str:
    return f"{region_dir(region_id)}/{MANIFEST_DIR}/{VERSION_HINT}"


def wal_path(region_id: uuid.UUID | str, position: int) -> str:
    return f"{region_dir(region_id)}/{WAL_DIR}/{bitrev64_name(position, 'arrow')}"


def generation_dir_name(prefix: str, generation: int) -> str:
    """`{8 lowercase hex}_gen_{g}`; a retried flush uses a new random prefix."""
    if not isinstance(prefix, str) or not _HEX8_RE.fullmatch(prefix):
        raise ValueError(f"generation prefix must be 8 lowercase hex digits, got {prefix!r}")
    if not 0 <= generation <= _U64_MAX:
        raise ValueError(f"generation {generation} is not a u64")
    return f"{prefix}_gen_{generation}"


def parse_generation_dir_name(name: str) -> tuple[str, int] | None:
    """(prefix, generation) of a generation directory name, or None."""
    m = _GEN_DIR_RE.fullmatch(name)
    if m is None or int(m.group(2)) > _U64_MAX:
        return None
    return m.group(1), int(m.group(2))


def generation_path(region_id: uuid.UUID | str, dir_name: str) -> str:
    return f"{region_dir(region_id)}/{dir_name}"


def parse_generation_path(path: str) -> tuple[uuid.UUID, int] | None:
    """(region id, generation) of a generation directory path `_mem_wal/{region}/{hex8}_gen_{g}`, or None."""
    parts = path.split("/")
    if len(parts) != 3 or parts[0] != MEM_WAL_DIR or (name := parse_generation_dir_name(parts[2])) is None:
        return None
    try:
        return uuid.UUID(parts[1]), name[1]
    except ValueError:
        return None
