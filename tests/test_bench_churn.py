"""bench/churn.py: its model's checks catch stale and wrong answers (and accept right ones), its BM25
equals the reference scorer, and a tiny real run under churn ends with every answer right."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datafusion
import numpy as np
import pyarrow as pa
import pytest
from support.benches import load_report
from support.search_oracle import bm25, make_rows

import memwal_df as mw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _churn_model import Bm25Reference, Model, Window, check_top_k  # noqa: E402
from churn import COUNT, LOOKUP, ChurnWriter, Reader, build, parse_args  # noqa: E402


def base(n: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(np.arange(n), pa.int64()),
            "value": pa.array(np.arange(n) / 10),
            "text": [f"w{i % 3}" for i in range(n)],
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(n * 2, np.float32)), 2),
        }
    )


def put(model: Model, ids: list[int], values: list[float]) -> int:
    rows = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "value": pa.array(values, pa.float64()),
            "text": ["x"] * len(ids),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(len(ids) * 2, np.float32)), 2),
        }
    )
    seq = model.begin_put(rows)
    model.ack(seq)
    return seq


def delete(model: Model, ids: list[int]) -> int:
    seq = model.begin_delete(np.array(ids, np.int64))
    model.ack(seq)
    return seq


def test_rows_are_right_only_if_some_state_of_the_window_held_them():
    m = Model(base(10))  # values 0.0, 0.1, ..., 0.9
    s1 = put(m, [1, 12], [0.55, 0.66])
    s2 = delete(m, [1, 2])
    s3 = put(m, [1], [0.77])
    ids = np.array([1, 12, 3])
    assert m.bad_rows(ids, np.array([0.55, 0.66, 0.3]), Window(s1, s1)) == []
    assert m.bad_rows(np.array([1]), np.array([0.1]), Window(0, s3)) == []  # the base version, S_0
    stale = m.bad_rows(np.array([1]), np.array([0.1]), Window(s1, s3))
    assert len(stale) == 1 and "key 1 = 0.1" in stale[0]
    assert m.bad_rows(np.array([1]), np.array([0.77]), Window(s1, s2)) != []  # from a later write
    assert m.bad_rows(np.array([12, 12]), np.array([0.66, 0.66]), Window(s3, s3)) == ["key 12 returned twice"]
    assert [math.isnan(v) for v in m.values_in(2, Window(s1, s3))] == [False, True]  # 0.2, then deleted
    assert [math.isnan(v) for v in m.values_in(99, Window(0, s3))] == [True]  # never written
    assert m.count_range(Window(0, s3)) == (9, 11)  # 10 base; +1 new (12); -2 deleted; +1 back
    in_flight = m.begin_delete(np.array([3]))  # started, not acknowledged: may be seen or not
    assert m.window_start() == s3 and m.window_end() == in_flight
    assert m.bad_rows(np.array([3]), np.array([0.3]), Window(s3, in_flight)) == []
    assert [math.isnan(v) for v in m.values_in(3, Window(s3, in_flight))] == [False, True]


def test_a_filter_must_hold_every_key_that_matched_throughout_the_window():
    m = Model(base(10))
    s1 = put(m, [5], [0.01])  # 0.5 -> 0.01: matches from s1 on
    s2 = put(m, [0], [0.9])  # 0.0 -> 0.9: stops matching at s2
    below = lambda v: v < 0.25  # noqa: E731
    every = np.array([0, 1, 2, 5])
    assert m.missing_matches(every, below, Window(s1, s2)) == []
    assert m.missing_matches(np.array([1, 2]), below, Window(s1, s2)) == [
        "1 rows that matched throughout are missing, e.g. keys [5]"
    ]  # 0 may go (it stopped matching), 5 may not
    assert m.missing_matches(np.array([0, 1, 2]), below, Window(0, s1)) == []  # 5 did not match in S_0


def test_bm25_reference_equals_the_reference_scorer():
    rows = make_rows(list(range(60)), seed=3).to_pylist()
    rows[7]["text"] = None
    by_key = {r["id"]: r for r in rows}
    ref = Bm25Reference(np.arange(60), [r["text"] for r in rows])
    for query in ("apple", "fig kiwi", "quince sloe yuzu", "nothing"):
        want, got = bm25(by_key, query), ref.scores(query)
        assert got.keys() == want.keys()
        assert all(math.isclose(got[k], want[k], rel_tol=1e-9) for k in want)


def test_top_k_check_catches_a_wrong_score_and_a_missed_better_row():
    expected = {1: 3.0, 2: 2.0, 3: 2.0, 4: 1.0}
    assert check_top_k([1, 3], [3.0, 2.0], expected, 2, higher_first=True) == []  # a tie: either key
    assert check_top_k([1, 4], [3.0, 2.0], expected, 2, higher_first=True) != []  # 4 scored wrong
    assert check_top_k([1, 4], [3.0, 1.0], expected, 2, higher_first=True) != []  # 2 or 3 was better


@pytest.mark.parametrize("with_writer", [True, False])
def test_a_reader_blind_to_acknowledged_writes_fails_the_checks(tmp_path, with_writer):
    args = parse_args(["--base-rows", "1000", "--partitions", "2", "--batch", "40", "--lookups", "2"])
    t, rows, vocab = build(tmp_path, args)
    model = Model(rows)
    w = t.writer(durable=True)
    writer = ChurnWriter(w, model, vocab, args)
    writer._write_batch()
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(t.uri, writer=w if with_writer else None))
    reader = Reader(ctx, model, args, vocab)
    for key in writer.recent.tolist():
        reader.lookup(key)
    reader.count()
    reader.quiescent(2)
    w.close()
    if with_writer:
        assert reader.failures == [] and len(reader.recall) == 2
    else:
        assert any(f.startswith(LOOKUP) for f in reader.failures)
        assert any(f.startswith(COUNT) for f in reader.failures)


def test_a_tiny_run_under_churn_reports_every_query_kind_and_no_wrong_answer(tmp_path):
    out = tmp_path / "churn.json"
    tiny = ["--base-rows", "2000", "--seconds", "6", "--rate", "400", "--batch", "100"]
    tiny += ["--memtable-rows", "200", "--interval", "0.5", "--retention", "5", "--partitions", "4"]
    tiny += ["--frozen-queries", "2", "--check-every", "3", "--checks", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "churn.py"),
        *tiny,
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["writes"] > 0 and len(data["base_commits"]) > 1
    assert [q["query"] for q in data["queries"]] == [
        "point lookup",
        "count(*)",
        "filter (value < 0.1)",
        "vector_search",
        "fts",
    ]
    for q in data["queries"]:
        assert q["churn_queries"] > 0 and q["first_after_merge_n"] > 0
        assert f"| {q['query']} | {q['frozen_p50_ms']:,.2f} | {q['p50_ms']:,.2f} |" in run.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["churn.json"]  # the table is deleted
    assert data["table"] in run.stdout and data["table"] in "\n".join(load_report().churn_section(data)[0])
