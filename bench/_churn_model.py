"""The model bench/churn.py checks every answer against: each key's value history, indexed by the
sequence number of the write that set it, plus the newest vector and text of each key for the exact
search checks at quiescent points.

Writes are numbered 1, 2, ... in the order the single writer starts them, and recorded before they
start; state `S_i` is the table after write `i` (`S_0`: the base). A query that began after write
`a` was acknowledged and ended before write `c + 1` was started may show any state in `S_a .. S_c`
per key (its levels are read at different moments): `Window(a, c)`. The checks:

* a row `(id, value)` is right when `id` had `value` in some state of the window (`value` is a fresh
  random float per write, so it names the version);
* a filter result must also hold every key that matched in every state of the window;
* `count(*)` must lie between the smallest and largest live count of the window;
* searches at a quiescent point (`Window(a, a)`): BM25 (k1 = 1.2, b = 0.75, statistics over every
  live row, the documented ranking) and l2 distances computed here with numpy over the newest rows.

Everything is vectorized over keys that did not change during the window; only keys written during
it are looked at one by one.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ABSENT = math.nan  # the value of a key that has no live row
K1, B = 1.2, 0.75


@dataclass(frozen=True)
class Window:
    """The states `S_first .. S_last` a query may have read."""

    first: int
    last: int


class Model:
    """Value history of every key, thread-safe: the writer thread records, readers check."""

    def __init__(self, base: pa.Table) -> None:
        n = base.num_rows
        ids = base.column("id").to_numpy()
        if not np.array_equal(ids, np.arange(n)):
            raise ValueError("the model expects base keys 0..n-1 in order")
        self._lock = threading.Lock()
        cap = n + n // 4 + 1024
        self.value = np.full(cap, ABSENT)
        self.value[:n] = base.column("value").to_numpy()
        self.last_seq = np.zeros(cap, np.int64)
        self.vec = np.zeros((cap, base.schema.field("vec").type.list_size), np.float32)
        self.vec[:n] = base.column("vec").combine_chunks().flatten().to_numpy().reshape(n, -1)
        self.text = np.empty(cap, object)
        self.text[:n] = base.column("text").to_pylist()
        self.history: dict[int, list[tuple[int, float]]] = {}  # keys written since the base
        self.counts = [n]  # live rows in S_i
        self.started = 0  # writes started (and recorded)
        self.acked = 0  # writes acknowledged
        self.next_key = n  # the first key never written

    # ----------------------------------------------------------------------------------- recording

    def begin_put(self, rows: pa.Table) -> int:
        """Number the upsert of `rows` and record it; call right before it starts (a query running
        meanwhile may see it or not: the window's last state is the newest write started)."""
        ids = rows.column("id").to_numpy()
        vecs = rows.column("vec").combine_chunks().flatten().to_numpy().reshape(len(ids), -1)
        with self._lock:
            seq = self._record(ids, rows.column("value").to_numpy())
            self.vec[ids] = vecs
            self.text[ids] = rows.column("text").to_pylist()
            return seq

    def begin_delete(self, ids: np.ndarray) -> int:
        """Number the delete of `ids` and record it; call right before it starts."""
        with self._lock:
            return self._record(ids, np.full(len(ids), ABSENT))

    def ack(self, seq: int) -> None:
        """Write `seq` was acknowledged."""
        with self._lock:
            if seq != self.acked + 1 or seq > self.started:
                raise RuntimeError(f"write {seq} acknowledged after {self.acked}: one writer, in order")
            self.acked = seq

    def _record(self, ids: np.ndarray, values: np.ndarray) -> int:
        if self.started != self.acked:
            raise RuntimeError(f"write {self.started} is still in flight: one writer, one write at a time")
        self._grow(int(ids.max()) + 1)
        self.started += 1
        seq = self.started
        old = self.value[ids]
        for key, was, new in zip(ids.tolist(), old.tolist(), values.tolist(), strict=True):
            self.history.setdefault(key, [(0, was)]).append((seq, new))
        self.value[ids] = values
        self.last_seq[ids] = seq
        live = int(np.count_nonzero(~np.isnan(values))) - int(np.count_nonzero(~np.isnan(old)))
        self.counts.append(self.counts[-1] + live)
        self.next_key = max(self.next_key, int(ids.max()) + 1)
        return seq

    def _grow(self, size: int) -> None:
        cap = len(self.value)
        if size <= cap:
            return
        new = max(size, 2 * cap)
        self.value = np.concatenate([self.value, np.full(new - cap, ABSENT)])
        self.last_seq = np.concatenate([self.last_seq, np.zeros(new - cap, np.int64)])
        self.vec = np.concatenate([self.vec, np.zeros((new - cap, self.vec.shape[1]), np.float32)])
        self.text = np.concatenate([self.text, np.empty(new - cap, object)])

    # ------------------------------------------------------------------------------------ reading

    def window_start(self) -> int:
        with self._lock:
            return self.acked

    def window_end(self) -> int:
        with self._lock:
            return self.started

    def keys_in_use(self) -> int:
        with self._lock:
            return self.next_key

    def values_in(self, key: int, w: Window) -> list[float]:
        """Every value `key` had in `S_first .. S_last` (ABSENT for no row)."""
        with self._lock:
            return self._values_in(key, w)

    def _values_in(self, key: int, w: Window) -> list[float]:
        hist = self.history.get(key)
        if hist is None:
            return [float(self.value[key]) if key < len(self.value) else ABSENT]
        out = []
        for seq, value in hist:
            if seq <= w.first:
                out = [value]
            elif seq <= w.last:
                out.append(value)
        return out

    # ----------------------------------------------------------------------------------- checking

    def bad_rows(self, ids: np.ndarray, values: np.ndarray, w: Window) -> list[str]:
        """The rows `(id, value)` no state of the window holds, and repeated keys, described."""
        out = [f"key {k} returned twice" for k in _repeated(ids)]
        with self._lock:
            inside = ids < len(self.value)
            safe = np.where(inside, ids, 0)
            ok = inside & (self.value[safe] == values) & (self.last_seq[safe] <= w.last)
            for key, value in zip(ids[~ok].tolist(), values[~ok].tolist(), strict=True):
                seen = self._values_in(key, w)
                if value not in seen:
                    out.append(
                        f"key {key} = {value!r}, but it held {_show(seen)} in writes {w.first}..{w.last}"
                    )
        return out

    def missing_matches(
        self, ids: np.ndarray, match: Callable[[np.ndarray], np.ndarray], w: Window
    ) -> list[str]:
        """The keys that matched `match` (on values; ABSENT never matches) in every state of the
        window but are not in `ids`, described."""
        got = set(ids.tolist())
        with self._lock:
            top = self.next_key
            steady = (self.last_seq[:top] <= w.first) & _matches(match, self.value[:top])
            required = set(np.flatnonzero(steady).tolist())
            for key in np.flatnonzero(self.last_seq[:top] > w.first).tolist():
                if _matches(match, np.asarray(self._values_in(key, w))).all():
                    required.add(key)
        missing = sorted(required - got)
        return (
            [f"{len(missing)} rows that matched throughout are missing, e.g. keys {missing[:5]}"]
            if missing
            else []
        )

    def count_range(self, w: Window) -> tuple[int, int]:
        """The smallest and largest live row count in the window."""
        with self._lock:
            span = self.counts[w.first : w.last + 1]
            return min(span), max(span)

    # ----------------------------------------------------------------------- quiescent references

    def live(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keys, vectors and texts of the live rows of the newest state (a copy)."""
        with self._lock:
            top = self.next_key
            keys = np.flatnonzero(~np.isnan(self.value[:top]))
            return keys, self.vec[keys].copy(), self.text[keys].copy()


def _matches(match: Callable[[np.ndarray], np.ndarray], values: np.ndarray) -> np.ndarray:
    return ~np.isnan(values) & match(np.nan_to_num(values, nan=0.0))


def _repeated(ids: np.ndarray) -> list[int]:
    uniq, counts = np.unique(ids, return_counts=True)
    return uniq[counts > 1].tolist()


def _show(values: Sequence[float]) -> str:
    return ", ".join("no row" if math.isnan(v) else repr(v) for v in values)


# ------------------------------------------------------------------------------------ references


class Bm25Reference:
    """BM25 over a fixed set of documents (Lance's `simple` tokenizer on ASCII text: lower-cased runs
    of letters and digits), every document counted in the corpus statistics."""

    def __init__(self, keys: np.ndarray, texts: Sequence[str | None] | np.ndarray) -> None:
        arr = pa.array(list(texts), pa.string())
        keep = pc.is_valid(arr)
        self.keys = keys[np.asarray(keep)]
        words = pc.split_pattern_regex(pc.utf8_lower(arr.filter(keep)), "[^a-z0-9]+")
        flat = pc.list_flatten(words)
        parents = np.asarray(pc.list_parent_indices(words))
        nonempty = np.asarray(pc.not_equal(flat, ""))
        self.tokens = flat.filter(pa.array(nonempty))
        self.doc_of = parents[nonempty]
        self.length = np.bincount(self.doc_of, minlength=len(self.keys)).astype(np.float64)
        self.avgdl = float(self.length.mean()) if len(self.keys) else 0.0

    def scores(self, query: str) -> dict[int, float]:
        """Score of every document holding a query term."""
        n = len(self.keys)
        total = np.zeros(n)
        for term in dict.fromkeys(re.findall("[a-z0-9]+", query.lower())):
            hits = self.doc_of[np.asarray(pc.equal(self.tokens, term))]
            tf = np.bincount(hits, minlength=n).astype(np.float64)
            df = int(np.count_nonzero(tf))
            if df == 0:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            total += idf * tf * (K1 + 1) / (tf + K1 * (1 - B + B * self.length / self.avgdl))
        hit = np.flatnonzero(total > 0)
        return dict(zip(self.keys[hit].tolist(), total[hit].tolist(), strict=True))


def check_top_k(
    got_keys: Sequence[int],
    got_scores: Sequence[float],
    expected: dict[int, float],
    k: int,
    higher_first: bool,
) -> list[str]:
    """A ranked result against exact scores of every candidate: each returned key's score must be
    its expected one, and the returned scores must be the best `k` expected scores (ties may pick
    any of the tied keys)."""
    out = []
    for key, score in zip(got_keys, got_scores, strict=True):
        want = expected.get(key)
        if want is None or not math.isclose(score, want, rel_tol=1e-4, abs_tol=1e-4):
            out.append(f"key {key} scored {score}, expected {want}")
    best = sorted(expected.values(), reverse=higher_first)[:k]
    ranked = sorted(got_scores, reverse=higher_first)
    if len(ranked) != len(best) or not np.allclose(ranked, best, rtol=1e-4, atol=1e-4):
        out.append(f"scores {[round(s, 4) for s in ranked]}, expected the best {[round(s, 4) for s in best]}")
    return out


def l2_distances(vecs: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Squared l2 distance of each row of `vecs` to `query` (Lance's `l2`)."""
    out = np.empty(len(vecs))
    q = query.astype(np.float64)
    for lo in range(0, len(vecs), 65536):  # float64 in slices: exact enough, bounded memory
        diff = vecs[lo : lo + 65536].astype(np.float64) - q
        out[lo : lo + 65536] = np.einsum("ij,ij->i", diff, diff)
    return out
