"""The change feed (`Table.changes`, `memwal_df.read.changes`) and its consumers
(`memwal_df.format.consumers`): the feed applied in (`_region`, `_generation`, `_position`) order to
a copy of the initial rows ends equal to a dict model of every write, under random writes, flushes,
merges and GC; resuming from any offset yields the rest exactly once; offsets whose changes GC
removed raise `ChangesExpiredError`; a generation Lance's own writer made (duplicates hidden by a
deletion vector) reads as its visible rows; registered consumers pin generations through GC until their
expiry passes (locally and on the moto S3 server)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import uuid
from datetime import timedelta
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.jobs import Workload, cleanup, create, flushed_generations

from memwal_df.errors import (
    ChangesExpiredError,
    InvalidArgumentError,
    InvalidConfigError,
    MissingGenerationError,
)
from memwal_df.format import consumers, layout
from memwal_df.format.consumers import ChangeOffsets
from memwal_df.read.changes import net_changes
from memwal_df.table import Table, create_table

ZERO = timedelta(0)
BASE = 50
ORDER = [("_region", "ascending"), ("_generation", "ascending"), ("_position", "ascending")]
Change = tuple[str, int, int]


def apply(copy: dict[Any, dict[str, Any]], changes: pa.Table) -> list[Change]:
    """Apply `changes` to `copy` in feed order; their (region, generation, position) in that order."""
    done = []
    for row in changes.sort_by(ORDER).to_pylist():
        done.append((row.pop("_region"), row.pop("_generation"), row.pop("_position")))
        if row.pop("_change_type") == "delete":
            copy.pop(row["id"], None)
        else:
            copy[row["id"]] = row
    return done


def ids(changes: pa.Table) -> list[Change]:
    return [
        (r["_region"], r["_generation"], r["_position"])
        for r in changes.sort_by(ORDER).select(["_region", "_generation", "_position"]).to_pylist()
    ]


def written(tmp_path: Any, generations: int, seed: int = 3) -> tuple[Table, Workload]:
    table = create(str(tmp_path / "t"), None, regions=2, base=BASE)
    work = Workload(table, seed, base=BASE)
    with table.writer() as w:
        for _ in range(generations):
            work.write(w, puts=12, deletes=4)
            w.flush()
    return table, work


def collect_all(table: Table) -> int:
    """Merge everything, drop old base versions and GC; the number of generations removed."""
    table.merge()
    cleanup(table)
    return sum(map(len, table.gc(grace=ZERO).generations.values()))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.sampled_from(["write", "write", "flush", "merge", "gc", "read"]), min_size=3, max_size=12
    ),
    seed=st.integers(0, 10_000),
)
def test_the_feed_applied_in_order_equals_the_table(tmp_path_factory, ops, seed):
    table = create(str(tmp_path_factory.mktemp("feed") / "t"), None, regions=2, base=BASE)
    work = Workload(table, seed, base=BASE)
    copy = dict(work.model)  # the initial rows are no changes: a replica starts from them
    net = dict(work.model)  # the same, from `net_changes` of each read, its rows shuffled
    seen: list[Change] = []
    table.register_consumer("replica")
    shuffle = np.random.default_rng(seed).permutation

    def read() -> None:
        feed = table.changes(consumer="replica")
        changes = feed.read_all()
        seen.extend(apply(copy, changes))
        feed.commit()
        upserts, deletes = net_changes(changes.take(shuffle(changes.num_rows)), ["id"])
        for key in deletes.column("id").to_pylist():
            net.pop(key, None)
        net.update((r["id"], r) for r in upserts.to_pylist())

    with table.writer() as w:
        for op in ops:
            if op == "write":
                work.write(w, puts=10, deletes=3)
            elif op == "flush":
                w.flush()
            elif op == "merge":
                table.merge()
            elif op == "gc":
                cleanup(table)
                table.gc(grace=ZERO)
            else:
                read()
    read()  # closing the writer flushed the rest
    assert copy == net == work.model
    assert len(seen) == len(set(seen))  # no change applied twice


def test_resuming_from_any_offset_yields_the_rest_exactly_once(tmp_path):
    table, _ = written(tmp_path, generations=3)
    full = table.changes().read_all()
    by_region: dict[str, list[Change]] = {}
    for c in ids(full):
        by_region.setdefault(c[0], []).append(c)
    assert len(by_region) == 2 and all(len(cs) > 10 for cs in by_region.values())
    end = table.changes("latest").start
    for k in range(max(map(len, by_region.values())) + 1):
        cut = {
            r: {"generation": cs[k][1], "position": cs[k][2]} if k < len(cs) else end.to_dict()[r]
            for r, cs in by_region.items()
        }
        rest = table.changes(json.dumps(cut))
        assert ids(rest.read_all()) == sorted(c for cs in by_region.values() for c in cs[k:])
        assert rest.offsets == end
        head = table.changes("earliest", until=cut)
        assert ids(head.read_all()) == sorted(c for cs in by_region.values() for c in cs[:k])
        assert head.offsets == ChangeOffsets.parse(cut)


def test_offsets_after_every_batch_and_generation_limits_resume_exactly(tmp_path):
    table, _ = written(tmp_path, generations=3)
    full = ids(table.changes().read_all())
    feed = table.changes()
    done: list[Change] = []
    for batch in feed:  # the offsets after each batch resume with the batches after it
        done += ids(pa.Table.from_batches([batch]))
        assert done + ids(table.changes(feed.offsets).read_all()) == full
    got: list[Change] = []
    offsets: Any = "earliest"
    for _ in range(20):
        step = table.changes(offsets, max_generations=1)
        changes = ids(step.read_all())
        assert len({(r, g) for r, g, _ in changes}) <= 1
        got += changes
        if step.offsets == step.start:
            break
        offsets = step.offsets.to_dict()
    assert sorted(got) == full and len(got) == len(full)


def test_offsets_gc_removed_raise_and_other_reads_carry_on(tmp_path):
    table, work = written(tmp_path, generations=2)
    first = table.changes("earliest").start
    planned = table.changes(first)  # planned now, read after GC
    done = table.changes()
    for _ in done:
        after_last_batch = done.offsets  # each region's last batch ended its last generation
    assert collect_all(table) == 4
    with pytest.raises(ChangesExpiredError) as e:
        table.changes(first)
    assert e.value.first_retained == 3 and e.value.offset == (1, 0)
    with pytest.raises(ChangesExpiredError):
        table.changes({})  # a region it does not name is needed from its first change
    with pytest.raises(ChangesExpiredError):
        planned.read_all()
    assert table.changes(done.offsets).read_all().num_rows == 0  # read to the end: nothing lost
    assert after_last_batch == done.offsets
    with table.writer() as w:
        work.write(w, puts=12, deletes=4)
    after = table.changes(done.offsets).read_all()
    assert {g for _, g, _ in ids(after)} == {3}
    assert ids(table.changes("earliest").read_all()) == ids(after)
    assert table.changes("latest").read_all().num_rows == 0


def test_a_generation_lances_writer_made_reads_as_its_visible_rows(tmp_path):
    base = pa.table({"id": pa.array([100], pa.int64()), "v": ["base"]})
    table = create_table(str(tmp_path / "t"), base, "id")
    native = lance.dataset(table.uri).mem_wal_writer(str(uuid.uuid4()))
    native.put(pa.table({"id": pa.array([1, 2, 3], pa.int64()), "v": ["a1", "a2", "a3"]}))
    native.put(pa.table({"id": pa.array([2, 3, 30], pa.int64()), "v": ["b2", "b3", "b30"]}))
    native.delete(pa.table({"id": pa.array([3], pa.int64())}))
    native.close()  # one generation of 7 rows, older duplicates hidden by a deletion vector
    changes = table.changes().read_all()
    assert changes.select(["id", "v", "_change_type", "_generation", "_position"]).to_pylist() == [
        {"id": 1, "v": "a1", "_change_type": "upsert", "_generation": 1, "_position": 0},
        {"id": 2, "v": "b2", "_change_type": "upsert", "_generation": 1, "_position": 1},
        {"id": 30, "v": "b30", "_change_type": "upsert", "_generation": 1, "_position": 2},
        {"id": 3, "v": None, "_change_type": "delete", "_generation": 1, "_position": 3},
    ]
    rest = table.changes({changes["_region"][0].as_py(): {"generation": 1, "position": 2}}).read_all()
    assert rest["id"].to_pylist() == [30, 3]


def test_a_listed_generation_that_is_gone_is_damage_not_expiry(tmp_path):
    table, _ = written(tmp_path, generations=1)
    ((_, path),) = flushed_generations(table, table.region_ids()[0])
    shutil.rmtree(tmp_path / "t" / path)
    with pytest.raises(MissingGenerationError):
        table.changes().read_all()


def test_registered_consumers_pin_generations_until_they_expire(table_uri, table_storage_options):
    table = create(table_uri, table_storage_options, regions=2, base=BASE)
    table.register_consumer("slow")
    table.register_consumer("fast", expiry=timedelta(hours=1))
    work = Workload(table, 5, base=BASE)
    with table.writer() as w:
        for _ in range(3):
            work.write(w, puts=12, deletes=4)
            w.flush()
    assert collect_all(table) == 0  # neither consumer has read anything
    fast = table.changes(consumer="fast")
    fast.read_all()
    fast.commit()
    assert collect_all(table) == 0  # "slow" still pins every generation
    slow = table.changes(consumer="slow", max_generations=2)
    slow.read_all()
    slow.commit()
    needs = {r: slow.offsets.of(r)[0] for r in table.region_ids()}
    assert collect_all(table) == sum(g - 1 for g in needs.values()) == 2
    for r in table.region_ids():
        assert [g for g, _ in flushed_generations(table, r)] == list(range(needs[r], 4))
    record = consumers.read_consumer(table.storage, "slow")
    assert record is not None and record.pins(time.time())
    old = dataclasses.replace(record, committed_at=time.time() - consumers.DEFAULT_EXPIRY.total_seconds() - 1)
    consumers.write_consumer(table.storage, old)  # stopped committing longer ago than its expiry
    assert collect_all(table) == 4
    with pytest.raises(ChangesExpiredError):
        table.changes(consumer="slow")
    assert table.changes(consumer="fast").read_all().num_rows == 0  # read everything: not expired
    assert sorted(c.consumer_id for c in table.consumers()) == ["fast", "slow"]
    table.remove_consumer("slow")
    assert [c.consumer_id for c in table.consumers()] == ["fast"]


def test_bad_arguments_raise_typed_errors_and_change_nothing(tmp_path):
    table, _ = written(tmp_path, generations=1)
    region = str(table.region_ids()[0])
    bad_offsets: list[Any] = ["newest", "{", '{"x": {"generation": 1, "position": 0}}', {region: [1, 0]}]
    for since in bad_offsets:
        with pytest.raises(InvalidArgumentError):
            table.changes(since)
    with pytest.raises(InvalidArgumentError):
        table.changes({region: {"generation": 0, "position": 0}})
    with pytest.raises(InvalidArgumentError):
        table.changes(until="earliest")
    with pytest.raises(InvalidArgumentError):
        table.changes(columns=["nope"])
    with pytest.raises(InvalidArgumentError):
        table.changes(max_generations=0)
    with pytest.raises(InvalidArgumentError):
        table.changes().commit()  # no consumer
    with pytest.raises(InvalidArgumentError):
        table.register_consumer("../x")
    with pytest.raises(InvalidConfigError):
        table.register_consumer("x", expiry=ZERO)
    assert table.consumers() == []
    table.storage.put(layout.consumer_path("broken"), b'{"consumer_id": "broken", "expiry_s": 1e400}')
    assert table.consumers() == [] and table.gc(grace=ZERO).removed == 0  # GC reads past it
    with pytest.raises(InvalidConfigError):
        table.changes(consumer="broken")
    only_keys = table.changes(columns=[]).read_all()
    assert only_keys.column_names == ["id", "_change_type", "_region", "_generation", "_position"]
    assert only_keys.num_rows == table.changes().read_all().num_rows


def test_offsets_round_trip_as_json():
    offsets = ChangeOffsets({uuid.uuid4(): (3, 7), uuid.uuid4(): (1, 0)})
    assert ChangeOffsets.parse(offsets.to_json()) == offsets
    assert ChangeOffsets.parse(offsets.to_dict()) == offsets
    assert json.loads(offsets.to_json()) == offsets.to_dict()
