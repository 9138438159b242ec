"""The main job of `make demo`: a table with text and vectors, upserts streamed through four regions
while SQL queries (scan, point lookup, vector search, full-text search) see every write at once, and
the background jobs (`table.maintain`) merging flushed generations into the base table meanwhile.
At the end every row is read back and compared with a model of every write.

Usage: python examples/demo.py [DIRECTORY]   (default: a temporary directory, removed afterwards)
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import datafusion
import numpy as np
import pyarrow as pa

import memwal_df as mw
from memwal_df.cli.status import collect, text

BASE_ROWS, ROUNDS, BATCH, DIM = 5_000, 20, 1_000, 16
WORDS = "lance arrow table stream region merge vector search index query writer reader".split()


def make_rows(rng: np.random.Generator, ids: np.ndarray, round_: int) -> pa.Table:
    """Rows for `ids`: a category, text of 4 words plus the token `r{round}`, a random vector."""
    words = rng.choice(WORDS, (len(ids), 4))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "category": pa.array([f"cat{i % 5}" for i in ids.tolist()]),
            "text": pa.array([" ".join(w) + f" r{round_}" for w in words.tolist()]),
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.standard_normal(len(ids) * DIM, np.float32)), DIM
            ),
            "round": pa.array(np.full(len(ids), round_, np.int32)),
        }
    )


class Timings:
    """Query latencies by kind, in milliseconds."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}

    def run(self, kind: str, ctx: datafusion.SessionContext, sql: str) -> list[dict]:
        t0 = time.perf_counter()
        rows = ctx.sql(sql).to_arrow_table().to_pylist()
        self.ms.setdefault(kind, []).append((time.perf_counter() - t0) * 1e3)
        return rows


def vector_literal(vec: list[float]) -> str:
    return "[" + ", ".join(f"{x:.9g}" for x in vec) + "]"


def stream(table: mw.Table, rng: np.random.Generator, model: dict[int, dict], timings: Timings) -> int:
    """ROUNDS rounds of upserts (half updates) and deletes, each checked by four fresh queries;
    returns the number of mismatches between a query and the model."""
    bad = 0
    next_id = BASE_ROWS
    with table.writer(durable=True, max_memtable_rows=2_000) as w:
        ctx = mw.register(datafusion.SessionContext())
        ctx.register_table("t", mw.MemWalTable(table.uri, writer=w))  # durable levels + w's MemTables
        for round_ in range(1, ROUNDS + 1):
            ids = np.concatenate(
                [rng.choice(next_id, BATCH // 2, replace=False), np.arange(next_id, next_id + BATCH // 2)]
            )
            next_id += BATCH // 2
            batch = make_rows(rng, ids, round_)
            w.put(batch)
            model.update({r["id"]: r for r in batch.to_pylist()})
            if round_ % 5 == 0:
                gone = rng.choice(next_id, 100, replace=False)
                w.delete(pa.array(gone, pa.int64()))
                for k in gone.tolist():
                    model.pop(k, None)
            probe = int(ids[0]) if int(ids[0]) in model else int(ids[-1])
            looked_up = timings.run("point lookup", ctx, f"SELECT id, round FROM t WHERE id = {probe}")
            near = timings.run(
                "vector search",
                ctx,
                f"SELECT id FROM vector_search('t', 'vec', {vector_literal(model[probe]['vec'])}, 1)",
            )
            hits = timings.run(
                "full-text search", ctx, f"SELECT id, round FROM fts('t', 'text', 'r{round_}', 10)"
            )
            count = timings.run("count(*) scan", ctx, "SELECT count(*) AS n FROM t")[0]["n"]
            ok = (
                looked_up == [{"id": probe, "round": round_}]
                and near == [{"id": probe}]
                and hits
                and all(h["round"] == round_ for h in hits)
                and count == len(model)
            )
            bad += not ok
            if round_ % 4 == 0 or not ok:
                print(
                    f"round {round_:2d}: {count:,} live rows; id {probe} -> round {looked_up[0]['round']}; "
                    f"nearest to its vector: id {near[0]['id']}; fts 'r{round_}': {len(hits)} hits"
                    f"{'' if ok else '  MISMATCH'}"
                )
    return bad


def main(directory: str | None = None) -> int:
    root = Path(directory or tempfile.mkdtemp(prefix="memwal-demo-")).resolve()
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(7)
    try:
        base = make_rows(rng, np.arange(BASE_ROWS), 0)
        t0 = time.perf_counter()
        table = mw.create_table(str(root), base, primary_key="id", region_spec=mw.bucket("id", 4))
        print(
            f"created {root}: {BASE_ROWS:,} rows (id, category, text, vec[{DIM}]), region spec bucket(id, 4) "
            f"in {time.perf_counter() - t0:.2f}s"
        )
        model = {r["id"]: r for r in base.to_pylist()}

        stop = threading.Event()
        maintainer = mw.open_table(str(root))  # the background jobs, as a separate service would run them
        rounds: list = []
        jobs = threading.Thread(target=lambda: rounds.extend(maintainer.maintain(interval=0.5, stop=stop)))
        jobs.start()
        timings = Timings()
        t0 = time.perf_counter()
        try:
            bad = stream(table, rng, model, timings)
        finally:
            stream_s = time.perf_counter() - t0
            stop.set()
            jobs.join()
        merges = [r.results["merge"] for r in rounds if "merge" in r.results]
        merged = sum(len(g) for m in merges for g in m.generations.values())
        errors = sorted({name for r in rounds for name in r.errors})
        print(
            f"\nstreamed {ROUNDS * BATCH:,} durable upserts and {ROUNDS // 5 * 100} deletes with "
            f"{sum(len(v) for v in timings.ms.values())} queries in {stream_s:.1f}s; the background jobs ran "
            f"{len(rounds)} rounds and merged {merged} generations"
            + (f" (failed jobs, retried: {', '.join(errors)})" if errors else "")
        )
        print("query latency (ms)      p50     max")
        for kind, ms in timings.ms.items():
            print(f"  {kind:20s} {statistics.median(ms):6.1f}  {max(ms):6.1f}")

        t0 = time.perf_counter()
        table.merge()
        print(f"\nfinal merge in {time.perf_counter() - t0:.2f}s\n")
        print(text(collect(table)))

        ctx = mw.register(datafusion.SessionContext())
        ctx.register_table("t", mw.MemWalTable(str(root)))
        t0 = time.perf_counter()
        got = {r["id"]: r for r in ctx.sql("SELECT * FROM t").to_arrow_table().to_pylist()}
        print(f"\nread back {len(got):,} rows with SELECT * in {time.perf_counter() - t0:.2f}s")
        if got != model or bad:
            print(f"MISMATCH: {bad} rounds disagreed with the model; read-back differs: {got != model}")
            return 1
        print("read-back equals the model of every write: OK")
        return 0
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
