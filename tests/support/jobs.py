"""The background-job side of the tests: a small workload with a dict model, the test merger, and
oracles of the merge history.

`Workload` writes random upserts and deletes through a real table writer and keeps the expected rows
in a dict. `merge_region` / `merge_all` run the real merger (`memwal_df.jobs.merger`); `gc_merged` is
a deliberately aggressive stand-in for GC that deletes the directory of every merged generation at
once, ignoring time travel and grace (the real `Table.gc` keeps what retained base versions reach):
reader tests use it to check that readers skip garbage-collected generations. `rows_at(table,
version)` reads what a time-travelling reader of base version `version` sees (the base at that
version + every listed generation above its merged generation), row by row, failing if a generation
it needs is gone; `progress_history` is the merge progress of every retained base version; `finish`
runs a writer and every job to completion and checks that the base alone holds the model and nothing
half-deleted is left.
"""

from __future__ import annotations

import random
import uuid
from datetime import timedelta
from typing import Any

import lance
import pyarrow as pa

import memwal_df as mw
from memwal_df.format import layout, memwal_index
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.jobs.index_catchup import coverage
from memwal_df.jobs.merger import GENERATIONS_PER_COMMIT
from memwal_df.table import Table
from support.reference import stored_rows
from support.wal_oracle import apply_rows

KEYS = 400


def create(uri: str, options: dict[str, str] | None, regions: int = 4, base: int = 200) -> Table:
    data = pa.table({"id": pa.array(range(base), pa.int64()), "v": pa.array([0.0] * base)})
    return mw.create_table(uri, data, "id", region_spec=mw.bucket("id", regions), storage_options=options)


class Workload:
    """Random puts/deletes through `table.writer()`, mirrored in `model` (key -> row)."""

    def __init__(self, table: Table, seed: int, base: int = 200) -> None:
        self.table = table
        self.rng = random.Random(seed)
        self.model: dict[Any, dict[str, Any]] = {i: {"id": i, "v": 0.0} for i in range(base)}
        self.step = 0

    def write(self, writer: Any, puts: int = 30, deletes: int = 8) -> None:
        self.step += 1
        keys = sorted(self.rng.sample(range(KEYS), puts))
        rows = [{"id": k, "v": float(self.step * 1000 + k)} for k in keys]
        writer.put(pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.int64()), ("v", pa.float64())])))
        for r in rows:
            self.model[r["id"]] = r
        dead = sorted(self.rng.sample(range(KEYS), deletes))
        writer.delete(pa.table({"id": pa.array(dead, pa.int64())}))
        for k in dead:
            self.model.pop(k, None)

    def generation(self, writer: Any) -> None:
        """One write then a flush: at least one new generation in some regions."""
        self.write(writer)
        writer.flush()


def flushed_generations(table: Table, region_id: uuid.UUID) -> list[tuple[int, str]]:
    """(generation, path relative to the table root) of every flushed generation, ascending."""
    m = RegionManifestStore(table.storage, region_id).latest()
    if m is None:
        return []
    return sorted((s.generation, layout.generation_path(region_id, s.path)) for s in m.sstables)


def merged_generation(table: Table, region_id: uuid.UUID) -> int:
    """The region's merged generation at the latest base version."""
    table.refresh()
    return memwal_index.merged_generations(table.details).get(region_id, 0)


def merge_progress(table: Table, version: int) -> dict[uuid.UUID, int] | None:
    """Merged generation per region recorded at base version `version`; None when that version has
    no MemWAL index."""
    found = memwal_index.read_details(table.uri, table.storage_options or None, version)
    return memwal_index.merged_generations(found[0]) if found else None


def merge_region(table: Table, region_id: uuid.UUID, up_to: int | None = None) -> list[int]:
    """Merge the region's unmerged flushed generations (those <= `up_to` if given) into the base, in
    ascending order, with the real merger; returns the generations merged."""
    floor = merged_generation(table, region_id)
    pending = [
        g for g, _ in flushed_generations(table, region_id) if g > floor and (up_to is None or g <= up_to)
    ]
    if not pending:
        return []
    return list(table.merge([region_id], max_generations=len(pending)).generations.get(region_id, ()))


def merge_all(table: Table) -> dict[uuid.UUID, list[int]]:
    """Merge every region's unmerged generations."""
    merged = table.merge().generations
    return {r: list(merged.get(r, ())) for r in table.region_ids()}


def gc_merged(table: Table) -> list[str]:
    """Delete the directory of every merged generation still present; returns the paths deleted."""
    table.refresh()
    merged = memwal_index.merged_generations(table.details)
    deleted = []
    for region_id in table.region_ids():
        floor = merged.get(region_id, 0)
        for gen, path in flushed_generations(table, region_id):
            if gen <= floor and table.storage.list_dir(path):
                table.storage.delete_prefix(path)
                deleted.append(path)
    return deleted


def rows_at(table: Table, version: int | None = None) -> dict[Any, dict[str, Any]]:
    """What a reader of base version `version` (None: latest) sees, from the current region manifests.

    Raises when a generation that reader needs (listed, above its merged generation) is missing."""
    options = table.storage_options or None
    ds = lance.dataset(table.uri, version=version, storage_options=options)
    merged = merge_progress(table, ds.version)
    assert merged is not None
    model: dict[Any, dict[str, Any]] = {}
    apply_rows(model, ds.to_table().to_pylist())
    for region_id in table.region_ids():
        for gen, path in flushed_generations(table, region_id):
            if gen > merged.get(region_id, 0):
                uri = table.storage.child_uri(path)
                apply_rows(model, lance.dataset(uri, storage_options=options).to_table().to_pylist())
    return model


def progress_history(table: Table) -> list[dict[uuid.UUID, int]]:
    """Merge progress (`compacted_sstables`) of every retained base version, oldest first."""
    ds = lance.dataset(table.uri, storage_options=table.storage_options or None)
    return [merge_progress(table, v) or {} for v in sorted(x["version"] for x in ds.versions())]


def assert_monotonic(history: list[dict[uuid.UUID, int]]) -> None:
    last: dict[uuid.UUID, int] = {}
    for i, progress in enumerate(history):
        for region, gen in last.items():
            assert progress.get(region, 0) >= gen, f"merge progress of {region} went back at version {i + 1}"
        last = progress


def base_rows(table: Table) -> dict[Any, dict[str, Any]]:
    table.refresh()
    return {r["id"]: r for r in table.dataset.to_table().to_pylist()}


def cleanup(table: Table) -> None:
    """Drop every base version but the latest (not `delete_unverified`: that would also delete the
    files of a merge still being written)."""
    lance.dataset(table.uri, storage_options=table.storage_options or None).cleanup_old_versions(
        older_than=timedelta(0)
    )


def every_version_reads(
    table: Table, model: dict[Any, dict[str, Any]], interrupted_cleanup: bool = False
) -> int:
    """Every retained base version (time travel) reads exactly `model`.

    With `interrupted_cleanup` (a process was killed inside Lance's `cleanup_old_versions`), a
    version other than the latest whose base files Lance itself can no longer read is skipped: a
    kill inside the cleanup can leave the manifest of a version it condemned listing files it already
    deleted (seen in `test_crash_jobs`; the next cleanup removes the manifest). Returns the versions
    skipped."""
    options = table.storage_options or None
    ds = lance.dataset(table.uri, storage_options=options)
    versions = sorted(v["version"] for v in ds.versions())
    skipped = 0
    for v in versions[1:] if versions[0] == 1 else versions:  # version 1 predates the MemWAL index
        if interrupted_cleanup and v != versions[-1]:
            try:
                lance.dataset(table.uri, version=v, storage_options=options).to_table()
            except (OSError, ValueError) as e:
                assert "Not found" in str(e), e
                skipped += 1
                continue
        assert rows_at(table, v) == model, f"base version {v}"
    return skipped


def catchup_at(table: Table, version: int) -> dict[str, dict[uuid.UUID, int]]:
    """`index_catchup` of base version `version`."""
    found = memwal_index.read_details(table.uri, table.storage_options or None, version)
    return memwal_index.index_catchup(found[0]) if found else {}


def assert_catchup_covered(table: Table) -> None:
    """At every retained base version, a base row the index does not cover (its fragment is outside
    the index's `fragment_bitmap`s) was merged by a generation above the index's recorded catch-up
    for that region. A fragment belongs to the merge commit that created it (the first version
    listing it); that commit's region is the one whose merge progress it raised."""
    options = table.storage_options or None
    ds = lance.dataset(table.uri, storage_options=options)
    versions = sorted(v["version"] for v in ds.versions())
    history = progress_history(table)
    made_by: dict[int, tuple | None] = {}  # fragment id -> (region, generation) of the merge that wrote it
    best: dict = {}
    for version, progress in zip(versions, history, strict=True):
        at = ds.checkout_version(version)
        raised = {r: g for r, g in progress.items() if g > best.get(r, 0)}
        for f in at.get_fragments():
            if f.fragment_id not in made_by and len(raised) == 1:
                made_by[f.fragment_id] = next(iter(raised.items()))
            made_by.setdefault(f.fragment_id, None)
        best.update(raised)
        catchup = catchup_at(table, version)
        for name, covered in coverage(at).items():
            for f in at.get_fragments():
                owner = made_by[f.fragment_id]
                if f.fragment_id in covered or owner is None:
                    continue
                region, gen = owner
                assert catchup.get(name, {}).get(region, 0) < gen, (
                    f"version {version}: {name} claims generation {gen} of {region}, fragment "
                    f"{f.fragment_id} holding it is not indexed"
                )


class VersionOracle:
    """Checks the merge history at every retained base version: merge progress never goes back, and
    the base holds exactly the initial rows plus, per region, generations 1..merged applied in order
    (so no generation was merged twice or after a newer one); the only other state allowed is the
    tombstone pass of a region's next generation (committed before its marker).

    Generation contents are cached when first read (they are immutable); GC must not remove one
    before this oracle has seen it."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.options = table.storage_options or None
        first = lance.dataset(table.uri, version=1, storage_options=self.options)
        self.initial = {r["id"]: r for r in first.to_table().to_pylist()}
        self.generations: dict[tuple[uuid.UUID, int], list[dict[str, Any]]] = {}

    def _rows(self, region_id: uuid.UUID, gen: int) -> list[dict[str, Any]]:
        if (region_id, gen) not in self.generations:
            for g, path in flushed_generations(self.table, region_id):
                if (region_id, g) not in self.generations:
                    uri = self.table.storage.child_uri(path)
                    rows = lance.dataset(uri, storage_options=self.options).to_table().to_pylist()
                    self.generations[(region_id, g)] = rows
        return self.generations.get((region_id, gen), [])

    def expected(self, progress: dict[uuid.UUID, int]) -> tuple[dict[Any, dict[str, Any]], set[Any]]:
        """(base rows merge progress `progress` stands for, keys the tombstone pass of the next
        commit's generations (up to `GENERATIONS_PER_COMMIT` of them) may already have deleted)."""
        model = dict(self.initial)
        pending: set[Any] = set()
        for region_id in self.table.region_ids():
            merged = progress.get(region_id, 0)
            for gen in range(1, merged + 1):
                apply_rows(model, self._rows(region_id, gen))
            for gen in range(merged + 1, merged + 1 + GENERATIONS_PER_COMMIT):
                pending |= {r["id"] for r in self._rows(region_id, gen) if r.get("_tombstone")}
        return model, pending

    def check(self) -> int:
        """Check every retained base version; returns how many were checked."""
        ds = lance.dataset(self.table.uri, storage_options=self.options)
        versions = sorted(v["version"] for v in ds.versions())
        last: dict[uuid.UUID, int] = {}
        for version in versions:
            progress = merge_progress(self.table, version) or {}
            for region, gen in last.items():
                assert progress.get(region, 0) >= gen, (
                    f"version {version}: merge progress of {region} went back"
                )
            last = progress
            model, pending = self.expected(progress)
            base = {r["id"]: r for r in ds.checkout_version(version).to_table().to_pylist()}
            for key in base.keys() | model.keys():
                if key in pending:
                    assert base.get(key) in (model.get(key), None), f"version {version}: key {key}"
                else:
                    assert base.get(key) == model.get(key), f"version {version}: key {key}"
        return len(versions)


def finish(table: mw.Table, work: Workload) -> None:
    """A new writer claims, replays and writes; every job runs to completion; the base holds it all."""
    with table.writer() as w:
        work.generation(w)
    table.merge()
    table.catch_up_indexes()
    cleanup(table)
    table.gc(grace=timedelta(0))
    assert base_rows(table) == work.model
    assert stored_rows(table) == work.model
    assert_monotonic(progress_history(table))
    for rid in table.region_ids():  # nothing half-deleted left behind
        listed = {p.rsplit("/", 1)[1] for _, p in flushed_generations(table, rid)}
        present = {
            n for n in table.storage.list_dir(layout.region_dir(rid)) if layout.parse_generation_dir_name(n)
        }
        assert present == listed, f"leftover generation directories {present - listed}"
