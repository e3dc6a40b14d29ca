"""``rubricsearch serve``: the API (and web UI) with uvicorn on RUBRICSEARCH_HOST / RUBRICSEARCH_PORT."""

from __future__ import annotations

import argparse
from typing import Any

from rubricsearch.app.cli.sets import cli_settings


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the HTTP server (one process: it owns the data directory)")
    p.add_argument("--host", default=None, help="default: RUBRICSEARCH_HOST (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: RUBRICSEARCH_PORT (8000)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rubricsearch.app.http_limits import GracefulServer, server_config
    from rubricsearch.app.main import create_app

    settings = cli_settings()
    host = args.host or settings.host
    port = args.port if args.port is not None else settings.port
    # One process only: the FAISS directory and the in-process workers belong to it (scale out with
    # PostgreSQL + Qdrant + separate worker processes instead of uvicorn --workers).
    # Open event streams (job progress) must not hold a shutdown forever.
    app = create_app(settings)
    config = server_config(app, settings, host=host, port=port, log_level=args.log_level, proxy_headers=False,
                           timeout_graceful_shutdown=10)
    GracefulServer(config, app.state.stopping).run()
    return 0
