"""SIGKILL a child process on entry to its k-th file-system call (`ptrace_kill.py`, a ptrace tracer).

The kill lands exactly between two file-system steps: killed on entry to its k-th call of the
`namespace` class (`link`/`linkat`, `rename*`, `mkdir*`, `unlink*`, `rmdir`) the process has made
every change of a directory's entries before that one and none after, so a sweep k = 1, 2, ... walks
through every state a process crash can leave; the `sync` class (`fsync`, `fdatasync`) kills after a
publish and before its directory is synced (for a process crash the state right after the publish).
Calls are counted over all threads in the order they are made (a flush runs on its own thread, its
fsyncs on a pool, Lance on its own threads).

The child (`crash_point_child.py`) imports memwal_df, prints `ready` and waits for its command; the
tracer attaches then, so counting starts with the command, not with the imports. `ChildPool` starts
the next child while the current one runs (the imports take most of a child's time).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.children import SOURCE_ROOT, close_process

CHILD = Path(__file__).with_name("crash_point_child.py")
TRACER = Path(__file__).with_name("ptrace_kill.py")
TIMEOUT = 300.0
CLASSES = {
    "namespace": "link,linkat,rename,renameat,renameat2,mkdir,mkdirat,unlink,unlinkat,rmdir",
    "sync": "fsync,fdatasync",
}
_unavailable: list[str | None] = []


def unavailable() -> str | None:
    """Why a process cannot be killed at a system call here (not Linux x86-64/arm64, ptrace
    refused), or None."""
    if not _unavailable:
        _unavailable.append(_probe())
    return _unavailable[0]


def _probe() -> str | None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"ptrace crash points need Linux on x86-64 or arm64, not {sys.platform} {platform.machine()}"
    script = "import os, sys; print('ready', flush=True); sys.stdin.readline(); os.getppid(); print('alive')"
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        tracer = start_tracer(child.pid, 1, "getppid", None)
        out, _ = child.communicate("go\n", timeout=60)
        said = tracer.communicate(timeout=60)[0]
    except (AssertionError, OSError, subprocess.SubprocessError) as e:
        child.kill()
        child.wait()
        return f"ptrace could not kill a process at a system call: {e}"
    if child.returncode != -signal.SIGKILL or "killed getppid" not in said:
        return f"ptrace could not kill a process at a system call: {said!r} {out!r}"
    return None


def start_tracer(pid: int, k: int, names: str, stderr_path: Path | None) -> subprocess.Popen:
    """`ptrace_kill.py` attached to every thread of `pid` (returns once it is)."""
    err = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL
    try:
        tracer = subprocess.Popen(
            [sys.executable, str(TRACER), str(pid), str(k), names],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    finally:
        if stderr_path:
            err.close()  # type: ignore[union-attr]
    assert tracer.stdout is not None
    line = tracer.stdout.readline()
    if line != "attached\n":
        tracer.kill()
        tracer.wait()
        detail = stderr_path.read_text(errors="replace")[-800:] if stderr_path else ""
        raise OSError(f"the tracer did not attach to {pid}: {line!r} {detail}")
    return tracer


@dataclass
class Run:
    """What a child did: its messages (JSON lines), whether the tracer killed it, and where."""

    messages: list[dict[str, Any]]
    killed: bool  # on entry to the k-th call (else it finished: exit 0)
    kill: tuple[str, int] | None  # (call class, k)
    call: str | None  # the system call it was killed on
    calls: int | None  # when it was not killed: how many calls of the class it made

    def last(self, *kinds: str) -> dict[str, Any] | None:
        """The last message having one of `kinds` as a key."""
        return next((m for m in reversed(self.messages) if any(k in m for k in kinds)), None)


@dataclass
class Child:
    proc: subprocess.Popen
    stderr_path: Path

    def stderr(self, lines: int = 40) -> str:
        return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"the child did not start: {line!r}\n{self.stderr()}"

    def run(self, command: dict[str, Any], kill: tuple[str, int] | None = None) -> Run:
        """Send `command`; with `kill = (class, k)` (a key of `CLASSES`) the child is killed on entry
        to its k-th call of that class from then on. Returns once the child has ended (killed, or
        exit 0 after `done`)."""
        tracer = None
        if kill is not None:
            tracer = start_tracer(
                self.proc.pid, kill[1], CLASSES[kill[0]], self.stderr_path.with_suffix(".tracer")
            )
        try:
            out, _ = self.proc.communicate(json.dumps(command) + "\n", timeout=TIMEOUT)
            said = tracer.communicate(timeout=60)[0] if tracer is not None else ""
        finally:
            for p in (self.proc, tracer):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
        messages = []
        for line in out.splitlines():
            try:
                messages.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        code = self.proc.returncode
        assert code in (0, -signal.SIGKILL), f"child exit {code}: {messages[-3:]}\n{self.stderr()}"
        killed = code == -signal.SIGKILL
        assert killed == said.startswith("killed"), f"tracer: {said!r}, child exit {code}\n{self.stderr()}"
        assert killed or (messages and "done" in messages[-1]), f"child ended early\n{self.stderr()}"
        word = said.split()[1] if said else None
        return Run(
            messages, killed, kill, word if killed else None, int(word) if word and not killed else None
        )

    def close(self) -> None:
        close_process(self.proc)


def start_child(log_dir: Path) -> Child:
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": SOURCE_ROOT + (os.pathsep + path if path else ""),
        "PYTHONDONTWRITEBYTECODE": "1",  # no .pyc renames among the counted calls
    }
    stderr_path = log_dir / f"crash-point-child-{time.monotonic_ns()}.stderr"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-u", str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    return Child(proc, stderr_path)


@dataclass
class ChildPool:
    """Ready children, one taken per run; the next one starts while the taken one works."""

    log_dir: Path
    _next: Child | None = None
    _all: list[Child] = field(default_factory=list)

    def take(self) -> Child:
        child = self._next or self._start()
        self._next = self._start()
        child.wait_ready()
        return child

    def _start(self) -> Child:
        child = start_child(self.log_dir)
        self._all.append(child)
        return child

    def close(self) -> None:
        for child in self._all:
            child.close()
