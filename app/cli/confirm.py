"""Asking before a destructive command: never from a pipe, only on an explicit yes."""

from __future__ import annotations

import sys


def refused(question: str) -> int | None:
    """None when the user answered yes; else the exit status (2: no terminal to ask, 1: declined)."""
    if not sys.stdin.isatty():
        print("refusing to delete without --yes (stdin is not a terminal)", file=sys.stderr)
        return 2
    if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
        print("nothing deleted")
        return 1
    return None
