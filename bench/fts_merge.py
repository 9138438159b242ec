"""Full-text search while merges move rows into the base: the first `fts` after each merge and repeated ones.

Workload: a base of `--docs` short documents (id int64 primary key, category, text of 5-15 words of
the reference workload's 3,000-word vocabulary; no vectors), 4 bucket regions, optionally
(`--index`) a Lance inverted index on `text` (stemming and stop words off, as bench/search.py).
Then `--rounds` rounds of `--upserts` upserts (half updates of random base keys, half new keys),
flushed and merged into the base; after each merge, in the same process and through one long-lived
`MemWalTable`: the first `fts` (k = 10, 1-3 words), then `--repeat` more queries (p50, max). Before
the rounds: the first query of the process (the base's term state built from nothing) and the
frozen table's p50.

Memory: the bytes of the base's term state (`memwal_df.read.search.fts.base_terms.BASE_TERMS.nbytes`:
postings, document lengths, keys, vocabularies), the peak of numpy's allocations while it is built
again from nothing (tracemalloc), and the resident set.

    python bench/fts_merge.py --docs 50000 --upserts 1000 --rounds 3   # quick
    python bench/fts_merge.py --index                                  # 1M documents, 10k upserts
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
from _workload import make_rows, make_vocab, resident_mb, scratch_root

import memwal_df as mw
from memwal_df.read.search.fts.base_terms import BASE_TERMS
from memwal_df.read.search.planner import plan_fts


def term_state_mb() -> float:
    return BASE_TERMS.nbytes / 2**20


def rebuild_peak_mb(uri: str, query: Callable[[], float]) -> float:
    """The peak of numpy's allocations (tracemalloc) while the base term state is built again."""
    BASE_TERMS.forget(str(Path(uri).resolve()))
    BASE_TERMS.forget(uri)
    tracemalloc.start()
    query()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def text_rows(rng: np.random.Generator, ids: np.ndarray, vocab: list[str]) -> pa.Table:
    return make_rows(rng, ids, vocab).drop_columns(["value", "vec"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--upserts", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--index", action="store_true", help="a Lance inverted index on the base's text")
    p.add_argument("--dir", default=None, help="where to make the table (default: bench/results/)")
    args = p.parse_args()
    root = scratch_root(args.dir, "fts-merge-")
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> None:
    rng = np.random.default_rng(7)
    vocab = make_vocab(rng)
    uri = str(root / "t")
    base = text_rows(rng, np.arange(args.docs, dtype=np.int64), vocab)
    table = mw.create_table(uri, base, "id", region_spec=mw.bucket("id", 4))
    del base
    if args.index:
        lance.dataset(uri).create_scalar_index("text", "INVERTED", stem=False, remove_stop_words=False)
    queries = [" ".join(rng.choice(vocab, int(rng.integers(1, 4)))) for _ in range(args.repeat * 4)]
    reader = mw.MemWalTable(uri)
    gc.collect()

    def query(i: int) -> float:
        t0 = time.perf_counter()
        plan_fts(reader, "text", queries[i % len(queries)], 10).to_table()
        return (time.perf_counter() - t0) * 1000

    cold = query(0)
    print(f"docs={args.docs} index={args.index} upserts/round={args.upserts}")
    print(
        f"first query of the process: {cold:.1f} ms, base term state {term_state_mb():.1f} MB, "
        f"resident {resident_mb():.0f} MB"
    )
    build_peak_mb = rebuild_peak_mb(uri, lambda: query(0))
    print(f"peak numpy memory of a rebuild of the base term state (tracemalloc): {build_peak_mb:.0f} MB")
    frozen = [query(i) for i in range(1, args.repeat + 1)]
    print(f"frozen: p50 {statistics.median(frozen):.2f} ms, max {max(frozen):.2f} ms")
    print(
        "| round | base fragments | first fts after merge (ms) | repeated p50 (ms) | max (ms) "
        "| term state (MB) |"
    )
    print("|--:|--:|--:|--:|--:|--:|")
    next_id = args.docs
    writer = table.writer(durable=False, indexed=False)
    for r in range(1, args.rounds + 1):
        half = args.upserts // 2
        ids = np.concatenate([rng.choice(next_id, half, replace=False), np.arange(next_id, next_id + half)])
        next_id += half
        writer.put(text_rows(rng, ids, vocab))
        writer.flush()
        table.merge()
        first = query(r * 7)
        again = [query(r * 7 + i) for i in range(1, args.repeat + 1)]
        fragments = len(lance.dataset(uri).get_fragments())
        print(
            f"| {r} | {fragments} | {first:.1f} | {statistics.median(again):.2f} | {max(again):.2f} "
            f"| {term_state_mb():.1f} |"
        )
    writer.close()
    print(f"resident at the end: {resident_mb():.0f} MB")


if __name__ == "__main__":
    main()
