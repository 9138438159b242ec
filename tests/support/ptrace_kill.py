"""Kill a running process on entry to its k-th call of a set of system calls, counted over all its
threads in the order they make them: a minimal ptrace tracer (standard library only, Linux x86-64
and arm64).

    python ptrace_kill.py PID K NAME[,NAME...]

It attaches to every thread of PID (and follows new ones), prints `attached` once all are traced,
then stops each thread at every system call entry. At the k-th entry of a call in NAMES it sends
SIGKILL while that thread is still stopped there, so the call never runs: the process dies with
exactly the k-1 earlier calls made (each of them entered, and so completed: a file-system call is not
interrupted half-way). Prints `killed NAME` then, or `ended N` (N calls seen) when the process ended
first. strace's `-e inject=NAME:signal=SIGKILL:when=K` does the same per thread; this counts across
threads, so a call made by a flush thread or a file-system worker pool has a position too.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import sys

PTRACE_SYSCALL = 24
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_LISTEN = 0x4208
PTRACE_GET_SYSCALL_INFO = 0x420E
PTRACE_O_TRACESYSGOOD = 0x1
PTRACE_O_TRACECLONE = 0x8
PTRACE_O_EXITKILL = 0x100000
PTRACE_EVENT_STOP = 128
SYSCALL_INFO_ENTRY = 1
WALL = 0x40000000
OPTIONS = PTRACE_O_TRACESYSGOOD | PTRACE_O_TRACECLONE | PTRACE_O_EXITKILL

# System call numbers of the calls the crash tests count (arm64 has only the *at forms).
NUMBERS = {
    "x86_64": {
        "link": 86, "linkat": 265, "rename": 82, "renameat": 264, "renameat2": 316, "mkdir": 83,
        "mkdirat": 258, "unlink": 87, "unlinkat": 263, "rmdir": 84, "fsync": 74, "fdatasync": 75,
        "openat": 257, "getppid": 110,
    },
    "aarch64": {
        "linkat": 37, "renameat": 38, "renameat2": 276, "mkdirat": 34, "unlinkat": 35, "fsync": 82,
        "fdatasync": 83, "openat": 56, "getppid": 173,
    },
}  # fmt: skip


class SyscallInfo(ctypes.Structure):  # struct ptrace_syscall_info, entry member of the union
    _fields_ = [
        ("op", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
        ("arch", ctypes.c_uint32),
        ("instruction_pointer", ctypes.c_uint64),
        ("stack_pointer", ctypes.c_uint64),
        ("nr", ctypes.c_uint64),
        ("args", ctypes.c_uint64 * 6),
        ("rest", ctypes.c_uint64 * 2),
    ]


libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long


def ptrace(request: int, tid: int, addr: int = 0, data: int | ctypes.c_void_p = 0) -> int:
    result = libc.ptrace(request, tid, addr, data)
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")
    return result


def resume(tid: int, sig: int = 0) -> None:
    try:
        ptrace(PTRACE_SYSCALL, tid, 0, sig)
    except OSError:  # the thread is gone meanwhile
        pass


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def attach(pid: int) -> None:
    """Seize every thread of `pid` and resume each, stopping at system calls from then on."""
    seized: set[int] = set()
    while True:  # until no thread appeared while seizing (the process is idle, so once or twice)
        tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - seized
        if not tids:
            break
        for tid in tids:
            try:
                ptrace(PTRACE_SEIZE, tid, 0, OPTIONS)
                ptrace(PTRACE_INTERRUPT, tid)
            except OSError as e:
                if e.errno != errno.ESRCH:
                    raise
                continue  # the thread ended meanwhile (an idle worker thread retiring)
            seized.add(tid)
    waiting = set(seized)
    while waiting:  # each reports the stop of its interrupt (or of its exit)
        tid, status = os.waitpid(-1, WALL)
        waiting.discard(tid)
        if os.WIFSTOPPED(status):
            resume(tid)


def trace(pid: int, k: int, names: list[str]) -> None:
    numbers = NUMBERS[platform.machine()]
    targets = {numbers[n]: n for n in names if n in numbers}
    attach(pid)
    say("attached")
    info = SyscallInfo()
    count = 0
    while True:
        try:
            tid, status = os.waitpid(-1, WALL)
        except ChildProcessError:  # every traced thread has ended
            say(f"ended {count}")
            return
        if not os.WIFSTOPPED(status):
            continue
        sig, event = os.WSTOPSIG(status), status >> 16
        if sig == signal.SIGTRAP | 0x80:  # a system call stop
            ptrace(PTRACE_GET_SYSCALL_INFO, tid, ctypes.sizeof(info), ctypes.addressof(info))
            if info.op == SYSCALL_INFO_ENTRY and info.nr in targets:
                count += 1
                if count == k:
                    os.kill(pid, signal.SIGKILL)  # `tid` stays stopped at the entry: the call never runs
                    say(f"killed {targets[info.nr]}")
                    return
            resume(tid)
        elif event == PTRACE_EVENT_STOP:
            if sig in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
                ptrace(PTRACE_LISTEN, tid)  # a group stop: stay stopped until SIGCONT
            else:
                resume(tid)  # a new thread's first stop
        elif event:
            resume(tid)  # a clone event
        else:
            resume(tid, sig)  # a signal for the process: deliver it


def main() -> None:
    pid, k, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    trace(pid, k, names)


if __name__ == "__main__":
    main()
