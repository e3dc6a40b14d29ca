"""``rubricsearch sets create|list|delete``, plus the small helpers every data command shares."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rubricsearch.app.cli.confirm import refused
from rubricsearch.app.cli.remote import add_server_options, client, create_set, delete_set, set_rows

if TYPE_CHECKING:
    from rubricsearch.app.settings import Settings


def cli_settings() -> Settings:
    """Fresh settings from ``RUBRICSEARCH_*`` (not the cached server copy: tests change the environment)."""
    from rubricsearch.app.settings import Settings

    return Settings()


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain left-aligned text table."""
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def register(sub: Any) -> None:
    p = sub.add_parser("sets", help="create, list and delete reference sets")
    actions = p.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create an empty reference set")
    create.add_argument("name")
    create.add_argument("--dimensions", type=int, default=None,
                        help="Matryoshka vector size (64..model hidden size; default: the full size)")
    create.add_argument("--description", default="")
    create.set_defaults(func=run_create)
    listing = actions.add_parser("list", help="list reference sets with their counts")
    listing.set_defaults(func=run_list)
    for action in (create, listing):
        add_server_options(action)
    delete = actions.add_parser("delete", help="delete a set with its images, jobs and vectors")
    delete.add_argument("set", help="id or name")
    delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    add_server_options(delete)
    delete.set_defaults(func=run_delete)


def run_create(args: argparse.Namespace) -> int:
    from rubricsearch.app.sets import set_out
    from rubricsearch.app.state import open_state
    from rubricsearch.retrieval.errors import InvalidInput

    if args.dimensions is not None and args.dimensions < 64:
        raise InvalidInput("--dimensions must be at least 64")
    rs = client(args)
    if rs is not None:
        with rs:
            return create_set(rs, args)
    state = open_state(cli_settings())
    try:
        record = state.ingestion.create_set(args.name, description=args.description,
                                             embedding_dim=args.dimensions)
        out = set_out(state, record)
    finally:
        state.close()
    dims = out.dimensions or "the model's hidden size"
    print(f"created set {out.name!r} (id {out.id}, dimensions {dims})")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from rubricsearch.app.sets import set_out
    from rubricsearch.app.state import open_state
    from rubricsearch.indexer.catalog import list_sets

    rs = client(args)
    if rs is not None:
        with rs:
            rows = set_rows(rs)
    else:
        state = open_state(cli_settings())
        try:
            with state.catalog.read() as session:
                records = list_sets(session)
            sets = [set_out(state, r) for r in records]
        finally:
            state.close()
        rows = [(s.id, s.name, s.dimensions or "-", s.counts.indexed, s.counts.pending, s.counts.failed,
                 s.created_at.strftime("%Y-%m-%d %H:%M")) for s in sets]
    print(table(rows, ["id", "name", "dims", "indexed", "pending", "failed", "created"]) if rows else "no sets")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    from rubricsearch.app.sets import delete_set_everywhere, find_set
    from rubricsearch.app.state import open_state

    rs = client(args)
    if rs is not None:
        with rs:
            return delete_set(rs, args)
    state = open_state(cli_settings())
    try:
        record = find_set(state, args.set)
        if not args.yes:
            status = refused(f"delete set {record.name!r} ({record.id}) with all its images?")
            if status is not None:
                return status
        delete_set_everywhere(state, record)
    finally:
        state.close()
    print(f"deleted set {record.name!r} ({record.id})")
    return 0
