"""Soak benchmark: a table run as a service for many rounds of upserts and maintenance, read throughout
by one long-lived SessionContext, every answer checked against a model.

Table: `--base` rows (`id` int64 primary key, `value` float64, `text` of 2-6 words of the reference
workload's vocabulary, `vec` float32 x 32), 4 bucket regions, with a BTREE index on `id`, an INVERTED
index on `text` (stemming and stop words off) and IVF_PQ on `vec` (`--partitions`, 8 sub-vectors),
created on the base Lance table.

Each round: `--upserts` upserts through one `table.writer()` (90% keys already in the table, 10% new
keys), `w.flush()`, then one `table.maintain(max_rounds=1, interval=0, grace=0, version_retention=0)`
in this process (whatever jobs the maintain loop runs: merge, index build, catch-up, ...), timed; a
job error of the round is printed and recorded (it does not stop the run).

One `datafusion.SessionContext`, with `memwal_df.register(ctx)` and `MemWalTable(uri)` registered once
before the first round, reads throughout. At round 0 and every `--checkpoint` rounds (and after the
last round): after a warm-up round, `--repeat` rounds of each query kind — `--lookups` point lookups
(`id = k`: keys of the last round's upserts, random keys, a key never written), `count(*)`,
`sum(value)`, a filter (`value < 0.01`), `vector_search` (k = 10, default options) and `fts` (k = 10,
one word) — and their p50; every answer checked exactly against the model (numpy arrays: value, text
and vector per key): lookups, count and the filter exact, the sum to 1e-9, `vector_search` rows
current with their current vector and the exact l2 distance of that vector, `fts` rows current,
holding the word, and scored and ranked as BM25 over the model's live rows. Also per checkpoint: base
fragments (with deletion files), segments per index (`describe_indices()`), files and MiB under the
table directory, this process's RSS (reader, writer and maintain loop), the maintain round p50 since
the previous checkpoint and the live rows.

At the end the same live rows are written fresh: as a plain Lance table (`lance.write_dataset`, the
same three indexes; its disk is the peer of the table's disk) and as a fresh memwal_df table (same
indexes, nothing unmerged), which the same queries (the last checkpoint's) are timed on through a fresh
SessionContext: the peer of the soaked table's query p50s. Printed: the checkpoint table, the ratios
(last checkpoint / round 0, last checkpoint / fresh), and the targets. A wrong answer or a query error
is printed and the exit code is 1.

    python bench/soak.py --small                        # base 20k, 40 rounds, a checkpoint every 10
    python bench/soak.py --rounds 200 --checkpoint 50   # base 200k
    python bench/soak.py --small --json bench/results/soak.json
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import datafusion
import lance
import numpy as np
import pyarrow as pa
from _churn_model import Bm25Reference, check_top_k, l2_distances
from _cli import add_int_args, add_table_args, config_of, print_failures, write_json
from _narrow import layout
from _workload import (
    NUM_REGIONS,
    git_state,
    make_text,
    make_vocab,
    resident_mb,
    run_in_scratch,
    targets_markdown,
)

import memwal_df as mw

DIM = 32
K = 10
FILTER_LIMIT = 0.01
UPDATE_FRACTION = 0.9
LOOKUP, COUNT, SUM, FILTER, VECTOR, FTS = "lookup", "count(*)", "sum(value)", "filter", "vector_search", "fts"
KINDS = [LOOKUP, COUNT, SUM, FILTER, VECTOR, FTS]
MAX_QUERY_RATIO = 1.5  # last checkpoint p50 / round 0 p50
MAX_MAINTAIN_RATIO = 1.5  # maintain p50, last rounds / first rounds
MAX_DISK_RATIO = 2.0  # MiB on disk / the fresh plain Lance table's
MAX_RSS_GROWTH_MIB = 100.0
SCHEMA = pa.schema(
    [("id", pa.int64()), ("value", pa.float64()), ("text", pa.string()), ("vec", pa.list_(pa.float32(), DIM))]
)


# ------------------------------------------------------------------------------------------- data


def make_soak_rows(rng: np.random.Generator, ids: np.ndarray, vocab: list[str]) -> pa.Table:
    """Rows for `ids`: a fresh random value, 2-6 words of text and a random vector each."""
    n = len(ids)
    vec = rng.standard_normal(n * DIM, dtype=np.float32)
    return pa.Table.from_arrays(
        [
            pa.array(ids, pa.int64()),
            pa.array(rng.random(n)),
            pa.array(make_text(rng, n, vocab, 2, 6)),
            pa.FixedSizeListArray.from_arrays(pa.array(vec), DIM),
        ],
        schema=SCHEMA,
    )


class SoakModel:
    """The table's rows as numpy arrays by key: keys 0..n-1 are live (upserts only, no deletes)."""

    def __init__(self, base: pa.Table, capacity: int) -> None:
        self.n = 0
        self.value = np.zeros(capacity)
        self.vec = np.zeros((capacity, DIM), np.float32)
        self.text = np.empty(capacity, object)
        self.put(base)

    def put(self, rows: pa.Table) -> None:
        ids = rows.column("id").to_numpy()
        self.value[ids] = rows.column("value").to_numpy()
        self.vec[ids] = _vectors(rows)
        self.text[ids] = rows.column("text").to_numpy(zero_copy_only=False)
        self.n = max(self.n, int(ids.max()) + 1)

    def rows(self) -> pa.Table:
        """The live rows, as the table should hold them."""
        n = self.n
        return pa.Table.from_arrays(
            [
                pa.array(np.arange(n, dtype=np.int64)),
                pa.array(self.value[:n]),
                pa.array(self.text[:n], pa.string()),
                pa.FixedSizeListArray.from_arrays(pa.array(self.vec[:n].ravel()), DIM),
            ],
            schema=SCHEMA,
        )


def _vectors(r: pa.Table, column: str = "vec") -> np.ndarray:
    return r.column(column).combine_chunks().flatten().to_numpy().reshape(r.num_rows, DIM)


def create_indexes(uri: str, partitions: int) -> None:
    """BTREE on id, INVERTED on text, IVF_PQ on vec, on the Lance table at `uri`."""
    ds = lance.dataset(uri)
    ds.create_scalar_index("id", "BTREE")
    ds.create_scalar_index("text", "INVERTED", stem=False, remove_stop_words=False)
    ds.create_index("vec", "IVF_PQ", num_partitions=partitions, num_sub_vectors=8)


def build(uri: str, rows: pa.Table, partitions: int) -> mw.Table:
    """A memwal_df table of `rows` with the three indexes."""
    table = mw.create_table(uri, rows, "id", region_spec=mw.bucket("id", NUM_REGIONS))
    create_indexes(uri, partitions)
    table.refresh()
    return table


# ---------------------------------------------------------------------------------------- queries


@dataclass(frozen=True)
class Query:
    kind: str
    sql: str
    check: Callable[[pa.Table], list[str]]  # what is wrong with an answer


class Checker:
    """The queries of each kind and their checks against the model (no write in flight)."""

    def __init__(self, model: SoakModel, vocab: list[str], lookups: int) -> None:
        self.model, self.vocab, self.lookups = model, vocab, lookups
        self._bm25: Bm25Reference | None = None  # over the model's rows, until they change
        self.recall: list[float] = []

    def plan(self, rng: np.random.Generator, recent: np.ndarray) -> list[Query]:
        """One query of each kind and `lookups` lookups (in turn a key of the last round's upserts, a
        random key, a recent one, a key never written), parameters from `rng`."""
        n = self.model.n
        pick = [lambda: rng.choice(recent), lambda: rng.integers(0, n), lambda: n + rng.integers(0, 1000)]
        out = [self.lookup(int(pick[(0, 1, 0, 2)[i % 4]]())) for i in range(self.lookups)]
        out += [self.count(), self.sum(), self.filter()]
        out.append(self.vector(rng.standard_normal(DIM, dtype=np.float32)))
        text = self.model.text[int(rng.integers(0, n))]
        words = text.split()
        out.append(self.fts(words[int(rng.integers(0, len(words)))]))
        return out

    def lookup(self, key: int) -> Query:
        m = self.model

        def check(r: pa.Table) -> list[str]:
            if key >= m.n:
                return [] if r.num_rows == 0 else [f"key {key} was never written, got {r.num_rows} rows"]
            if r.num_rows != 1:
                return [f"key {key}: {r.num_rows} rows"]
            return self._rows_current(r)

        return Query(LOOKUP, f"SELECT id, value, text FROM t WHERE id = {key}", check)

    def count(self) -> Query:
        def check(r: pa.Table) -> list[str]:
            got = r.column(0)[0].as_py()
            return [] if got == self.model.n else [f"count {got}, live rows {self.model.n}"]

        return Query(COUNT, "SELECT count(*) FROM t", check)

    def sum(self) -> Query:
        def check(r: pa.Table) -> list[str]:
            got, want = r.column(0)[0].as_py(), math.fsum(self.model.value[: self.model.n])
            return [] if math.isclose(got, want, rel_tol=1e-9) else [f"sum {got!r}, expected {want!r}"]

        return Query(SUM, "SELECT sum(value) FROM t", check)

    def filter(self) -> Query:
        def check(r: pa.Table) -> list[str]:
            r = r.sort_by("id")
            want = np.flatnonzero(self.model.value[: self.model.n] < FILTER_LIMIT)
            ids = r.column("id").to_numpy()
            if not np.array_equal(ids, want):
                extra, missing = np.setdiff1d(ids, want), np.setdiff1d(want, ids)
                return [f"{len(ids)} rows, expected {len(want)}: extra {extra[:5]}, missing {missing[:5]}"]
            return self._rows_current(r)

        return Query(FILTER, f"SELECT id, value FROM t WHERE value < {FILTER_LIMIT}", check)

    def vector(self, q: np.ndarray) -> Query:
        lit = "[" + ",".join(f"{x:.9g}" for x in q) + "]"
        sql = f"SELECT id, value, vec, _distance FROM vector_search('t', 'vec', {lit}, {K})"
        m = self.model

        def check(r: pa.Table) -> list[str]:
            if r.num_rows != min(K, m.n):
                return [f"vector_search: {r.num_rows} rows, expected {min(K, m.n)}"]
            out = self._rows_current(r)
            ids = r.column("id").to_numpy()
            if out:
                return out
            if not np.array_equal(_vectors(r), m.vec[ids]):
                out.append(
                    f"vector_search: a row's vec is not its key's current vector (keys {ids.tolist()})"
                )
            got = r.column("_distance").to_numpy().astype(np.float64)
            want = l2_distances(m.vec[ids], q)
            if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                out.append(
                    f"vector_search: distances {got.round(4).tolist()}, exact {want.round(4).tolist()}"
                )
            if np.any(np.diff(got) < 0):
                out.append(f"vector_search: distances not ascending: {got.round(4).tolist()}")
            truth = np.argpartition(l2_distances(m.vec[: m.n], q), K - 1)[:K]
            self.recall.append(len(set(truth.tolist()) & set(ids.tolist())) / K)
            return out

        return Query(VECTOR, sql, check)

    def fts(self, word: str) -> Query:
        sql = f"SELECT id, value, text, _score FROM fts('t', 'text', '{word}', {K})"

        def check(r: pa.Table) -> list[str]:
            out = self._rows_current(r)
            texts = r.column("text").to_pylist()
            out += [
                f"fts '{word}': key {k} has text {t!r}"
                for k, t in zip(r["id"].to_pylist(), texts, strict=True)
                if word not in t.split()
            ]
            scores = self._reference().scores(word)
            got = r.column("_score").to_pylist()
            return out + [
                f"fts '{word}': {e}" for e in check_top_k(r["id"].to_pylist(), got, scores, K, True)
            ]

        return Query(FTS, sql, check)

    def _reference(self) -> Bm25Reference:
        """BM25 over the model's live rows."""
        if self._bm25 is None:
            self._bm25 = Bm25Reference(np.arange(self.model.n), self.model.text[: self.model.n])
        return self._bm25

    def changed(self) -> None:
        """The model changed: the BM25 reference is built again at its next use."""
        self._bm25 = None

    def _rows_current(self, r: pa.Table) -> list[str]:
        """Rows whose key is not live, is repeated, or whose value (and text) is not the key's current."""
        m = self.model
        ids = r.column("id").to_numpy()
        out = [f"key {k} returned twice" for k in np.unique(ids)[np.unique(ids, return_counts=True)[1] > 1]]
        live = ids < m.n
        if not live.all():
            return out + [f"keys {ids[~live][:5].tolist()} were never written"]
        bad = r.column("value").to_numpy() != m.value[ids]
        if "text" in r.column_names:
            bad |= r.column("text").to_numpy(zero_copy_only=False) != m.text[ids]
        for k, v in zip(ids[bad][:5].tolist(), r.column("value").to_numpy()[bad][:5].tolist(), strict=True):
            out.append(f"key {k} = {v!r}, its current row is value {m.value[k]!r}, text {m.text[k]!r}")
        return out


class Reader:
    """Runs queries through one SessionContext, times and checks them."""

    def __init__(self, ctx: datafusion.SessionContext, checker: Checker) -> None:
        self.ctx, self.checker = ctx, checker
        self.failures: list[str] = []
        self.checked = 0

    def run(self, q: Query) -> float:
        """One query's seconds (NaN when it raised); a wrong answer or an error is a failure."""
        t0 = time.perf_counter()
        try:
            result = self.ctx.sql(q.sql).to_arrow_table()
        except Exception as e:  # a failure of the run, reported with the others
            self.failures.append(f"{q.kind}: {type(e).__name__}: {e}")
            return float("nan")
        seconds = time.perf_counter() - t0
        self.failures += [f"{q.kind}: {m}" for m in q.check(result)]
        self.checked += 1
        return seconds

    def measure(self, plans: list[list[Query]]) -> dict[str, float]:
        """The first plan as a warm-up, then each plan's queries (in reverse order every other plan);
        p50 ms per kind."""
        samples: dict[str, list[float]] = {k: [] for k in KINDS}
        for q in plans[0]:
            self.run(q)
        for i, plan in enumerate(plans[1:]):
            for q in plan if i % 2 == 0 else plan[::-1]:
                samples[q.kind].append(self.run(q))
        return {k: _p50_ms(v) for k, v in samples.items()}


def _p50_ms(samples: list[float]) -> float:
    done = [s for s in samples if s == s]
    return statistics.median(done) * 1e3 if done else float("nan")


# -------------------------------------------------------------------------------------- checkpoints


def disk_usage(path: Path) -> tuple[int, float]:
    """Files and MiB under `path`."""
    files, size = 0, 0
    for parent, _, names in os.walk(path):
        for name in names:
            files += 1
            size += os.stat(os.path.join(parent, name)).st_size
    return files, size / 2**20


def index_segments(uri: str) -> dict[str, int]:
    """Segments per user index of the Lance table at `uri` (not the MemWAL index)."""
    ds = lance.dataset(uri)
    return {d.name: len(d.segments) for d in ds.describe_indices() if not d.name.startswith("__")}


def checkpoint(
    number: int, uri: str, reader: Reader, plans: list[list[Query]], maintain_s: list[float], live: int
) -> dict[str, Any]:
    """The figures of one checkpoint (queries first, then the layout and the process's RSS)."""
    p50 = reader.measure(plans)
    base = layout(uri)
    files, mib = disk_usage(Path(uri))
    gc.collect()
    return {
        "round": number,
        "p50_ms": p50,
        "fragments": base["fragments"],
        "deletion_files": base["deletion_files"],
        "index_segments": index_segments(uri),
        "files": files,
        "mib": mib,
        "rss_mib": resident_mb(),
        "maintain_rounds": len(maintain_s),
        "maintain_p50_s": statistics.median(maintain_s) if maintain_s else None,
        "maintain_max_s": max(maintain_s) if maintain_s else None,
        "live_rows": live,
        "load_average": os.getloadavg()[0],
    }


def plans_for(checker: Checker, seed: int, recent: np.ndarray, repeat: int) -> list[list[Query]]:
    """A warm-up plan and `repeat` measured ones, from `seed` (the same seed gives the same queries)."""
    rng = np.random.default_rng(seed)
    return [checker.plan(rng, recent) for _ in range(repeat + 1)]


# ------------------------------------------------------------------------------------------ report


def _segments(c: dict[str, Any]) -> str:
    return ", ".join(f"{name.removesuffix('_idx')} {n}" for name, n in sorted(c["index_segments"].items()))


def markdown(checkpoints: list[dict[str, Any]]) -> str:
    """The checkpoint table (query p50s in ms)."""
    lines = [
        "| after round | " + " | ".join(KINDS) + " | base fragments (with deletion files) | index segments"
        " | files / MiB on disk | reader RSS | maintain round p50 | live rows |",
        "|--:|" + "--:|" * len(KINDS) + "--:|---|--:|--:|--:|--:|",
    ]
    for c in checkpoints:
        maintain = "-" if c["maintain_p50_s"] is None else f"{c['maintain_p50_s']:.2f} s"
        cells = [str(c["round"]), *(f"{c['p50_ms'][k]:,.2f}" for k in KINDS)]
        cells += [
            f"{c['fragments']} ({c['deletion_files']})",
            _segments(c),
            f"{c['files']:,} / {c['mib']:,.1f}",
        ]
        cells += [f"{c['rss_mib']:,.0f} MiB", maintain, f"{c['live_rows']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios_markdown(first: dict[str, Any], last: dict[str, Any], fresh: dict[str, float]) -> str:
    """Per query kind: p50 at round 0, at the last checkpoint, on the fresh table, and the ratios."""
    lines = [
        f"| query | round 0 p50 ms | round {last['round']} p50 ms | fresh table p50 ms"
        f" | round {last['round']} / round 0 | round {last['round']} / fresh |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for k in KINDS:
        a, b, f = first["p50_ms"][k], last["p50_ms"][k], fresh[k]
        lines.append(f"| {k} | {a:,.2f} | {b:,.2f} | {f:,.2f} | {b / a:.2f}x | {b / f:.2f}x |")
    return "\n".join(lines)


def bounded(values: list[tuple[int, int]], rounds: int) -> tuple[bool, str]:
    """A count `(round, value)` per checkpoint is bounded when the second half of the run added at most
    half as much as the first half (at least 2): a plateau passes, steady growth does not."""
    start, last = values[0][1], values[-1][1]
    mid_round, mid = [(r, v) for r, v in values if r <= rounds // 2][-1]
    ok = last - mid <= max(2.0, (mid - start) / 2)
    return ok, f"{start} / {mid} / {last} at rounds 0 / {mid_round} / {values[-1][0]}"


def targets(
    checkpoints: list[dict[str, Any]], maintain_s: list[float], disk: dict[str, Any], rounds: int
) -> list[dict[str, Any]]:
    """The soak targets, judged on this run's figures."""
    first, last = checkpoints[0], checkpoints[-1]
    out = []
    for k in KINDS:
        ratio = last["p50_ms"][k] / first["p50_ms"][k]
        out.append(
            {
                "target": f"`{k}` p50 after round {last['round']} <= {MAX_QUERY_RATIO}x round 0",
                "measured": f"{ratio:.2f}x ({last['p50_ms'][k]:,.2f} against {first['p50_ms'][k]:,.2f} ms)",
                "met": ratio <= MAX_QUERY_RATIO,
            }
        )
    ok, measured = bounded([(c["round"], c["fragments"]) for c in checkpoints], rounds)
    out.append({"target": "base fragments bounded", "measured": measured, "met": ok})
    for name in sorted(first["index_segments"]):
        series = [(c["round"], c["index_segments"].get(name, 0)) for c in checkpoints]
        ok, measured = bounded(series, rounds)
        out.append({"target": f"`{name}` segments bounded", "measured": measured, "met": ok})
    span = min(100, len(maintain_s) // 2)
    if span:
        a, b = statistics.median(maintain_s[:span]), statistics.median(maintain_s[-span:])
        out.append(
            {
                "target": f"maintain round p50, last {span} rounds <= {MAX_MAINTAIN_RATIO}x first {span}",
                "measured": f"{b / a:.2f}x ({b:.2f} against {a:.2f} s)",
                "met": b / a <= MAX_MAINTAIN_RATIO,
            }
        )
    ratio = last["mib"] / disk["plain_mib"]
    out.append(
        {
            "target": f"disk <= {MAX_DISK_RATIO:g}x a fresh plain Lance table of the live rows",
            "measured": f"{ratio:.2f}x ({last['mib']:,.1f} against {disk['plain_mib']:,.1f} MiB)",
            "met": ratio <= MAX_DISK_RATIO,
        }
    )
    warm = checkpoints[1] if len(checkpoints) > 2 else first
    growth = last["rss_mib"] - warm["rss_mib"]
    out.append(
        {
            "target": f"RSS growth after warm-up (round {warm['round']}) <= {MAX_RSS_GROWTH_MIB:g} MiB",
            "measured": f"{growth:+,.0f} MiB ({warm['rss_mib']:,.0f} -> {last['rss_mib']:,.0f} MiB)",
            "met": growth <= MAX_RSS_GROWTH_MIB,
        }
    )
    return out


# -------------------------------------------------------------------------------------------- run


class JobTimes(logging.Handler):
    """Seconds of each job of the maintain round running, from the maintain loop's INFO record
    `round N: JOB done in S`."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if record.msg.startswith("round %d: %s done in") and isinstance(args, tuple):
            seconds = args[2]
            assert isinstance(seconds, int | float)
            self.seconds[str(args[1])] = float(seconds)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


@dataclass
class Soak:
    """What the rounds leave for the report."""

    checkpoints: list[dict[str, Any]]
    maintain_s: list[float]
    job_s: list[dict[str, float]]  # per round: seconds of each job that succeeded
    errors: list[str]
    jobs: list[str]

    def slowest(self, n: int = 5) -> list[str]:
        """The `n` slowest maintain rounds with their slowest jobs."""
        worst = sorted(range(len(self.maintain_s)), key=lambda i: -self.maintain_s[i])[:n]
        out = []
        for i in sorted(worst):
            jobs = sorted(self.job_s[i].items(), key=lambda kv: -kv[1])[:3]
            out.append(
                f"round {i + 1}: {self.maintain_s[i]:.1f} s ("
                + ", ".join(f"{j} {s:.1f} s" for j, s in jobs)
                + ")"
            )
        return out


def soak(
    table: mw.Table,
    model: SoakModel,
    reader: Reader,
    vocab: list[str],
    args: argparse.Namespace,
) -> tuple[Soak, np.ndarray]:
    """The rounds with their checkpoints; the run's figures and the last round's upserted keys."""
    rng = np.random.default_rng(args.seed + 1)
    recent = rng.integers(0, model.n, args.upserts)
    maintain_s: list[float] = []
    job_s: list[dict[str, float]] = []
    times = JobTimes()
    log = logging.getLogger("memwal_df.jobs.maintain")
    log.setLevel(logging.INFO)
    log.propagate = False  # its errors are printed from Round.errors
    log.addHandler(times)
    since = 0  # maintain rounds since the last checkpoint
    errors: list[str] = []
    seen: set[tuple[str, type]] = set()
    jobs: list[str] = []
    plans = plans_for(reader.checker, args.seed + 2, recent, args.repeat)
    checkpoints = [checkpoint(0, table.uri, reader, plans, [], model.n)]
    print_checkpoint(checkpoints[-1])
    n_new = args.upserts - round(args.upserts * UPDATE_FRACTION)
    with table.writer() as w:
        for number in range(1, args.rounds + 1):
            top = model.n
            ids = np.concatenate(
                [rng.choice(top, args.upserts - n_new, replace=False), np.arange(top, top + n_new)]
            ).astype(np.int64)
            rows = make_soak_rows(rng, ids, vocab)
            w.put(rows)
            w.flush()
            model.put(rows)
            reader.checker.changed()
            recent = ids
            t0 = time.perf_counter()
            rounds = table.maintain(
                max_rounds=1, interval=0, grace=timedelta(0), version_retention=timedelta(0)
            )
            maintain_s.append(time.perf_counter() - t0)
            job_s.append(times.take())
            since += 1
            for r in rounds:
                jobs = jobs or [*r.results, *(j for j in r.errors if j not in r.results)]
                for job, e in r.errors.items():
                    errors.append(f"round {number}: {job}: {type(e).__name__}: {e}")
                    print(f"maintain {errors[-1]}", flush=True)
                    if (job, type(e)) not in seen:  # the first of its kind with its traceback
                        seen.add((job, type(e)))
                        print("".join(traceback.format_exception(e)), end="", flush=True)
            if number % args.checkpoint == 0 or number == args.rounds:
                plans = plans_for(reader.checker, args.seed + 2 + number, recent, args.repeat)
                checkpoints.append(checkpoint(number, table.uri, reader, plans, maintain_s[-since:], model.n))
                since = 0
                print_checkpoint(checkpoints[-1])
    log.removeHandler(times)
    return Soak(checkpoints, maintain_s, job_s, errors, jobs), recent


def print_checkpoint(c: dict[str, Any]) -> None:
    p50 = ", ".join(f"{k} {c['p50_ms'][k]:.2f}" for k in KINDS)
    maintain = (
        ""
        if c["maintain_p50_s"] is None
        else f", maintain p50 {c['maintain_p50_s']:.2f} s, max {c['maintain_max_s']:.1f} s"
    )
    print(
        f"round {c['round']}: p50 ms {p50}; {c['fragments']} fragments ({c['deletion_files']} with deletion"
        f" files), segments {_segments(c)}, {c['files']:,} files / {c['mib']:,.1f} MiB,"
        f" RSS {c['rss_mib']:,.0f} MiB{maintain}; load average {c['load_average']:.1f}",
        flush=True,
    )


def fresh_peer(
    root: Path, model: SoakModel, checker: Checker, recent: np.ndarray, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, float], list[str], int]:
    """The live rows written fresh as a plain Lance table (disk) and a memwal_df table (the last
    checkpoint's queries, through a fresh SessionContext): disk figures, p50 ms per kind, failures,
    answers checked."""
    rows = model.rows()
    plain = root / "fresh-plain"
    lance.write_dataset(rows, str(plain))
    create_indexes(str(plain), args.partitions)
    ours = root / "fresh-memwal"
    build(str(ours), rows, args.partitions)
    del rows
    (plain_files, plain_mib), (ours_files, ours_mib) = disk_usage(plain), disk_usage(ours)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(str(ours)))
    reader = Reader(ctx, checker)
    p50 = reader.measure(plans_for(checker, args.seed + 2 + args.rounds, recent, args.repeat))
    disk = {
        "plain_files": plain_files,
        "plain_mib": plain_mib,
        "plain_fragments": len(lance.dataset(str(plain)).get_fragments()),
        "fresh_memwal_files": ours_files,
        "fresh_memwal_mib": ours_mib,
    }
    return disk, p50, reader.failures, reader.checked


def run(args: argparse.Namespace, root: Path) -> int:
    print(f"memwal_df {git_state()}, Python {platform.python_version()}, lance {lance.__version__}, {root}")
    rng = np.random.default_rng(args.seed)
    vocab = make_vocab(rng)
    base = make_soak_rows(rng, np.arange(args.base, dtype=np.int64), vocab)
    t0 = time.perf_counter()
    table = build(str(root / "t"), base, args.partitions)
    print(f"built {args.base:,} rows with three indexes in {time.perf_counter() - t0:.1f} s", flush=True)
    new_keys = args.rounds * (args.upserts - round(args.upserts * UPDATE_FRACTION))
    model = SoakModel(base, args.base + new_keys)
    del base
    checker = Checker(model, vocab, args.lookups)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(table.uri))  # once: read throughout
    reader = Reader(ctx, checker)
    t0 = time.perf_counter()
    result, recent = soak(table, model, reader, vocab, args)
    seconds = time.perf_counter() - t0
    disk, fresh, fresh_failures, fresh_checked = fresh_peer(root, model, checker, recent, args)
    failures = reader.failures + [f"fresh table: {f}" for f in fresh_failures]
    checked = reader.checked + fresh_checked
    tgt = targets(result.checkpoints, result.maintain_s, disk, args.rounds)
    first, last = result.checkpoints[0], result.checkpoints[-1]
    recall = float(np.mean(checker.recall)) if checker.recall else None
    print(
        f"\n{args.rounds} rounds of {args.upserts:,} upserts in {seconds:.0f} s; maintain jobs"
        f" {', '.join(result.jobs)}; {len(result.errors)} job errors; {checked:,} answers checked,"
        f" {len(failures)} wrong or failed; vector_search recall@{K} {recall:.3f} (not a check)\n"
    )
    print(markdown(result.checkpoints))
    print(
        "\nQuery p50 (ms) at round 0, at the last checkpoint and on the fresh table (the same live rows"
        " written as a new memwal_df table with the same indexes, nothing unmerged, queried through a"
        " fresh SessionContext with the last checkpoint's queries):\n"
    )
    print(ratios_markdown(first, last, fresh))
    print(
        f"\nDisk: {last['files']:,} files / {last['mib']:,.1f} MiB; a fresh plain Lance table of the"
        f" {last['live_rows']:,} live rows with the same indexes {disk['plain_files']:,} files /"
        f" {disk['plain_mib']:,.1f} MiB ({last['mib'] / disk['plain_mib']:.2f}x), a fresh memwal_df"
        f" table {disk['fresh_memwal_files']:,} files / {disk['fresh_memwal_mib']:,.1f} MiB."
        f" RSS {first['rss_mib']:,.0f} MiB at round 0, {last['rss_mib']:,.0f} MiB at round {last['round']}"
        f" ({last['rss_mib'] / first['rss_mib']:.2f}x).\n"
    )
    print(targets_markdown(tgt))
    print("\nSlowest maintain rounds (their slowest jobs):")
    for line in result.slowest():
        print(f"  {line}")
    if result.errors:
        print(f"\n{len(result.errors)} maintain job errors:")
        for e in result.errors[:30]:
            print(f"  {e}")
    print_failures(failures)
    if args.json:
        data = {
            "config": config_of(args) | {"git": git_state(), "lance": lance.__version__},
            "checkpoints": result.checkpoints,
            "maintain_s": result.maintain_s,
            "maintain_jobs": result.jobs,
            "maintain_job_s": result.job_s,
            "maintain_errors": result.errors,
            "fresh_p50_ms": fresh,
            "disk": disk,
            "targets": tgt,
            "table": markdown(result.checkpoints),
            "ratios": ratios_markdown(first, last, fresh),
            "recall": recall,
            "checked": checked,
            "failures": failures,
        }
        write_json(args.json, data)
    return 1 if failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="base 20k, 40 rounds, a checkpoint every 10")
    ap.add_argument("--base", type=int, help="base rows (default 200,000; --small 20,000)")
    ap.add_argument("--rounds", type=int, help="rounds of upserts + maintain (default 200; --small 40)")
    ap.add_argument("--checkpoint", type=int, help="rounds between checkpoints (default 50; --small 10)")
    ap.add_argument("--upserts", type=int, default=2000, help="upserts per round (90%% existing keys)")
    ap.add_argument("--partitions", type=int, help="IVF partitions (default 64; --small 16)")
    ap.add_argument("--repeat", type=int, default=10, help="measured rounds of queries per checkpoint")
    ap.add_argument("--lookups", type=int, default=4, help="point lookups per round of queries")
    add_int_args(ap, seed=42)
    add_table_args(ap, dir_help="where the tables go", keep_help="keep the tables")
    args = ap.parse_args(argv)
    args.base = args.base or (20_000 if args.small else 200_000)
    args.rounds = args.rounds or (40 if args.small else 200)
    args.checkpoint = args.checkpoint or (10 if args.small else 50)
    args.partitions = args.partitions or (16 if args.small else 64)
    if min(args.base, args.rounds, args.checkpoint, args.upserts, args.repeat, args.lookups) < 1:
        ap.error("sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_in_scratch(parse_args(argv), "soak-", run)


if __name__ == "__main__":
    sys.exit(main())
