"""Pieces shared by the benchmarks in bench/: the reference workload of docs/performance.md, Lance-native
shard snapshots of a memwal_df table, timing in rounds, and run metadata.

Workload: `id` int64 primary key, `category` string (16 values), `value` float64 in [0, 1), `text` of
5-15 words from a 3,000-word vocabulary, `vec` float32 x 64. Upserts are half updates of random base
keys, half new keys above the base, in `batch`-row tables. Everything is seeded: the same arguments
give the same rows.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from lance.mem_wal import ShardSnapshot

import memwal_df as mw
from memwal_df.format import memwal_index
from memwal_df.format.manifest import RegionManifestStore

ROOT = Path(__file__).resolve().parent.parent
PK_META = {b"lance-schema:unenforced-primary-key": b"true"}
DIM = 64
NUM_REGIONS = 4

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK_META),
        pa.field("category", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("text", pa.string()),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
    ]
)


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def make_vocab(rng: np.random.Generator) -> list[str]:
    """The workload's vocabulary: about 3,000 words of 2-4 syllables, sorted."""
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu", "pa", "do", "gi", "he"]
    return sorted({"".join(rng.choice(syllables, rng.integers(2, 5))) for _ in range(3000)})


def make_text(
    rng: np.random.Generator, n: int, vocab: list[str], min_words: int = 5, max_words: int = 15
) -> list[str]:
    """`n` texts of `min_words`..`max_words` words drawn from `vocab`."""
    lengths = rng.integers(min_words, max_words + 1, n)
    words = rng.integers(0, len(vocab), int(lengths.sum()))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    bounds = zip(starts.tolist(), ends.tolist(), strict=True)
    return [" ".join(vocab[w] for w in words[s:e]) for s, e in bounds]


def make_rows(rng: np.random.Generator, ids: np.ndarray, vocab: list[str]) -> pa.Table:
    """Rows of the reference workload for `ids`: category, value, text of 5-15 words, vec float32x64."""
    n = len(ids)
    text = make_text(rng, n, vocab)
    vec = rng.standard_normal(n * DIM, dtype=np.float32)
    return pa.Table.from_arrays(
        [
            pa.array(ids, pa.int64()),
            pa.array([f"cat{c:02d}" for c in rng.integers(0, 16, n)]),
            pa.array(rng.random(n)),
            pa.array(text),
            pa.FixedSizeListArray.from_arrays(pa.array(vec), DIM),
        ],
        schema=SCHEMA,
    )


@dataclass
class Workload:
    base: pa.Table
    batches: list[pa.Table]  # the upserts, one table (one chunk) per put
    singles: list[pa.Table]  # one-row tables for the latency runs
    upsert_rows: int


def vector_rows(ids: np.ndarray, rng: np.random.Generator, dim: int = 32) -> pa.Table:
    """Rows of a small serving-style table: `id` int64, `name` `n{id}`, `vec` float32 x `dim`."""
    vecs = rng.random((len(ids), dim), dtype=np.float32)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array(np.char.add("n", ids.astype(str))),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), dim),
        }
    )


def make_workload(base_rows: int, upsert_rows: int, batch: int, singles: int, seed: int = 42) -> Workload:
    """Base rows 0..base_rows-1, then `upsert_rows` upserts in `batch`-row tables (half updates of random
    base keys, half new keys counting up from base_rows), then `singles` one-row tables of new keys."""
    rng = np.random.default_rng(seed)
    vocab = make_vocab(rng)
    base = make_rows(rng, np.arange(base_rows, dtype=np.int64), vocab)
    batches = []
    next_id = base_rows
    for lo in range(0, upsert_rows, batch):
        n = min(batch, upsert_rows - lo)
        n_upd = min(n // 2, base_rows)
        upd = rng.choice(base_rows, n_upd, replace=False)
        new = np.arange(next_id, next_id + n - n_upd, dtype=np.int64)
        next_id += n - n_upd
        ids = np.concatenate([upd, new])
        rng.shuffle(ids)
        batches.append(make_rows(rng, ids, vocab).combine_chunks())
    single_ids = np.arange(next_id, next_id + singles, dtype=np.int64)
    pool = make_rows(rng, single_ids, vocab).combine_chunks()
    return Workload(base, batches, [pool.slice(i, 1) for i in range(singles)], upsert_rows)


# --------------------------------------------------------------------------------------------------
# Lance native readers
# --------------------------------------------------------------------------------------------------


def native_snapshots(t: mw.Table) -> list[ShardSnapshot]:
    """Lance `ShardSnapshot`s of every region of `t` from its latest region manifest: the flushed
    generations not merged yet (what `LsmScanner` / `LsmPointLookupPlanner` should read)."""
    merged = memwal_index.merged_generations(t.details)
    out = []
    for region_id in t.region_ids():
        m = RegionManifestStore(t.storage, region_id).latest()
        if m is None:
            continue
        snap = ShardSnapshot(str(region_id)).with_spec_id(m.shard_spec_id)
        snap = snap.with_current_generation(m.current_generation)
        for s in sorted(m.sstables, key=lambda s: s.generation):
            if s.generation > merged.get(region_id, 0):
                snap = snap.with_sstable(s.generation, s.path)
        out.append(snap)
    return out


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def time_rounds(fns: Sequence[Callable[[], int]], repeat: int) -> list[tuple[list[float], int]]:
    """`repeat` rounds, each calling every fn once (the order reversed every other round), so that a
    drift in machine load hits every engine alike. Per fn: its samples (s) and the row count it returned
    last (each fn returns a row count)."""
    samples: list[list[float]] = [[] for _ in fns]
    rows = [0] * len(fns)
    for rnd in range(repeat):
        order = list(range(len(fns)))
        for i in order if rnd % 2 == 0 else order[::-1]:
            gc.collect()
            t0 = time.perf_counter()
            rows[i] = fns[i]()
            samples[i].append(time.perf_counter() - t0)
    return list(zip(samples, rows, strict=True))


# --------------------------------------------------------------------------------------------------
# Run metadata
# --------------------------------------------------------------------------------------------------


def resident_mb() -> float:
    """This process's resident set (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scratch_root(directory: str | None, prefix: str) -> Path:
    """A fresh directory for a run's tables: under `directory`, else under bench/results/ (same disk)."""
    parent = Path(directory).resolve() if directory else ROOT / "bench" / "results"
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def run_in_scratch(args: Any, prefix: str, run: Callable[[Any, Path], int]) -> int:
    """`run(args, root)` in a fresh `scratch_root(args.dir, prefix)`, removed afterwards unless
    `args.keep`."""
    root = scratch_root(args.dir, prefix)
    try:
        return run(args, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def git_state() -> str:
    """HEAD of the project, with "+dirty" when memwal_df/ has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "memwal_df"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def scale_note(base_rows: int) -> str:
    """What a target's name gets when the run is smaller than the 1M-row workload the targets are
    set for (a smaller run is dominated by fixed costs)."""
    return "" if base_rows >= 1_000_000 else f" (measured at {base_rows:,} base rows)"


def targets_markdown(rows: list[dict[str, Any]]) -> str:
    """The run's target verdicts (`target`, `measured`, `met`) as the Markdown table the benches print."""
    lines = ["| target (docs/performance.md) | measured (memwal_df SQL) | met |", "|---|---|:-:|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['measured']} | {'yes' if r['met'] else 'NO'} |")
    return "\n".join(lines)
