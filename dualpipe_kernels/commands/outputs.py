"""Output paths of the commands, checked before any work starts (a run never ends by failing to save).

Each check raises ValueError naming the option, the path and the system's
reason, which ``cli.main`` prints as one line with exit status 2.  The checks
leave nothing behind except a directory the command would create anyway.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["check_output_file", "check_output_dir"]


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def check_output_file(path: str, option: str) -> None:
    """ValueError unless ``path`` can be written as a file (an existing file is not modified)."""
    if os.path.isdir(path):
        raise ValueError(f"{option} {path}: is a directory, not a file")
    try:
        if os.path.exists(path):
            with open(path, "r+b"):
                pass
        else:
            with open(path, "xb"):
                pass
            os.remove(path)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write: {_reason(exc)}") from None


def check_output_dir(path: str, option: str) -> None:
    """ValueError unless ``path`` is (or can be made) a directory in which files can be written."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write files there: {_reason(exc)}") from None
