"""Power loss: no acknowledged write is lost, and the table always recovers and reads.

Each workload (`tests/support/powerloss_workload.py`: durable puts and deletes with flushes, a merge,
the MemWAL index build and index catch-up, a base compaction, version cleanup and GC, a maintain
round, a region repair, the recovery of a writer killed with SIGKILL) runs on a real local table
under strace; `tests/support/powerloss.py` turns the trace into the file-system effects under the
table directory and builds the states a power loss after any effect can leave: only what was
fsynced, plus write-back up to an earlier moment, plus random subsets of the unsynced effects (a
rename whole or not at all, a file's unsynced writes as a prefix, the last one torn or zeros). Each
distinct state is written out as a real directory, recovered (`open_table(uri).recover()`) and read
through SQL; every write acknowledged before the power failed must read its value or a value a
later write gave the key, every acknowledged delete absent or a later value.

The default run checks a sample of each workload's states; the `slow` case checks over 2,000.
"""

from __future__ import annotations

import os
import random
import sys
import textwrap

import pytest
from support import powerloss as pl
from support import powerloss_states as ps
from support.figures import case_name, record

STRACE = pl.strace_works()  # None when strace can trace a child here
pytestmark = pytest.mark.skipif(STRACE is not None, reason=f"needs strace: {STRACE}")


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> pl.Recording:
    return pl.shared_recording(tmp_path_factory)


def check(request: pytest.FixtureRequest, rec: pl.Recording, per_workload: int, work, seed: int) -> None:
    report = ps.run_states(rec, dict.fromkeys(rec.workloads, per_workload), work, seed=seed)
    print(report.text())
    figures = {
        "crash_points": sum(report.points.values()),
        "states_checked": sum(report.states.values()),
        "acks_checked": report.acks_checked,
        # acknowledged writes read back wrong, summed over crash points; crash points that raised
        "lost_writes": sum(1 for f in report.lost for p in f.problems if p.startswith("LOST")),
        "failed_to_open": len(report.failed),
        **{f"states_{w}": n for w, n in report.states.items()},
    }
    record(pl.GUARANTEE, case_name(request), **figures)
    assert all(n >= per_workload * 0.9 for n in report.states.values()), report.summary()
    assert report.acks_checked > 0
    assert not (report.failed or report.lost or report.wrong), report.text()


def test_power_loss_sample(request, recording, tmp_path):
    check(request, recording, 30, tmp_path, seed=0)


@pytest.mark.slow
def test_power_loss_full(request, recording, tmp_path):
    check(request, recording, 260, tmp_path, seed=1)


# ---------------------------------------------------------------------------------------------------
# the recorder and the state builder on a child whose durability is known
# ---------------------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys
    w = os.path.join(sys.argv[1], "w")
    flags = os.O_WRONLY | os.O_CREAT
    d = os.open(w, os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open(w + "/a", flags, 0o644)  # a: written, fsynced, its entry fsynced
    os.write(fd, b"A" * 10); os.fsync(fd); os.close(fd); os.fsync(d)
    os.write(1, b"w ACK a\\n")
    fd = os.open(w, os.O_WRONLY | os.O_TMPFILE, 0o644)  # t: an unnamed file, synced, then linked
    os.write(fd, b"T" * 7); os.fdatasync(fd); os.link(f"/proc/self/fd/{fd}", "t", dst_dir_fd=d); os.close(fd)
    os.fsync(d)
    fd = os.open(w + "/b", flags, 0o644)  # b: never synced
    os.write(fd, b"B" * 10); os.pwrite(fd, b"b" * 10, 10); os.close(fd)
    fd = os.open(w + "/c.tmp", flags, 0o644)  # c: synced bytes, renamed into place, entry not synced
    os.write(fd, b"C" * 5); os.fdatasync(fd); os.close(fd); os.rename(w + "/c.tmp", w + "/c")
    fd = os.open(w + "/a", os.O_WRONLY | os.O_APPEND)  # a grows: the tail is not synced
    os.write(fd, b"+" * 4); os.close(fd)
    os.mkdir(w + "/sub")  # sub/f: synced in a directory whose own entry is not
    s = os.open(w + "/sub", os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open(w + "/sub/f", flags, 0o644); os.write(fd, b"F"); os.fsync(fd); os.close(fd); os.fsync(s)
    os.unlink(w + "/old")  # old: a base file, unlinked without a directory sync
    """
)


def test_recorder_and_state_builder_follow_what_was_synced(tmp_path):
    root = tmp_path / "root"
    (root / "w").mkdir(parents=True)
    (root / "w" / "old").write_bytes(b"old")
    rec = pl.trace_run([sys.executable, "-c", CHILD, str(root)], root, ("w",))  # verifies the model
    states = ps.CrashStates(rec, "w")
    ack = next(e.index for e in rec.effects if e.kind == "out")

    def contents(state: ps.CrashState) -> dict[str, bytes | None]:
        return {p: data for p, (_, data) in state.files.items()}

    assert contents(states.build(-1, "synced")) == {"old": b"old"}
    assert contents(states.build(ack, "synced")) == {"a": b"A" * 10, "old": b"old"}
    last = states.points[-1]
    assert contents(states.build(last, "synced")) == {"a": b"A" * 10, "t": b"T" * 7, "old": b"old"}
    seen: list[dict[str, bytes | None]] = []
    for seed in range(300):
        mode = ("prefix", "subset")[seed % 2]
        files = contents(states.build(last, mode, random.Random(seed)))
        a = files["a"]
        assert a is not None, files
        assert a[:10] == b"A" * 10 and files["t"] == b"T" * 7, files
        assert a[10:] == bytes(4) or b"++++".startswith(a[10:]), files
        assert files.get("c", b"C" * 5) == b"C" * 5 and not ("c" in files and "c.tmp" in files), files
        assert files.get("sub/f", b"F") == b"F", files
        b = files.get("b")
        assert b is None or len(b) <= 20, files
        seen.append(files)
    assert any("b" not in f for f in seen) and any(f.get("b") == b"B" * 10 + b"b" * 10 for f in seen)
    assert any(f.get("b") not in (None, b"", b"B" * 10 + b"b" * 10) for f in seen)  # torn or zeros
    assert any("c" in f for f in seen) and any("c" not in f for f in seen)
    assert any("old" not in f for f in seen) and any((f["a"] or b"").endswith(b"++++") for f in seen)
    assert any("sub/f" in f for f in seen)
    state = states.build(last, "synced")
    state.materialize(tmp_path / "state")
    assert sorted(os.listdir(tmp_path / "state")) == ["a", "old", "t"]
    assert (tmp_path / "state" / "t").read_bytes() == b"T" * 7
