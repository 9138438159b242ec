"""The `memwal` command line: `memwal COMMAND --help` describes each command.

Commands: create, ingest, delete, sql (a shell without a query), explain, status, merge, build-index,
compact, gc, recover, repair, maintain, bench, serve. Errors print one line on stderr (with `--json`: the
document `{"error": {"type": ..., "message": ...}}` on one line of stdout) and exit with a code of
`Exit` (docs/operations.md): 2 bad arguments or data, 3 no such table or file, 4 lost a race or
fenced (retry), 5 storage failure, 6 SQL error, 1 anything else; 130 on Ctrl-C (143: `ingest` / `delete`
on SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from memwal_df.cli import bench, create, ingest, jobs, query, serve, status
from memwal_df.cli.common import Exit, error_document, exit_code

__all__ = ["Exit", "main", "parser"]


def parser(prog: str = "memwal") -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `memwal` parser and each command's own parser by name."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Streaming-upsert Lance tables (the Lance MemTable & WAL spec), queried with DataFusion.",
        epilog="Run `memwal COMMAND --help` for a command's options. Docs: docs/operations.md.",
    )
    p.add_argument("--traceback", action="store_true", help="on an error, print the full traceback")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (create, ingest, query, status, jobs, bench, serve):
        module.register(sub)
    return p, sub.choices


def main(argv: list[str] | None = None, prog: str = "memwal") -> int:
    """Run one command; returns its exit code (argparse's usage errors exit with 2 themselves)."""
    p, commands = parser(prog)
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = p.parse_known_args(argv)
    if extra:
        # argparse's first pass cannot take an option between two positionals (`delete URI -o K=V
        # FILE`, `explain URI -o K=V "id = 1"`): parse the command's own words again, intermixed.
        sub = commands[args.command]
        position = argv.index(args.command)
        args = argparse.Namespace(**{**vars(args), **vars(sub.parse_intermixed_args(argv[position + 1 :]))})
    try:
        return int(args.run(args))
    except BrokenPipeError:  # the reader of stdout went away (`memwal ... | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OK
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except Exception as e:  # noqa: BLE001 - every error becomes a message and an exit code
        if args.traceback:
            raise
        if getattr(args, "json", False):
            print(json.dumps(error_document(e)), flush=True)
            return int(exit_code(e))
        notes = "".join(f"\n  {n}" for n in getattr(e, "__notes__", ()))
        print(f"{prog} {args.command}: error: {type(e).__name__}: {e}{notes}", file=sys.stderr)
        return int(exit_code(e))
