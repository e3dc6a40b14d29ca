"""The ``rubricsearch`` command line; each sub-command lives in its own module of this package, or in a plug-in."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from rubricsearch.app.plugins import plugins
from rubricsearch.retrieval.errors import BackendUnavailable, RubricSearchError

# Modules that define ``register(subparsers)``; a sub-command sets ``func(args) -> int``.
COMMAND_MODULES = tuple(f"{__name__}.{name}" for name in
                        ("models", "sets", "ingest", "search", "jobs", "judgments", "train", "serve", "worker"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rubricsearch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for plugin in plugins():  # the demo's commands, and any other installed plug-in's
        plugin.register_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RubricSearchError as exc:
        print(f"error ({exc.kind}): {exc.message}", file=sys.stderr)
        from rubricsearch.app.cli.manifests import error_rows

        for line in error_rows(exc.details):
            print(line, file=sys.stderr)
        hint = next_step(args, exc)
        if hint:
            print(hint, file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a person stopped it; a traceback would only hide what to do next
        print("\ninterrupted (run the same command again to resume: finished work is kept)", file=sys.stderr)
        return 130


def next_step(args: argparse.Namespace, exc: RubricSearchError) -> str | None:
    """What to try when an in-process data command cannot open what it needs here: a server that holds this
    data dir (``serve``, ``demo``) can run the same command through its API."""
    if isinstance(exc, BackendUnavailable) and hasattr(args, "server") and not args.server:
        return ("next step: if a server (`rubricsearch serve` or `rubricsearch demo`) uses this data dir, run the "
                "command through it: add --server URL (e.g. --server http://127.0.0.1:8000, or set "
                "RUBRICSEARCH_CLIENT_URL) and --api-key KEY where it needs one")
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
