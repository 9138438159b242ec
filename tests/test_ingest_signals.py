"""`memwal ingest` interrupted by SIGINT or SIGTERM (a real process reading a pipe that stays open):
it stops reading, flushes and closes the writer, reports the rows it acknowledged and exits with 130
(SIGINT) or 143 (SIGTERM); every acknowledged row is then visible through SQL, without `recover`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import datafusion
import pyarrow as pa
import pytest
from support.children import SOURCE_ROOT, close_process

import memwal_df as mw

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float64())])
BASE = pa.table({"id": pa.array([-1, -2], pa.int64()), "v": [0.0, 0.0]}, schema=SCHEMA)


def sql_rows(uri: str) -> dict[int, float]:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    return {r["id"]: r["v"] for r in ctx.sql("SELECT id, v FROM t").to_arrow_table().to_pylist()}


def feed(stdin, stop: threading.Event, rows: int = 2_000_000) -> None:
    """JSON lines `{"id": i, "v": i + 0.5}` in order, until `stop` or the reader goes away."""
    try:
        for start in range(0, rows, 1000):
            if stop.is_set():
                return
            stdin.write(
                "".join(f'{{"id": {i}, "v": {i + 0.5}}}\n' for i in range(start, start + 1000)).encode()
            )
            stdin.flush()
    except (BrokenPipeError, ValueError, OSError):
        return


def wal_entries(uri: str) -> int:
    return len(list(Path(uri).glob("_mem_wal/*/wal/*.arrow")))


@pytest.mark.parametrize(
    "sig, code, spec",
    [(signal.SIGINT, 130, None), (signal.SIGINT, 130, "bucket"), (signal.SIGTERM, 143, "bucket")],
)
def test_a_signal_mid_ingest_flushes_and_every_acknowledged_row_is_visible(tmp_path, sig, code, spec):
    uri = str(tmp_path / "t")
    mw.create_table(uri, BASE, "id", region_spec=mw.bucket("id", 4) if spec else None)
    env = {**os.environ, "PYTHONPATH": SOURCE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memwal_df", "ingest", uri, "-", "--format", "json", "--batch-size", "1000"]
        + ["--json"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(proc.stdin, stop), daemon=True)
    feeder.start()
    assert proc.stderr is not None
    try:
        deadline = time.monotonic() + 120
        while wal_entries(uri) < 3:  # it has acknowledged writes, and goes on reading
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)  # (stdin stays open: the feeder still writes)
    finally:
        stop.set()
        close_process(proc)
    assert proc.returncode == code, err.decode()
    info = json.loads(out)
    assert info["interrupted"] == signal.Signals(sig).name
    acknowledged = info["rows"]
    assert acknowledged >= 1000 and acknowledged % 1000 == 0
    assert f"{signal.Signals(sig).name}: stopping" in err.decode()
    expected = {-1: 0.0, -2: 0.0, **{i: i + 0.5 for i in range(acknowledged)}}
    assert sql_rows(uri) == expected  # no recover, no maintain: the ingest flushed on its way out


def test_the_text_report_of_an_interrupted_ingest_says_the_rows_are_visible(tmp_path):
    uri = str(tmp_path / "t")
    mw.create_table(uri, BASE, "id")
    env = {**os.environ, "PYTHONPATH": SOURCE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memwal_df", "ingest", uri, "-", "--format", "json", "--batch-size", "500"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    stop = threading.Event()
    threading.Thread(target=feed, args=(proc.stdin, stop), daemon=True).start()
    assert proc.stderr is not None
    try:
        deadline = time.monotonic() + 120
        while wal_entries(uri) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        stop.set()
        close_process(proc)
    assert proc.returncode == 130, err.decode()
    text = out.decode()
    assert text.startswith("interrupted by SIGINT: upserted ") and "durable, visible" in text
    rows = int(text.split("upserted ")[1].split(" ")[0].replace(",", ""))
    assert len(sql_rows(uri)) == rows + 2
