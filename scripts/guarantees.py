"""Render docs/guarantees.md from the figures a test run recorded (tests/support/figures.py).

    python scripts/guarantees.py [FIGURES_JSON] [OUTPUT_MD]

Defaults: build/reliability.json -> docs/guarantees.md. The guarantees, what proves each and the
limits are written here; every number in the output comes from the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

GUARANTEES = {
    "a crashed job or writer loses nothing acknowledged": (
        "A durable write that returned is never lost, and no write is ever kept in part (per region), "
        "whatever process dies where: writers (during a WAL append, a claim, any step of a MemTable "
        "flush, at random moments), mergers (between the tombstone and the upsert pass, before and after "
        "the upsert commit), GC (after unlisting generations, inside a directory's deletion, between WAL "
        "deletions), the index builder (after a WAL hint, before and after its commit), and a writer and "
        "the job loop SIGKILLed together at random moments. After each crash a new writer claims and "
        "replays, and the stored rows, a crash-now view, the reader of the latest base version and every "
        "retained base version equal a state the acknowledged writes lead to; merge progress never goes "
        "back; running every job to completion leaves the model in the base and nothing half-deleted."
    ),
    "kills inside a region claim": (
        "A writer process SIGKILLed inside a region claim loses nothing acknowledged. A ptrace tracer "
        "(`tests/support/ptrace_kill.py`) kills it on entry to its k-th file-system call, for k = 1, 2, "
        "... until a run ends unkilled, so every step is a crash point: each change of a directory's "
        "entries (`link`, `rename`, `mkdir`, `unlink` families) and each `fsync` / `fdatasync`. The "
        "claims are those of a region holding a dead writer's unflushed durable WAL entries (the manifest "
        "version with the raised epoch, its version hint, the fence sentinel, the version recording it) "
        "and of a region that does not exist yet (its directories, manifest version 1), round after round "
        "with durable writes (acknowledged once the call returned) in between. After each kill the table "
        "opens, `status` and the SQL reader work and the reader shows exactly what is stored; what a crash "
        "now would leave is the acknowledged state (the write in flight whole or absent); every region "
        "keeps its invariants (a first claim killed before its commit leaves a region directory without "
        "a manifest version and nothing else in it); recovery stores exactly that state, a second "
        "recovery has nothing to do, and the region takes a new write. Local storage: on S3 the steps are "
        "HTTP requests."
    ),
    "kills during recovery": (
        "`open_table(uri).recover()` SIGKILLed on entry to its k-th file-system call, counted over all "
        "its threads (the claims and replays, then each flush: Lance's data, transaction and manifest "
        "files, the bloom filter, the primary-key index, the checksum sidecar, the syncs, the manifest "
        "commit and version hint; two regions, each with a flushed generation and unflushed durable WAL "
        "entries of a dead writer), then killed again at a random position up to k, then run to the "
        "end, leaves every write the dead writer acknowledged with its value; after each kill the durable "
        "state is exactly the acknowledged one and the table opens and reads, and after the recovery GC "
        "removes every generation directory the killed flushes left."
    ),
    "a power loss loses nothing acknowledged": (
        "A power loss at any moment of durable writes and flushes, a merge, the MemWAL index build and "
        "index catch-up, a base compaction, version clean-up and GC, a maintain round, a region repair "
        "and a recovery loses no acknowledged write, and the table recovers and reads. Each workload "
        "runs on a real local table under strace (`tests/support/powerloss*.py`); every state the file "
        "system can be left in after any recorded effect is built from the trace (only what was "
        "fsynced; plus write-back up to an earlier moment; plus random subsets of the unsynced effects: "
        "a rename whole or not at all, a file's unsynced writes as a prefix, the last one torn or zeros), "
        "recovered with `open_table(uri).recover()` (which sets aside a newest base version that did "
        "not survive whole) and read through SQL: every acknowledged write reads its value or a later "
        "one, every acknowledged delete reads absent or a later value. The fsync audit "
        "(`tests/test_fsync_audit.py`) checks on the same traces that no publish (a Lance version, a "
        "region manifest, a WAL entry, a GC or clean-up deletion, an acknowledgement, a returning call) "
        "depends on a file whose bytes or directory entry were not yet synced, but the files of the "
        "Lance call that publishes the version itself. What is synced when: `docs/writing.md`."
    ),
    "durable writes survive storage faults": (
        "Under refused requests, writes whose answer is lost after they landed, and slow requests, on any "
        "memwal_df storage call (claims, WAL appends, manifest commits, reads), with crashes and reclaims "
        "in between, the table ends in a state the acknowledged writes lead to (writes that raised: whole "
        "or absent), with every structural invariant (contiguous manifest versions and WAL, epochs "
        "stepping by one, complete generations). Also with the S3 server killed mid-run: writes fail with "
        "`StorageError` while it is down, and after it restarts on the same port (its state replayed by "
        "moto's request recorder: moto keeps no state of its own across restarts) the same writer goes on. "
        "Merge, index build, version cleanup and GC on a faulty handle fail only with typed errors, and "
        "a clean reader sees exactly the model after every round."
    ),
    "nothing corrupt is read": (
        "A torn WAL entry or manifest (a store that breaks atomicity) raises `CorruptWalEntryError` / "
        "`CorruptManifestError` naming the file at the next write, claim and recovery (`recover`: inside "
        "`CorruptRegionsError`); it is never skipped, and `repair_region` sets a torn trailing WAL entry "
        "aside. A torn or vanishing `version_hint.json` is harmless: readers and writers probe past it."
    ),
    "bad input never corrupts a table; nothing corrupt is read": (
        "Wrongly typed, misnamed, lossy or NULL keys and values, puts lacking a column (a put replaces "
        "whole rows) and vectors of another dimension are typed errors naming the column before any "
        "region receives a row (not even its WAL); duplicate keys in one batch resolve to the last row "
        "through flush and merge (the base keeps one row per key); every primary-key type Lance 14 "
        "accepts round-trips through put, delete, crash + replay, flush, merge and the SQL reader; a "
        "corrupt WAL entry or manifest makes every entry point fail with the typed error naming the file "
        "(claim, recover, routed write; for a manifest also merge, GC, index build, and SQL through "
        "DataFusion's wrapper; jobs over many regions raise it inside `CorruptRegionsError` after the "
        "healthy regions) and `status` lists it; foreign files in the table directory are ignored and "
        "kept; a put of hundreds of MB is written with a working set that does not grow with the batch."
    ),
    "a corrupt region stays one region's problem": (
        "A region with a corrupt WAL entry or manifest fails only what needs it: `recover`, merge, GC and "
        "the index build finish every healthy region and then raise `CorruptRegionsError` naming each "
        "skipped region and file (the maintain loop keeps running); a routed write stores the rows of "
        "healthy regions and refuses the corrupt region's; `status` lists the file and error; a query "
        "whose lookup keys or filter rule the region out runs, any other raises the typed error. "
        "`repair_region` changes nothing until confirmed, then sets a corrupt trailing WAL entry aside "
        "into the region's quarantine directory behind a new epoch's fence sentinel (a corrupt entry "
        "followed by valid ones only with `discard_later`), after which memwal_df and Lance claim and "
        "replay the region again."
    ),
    "verified reads": (
        "Every file memwal_df writes for a flushed generation (data, manifests, version hint, "
        "transactions, `bloom_filter.bin`, `_pk_index/`, maintained indexes) is listed with its size and "
        "CRC-32 in the generation's checksum sidecar (itself checksummed), written before the directory is "
        "synced and listed in a region manifest. Readers verify a generation before reading anything "
        "from it (once per process), the merger before every read of it. Damage to any of these files at "
        "random offsets (flipped bytes, zeroed ranges), a missing or an unlisted file, never yields a "
        "wrong answer: scans, counts, lookups and filters return exactly the dict model or raise "
        "`CorruptGenerationError` naming the region, generation and file (always, once a byte changed); "
        "a zeroed bloom filter is an error, never 'key not found'; lookups in other regions are "
        "answered. The merger refuses a corrupt generation (the generations before it merge, the base "
        "keeps the rest, other regions merge); `status` lists it and `memwal status` exits 1; "
        "`repair_region` rebuilds it from its WAL entries or, when they are gone, sets it aside and counts "
        "the rows lost. A generation Lance's own writer made (no sidecar) with a repeated key or a row "
        "count other than its manifest entry's is refused before a merge. Lance reads generations with "
        "the sidecar (`lance.dataset`, `LsmScanner`, `LsmPointLookupPlanner`, a native merge)."
    ),
    "one key, one region": (
        "A primary key lives in exactly one region. A region spec may read primary-key columns only: "
        "every transform over another column is refused with `NonKeyRegionColumnError` wherever a spec "
        "is created or added (`create_table`, `memwal create`, `memwal_index.initialize`, "
        "`replace_details`), and the refused create leaves nothing at the URI (local and S3). Over key "
        "columns, random histories of upserts (changing every other column), deletes and flushes keep "
        "each key in the generations of one region, for every transform, and SQL returns each key "
        "once. A region writer opens an existing region or a new one named by its values: an unknown "
        "region id on a table with a spec is refused (`UnknownRegionError`, API and `memwal ingest "
        "--region`) and creates nothing. A table whose spec was made elsewhere on a non-key column "
        "opens and reads, and every writer refuses it unless the caller opts in."
    ),
    "fencing: one writer per epoch": (
        "Claimers racing for one region (processes, and threads on a slow store) each get their own "
        "epoch; no two acknowledged writes share a WAL position; the WAL holds exactly the acknowledged "
        "writes and the last claim's replay holds, per key, the acknowledged write with the highest "
        "position."
    ),
    "under load every read is fresh and memory is bounded": (
        "Four regions written at full speed by four durable writer processes while a process merges, "
        "builds and catches up indexes, cleans up versions and garbage-collects, and the test reads the "
        "table through SQL again and again: every read shows, per key, a state its writer wrote and never "
        "an older state than an earlier read showed; at the end every view equals the model from the "
        "writers' logs and merge progress only went forward. Peak RSS (VmHWM) per process is recorded; "
        "writers run with an 8 MiB unflushed-MemTable limit (backpressure)."
    ),
    "reader freshness": (
        "A `MemWalTable` registered once in a `SessionContext` (a service embedding DataFusion) reads, "
        "at every query, the base table's latest version, found by Lance's own latest-version "
        "resolution (never inferred from a missing version + 1, which version cleanup deletes while "
        "newer versions exist), and each region's latest manifest. Queried through every read path "
        "(count, full scan, point lookups, a filter, vector_search, fts, memwal_explain) after each of "
        "several rounds of writes, merge, index build, cleanup of every base version but the latest "
        "and GC without a grace period, on local storage and S3, in `latest` mode (also after a flush "
        "not merged yet) and `snapshot` mode, it returns exactly the model of every write. A region "
        "manifest read before is reused only while it is provably the latest, also when GC deletes it "
        "and its successor during the check. The writer state machine (`tests/test_state_machine.py`) "
        "also keeps one registered reader across random writes, crashes, recoveries and job rounds and "
        "compares it after every step with a table opened afresh. Read state carried across "
        "versions is exact: one context with the durable table and the writer's table registered "
        "once answers every query shape (counts, scans with and without the key, filters, key ranges, "
        "top-k, GROUP BY, LIMIT, point lookups, fts against a reference BM25, vector_search against "
        "brute force) like a dict model after every step of random histories of writes, flushes, "
        "merges, index builds and catch-ups, Lance compactions of the base, version cleanups, GC and "
        "writer reopens, with and without base indexes, and at each lifecycle edge a cache could get "
        "wrong (a query planned before a merge and run after it, a generation collected between two "
        "queries, a region created after registration, the base version of an earlier query cleaned "
        "up, a key in two generations of which one is merged, a delete of a key only the base holds)."
    ),
}

PROOF = {
    "test_crash.py": "writer crash points (flush, claim, WAL), SIGKILL streams, racing claim processes",
    "test_crash_jobs.py": "merger / GC / index builder crash points; writer + job loop SIGKILLed at random",
    "test_crash_points.py": (
        "SIGKILL on entry to the k-th file-system call (a ptrace tracer) inside claims and recovery"
    ),
    "test_power_loss.py": "states a power loss leaves, built from strace records of eight workloads",
    "test_fsync_audit.py": "no publish depends on an unsynced file, on the same traces",
    "test_base_durability.py": "each base commit fsynced; torn newest base versions rolled back",
    "test_faults.py": "tests/support/faulty_storage.py over the real local / S3 storage; moto restart",
    "test_bad_input.py": "bad input, key types, corrupt files, foreign files, huge batches",
    "test_generation_checksums.py": (
        "damaged, missing and unlisted generation files vs a dict model; merge, status, repair, Lance"
    ),
    "test_corrupt_regions.py": (
        "a corrupt region among healthy ones: recover, writes, status, jobs, queries, repair"
    ),
    "test_load.py": "4 writer processes + job process + reader",
    "test_region_integrity.py": "key-column region specs, phantom region ids, all-or-nothing create",
    "test_reader_freshness.py": "a registered reader across job rounds with cleanup and GC",
    "test_read_state.py": "every SQL shape and both searches vs a dict model across random histories",
}


def render(data: dict) -> str:
    run = data.get("_run", {})
    out = [
        "# Guarantees and what proves them",
        "",
        "Generated by `scripts/guarantees.py` from the figures the reliability tests recorded "
        f"(`tests/support/figures.py`) in the run of {run.get('started', '?')} to {run.get('ended', '?')} "
        "(`make reliability`: the reliability test files, default sample and `slow` cases"
        + (
            f", plus {run['follow_ups']} follow-up run(s) of tests added or fixed after it"
            if run.get("follow_ups")
            else ""
        )
        + "). "
        "Do not edit by hand. Counts add up over the parametrized cases of a test; `peak_*` are maxima.",
        "",
    ]
    totals: dict[str, float] = {}
    for guarantee, text in GUARANTEES.items():
        out += [f"## {guarantee[0].upper()}{guarantee[1:]}", "", text, ""]
        tests = data.get(guarantee, {})
        if not tests:
            out += ["_No figures in this run._", ""]
            continue
        out += ["| test | cases | figures |", "|---|---:|---|"]
        for test, figures in sorted(tests.items()):
            shown = ", ".join(
                f"{k.replace('_', ' ')} {v:,}" for k, v in sorted(figures.items()) if k != "runs"
            )
            out.append(f"| `{test}` | {figures['runs']} | {shown} |")
            for k, v in figures.items():
                if k in ("crash_points", "faults_injected", "rows_checked", "writes_acknowledged"):
                    totals[k] = totals.get(k, 0) + v
                elif k.startswith("peak_"):
                    totals[k] = max(totals.get(k, 0), v)
        out.append("")
    out += ["## Totals of the run", ""]
    out += [f"- {k.replace('_', ' ')}: {v:,}" for k, v in sorted(totals.items())]
    out += ["", "## Test files", ""]
    out += [f"- `tests/{name}`: {what}" for name, what in PROOF.items()]
    out += [
        "",
        "## Limits",
        "",
        "- A region manifest torn exactly at a protobuf field boundary after its region id (only the "
        "region values follow it) would decode; every earlier cut is caught (`CorruptManifestError`).",
        "- WAL entries written by Lance's native writer (or by memwal_df before entries carried a "
        "checksum) are unchecked: a bit flip in their value buffers that keeps the Arrow IPC "
        "structure valid cannot be detected; torn and structurally broken entries are.",
        "- Generations are verified once per process by readers: damage after that is seen by merges, "
        "`status` and new processes, not by the readers of that process.",
        "- The SQL reader reports a corrupt manifest through DataFusion, which wraps the typed error in "
        "its own exception: the message names the error type and the file.",
        "- A `cleanup_old_versions` (Lance) killed midway can leave base versions it condemned listed "
        "with files already deleted: Lance cannot read them (time travel to them fails); the latest "
        "version is never affected and memwal_df's GC counts them as retained (conservative). The "
        "random-kill tests skip exactly those (`half cleaned versions skipped`).",
        "- A reader of a base version that `cleanup_old_versions` removes while it reads fails in "
        "Lance: keep versions longer than queries run (the load test keeps them 20 s).",
        "- Power loss is simulated on local storage with the strict POSIX model (an fsync of a file "
        "does not make its name durable); object stores need none of it (a completed PUT is durable).",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "reliability.json"
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs" / "guarantees.md"
    dst.write_text(render(json.loads(src.read_text())))
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
