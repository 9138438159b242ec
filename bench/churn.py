"""Churn benchmark: reads while the table changes under them, every answer checked against a model.

Table: the reference workload of docs/performance.md (id int64 primary key, category, value, text of
5-15 words, vec float32x64), `--base-rows` rows with btree (id), inverted (text, stemming and stop
words off) and IVF_PQ (vec, `--partitions`, 16 sub-vectors) indexes, 4 bucket regions.

1. Frozen: `--frozen-queries` queries of each kind on the table before any write (after a warm-up).
2. Churn, for `--seconds`, all at once:
   * a writer thread: a durable `TableWriter` putting `--rate` rows/s in `--batch`-row puts (half
     updates of existing keys, half new keys), each put followed by a delete of `--delete-fraction`
     x batch random keys; MemTables flush at `--memtable-rows` rows per region;
   * the maintain loop (`memwal maintain`: merge, MemWAL index build, index catch-up, compaction,
     version cleanup, GC) in a child process, a round every `--interval` seconds, `--retention`
     seconds for base versions and the GC grace; `--no-maintain` leaves it out (the control: the
     writer alone, so the CPU the loop takes can be told apart from the reader's own work);
   * this thread, reading through one DataFusion SessionContext with `MemWalTable(uri, writer=w)`
     registered once: `--lookups` point lookups (`id = k`, half of them keys of the last put), then
     `count(*)`, a filter (`value < 0.1`), `vector_search` (k = 10, `--nprobes`) and `fts` (k = 10,
     1-3 words), round after round. Before each query it reads the base table's version; when new
     versions appeared, the next query of each kind is also counted as "first after a merge" if one
     of them changed rows (its Lance transaction is not a `CreateIndex`), else as "first after an
     index commit" (MemWAL index build, index catch-up).
   Every `--check-every` seconds the writer pauses for the quiescent checks below (not counted in
   `--seconds`).
3. Quiescent checks (frozen, during churn, at the end with the writer stopped): `fts` against BM25
   computed here over the model's live rows (scores and top-k exact), `vector_search` with every
   partition probed and refine 10 (each returned distance must be the exact one of that key's live
   vector; recall@10 against brute force must average >= `--min-recall`), `count(*)` exact.

Every answer is checked against the model of bench/_churn_model.py, in the window of writes the query
overlapped: a stale or wrong answer, or a query error, is a failure: all are printed and the exit
code is 1. The report: per query kind, frozen p50, churn p50 / p99 / max, the first queries after a
merge and after an index commit (count, p50, max), and the ratios p99 / frozen p50 and
first-after-merge max / frozen p50; `--json` writes it as data.

    python bench/churn.py --small                 # base 50k, 60 s
    python bench/churn.py                         # base 1M, 120 s
    python bench/churn.py --small --json bench/results/churn.json
    python bench/churn.py --no-maintain           # the control: writer and reader, no maintain loop
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datafusion
import lance
import numpy as np
import pyarrow as pa
from _churn_model import Bm25Reference, Model, Window, check_top_k, l2_distances
from _cli import add_int_args, add_table_args, config_of, print_failures, write_json
from _workload import DIM, NUM_REGIONS, ROOT, git_state, make_rows, make_workload, run_in_scratch

import memwal_df as mw

K = 10
LOOKUP, COUNT, FILTER, VECTOR, FTS = (
    "point lookup",
    "count(*)",
    "filter (value < 0.1)",
    "vector_search",
    "fts",
)
KINDS = [LOOKUP, COUNT, FILTER, VECTOR, FTS]
FILTER_LIMIT = 0.1


# ------------------------------------------------------------------------------------------- setup


def build(root: Path, args: argparse.Namespace) -> tuple[mw.Table, pa.Table, list[str]]:
    """The indexed base table under `root`; its rows and the vocabulary of their text."""
    base = make_workload(args.base_rows, 0, 1, 0, seed=args.seed).base
    t = mw.create_table(str(root / "t"), base, primary_key="id", region_spec=mw.bucket("id", NUM_REGIONS))
    ds = lance.dataset(t.uri)
    ds.create_scalar_index("id", "BTREE")
    ds.create_scalar_index("text", "INVERTED", stem=False, remove_stop_words=False)
    ds.create_index("vec", "IVF_PQ", num_partitions=args.partitions, num_sub_vectors=16)
    t.refresh()
    vocab = sorted({w for s in base.column("text").slice(0, 20_000).to_pylist() for w in s.split()})
    return t, base, vocab


class ChurnWriter(threading.Thread):
    """Puts `rate` rows/s (half updates, half new keys), each put followed by a delete of random keys;
    records each write in the model before it starts and acknowledges it there once it returned.
    `pause()` returns once no write is in flight."""

    def __init__(self, w: mw.TableWriter, model: Model, vocab: list[str], args: argparse.Namespace) -> None:
        super().__init__(name="churn-writer", daemon=True)
        self.w, self.model, self.vocab = w, model, vocab
        self.batch, self.rate, self.delete_fraction = args.batch, args.rate, args.delete_fraction
        self.rng = np.random.default_rng(args.seed + 1)
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.busy = threading.Lock()  # held while a write is in flight
        self.recent = np.arange(min(args.batch, args.base_rows), dtype=np.int64)  # keys of the last put
        self.rows = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        due = time.perf_counter()
        try:
            while not self.stop.is_set():
                if self.paused.is_set():
                    time.sleep(0.01)
                    continue
                with self.busy:
                    self._write_batch()
                due += self.batch / self.rate
                self.stop.wait(max(0.0, due - time.perf_counter()))
        except BaseException as e:  # reported as a failure by the main thread
            self.error = e

    def _write_batch(self) -> None:
        top = self.model.keys_in_use()
        n_upd = min(self.batch // 2, top)
        ids = np.concatenate(
            [self.rng.choice(top, n_upd, replace=False), np.arange(top, top + self.batch - n_upd)]
        ).astype(np.int64)
        rows = make_rows(self.rng, ids, self.vocab).combine_chunks()
        seq = self.model.begin_put(rows)
        self.w.put(rows)
        self.model.ack(seq)
        self.recent = ids
        self.rows += len(ids)
        n_del = round(self.batch * self.delete_fraction)
        if n_del:
            gone = self.rng.choice(top, min(n_del, top), replace=False).astype(np.int64)
            seq = self.model.begin_delete(gone)
            self.w.delete(pa.table({"id": pa.array(gone, pa.int64())}))
            self.model.ack(seq)

    def pause(self) -> None:
        self.paused.set()
        with self.busy:  # waits for the write in flight
            pass

    def resume(self) -> None:
        self.paused.clear()


def start_maintain(uri: str, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    """`memwal maintain` on the table, in a child process (as an operator runs it)."""
    cmd = [sys.executable, "-m", "memwal_df", "maintain", uri, "--interval", str(args.interval)]
    cmd += ["--version-retention", str(args.retention), "--grace", str(args.retention), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop_maintain(proc: subprocess.Popen) -> int:
    """SIGTERM (the loop finishes its round), then wait; the exit code."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ----------------------------------------------------------------------------------------- queries


@dataclass
class Stats:
    """Latencies (seconds) of one query kind."""

    frozen: list[float] = field(default_factory=list)
    churn: list[float] = field(default_factory=list)
    after_merge: list[float] = field(default_factory=list)  # first query after a merge commit
    after_index: list[float] = field(default_factory=list)  # first after index commits only


class Reader:
    """The queries, each checked against the model in the window of writes it overlapped."""

    def __init__(
        self, ctx: datafusion.SessionContext, model: Model, args: argparse.Namespace, vocab: list[str]
    ):
        self.ctx, self.model, self.args, self.vocab = ctx, model, args, vocab
        self.rng = np.random.default_rng(args.seed + 2)
        self.stats = {k: Stats() for k in KINDS}
        self.failures: list[str] = []
        self.recall: list[float] = []

    def sql(self, query: str) -> pa.Table:
        return self.ctx.sql(query).to_arrow_table()

    def timed(
        self, kind: str, run: Callable[[], pa.Table], check: Callable[[pa.Table, Window], list[str]]
    ) -> float:
        """Run one query; its seconds (NaN if it raised). Failures are recorded."""
        first = self.model.window_start()
        t0 = time.perf_counter()
        try:
            result = run()
        except Exception as e:  # a query error is a failure, not a crash of the benchmark
            self.failures.append(f"{kind}: {type(e).__name__}: {e}")
            return float("nan")
        seconds = time.perf_counter() - t0
        window = Window(first, self.model.window_end())
        self.failures += [
            f"{kind} (writes {window.first}..{window.last}): {m}" for m in check(result, window)
        ]
        return seconds

    def one_of_each(self, recent: np.ndarray) -> list[tuple[str, Callable[[], float]]]:
        """One round of queries as (kind, run) pairs: lookups, count, filter, vector, fts."""
        out: list[tuple[str, Callable[[], float]]] = []
        top = self.model.keys_in_use()
        for i in range(self.args.lookups):
            key = (
                int(self.rng.choice(recent)) if i % 2 == 0 else int(self.rng.integers(0, top + top // 50 + 1))
            )
            out.append((LOOKUP, functools.partial(self.lookup, key)))
        out.append((COUNT, self.count))
        out.append((FILTER, self.filter))
        q = self.rng.standard_normal(DIM, dtype=np.float32)
        out.append((VECTOR, lambda: self.vector(q, f"named_struct('nprobes', {self.args.nprobes})")))
        text = " ".join(self.rng.choice(self.vocab, int(self.rng.integers(1, 4))))
        out.append((FTS, lambda: self.fts(text)))
        return out

    def lookup(self, key: int) -> float:
        def check(r: pa.Table, w: Window) -> list[str]:
            if r.num_rows == 0:
                seen = self.model.values_in(key, w)
                return [] if any(np.isnan(seen)) else [f"key {key} not found, but it held {seen}"]
            return self.model.bad_rows(_ids(r), _values(r), w)

        return self.timed(LOOKUP, lambda: self.sql(f"SELECT id, value FROM t WHERE id = {key}"), check)

    def count(self) -> float:
        def check(r: pa.Table, w: Window) -> list[str]:
            n, (lo, hi) = r.column(0)[0].as_py(), self.model.count_range(w)
            return [] if lo <= n <= hi else [f"count {n}, live rows were {lo}..{hi}"]

        return self.timed(COUNT, lambda: self.sql("SELECT count(*) FROM t"), check)

    def filter(self) -> float:
        def check(r: pa.Table, w: Window) -> list[str]:
            ids, values = _ids(r), _values(r)
            out = self.model.bad_rows(ids, values, w)
            out += [f"value {v} does not match" for v in values[values >= FILTER_LIMIT][:3].tolist()]
            return out + self.model.missing_matches(ids, lambda v: v < FILTER_LIMIT, w)

        query = f"SELECT id, value FROM t WHERE value < {FILTER_LIMIT}"
        return self.timed(FILTER, lambda: self.sql(query), check)

    def vector(self, q: np.ndarray, options: str, live: tuple[np.ndarray, np.ndarray] | None = None) -> float:
        """`vector_search` for `q`; with `live` (sorted keys and vectors of the live rows: no write in
        flight) also the exact distances and recall."""
        lit = "[" + ",".join(f"{x:.9g}" for x in q) + "]"
        query = f"SELECT id, value, _distance FROM vector_search('t', 'vec', {lit}, {K}, {options})"

        def check(r: pa.Table, w: Window) -> list[str]:
            out = self.model.bad_rows(_ids(r), _values(r), w)
            if r.num_rows != min(K, self.model.count_range(w)[0]):
                out.append(f"{r.num_rows} rows, expected {K}")
            return out + (self.exact_vector(r, q, *live) if live is not None else [])

        return self.timed(VECTOR, lambda: self.sql(query), check)

    def fts(self, text: str, reference: Bm25Reference | None = None) -> float:
        query = f"SELECT id, value, _score FROM fts('t', 'text', '{text}', {K})"

        def check(r: pa.Table, w: Window) -> list[str]:
            out = self.model.bad_rows(_ids(r), _values(r), w)
            if reference is not None:
                got = r.column("_score").to_pylist()
                out += check_top_k(_ids(r).tolist(), got, reference.scores(text), K, higher_first=True)
            return out

        return self.timed(FTS, lambda: self.sql(query), check)

    def exact_vector(self, r: pa.Table, q: np.ndarray, keys: np.ndarray, vecs: np.ndarray) -> list[str]:
        """Each returned distance is that key's live vector's; records recall@K against brute force."""
        d = l2_distances(vecs, q)
        truth = set(keys[np.argsort(d)[:K]].tolist())
        got = _ids(r)
        at = np.minimum(np.searchsorted(keys, got), len(keys) - 1)
        out = []
        for key, i, dist in zip(got.tolist(), at.tolist(), r.column("_distance").to_pylist(), strict=True):
            want = float(d[i]) if keys[i] == key else None
            if want is None or not np.isclose(dist, want, rtol=1e-3, atol=1e-3):
                out.append(f"key {key} at distance {dist}, its live vector is at {want}")
        self.recall.append(len(truth & set(got.tolist())) / K)
        return out

    def quiescent(self, queries: int) -> None:
        """The exact checks; call with no write in flight (the window is one state)."""
        keys, vecs, texts = self.model.live()
        reference = Bm25Reference(keys, texts)
        full = f"named_struct('nprobes', {self.args.partitions}, 'refine_factor', 10)"
        for _ in range(queries):
            self.fts(" ".join(self.rng.choice(self.vocab, int(self.rng.integers(1, 4)))), reference)
            self.vector(self.rng.standard_normal(DIM, dtype=np.float32), full, (keys, vecs))
        self.count()


def _ids(r: pa.Table) -> np.ndarray:
    return r.column("id").to_numpy().astype(np.int64)


def _values(r: pa.Table) -> np.ndarray:
    return r.column("value").to_numpy().astype(np.float64)


# ------------------------------------------------------------------------------------------- phases


def frozen_phase(reader: Reader, args: argparse.Namespace) -> None:
    """Warm-up, then `--frozen-queries` rounds on the table before any write."""
    for _ in range(2):
        for _, run in reader.one_of_each(np.arange(min(args.base_rows, 1000))):
            run()
    for _ in range(args.frozen_queries):
        for kind, run in reader.one_of_each(np.arange(args.base_rows)):
            reader.stats[kind].frozen.append(run())
    reader.quiescent(args.checks)


def churn_phase(reader: Reader, writer: ChurnWriter, uri: str, args: argparse.Namespace) -> list[Commit]:
    """Query round after round for `--seconds` of churn, with the quiescent checks (the writer
    paused, not counted in the seconds) every `--check-every` seconds; the base table's commits
    seen, in order."""
    commits = [Commit(lance.dataset(uri).version, "base")]
    pending: dict[str, str] = {}  # query kind -> "merge" / "index": its next query is a first after
    end = time.perf_counter() + args.seconds
    next_check = time.perf_counter() + args.check_every
    while time.perf_counter() < end and writer.error is None:
        for kind, run in reader.one_of_each(writer.recent):
            new = new_commits(uri, commits[-1].version)
            if new:
                commits += new
                what = "merge" if any(c.is_merge for c in new) else "index"
                pending = {k: "merge" if pending.get(k) == "merge" else what for k in KINDS}
            seconds = run()
            reader.stats[kind].churn.append(seconds)
            if kind in pending:
                stats = reader.stats[kind]
                (stats.after_merge if pending.pop(kind) == "merge" else stats.after_index).append(seconds)
        if time.perf_counter() >= next_check:
            paused = time.perf_counter()
            writer.pause()
            reader.quiescent(args.checks)
            writer.resume()
            end += time.perf_counter() - paused  # `--seconds` of churn, pauses not counted
            next_check = time.perf_counter() + args.check_every
    return commits


@dataclass(frozen=True)
class Commit:
    """A base table version and the Lance operation that made it."""

    version: int
    operation: str

    @property
    def is_merge(self) -> bool:
        """Rows changed (a merge of generations); index builds and catch-ups commit `CreateIndex`."""
        return self.operation != "CreateIndex"


def new_commits(uri: str, seen: int) -> list[Commit]:
    """The base table's versions after `seen` with their operation (`unknown` when the version or its
    transaction is gone: cleaned up meanwhile)."""
    ds = lance.dataset(uri)
    out = []
    for v in range(seen + 1, ds.version + 1):
        try:
            tx = ds.read_transaction(v)
        except Exception:  # cleaned up by the maintain loop meanwhile
            tx = None
        operation = "unknown" if tx is None else type(tx.operation).__name__
        out.append(Commit(v, operation))
    return out


# ------------------------------------------------------------------------------------------ report


def _ms(samples: list[float], p: float) -> float | None:
    done = [s for s in samples if s == s]  # NaN: the query raised
    return float(np.percentile(np.asarray(done) * 1e3, p)) if done else None


def summarize(stats: dict[str, Stats]) -> list[dict[str, Any]]:
    """Per query kind: latency percentiles in ms and their ratios to the frozen p50."""
    rows = []
    for kind, s in stats.items():
        row: dict[str, Any] = {
            "query": kind,
            "frozen_p50_ms": _ms(s.frozen, 50),
            "churn_queries": len(s.churn),
            "p50_ms": _ms(s.churn, 50),
            "p99_ms": _ms(s.churn, 99),
            "max_ms": _ms(s.churn, 100),
            "first_after_merge_n": len(s.after_merge),
            "first_after_merge_p50_ms": _ms(s.after_merge, 50),
            "first_after_merge_max_ms": _ms(s.after_merge, 100),
            "first_after_index_n": len(s.after_index),
            "first_after_index_p50_ms": _ms(s.after_index, 50),
            "first_after_index_max_ms": _ms(s.after_index, 100),
        }
        frozen = row["frozen_p50_ms"]
        for name, of in (
            ("p99_over_frozen", "p99_ms"),
            ("first_after_merge_max_over_frozen", "first_after_merge_max_ms"),
        ):
            row[name] = row[of] / frozen if frozen and row[of] is not None else None
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The per-kind table the benchmark prints."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:,.2f}"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}x"

    lines = [
        "| query | frozen p50 ms | churn p50 ms | p99 ms | max ms | first after a merge: n, p50 / max ms"
        " | first after an index commit: n, p50 / max ms | p99 / frozen p50"
        " | first-after-merge max / frozen p50 |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        cells = [r["query"], ms(r["frozen_p50_ms"]), ms(r["p50_ms"]), ms(r["p99_ms"]), ms(r["max_ms"])]
        for after in ("merge", "index"):
            cells.append(
                f"{r[f'first_after_{after}_n']}, {ms(r[f'first_after_{after}_p50_ms'])}"
                f" / {ms(r[f'first_after_{after}_max_ms'])}"
            )
        cells += [ratio(r["p99_over_frozen"]), ratio(r["first_after_merge_max_over_frozen"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="base 50k rows, 60 s, 64 partitions")
    ap.add_argument("--base-rows", type=int, help="base rows (default 1,000,000; --small 50,000)")
    ap.add_argument("--seconds", type=float, help="churn duration (default 120; --small 60)")
    ap.add_argument("--rate", type=float, default=2000, help="rows/s written (default 2,000)")
    ap.add_argument("--batch", type=int, default=500, help="rows per put (default 500)")
    ap.add_argument("--delete-fraction", type=float, default=0.05, help="keys deleted per put, x batch")
    ap.add_argument("--memtable-rows", type=int, default=5000, help="max_memtable_rows per region")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between maintain rounds")
    ap.add_argument("--no-maintain", action="store_true", help="the control: no maintain loop runs")
    ap.add_argument("--retention", type=float, default=20.0, help="base version retention and GC grace, s")
    ap.add_argument("--partitions", type=int, help="IVF partitions (default 256; --small 64)")
    ap.add_argument("--nprobes", type=int, default=20)
    ap.add_argument("--lookups", type=int, default=4, help="point lookups per round of queries")
    ap.add_argument("--frozen-queries", type=int, default=30, help="rounds of queries on the frozen table")
    ap.add_argument("--check-every", type=float, default=30.0, help="seconds between quiescent checks")
    ap.add_argument("--checks", type=int, default=3, help="exact fts and vector queries per quiescent check")
    ap.add_argument("--min-recall", type=float, default=0.9, help="mean recall@10, all partitions probed")
    add_int_args(ap, seed=42)
    add_table_args(ap)
    args = ap.parse_args(argv)
    args.base_rows = args.base_rows or (50_000 if args.small else 1_000_000)
    args.seconds = args.seconds if args.seconds is not None else (60.0 if args.small else 120.0)
    args.partitions = args.partitions or (64 if args.small else 256)
    return args


def run(args: argparse.Namespace, root: Path) -> int:
    """Build, measure, check; print (and with --json write) the report; the exit code."""
    print(f"memwal_df {git_state()}, Python {platform.python_version()}, lance {lance.__version__}, {root}")
    t0 = time.perf_counter()
    t, base, vocab = build(root, args)
    model = Model(base)
    del base
    print(f"built {args.base_rows:,} rows with indexes in {time.perf_counter() - t0:.0f} s", flush=True)
    w = t.writer(durable=True, max_memtable_rows=args.memtable_rows)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(t.uri, writer=w))
    reader = Reader(ctx, model, args, vocab)
    frozen_phase(reader, args)
    writer = ChurnWriter(w, model, vocab, args)
    log = root / "maintain.log"
    maintain = None if args.no_maintain else start_maintain(t.uri, args, log)
    writer.start()
    try:
        commits = churn_phase(reader, writer, t.uri, args)
    finally:
        writer.stop.set()
        writer.join()
        maintain_code = 0 if maintain is None else stop_maintain(maintain)
    reader.quiescent(args.checks)
    w.close()
    text = log.read_text(errors="replace") if log.exists() else ""
    return report(args, reader, writer, commits, maintain_code, text)


def report(
    args: argparse.Namespace,
    reader: Reader,
    writer: ChurnWriter,
    commits: list[Commit],
    maintain_code: int,
    log: str,
) -> int:
    rows = summarize(reader.stats)
    failures = list(reader.failures)
    if writer.error is not None:
        failures.append(f"writer: {type(writer.error).__name__}: {writer.error}")
    recall = float(np.mean(reader.recall)) if reader.recall else None
    if recall is not None and recall < args.min_recall:
        failures.append(
            f"vector_search recall@{K} {recall:.3f} < {args.min_recall} with every partition probed"
        )
    problems = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    print(
        f"\n{writer.rows:,} rows written in {reader.model.acked:,} writes over {args.seconds:.0f} s;"
        f" {len(commits) - 1} base commits, {sum(c.is_merge for c in commits[1:])} of them merges;"
        f" maintain exit code {maintain_code},"
        f" {len(problems)} error lines in its log; exact-check recall@{K} {recall}\n"
    )
    print(markdown(rows))
    for line in problems[:10]:
        print(f"maintain: {line}")
    print_failures(failures)
    if args.json:
        data = {
            "config": config_of(args) | {"git": git_state()},
            "queries": rows,
            "table": markdown(rows),
            "rows_written": writer.rows,
            "writes": reader.model.acked,
            "base_commits": [{"version": c.version, "operation": c.operation} for c in commits],
            "recall": recall,
            "maintain": {"exit_code": maintain_code, "error_lines": problems},
            "failures": failures,
        }
        write_json(args.json, data)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    return run_in_scratch(parse_args(argv), "churn-", run)


if __name__ == "__main__":
    sys.exit(main())
