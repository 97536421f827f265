"""argparse types shared by the subcommands: parse a number, or fail with a message naming the text."""

from __future__ import annotations

import argparse

__all__ = ["parse_float", "parse_int"]


def parse_float(text: str) -> float:
    """``float(text)``; argparse.ArgumentTypeError ``not a number: 'text'`` otherwise (inf and nan parse)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def parse_int(text: str) -> int:
    """``int(text)``; argparse.ArgumentTypeError ``not an integer: 'text'`` otherwise."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
