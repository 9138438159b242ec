"""bench/soak.py: its checks catch a wrong answer, and a tiny soak run checks every answer and exits 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datafusion
import numpy as np

import memwal_df as mw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from soak import KINDS, Checker, Reader, SoakModel, build, main, make_soak_rows  # noqa: E402


def test_the_checks_catch_an_answer_the_model_does_not_hold(tmp_path):
    rng = np.random.default_rng(1)
    vocab = ["alpha", "beta", "gamma", "delta"]
    rows = make_soak_rows(rng, np.arange(600, dtype=np.int64), vocab)
    table = build(str(tmp_path / "t"), rows, partitions=2)
    model = SoakModel(rows, 600)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(table.uri))
    reader = Reader(ctx, Checker(model, vocab, lookups=4))
    for q in reader.checker.plan(rng, np.arange(10)):
        reader.run(q)
    assert reader.failures == [] and reader.checked == 4 + len(KINDS) - 1
    model.value[5] += 1.0  # the table still holds the old value
    model.text[5] = "alpha alpha alpha alpha alpha"
    reader.checker.changed()
    for q in (reader.checker.lookup(5), reader.checker.sum(), reader.checker.fts("alpha")):
        reader.run(q)
    assert [f.split(":")[0] for f in reader.failures][:2] == ["lookup", "sum(value)"]
    assert any(f.startswith("fts") for f in reader.failures)  # key 5's BM25 score changed


def test_a_tiny_soak_run_checks_every_answer_and_exits_0(tmp_path, capsys):
    out = tmp_path / "soak.json"
    tiny = ["--base", "3000", "--rounds", "3", "--checkpoint", "1", "--upserts", "200", "--partitions", "4"]
    code = main([*tiny, "--repeat", "2", "--dir", str(tmp_path), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["checked"] >= 5 * 3 * (4 + len(KINDS) - 1)  # 5 measurements
    assert [c["round"] for c in data["checkpoints"]] == [0, 1, 2, 3]
    assert [c["live_rows"] for c in data["checkpoints"]] == [3000, 3020, 3040, 3060]
    assert len(data["maintain_s"]) == 3 and "merge" in data["maintain_jobs"]
    assert data["table"] in printed and data["ratios"] in printed
    assert [p.name for p in tmp_path.iterdir()] == ["soak.json"]  # the tables are deleted
