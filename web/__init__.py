"""The web UI: Jinja2 templates and static assets (plain CSS and JS, no build step).

Pages are served by :mod:`app.routers.web`; everything they do after loading goes through the same
REST API as any other client, so the UI never has powers the API lacks.
"""

from __future__ import annotations

from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = WEB_DIR / "templates"
STATIC_DIR = WEB_DIR / "static"
