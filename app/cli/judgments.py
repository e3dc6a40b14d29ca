"""``rubricsearch judgments list|add|import|export|derive|delete SET ...``: a set's judgments through a running
server's API (``--server URL``); the judgments are recorded where the server's catalog is."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rubricsearch.app.cli.confirm import refused
from rubricsearch.app.cli.remote import add_server_options
from rubricsearch.app.cli.sets import table

if TYPE_CHECKING:
    from pydantic import BaseModel

    from rubricsearch.app.client import Client
    from rubricsearch.app.schemas.judgments import JudgmentOut

T = TypeVar("T", bound="BaseModel")

NDJSON = "application/x-ndjson"
HEADERS = ["id", "image", "sha256", "criterion", "holds", "source", "author", "created"]


def register(sub: Any) -> None:
    p = sub.add_parser("judgments", help="record, list, import, export, derive and delete a set's judgments "
                                         "(through --server)")
    actions = p.add_subparsers(dest="action", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = actions.add_parser(name, help=help)
        parser.add_argument("set", help="the set's id or name")
        add_server_options(parser)
        return parser

    listing = action("list", "list judgments, newest last")
    _filters(listing)
    listing.add_argument("--limit", type=int, default=100, help="at most this many (default 100; one page)")
    listing.set_defaults(func=run_list)

    add = action("add", "record one judgment (replaces the cell's earlier one)")
    add.add_argument("--image", required=True, help="the reference: catalog id or sha256")
    add.add_argument("--criterion", required=True)
    answer = add.add_mutually_exclusive_group(required=True)
    answer.add_argument("--holds", dest="holds", action="store_true", help="the criterion holds")
    answer.add_argument("--not-holds", dest="holds", action="store_false", help="the criterion does not hold")
    add.add_argument("--source", choices=["person", "api"], default="person")
    add.add_argument("--author", default=None, help="who judged (default: the API key's short hash)")
    add.set_defaults(func=run_add)

    imp = action("import", "record the judgments of a JSONL file (an export's lines)")
    imp.add_argument("file", type=Path)
    imp.set_defaults(func=run_import)

    exp = action("export", "every judgment as JSONL (to stdout, or --output FILE)")
    _filters(exp)
    exp.add_argument("--output", "-o", type=Path, default=None)
    exp.set_defaults(func=run_export)

    derive = action("derive", "judgments from a metadata field whose values exclude each other")
    derive.add_argument("key", help="the metadata field (or facet attribute)")
    derive.add_argument("--statement", action="append", default=[], metavar="VALUE=TEXT",
                        help="word a value's statement (repeatable)")
    derive.add_argument("--dry-run", action="store_true", help="show the statements and counts, record nothing")
    derive.add_argument("--overwrite", action="store_true", help="replace cells a person or client judged")
    derive.set_defaults(func=run_derive)

    delete = action("delete", "delete one judgment by id (undo), or those a filter selects")
    delete.add_argument("id", nargs="?", type=int, default=None, help="the judgment's id")
    _filters(delete)
    delete.add_argument("--all", action="store_true", help="every judgment of the set")
    delete.add_argument("--yes", action="store_true", help="do not ask before deleting by filter")
    delete.set_defaults(func=run_delete)


def _filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", default=None, help="only this reference (catalog id or sha256)")
    p.add_argument("--criterion", default=None, help="only this criterion")
    p.add_argument("--source", choices=["person", "api", "derived"], default=None)


def _params(args: argparse.Namespace) -> dict[str, str]:
    return {k: v for k in ("image", "criterion", "source") if (v := getattr(args, k)) is not None}


def _client(args: argparse.Namespace) -> Client:
    from rubricsearch.retrieval.errors import InvalidInput

    if not args.server:
        raise InvalidInput("judgments live in a server's catalog: give --server URL (or set RUBRICSEARCH_CLIENT_URL) "
                           "and --api-key KEY (an admin key to change them)")
    from rubricsearch.app.client import Client

    return Client(args.server, api_key=args.api_key)


def _path(args: argparse.Namespace) -> str:
    from urllib.parse import quote

    return f"/v1/sets/{quote(args.set, safe='')}/judgments"  # the API takes a set's name as its id


def _rows(judgments: list[JudgmentOut]) -> str:
    rows = [(j.id, j.image_id, j.sha256[:12], j.criterion, "yes" if j.holds else "no", j.source, j.author or "-",
             j.created_at.strftime("%Y-%m-%d %H:%M:%S")) for j in judgments]
    return table(rows, HEADERS) if rows else "no judgments"


def _send(rs: Client, method: str, path: str, parse: type[T], **kwargs: Any) -> T:
    """A JSON call, read as ``parse``; the server's errors come back as its domain errors."""
    from rubricsearch.app.client.core import Call

    return rs.send(Call[T](method, path, parse, **kwargs))


def _raw(rs: Client, method: str, path: str, **kwargs: Any) -> bytes:
    """A call whose body is not JSON (JSONL in or out)."""
    from rubricsearch.app.client import raise_for_error

    response = rs.http.request(method, path, **kwargs)
    raise_for_error(response)
    return response.content


def run_list(args: argparse.Namespace) -> int:
    from rubricsearch.app.schemas.judgments import JudgmentList

    with _client(args) as rs:
        page = _send(rs, "GET", _path(args), JudgmentList, params={**_params(args), "limit": max(1, args.limit)})
    print(_rows(page.data))
    if page.total > len(page.data):
        print(f"({len(page.data)} of {page.total}; `export` writes them all)")
    return 0


def run_add(args: argparse.Namespace) -> int:
    from rubricsearch.app.schemas.judgments import JudgmentList

    ref: dict[str, Any] = {"sha256": args.image} if len(args.image) == 64 else {"image_id": _image_id(args.image)}
    body = {**ref, "criterion": args.criterion, "holds": args.holds, "source": args.source}
    if args.author is not None:
        body["author"] = args.author
    with _client(args) as rs:
        out = _send(rs, "POST", _path(args), JudgmentList, json=body)
    print(_rows(out.data))
    return 0


def _image_id(text: str) -> int:
    from rubricsearch.retrieval.errors import InvalidInput

    if not text.isdigit():
        raise InvalidInput(f"--image takes a catalog id (a number) or a sha256 (64 hex digits), not {text!r}")
    return int(text)


def run_import(args: argparse.Namespace) -> int:
    from rubricsearch.app.schemas.judgments import ImportOut
    from rubricsearch.retrieval.errors import NotFound

    if not args.file.is_file():
        raise NotFound(f"no such file: {args.file}")
    with _client(args) as rs:
        data = _raw(rs, "POST", f"{_path(args)}/import", content=args.file.read_bytes(),
                    headers={"Content-Type": NDJSON})
    out = ImportOut.model_validate_json(data)
    print(f"recorded {len(out.data)} judgments from {out.lines} lines of {args.file}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    with _client(args) as rs:
        data = _raw(rs, "GET", _path(args), params={**_params(args), "format": "jsonl"})
    if args.output is None:
        sys.stdout.write(data.decode())
    else:
        args.output.write_bytes(data)
        print(f"wrote {len(data.splitlines())} judgments to {args.output}")
    return 0


def run_derive(args: argparse.Namespace) -> int:
    from rubricsearch.app.schemas.judgments import DeriveOut
    from rubricsearch.retrieval.errors import InvalidInput

    statements: dict[str, str] = {}
    for item in args.statement:
        value, sep, text = item.partition("=")
        if not sep:
            raise InvalidInput(f"--statement takes VALUE=TEXT, not {item!r}")
        statements[value] = text
    body = {"key": args.key, "statements": statements, "dry_run": args.dry_run, "overwrite": args.overwrite}
    with _client(args) as rs:
        out = _send(rs, "POST", f"{_path(args)}/derive", DeriveOut, json=body)
    print(table([(s.value, s.statement, s.yes, s.no) for s in out.statements], ["value", "statement", "yes", "no"]))
    verb = "recorded" if out.recorded else "would record (dry run)"
    print(f"{verb} {out.judgments} judgments for {out.images} images; {out.skipped_images} images hold none of the "
          f"values; {out.kept} cells judged by a person or client kept")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    from rubricsearch.app.schemas.judgments import DeletedOut, JudgmentOut
    from rubricsearch.retrieval.errors import InvalidInput

    where = _params(args)
    if (args.id is not None) == bool(where or args.all):
        raise InvalidInput("name one judgment id, or a filter (--image, --criterion, --source) or --all")
    with _client(args) as rs:
        path = _path(args)
        if args.id is not None:
            gone = _send(rs, "DELETE", f"{path}/{args.id}", JudgmentOut)
            print(f"deleted judgment {gone.id}")
            print(_rows([gone]))
            return 0
        if not args.yes:
            what = "every judgment" if args.all else f"the judgments where {where}"
            status = refused(f"delete {what} of set {args.set!r} on {args.server}?")
            if status is not None:
                return status
        out = _send(rs, "DELETE", path, DeletedOut, params={**where, "all": str(args.all).lower()})
    print(f"deleted {out.deleted} judgments")
    return 0
