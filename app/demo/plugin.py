"""The demo as a plug-in (entry point ``rubricsearch.plugins: demo``): its commands, its trained models as the
offline fallback, their label, the candidate faces on the Compare page and the admin key it generates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rubricsearch.app.plugins import Offered, Plugin


class DemoPlugin(Plugin):
    name = "demo"

    def register_commands(self, sub: Any) -> None:
        from rubricsearch.app.demo import cli

        cli.register(sub)

    def fallback_model(self, data_dir: Path, kind: str) -> Path | None:
        from rubricsearch.app.demo.checkpoints import demo_checkpoint

        return demo_checkpoint(data_dir, kind)

    def models_label(self, data_dir: Path, served: dict[str, str]) -> str | None:
        from rubricsearch.app.demo.checkpoints import DEMO_LABEL, is_demo_model

        ours = "embedding" in served and all(is_demo_model(data_dir, m, kind) for kind, m in served.items())
        return DEMO_LABEL if ours else None

    def compare_candidates(self, data_dir: Path) -> list[Offered]:
        from rubricsearch.app.demo.candidates import offered

        return offered(data_dir)

    def admin_key_file(self, data_dir: Path) -> Path:
        from rubricsearch.app.demo import KEY_FILE

        return data_dir / KEY_FILE


plugin = DemoPlugin()
