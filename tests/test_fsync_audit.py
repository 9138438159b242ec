"""The fsync audit: no code path publishes anything that depends on a file whose bytes or directory
entry were not yet synced.

The power-loss workloads (`tests/support/powerloss_workload.py`) are traced with strace
(`tests/support/powerloss.py`) and `tests/support/powerloss_audit.py` checks every publish of the
run: a Lance version of the base table (also the MemWAL index commits), a region manifest, a WAL
entry, another memwal_df file under `_mem_wal/`, a GC or version cleanup deletion, and the return of
a memwal_df call or of an acknowledged put. At each, every file the run wrote or named before must be
durable (bytes fsynced after the last write, every directory entry on its path fsynced), except the
files of the Lance call that publishes a version (Lance writes without fsync; memwal_df syncs them
after the call). The failure message lists each publish, the unsynced files it depends on, and the
operation and Lance call that wrote them.
"""

from __future__ import annotations

import sys
import textwrap
import uuid

import pytest
from support import powerloss as pl
from support.figures import case_name, record
from support.powerloss_audit import audit

STRACE = pl.strace_works()  # None when strace can trace a child here
pytestmark = pytest.mark.skipif(STRACE is not None, reason=f"needs strace: {STRACE}")

# What every workload must publish at least once, so that the audit cannot pass by seeing nothing.
EXPECTED = {
    "write": {"WAL entry", "region manifest", "return of put", "return of flush"},
    "merge": {"Lance version", "return of merge", "WAL entry"},
    "index": {"Lance version", "return of build_index", "return of catch_up_indexes"},
    "compact": {"Lance version", "return of compact"},
    "gc": {"Lance version", "GC deletion", "version cleanup deletion", "return of gc"},
    "maintain": {"Lance version", "GC deletion", "version cleanup deletion", "return of maintain"},
    "repair": {"memwal_df file", "region manifest", "return of repair_region"},
    "recover": {"region manifest", "return of recover"},
}


def test_no_publish_depends_on_an_unsynced_file(request, tmp_path_factory):
    rec = pl.shared_recording(tmp_path_factory)
    result = audit(rec)
    print(result.report(limit=10_000))
    record(
        pl.GUARANTEE,
        case_name(request),
        publishes_checked=sum(result.publishes.values()),
        publishes_over_unsynced_files=len(result.violations),
    )
    for workload, kinds in EXPECTED.items():
        seen = {kind for (w, kind) in result.publishes if w == workload}
        assert kinds <= seen, f"{workload}: no {sorted(kinds - seen)} publish was seen (saw {sorted(seen)})"
    assert not result.violations, result.report()


# ---------------------------------------------------------------------------------------------------
# the audit itself, on a child that imitates the publishes with known syncs
# ---------------------------------------------------------------------------------------------------

REGION = str(uuid.UUID(int=7))
CHILD = textwrap.dedent(
    """
    import os, sys
    w = os.path.join(sys.argv[1], "w")
    region = sys.argv[2]
    def out(line): os.write(1, (line + "\\n").encode())
    def put(path, data, sync):  # a file written in place (Lance style: no fsync unless `sync`)
        fd = os.open(os.path.join(w, path), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, data)
        if sync: os.fsync(fd)
        os.close(fd)
    def sync_dir(path):
        fd = os.open(os.path.join(w, path), os.O_RDONLY | os.O_DIRECTORY); os.fsync(fd); os.close(fd)
    def publish(path, data):  # memwal_df style: synced temp file, no-clobber link, directory fsync
        d = os.open(os.path.dirname(os.path.join(w, path)), os.O_RDONLY | os.O_DIRECTORY)
        fd = os.open(".", os.O_WRONLY | os.O_TMPFILE, 0o644, dir_fd=d)
        os.write(fd, data); os.fdatasync(fd)
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=d)
        os.close(fd); os.fsync(d); os.close(d)
    manifest = f"_mem_wal/{region}/manifest"
    out("w OP lance-1")
    out("- BEGIN 0 LanceDataset.fake memwal_df/fake.py:1:one")
    put("data/x", b"x", False)
    put("_versions/1.manifest", b"v1", False)  # version 1 over data/x of the same call: allowed
    out("- END 0")
    out("- BEGIN 1 LanceDataset.fake memwal_df/fake.py:2:two")
    put("data/y", b"y", False)
    put("_versions/2.manifest#1", b"v2", False)
    os.link(os.path.join(w, "_versions/2.manifest#1"), os.path.join(w, "_versions/2.manifest"))
    os.unlink(os.path.join(w, "_versions/2.manifest#1"))  # version 2 over call 1's files: violation
    out("- END 1")
    out("w DONE lance-1")  # returns with unsynced files: violation
    out("w OP publish")
    publish(manifest + "/1.binpb", b"m1")  # region manifest over unsynced files: violation
    for path in ("data/x", "data/y", "_versions/1.manifest", "_versions/2.manifest"):
        fd = os.open(os.path.join(w, path), os.O_RDONLY); os.fsync(fd); os.close(fd)
    sync_dir("data")
    publish(manifest + "/2.binpb", b"m2")  # the _versions entries are still not synced: violation
    sync_dir("_versions")
    publish(manifest + "/3.binpb", b"m3")  # everything synced: fine
    os.unlink(os.path.join(w, manifest, "1.binpb"))  # GC deletion, everything synced: fine
    out("w DONE publish")
    """
)


def test_audit_finds_each_publish_over_unsynced_files(tmp_path):
    root = tmp_path / "root"
    for d in ("data", "_versions", f"_mem_wal/{REGION}/manifest"):
        (root / "w" / d).mkdir(parents=True)
    rec = pl.trace_run([sys.executable, "-c", CHILD, str(root), REGION], root, ("w",))
    result = audit(rec)
    found = {
        (v.kind, v.publish.path2 or v.publish.text, tuple(sorted(u.path for u in v.files)))
        for v in result.violations
    }
    m = f"w/_mem_wal/{REGION}/manifest"
    assert found == {
        ("Lance version", "w/_versions/2.manifest", ("w/_versions/1.manifest", "w/data/x")),
        (
            "return of lance-1",
            "DONE lance-1",
            ("w/_versions/1.manifest", "w/_versions/2.manifest", "w/data/x", "w/data/y"),
        ),
        (
            "region manifest",
            f"{m}/1.binpb",
            ("w/_versions/1.manifest", "w/_versions/2.manifest", "w/data/x", "w/data/y"),
        ),
        ("region manifest", f"{m}/2.binpb", ("w/_versions/1.manifest", "w/_versions/2.manifest")),
    }, result.report()
    assert result.publishes[("w", "GC deletion")] == 1 and result.publishes[("w", "region manifest")] == 3
    (v,) = [v for v in result.violations if v.kind == "Lance version"]
    assert "LanceDataset.fake from memwal_df/fake.py:2:two" in v.lance_call
    assert all("data/x" not in u.path or "fake.py:1:one" in u.by for u in v.files)
