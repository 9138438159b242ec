"""The maintain loop recovers regions whose writer is gone (`memwal_df.jobs.region_recovery`): a writer
process SIGKILLed after acknowledging writes has them visible through SQL after a maintain round past
its lease's expiry, without `recover`; a live writer (a process writing through many rounds) is never
claimed; a writer that stopped renewing and comes back is fenced; a recovery that raced a writer's
commit gives up."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from support.children import close_process, op_rows, read_log, spawn, stderr_tail, wait_ready

import memwal_df as mw
from memwal_df import errors
from memwal_df.format.lease import now_ms
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.jobs import region_recovery
from memwal_df.write import writer_lease
from memwal_df.write.region_open import region_context
from memwal_df.write.region_writer import RegionWriter
from memwal_df.write.writer_lease import RecoveryClaim

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float64())])
BASE = pa.table({"id": pa.array(range(10), pa.int64()), "v": [-1.0] * 10}, schema=SCHEMA)


def sql_rows(uri: str) -> dict[int, float | None]:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    return {r["id"]: r["v"] for r in ctx.sql("SELECT id, v FROM t").to_arrow_table().to_pylist()}


def model_of(ops: list[dict[str, Any]]) -> dict[int, float | None]:
    model: dict[int, float | None] = {r["id"]: r["v"] for r in BASE.to_pylist()}
    for op in ops:
        for row in op_rows(op):
            if row["_tombstone"]:
                model.pop(row["id"], None)
            else:
                model[row["id"]] = row["v"]
    return model


def wait_for_acks(log: Path, proc: Any, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and len(read_log(log)[0]) >= n:
            return
        assert proc.poll() is None, stderr_tail(proc)
        time.sleep(0.05)
    raise AssertionError(f"the writer acknowledged fewer than {n} ops in {timeout}s")


def wait_for_expiry(table: mw.Table, region: Any) -> None:
    lease = writer_lease.current(table.storage, region)
    assert lease is not None
    time.sleep(max(0.0, (lease.expires_ms - now_ms()) / 1000) + 0.2)
    assert not active_lease(table, region)


def active_lease(table: mw.Table, region: Any) -> bool:
    lease = writer_lease.current(table.storage, region)
    return lease is not None and lease.active(now_ms())


def epoch(table: mw.Table, region: Any) -> int:
    m = RegionManifestStore(table.storage, region).latest()
    assert m is not None
    return m.writer_epoch


@pytest.mark.parametrize("seed", [1, 2])
def test_a_maintain_round_after_the_lease_expired_makes_a_killed_writers_rows_visible(tmp_path, seed):
    table = mw.create_table(str(tmp_path / "t"), BASE, "id")  # one region (no spec)
    log = tmp_path / "writer.log"
    proc = spawn(
        "write", table.uri, None, tmp_path, seed=seed, keys=30, log=str(log), settings={"lease_ttl_s": 6.0}
    )
    try:
        wait_ready(proc)
        wait_for_acks(log, proc, 10 + 5 * seed)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        close_process(proc)
    acked, in_flight = read_log(log)
    expected = model_of(acked)
    visible = [expected, model_of(acked + in_flight)]  # the op in flight landed or not
    (region,) = table.region_ids()
    assert sql_rows(table.uri) == model_of([])  # acknowledged, in the WAL, not visible yet

    early = region_recovery.recover_abandoned(mw.open_table(table.uri))  # the lease has not expired
    assert early.live == (region,) and early.recovered == ()
    assert sql_rows(table.uri) == model_of([])

    wait_for_expiry(table, region)
    (done,) = mw.open_table(table.uri).maintain(interval=0, max_rounds=1)
    assert not done.errors, done.errors
    assert done.results["recover"].recovered == (region,)
    assert done.results["merge"].generations  # merged in the same round
    assert sql_rows(table.uri) in visible
    (again,) = mw.open_table(table.uri).maintain(interval=0, max_rounds=1)
    assert again.results["recover"].recovered == () and sql_rows(table.uri) in visible


def test_maintain_rounds_never_claim_a_live_writers_region(tmp_path):
    table = mw.create_table(str(tmp_path / "t"), BASE, "id", region_spec=mw.bucket("id", 2))
    log = tmp_path / "writer.log"
    # The lease is renewed every 3 s: a TTL of a few seconds can lapse while fsyncs stall on a busy disk.
    proc = spawn(
        "write", table.uri, None, tmp_path, seed=5, keys=30, seconds=10, log=str(log),
        settings={"lease_ttl_s": 9.0},
    )  # fmt: skip
    rounds = []
    try:
        wait_ready(proc)
        wait_for_acks(log, proc, 1)
        reader = mw.open_table(table.uri)
        while proc.poll() is None:
            rounds += reader.maintain(interval=0, max_rounds=1)
        assert proc.wait() == 0, stderr_tail(proc)  # a fenced writer would have failed
    finally:
        close_process(proc)
    assert len(rounds) >= 2
    assert all(r.results["recover"].recovered == () for r in rounds), [r.results["recover"] for r in rounds]
    assert any(r.results["recover"].live for r in rounds)  # it saw unflushed WAL entries and left them
    table = mw.open_table(table.uri)
    for region in table.region_ids():
        assert epoch(table, region) == 1  # claimed once
    acked, in_flight = read_log(log)
    assert not in_flight
    assert sql_rows(table.uri) == model_of(acked)


def rows(ids: list[int], v: float) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "v": [v] * len(ids)}, schema=SCHEMA)


def hang(writer: RegionWriter) -> None:
    """The writer stops renewing its lease, as a process that hangs does."""
    writer._lease._stop.set()
    writer._lease._thread.join()


def test_a_writer_that_comes_back_after_its_lease_expired_is_fenced(tmp_path):
    table = mw.create_table(str(tmp_path / "t"), BASE, "id", region_spec=mw.unsharded())
    w = table.region_writer(values=(0,), lease_ttl_s=1.0)
    w.put(rows([1, 50], 5.0))
    hang(w)
    wait_for_expiry(table, w.region_id)
    assert region_recovery.recover_abandoned(mw.open_table(table.uri)).recovered == (w.region_id,)
    assert sql_rows(table.uri) == {**model_of([]), 1: 5.0, 50: 5.0}
    with pytest.raises(errors.WriterFencedError):
        w.put(rows([2], 6.0))
    w.close()  # a fenced writer closes without flushing
    assert sql_rows(table.uri) == {**model_of([]), 1: 5.0, 50: 5.0}


def test_a_recovery_gives_up_when_the_writer_committed_since_it_looked(tmp_path):
    table = mw.create_table(str(tmp_path / "t"), BASE, "id", region_spec=mw.unsharded())
    w = table.region_writer(values=(0,), lease_ttl_s=1.0)
    w.put(rows([1], 5.0))
    hang(w)
    wait_for_expiry(table, w.region_id)
    seen = RegionManifestStore(table.storage, w.region_id).latest()
    expired = writer_lease.current(table.storage, w.region_id)
    assert seen is not None and expired is not None
    lease = writer_lease.take_expired(table.storage, w.region_id, expired, w._lease.ttl)
    assert lease is not None
    w.flush()  # the writer commits before the recovery claims
    ctx = region_context(table, w.region_id, seen)
    with pytest.raises(errors.CommitConflictError):
        RegionWriter(ctx, w.region_id, w.config, recovery=RecoveryClaim(seen.version, lease))
    assert not active_lease(table, w.region_id)  # released on the way out
    w.put(rows([2], 6.0))  # the writer goes on
    w.close()
    assert sql_rows(table.uri) == {**model_of([]), 1: 5.0, 2: 6.0}
    assert epoch(table, w.region_id) == 1
