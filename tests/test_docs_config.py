"""docs/configuration.md is generated from ``Settings``: it must be what ``python -m rubricsearch.app.config_docs``
prints now.

The second test varies what the page depends on (a description, a default, a bound, a new setting) and checks that
the rendering changes with it, so the first test cannot pass against a stale file by rendering something fixed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic.fields import FieldInfo

from rubricsearch.app import config_docs
from rubricsearch.app.settings import LimitSettings, Settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REGENERATE = "PYTHONPATH=$PWD .venv/bin/python -m rubricsearch.app.config_docs > docs/configuration.md"


def test_configuration_doc_is_up_to_date() -> None:
    assert DOC.read_text() == config_docs.render(), f"docs/configuration.md is stale: run `{REGENERATE}`"


def test_every_setting_has_a_row() -> None:
    text = DOC.read_text()
    names = config_docs.variables()
    assert "RUBRICSEARCH_LIMITS__MAX_JSON_BYTES" in names and "RUBRICSEARCH_LIMITS" not in names
    for name in names:
        assert f"| `{name}` |" in text


def _row(name: str) -> str:
    return next(line for line in config_docs.render().splitlines()
                if line.startswith(f"| `RUBRICSEARCH_{name.upper()}` |"))


def test_rendering_follows_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    field = Settings.model_fields["port"]
    before = config_docs.render()
    monkeypatch.setattr(field, "description", "the port | the server listens on")
    assert _row("port").endswith("| the port \\| the server listens on |")
    monkeypatch.setattr(field, "default", 9001)
    assert "| `9001` |" in _row("port")
    assert "≤ 65535" in _row("port")
    bytes_field = LimitSettings.model_fields["max_json_bytes"]
    monkeypatch.setattr(bytes_field, "default", 3 * 1024 * 1024)
    assert "| bytes, ≥ 1024 | `3MiB` |" in _row("limits__max_json_bytes")
    monkeypatch.setitem(Settings.model_fields, "brand_new", FieldInfo(annotation=int, default=7, description="new"))
    assert _row("brand_new") == "| `RUBRICSEARCH_BRAND_NEW` | integer | `7` | new |"
    monkeypatch.setitem(LimitSettings.model_fields, "grouped_new",
                        FieldInfo(annotation=float, default=0.5, description="newer"))
    assert _row("limits__grouped_new") == "| `RUBRICSEARCH_LIMITS__GROUPED_NEW` | number | `0.5` | newer |"
    assert config_docs.render() != before
