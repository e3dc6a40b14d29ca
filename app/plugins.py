"""Optional parts of the product, found at run time by their entry points: the core never imports one.

A plug-in is a :class:`Plugin` that a distribution names under the entry-point group ``rubricsearch.plugins``
(this project's pyproject.toml names the demo). The core asks every plug-in the questions below; the base class
answers "nothing", so a plug-in overrides only what it offers. Entry points are the ecosystem's mechanism for this
(pytest and vLLM find their plug-ins so): a team adds its own without changing rubricsearch, and taking the demo
out takes no core path with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, TypeVar

GROUP = "rubricsearch.plugins"
T = TypeVar("T")

log = logging.getLogger("rubricsearch.app")


@dataclass(frozen=True)
class Offered:
    """A candidate image the Compare page offers beside the upload field."""

    name: str
    title: str  # what the image shows, e.g. "a cat; ginger fur; triangular ears; dark forehead stripes; green eyes"
    data_url: str  # inlined in the page: no route serves files from the data dir


class Plugin:
    """The questions the core asks a plug-in, each answered "nothing" unless the plug-in overrides it."""

    name = "plugin"

    def register_commands(self, sub: Any) -> None:
        """Add the plug-in's sub-commands to the ``rubricsearch`` command line (argparse sub-parsers)."""

    def fallback_model(self, data_dir: Path, kind: str) -> Path | None:
        """A local checkpoint of this kind ("embedding" or "reranker") to serve when the configured model cannot
        be obtained (neither a local checkpoint nor a hub that answers)."""
        return None

    def models_label(self, data_dir: Path, served: dict[str, str]) -> str | None:
        """What every surface calls the serving models (``served``: kind -> public model id) when this plug-in
        made them."""
        return None

    def compare_candidates(self, data_dir: Path) -> list[Offered]:
        """Candidate images the Compare page offers."""
        return []

    def admin_key_file(self, data_dir: Path) -> Path | None:
        """Where an admin key this plug-in generated is kept, for the sign-in page's hint."""
        return None


@cache
def plugins() -> tuple[Plugin, ...]:
    """Every installed plug-in, loaded once, in name order; one that fails to load is logged and left out."""
    found = []
    for point in sorted(entry_points(group=GROUP), key=lambda p: p.name):
        try:
            plugin = point.load()
        except Exception as exc:  # a broken optional part must not stop the product
            log.warning("plug-in %s (%s) failed to load: %s", point.name, point.value, exc)
            continue
        if isinstance(plugin, Plugin):
            found.append(plugin)
        else:
            log.warning("plug-in %s (%s) is not a rubricsearch Plugin; left out", point.name, point.value)
    return tuple(found)


def first(question: Callable[[Plugin], T | None]) -> T | None:
    """The first plug-in's answer that is not None, or None."""
    return next((answer for plugin in plugins() if (answer := question(plugin)) is not None), None)
