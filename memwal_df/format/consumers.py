"""Change-feed offsets, and the consumers that store them under `_mem_wal/_consumers/`.

A change of the feed sits at (generation, position) of its region: the flushed generation holding
it and its row index in that generation's scan order. `ChangeOffsets` hold, per region, the position
of the next change to read: every change before it, in (generation, position) order, was read. A
region the offsets do not name is read from its first change, (1, 0). As data the offsets are
`{"<region uuid>": {"generation": g, "position": p}}` (JSON-serializable, keys sorted).

A consumer record (`{consumer_id}.json`, written with one atomic put) holds a consumer's committed
offsets, when it committed them and its expiry. While `committed_at` is less than `expiry` ago, the
record *pins* its regions: garbage collection keeps every generation at or above the one its offsets
name (`pinned_floors`). A consumer that stops committing stops pinning once its expiry passes, so GC
is never blocked for ever. Its record stays (its next read tells it what it lost: `ChangesExpiredError`)
until `remove_consumer`, or until GC removes it (`remove_stale`) once it stopped pinning more than the
record retention ago (`DEFAULT_RECORD_RETENTION`, 30 days). GC leaves an empty `{id}.expired` marker
in its place (listed, never read), so the consumer's next read raises `ConsumerExpiredError` instead of
starting over from the earliest change with a silent gap; registering the id again (or
`remove_consumer`) clears the marker.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from memwal_df.errors import InvalidArgumentError, InvalidConfigError, NotFoundError
from memwal_df.format import layout
from memwal_df.format.storage import Storage

log = logging.getLogger(__name__)

Position = tuple[int, int]
"""(generation, position) of a change within its region."""

FIRST: Position = (1, 0)
"""Where a region's changes start: generation numbers start at 1."""

DEFAULT_EXPIRY = timedelta(days=7)
DEFAULT_RECORD_RETENTION = timedelta(days=30)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True)
class ChangeOffsets:
    """Per region, the position of the next change to read (see the module docstring)."""

    regions: Mapping[uuid.UUID, Position] = field(default_factory=dict)

    def of(self, region_id: uuid.UUID) -> Position:
        """The next change to read in `region_id` (its first change if the offsets do not name it)."""
        return self.regions.get(region_id, FIRST)

    def to_dict(self) -> dict[str, dict[str, int]]:
        """Region id (text) -> {"generation": g, "position": p}, the form `parse` takes back."""
        return {
            str(r): {"generation": g, "position": p}
            for r, (g, p) in sorted(self.regions.items(), key=lambda item: str(item[0]))
        }

    def to_json(self) -> str:
        """`to_dict()` as compact JSON text, which `parse` also takes."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def parse(cls, value: ChangeOffsets | Mapping[str, Any] | str) -> ChangeOffsets:
        """Offsets from their dict or JSON form (or as they are); `InvalidArgumentError` if malformed."""
        if isinstance(value, ChangeOffsets):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"change offsets are not JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise InvalidArgumentError(f"change offsets must be a JSON object, got {type(value).__name__}")
        return cls(
            {layout.parse_region_id(r, "a change offset's region"): _position(p) for r, p in value.items()}
        )


def _position(value: Any) -> Position:
    """(generation, position) from `{"generation": g, "position": p}`."""
    if isinstance(value, Mapping) and set(value) == {"generation", "position"}:
        g, p = value["generation"], value["position"]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (g, p)) and g >= 1 and p >= 0:
            return g, p
    raise InvalidArgumentError(
        f'a change offset must be {{"generation": g, "position": p}}, integers g >= 1 and p >= 0, '
        f"got {value!r}"
    )


@dataclass(frozen=True)
class Consumer:
    """A registered change-feed consumer: its committed offsets, when (unix seconds), its expiry."""

    consumer_id: str
    offsets: ChangeOffsets
    committed_at: float
    expiry: timedelta = DEFAULT_EXPIRY

    def pins(self, now: float) -> bool:
        """Whether GC keeps what the consumer has not read: it committed less than `expiry` ago."""
        return now - self.committed_at < self.expiry.total_seconds()

    def stale(self, now: float, retention: timedelta) -> bool:
        """Whether the consumer stopped pinning more than `retention` ago: it committed more than
        `expiry + retention` ago, so GC may remove its record (`remove_stale`)."""
        return now - self.committed_at > (self.expiry + retention).total_seconds()

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "consumer_id": self.consumer_id,
                "offsets": self.offsets.to_dict(),
                "committed_at": self.committed_at,
                "expiry_s": self.expiry.total_seconds(),
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Consumer:
        """A record as `to_bytes` wrote it; `InvalidConfigError` if it cannot be decoded."""
        try:
            raw = json.loads(data)
            return cls(
                check_consumer_id(raw["consumer_id"]),
                ChangeOffsets.parse(raw["offsets"]),
                float(raw["committed_at"]),
                timedelta(seconds=float(raw["expiry_s"])),
            )
        except (ValueError, KeyError, TypeError, OverflowError) as e:  # InvalidArgumentError: a ValueError
            raise InvalidConfigError(f"a change-feed consumer record cannot be decoded: {e}") from None


def check_consumer_id(consumer_id: Any) -> str:
    """`consumer_id` if it is a valid consumer id (letters, digits, `_.-`, up to 128, not starting
    with `_.-`), else `InvalidArgumentError`."""
    if not isinstance(consumer_id, str) or not _ID.fullmatch(consumer_id):
        raise InvalidArgumentError(
            f"a consumer id is 1 to 128 letters, digits, '_', '.' or '-' starting with a letter or "
            f"digit, got {consumer_id!r}"
        )
    return consumer_id


def check_expiry(expiry: timedelta) -> timedelta:
    if expiry <= timedelta(0):
        raise InvalidConfigError(f"a consumer's expiry must be positive, got {expiry}")
    return expiry


def read_consumer(storage: Storage, consumer_id: str) -> Consumer | None:
    """The record of `consumer_id`, None if it is not registered."""
    try:
        data = storage.get(layout.consumer_path(check_consumer_id(consumer_id)))
    except NotFoundError:
        return None
    return Consumer.from_bytes(data)


def write_consumer(storage: Storage, consumer: Consumer) -> None:
    """Store `consumer` (one atomic put: readers see the old or the new record)."""
    storage.put(layout.consumer_path(check_consumer_id(consumer.consumer_id)), consumer.to_bytes())


def commit_offsets(
    storage: Storage, consumer_id: str, offsets: ChangeOffsets, expiry: timedelta | None = None
) -> Consumer:
    """Record that `consumer_id` read everything before `offsets`, now; keeps its expiry unless
    `expiry` is given (a new consumer gets `DEFAULT_EXPIRY`)."""
    if expiry is None:
        known = read_consumer(storage, consumer_id)
        expiry = DEFAULT_EXPIRY if known is None else known.expiry
    consumer = Consumer(consumer_id, offsets, time.time(), check_expiry(expiry))
    write_consumer(storage, consumer)
    return consumer


def expired(storage: Storage, consumer_id: str) -> bool:
    """Whether GC removed `consumer_id`'s record as stale (and nobody registered the id since)."""
    return storage.exists(layout.expired_consumer_path(check_consumer_id(consumer_id)))


def clear_expired(storage: Storage, consumer_id: str) -> None:
    """Forget that `consumer_id` expired (it is registered again, or removed)."""
    storage.delete(layout.expired_consumer_path(check_consumer_id(consumer_id)))


def remove_consumer(storage: Storage, consumer_id: str) -> None:
    storage.delete(layout.consumer_path(check_consumer_id(consumer_id)))
    clear_expired(storage, consumer_id)


def remove_stale(storage: Storage, found: Iterable[Consumer], retention: timedelta, now: float) -> list[str]:
    """Delete the records among `found` (`list_consumers`) that are `Consumer.stale` at `now`, each
    read again first so that a consumer that committed meanwhile keeps its record; their ids."""
    if retention < timedelta(0):
        raise InvalidConfigError(f"the consumer record retention must not be negative, got {retention}")
    removed = []
    for consumer in found:
        if not consumer.stale(now, retention):
            continue
        try:
            again = read_consumer(storage, consumer.consumer_id)
        except InvalidConfigError:
            continue  # overwritten with a record this version cannot read: keep it
        if again is not None and again.stale(now, retention):
            storage.put(layout.expired_consumer_path(consumer.consumer_id), b"")
            storage.delete(layout.consumer_path(consumer.consumer_id))
            removed.append(consumer.consumer_id)
    return removed


def list_consumers(storage: Storage) -> list[Consumer]:
    """Every readable consumer record (an undecodable one is logged and left out)."""
    found = []
    for name in storage.list_dir(layout.CONSUMER_DIR):
        if not name.endswith(".json"):
            continue
        try:
            consumer = read_consumer(storage, name[: -len(".json")])
        except (InvalidConfigError, InvalidArgumentError) as e:
            log.warning("change-feed consumer record %s ignored: %s", name, e)
            continue
        if consumer is not None:
            found.append(consumer)
    return found


def pinned_floors(
    consumers: Iterable[Consumer], regions: Iterable[uuid.UUID], now: float
) -> dict[uuid.UUID, int]:
    """Region -> the highest generation GC may remove for the consumers that pin (`Consumer.pins`):
    one below the lowest generation their offsets still need (a region an offset does not name
    is needed from generation 1). Regions no pinning consumer limits are left out."""
    pinning = [c for c in consumers if c.pins(now)]
    if not pinning:
        return {}
    return {r: min(c.offsets.of(r)[0] for c in pinning) - 1 for r in regions}
