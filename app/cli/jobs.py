"""``rubricsearch jobs [--set SET]``: recent ingestion jobs and their progress."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rubricsearch.app.cli.remote import add_server_options, client
from rubricsearch.app.cli.sets import cli_settings, table


def register(sub: Any) -> None:
    p = sub.add_parser("jobs", help="list ingestion jobs, newest first")
    p.add_argument("--set", dest="set_id", default=None, help="only this set's jobs (id or name)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--errors", action="store_true", help="also print each job's failed items")
    p.add_argument("--json", action="store_true", help="print the jobs as JSON (the API's Job objects)")
    add_server_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rubricsearch.app.sets import find_set
    from rubricsearch.app.state import open_state
    from rubricsearch.app.views import job_out

    rs = client(args)
    if rs is not None:
        with rs:
            jobs = rs.jobs(args.set_id, limit=max(1, args.limit)).data
    else:
        state = open_state(cli_settings())
        try:
            service = state.ingestion
            set_id = find_set(state, args.set_id).id if args.set_id else None
            jobs = [job_out(service, j) for j in service.list_jobs(set_id=set_id, limit=max(1, args.limit))]
        finally:
            state.close()
    if args.json:
        print(json.dumps([j.model_dump(mode="json") for j in jobs], indent=2))
        return 0
    rows = [(j.id, j.set_id[:12], j.kind, j.state, f"{j.progress:.0%}", j.done, j.skipped, j.failed, j.total,
             j.created_at.strftime("%Y-%m-%d %H:%M:%S")) for j in jobs]
    print(table(rows, ["id", "set", "kind", "state", "progress", "done", "skipped", "failed", "total", "created"])
          if rows else "no jobs")
    if args.errors:
        for job in jobs:
            for err in job.errors:
                print(f"{job.id}  {err.ref}: {err.error}")
    return 0
