"""Power-loss simulation: record what a workload does to the file system, build the states a power
loss could leave behind, and check each of them.

**Recorder** (this module and `powerloss_trace.py`). `record(root, workloads)` runs
`powerloss_workload.py setup` (untraced), makes the result durable with `os.sync()` and reads it
back as the *base state*, then runs `powerloss_workload.py run` under `strace -f -y -xx`
(`STRACE_ARGS`); `trace_run` does the same for any command. `powerloss_trace.parse_trace` turns the
trace into the ordered list of file-system effects on paths under `root` (`Effect`), following
O_TMPFILE files, renames, hard links, descriptors of many threads, and when each effect became
durable. After the run, the model's tree must equal the real directory byte for byte
(`Recording.verify`), so an effect the recorder missed (a system call it does not trace, an mmap
write) fails the run instead of going unnoticed. The child's stdout (one `write(1, ...)` per line,
see `powerloss_workload.py`) is part of the trace: the position of each `ACK` line says which writes
were acknowledged before a crash point, `OP` lines name the Python operation each effect belongs to,
and `BEGIN`/`END` lines the Lance call (for the fsync audit, `powerloss_audit.py`).

**Crash states** (`powerloss_states.py`). `CrashStates.build(point, mode, rng)` is the durable state
of one workload's table after a power loss right after effect `point` (a global effect index):
* `synced`: only what was made durable: a directory entry change survives iff its directory was
  fsynced after it (a rename: both directories); a file's bytes survive up to its last fsync /
  fdatasync; everything else is lost (an unsynced new file is absent or empty).
* `subset`: also a random subset of the unsynced directory changes (a rename lands whole or not at
  all), and per file a random prefix of its unsynced writes, the last one landed torn (a prefix of
  its bytes) or as zeros.
* `prefix`: also everything that completed before a random earlier moment (write-back up to then).
Each state is written out as a real directory (`materialize`): the base state plus the landed
effects; identical states are checked once (`fingerprint`).

**Checker** (`powerloss_states.py`). `check_state(path)` (run in worker processes) calls
`memwal_df.open_table(path).recover()`, then reads `SELECT id, value FROM t` and
`SELECT count(*) FROM t` through a DataFusion `SessionContext` with `memwal_df.register`; every
exception is recorded. `Expectations.check` then compares the rows with the writes acknowledged
before the crash point: an acknowledged key reads its acknowledged value or a value a later write of
the workload (started before the crash point) gave it; an acknowledged delete reads absent or such a
later value; a key is never read twice, and no value is read that no write gave. The `repair`
workload starts from a torn WAL entry: its states where the repair has not landed raise
`CorruptRegionsError` at recovery, and the checker then follows the operator's procedure
(`repair_region(apply=True)`, `recover()` again; `REPAIRED`). `run_states` builds, checks and
reports (`Report`) the states of every workload.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import memwal_df
from support.powerloss_trace import DATA_OPS, DIR_OPS, Effect, LanceCall, RecorderError, Tree, parse_trace

__all__ = [
    "DATA_OPS",
    "DIR_OPS",
    "GUARANTEE",
    "Effect",
    "LanceCall",
    "RecorderError",
    "Recording",
    "Tree",
    "record",
    "shared_recording",
    "strace_works",
    "trace_run",
]

WORKLOAD = Path(__file__).with_name("powerloss_workload.py")
SOURCE_ROOT = str(Path(memwal_df.__file__).resolve().parents[1])  # the memwal_df under test

SYSCALLS = (
    "open,openat,creat,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync,sync_file_range,"
    "syncfs,sync,rename,renameat,renameat2,link,linkat,unlink,unlinkat,mkdir,mkdirat,rmdir,"
    "ftruncate,truncate,fallocate,close,copy_file_range,sendfile,lseek,dup,dup2,dup3"
)
STRACE_ARGS = ("strace", "-f", "-qq", "-xx", "-s", "100000000", "-y", "-e", f"trace={SYSCALLS}")

# The guarantee the power-loss tests and the fsync audit record their figures under.
GUARANTEE = "a power loss loses nothing acknowledged"


# -------------------------------------------------------------------------------- a recording


@dataclass
class Recording:
    """The base state and the effects of one traced run of workloads under `root`."""

    root: Path
    workloads: tuple[str, ...]
    base: Tree
    effects: list[Effect]
    lance_calls: list[LanceCall]
    setup_lines: dict[str, list[str]]
    final: Tree  # the parser's model after the last effect

    def verify(self) -> None:
        """The model after every effect must be the real directory, byte for byte."""
        model = {
            p: (bytes(self.final.content[i]) if i in self.final.content else None)
            for p, i in self.final.files()
        }
        disk: dict[str, bytes | None] = {}
        for directory, dirs, files in os.walk(self.root):
            for name in dirs:
                disk[os.path.relpath(os.path.join(directory, name), self.root)] = None
            for name in files:
                full = os.path.join(directory, name)
                disk[os.path.relpath(full, self.root)] = Path(full).read_bytes()
        problems = [
            f"{p}: model {'dir' if model.get(p, b'') is None else len(model.get(p) or b'')}, "
            f"disk {'dir' if disk.get(p, b'') is None else len(disk.get(p) or b'')}"
            for p in sorted(set(model) | set(disk))
            if p not in model or p not in disk or model[p] != disk[p]
        ]
        if problems:
            raise RecorderError(
                f"the recorded effects do not lead to the real directory ({len(problems)} paths):\n"
                + "\n".join(problems[:40])
            )

    def lines(self, workload: str) -> list[Effect]:
        return [e for e in self.effects if e.kind == "out" and e.workload == workload]


def _child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": SOURCE_ROOT + (os.pathsep + path if path else ""),
        "PYTHONUNBUFFERED": "1",
        "RUST_LOG": "off",
    }


def strace_works() -> str | None:
    """None if strace can trace a child here, else why not."""
    if shutil.which("strace") is None:
        return "strace is not installed"
    try:
        p = subprocess.run([*STRACE_ARGS, "-o", "/dev/null", "true"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"strace does not run: {e}"
    return None if p.returncode == 0 else f"strace fails: {p.stderr.decode(errors='replace')[-500:]}"


def record(root: Path, workloads: Iterable[str]) -> Recording:
    """Set up each workload's table under `root` (untraced), make it durable, trace the run."""
    workloads = tuple(workloads)
    root = Path(os.path.realpath(root))
    root.mkdir(parents=True, exist_ok=True)
    env = _child_env()
    setup = subprocess.run(
        [sys.executable, "-u", str(WORKLOAD), "setup", str(root), *workloads],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=600,
    )
    lines = setup.stdout.splitlines()
    if not lines or lines[-1] != "- EXIT":
        raise RuntimeError(f"workload setup failed (exit {setup.returncode}):\n{setup.stderr[-4000:]}")
    setup_lines: dict[str, list[str]] = defaultdict(list)
    for line in lines:
        who, _, rest = line.partition(" ")
        setup_lines[who].append(rest)
    return trace_run(
        [sys.executable, "-u", str(WORKLOAD), "run", str(root), *workloads],
        root,
        workloads,
        dict(setup_lines),
    )


def trace_run(
    command: list[str],
    root: Path,
    workloads: tuple[str, ...],
    setup_lines: dict[str, list[str]] | None = None,
) -> Recording:
    """Make `root` durable and take it as the base state, run `command` under strace (cwd `root`,
    stdout into the trace only), and return its effects on `root`, checked against the disk."""
    root = Path(os.path.realpath(root))
    os.sync()
    base = Tree.scan(root)
    trace = root.parent / f"{root.name}.strace"
    run = subprocess.run(
        [*STRACE_ARGS, "-o", str(trace), *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
        cwd=root,
        timeout=900,
    )
    if run.returncode != 0:
        raise RuntimeError(f"traced run failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    effects, calls, final = parse_trace(trace, root, workloads, base)
    rec = Recording(root, workloads, base, effects, calls, setup_lines or {}, final)
    rec.verify()
    return rec


_RECORDINGS: dict[str, Recording] = {}


def shared_recording(tmp_path_factory: Any) -> Recording:
    """The recording of every workload, made once per pytest run (the power-loss tests and the fsync
    audit share it)."""
    from support.powerloss_workload import WORKLOADS

    root = tmp_path_factory.getbasetemp() / "powerloss" / "tables"
    key = str(root)
    if key not in _RECORDINGS:
        _RECORDINGS[key] = record(root, WORKLOADS)
    return _RECORDINGS[key]
