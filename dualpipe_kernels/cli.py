"""Console entry point ``dualpipe-kernels``.

Each sub-command lives in its own module under ``dualpipe_kernels.commands``
exposing ``add_parser(subparsers)`` and ``run(args) -> int``; adding a command
is adding one module name to ``_COMMANDS``.  Bad arguments exit with status 2
and a single line on stderr, never a traceback; so does an output file that
cannot be written.  ``--version`` prints the package version.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from dualpipe_kernels import __version__

_COMMANDS = ("simulate", "bench", "demo", "plan")


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dualpipe-kernels", description="DualPipe pipeline-parallel schedules, runtime and benchmarks"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in _COMMANDS:
        importlib.import_module(f"dualpipe_kernels.commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # user-facing validation errors: one line, status 2
        sys.stderr.write(f"dualpipe-kernels {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `dualpipe-kernels simulate ... | head`
        sys.stderr.close()
        return 0
    except OSError as e:  # a file the command could not write or read: one line, status 2
        where = f"{e.filename}: " if e.filename else ""
        sys.stderr.write(f"dualpipe-kernels {args.command}: error: {where}{e.strerror or e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
