"""Optional parts reach the core through entry points (rubricsearch/app/plugins.py): the demo is found that way,
a broken plug-in is left out without stopping the product, and without any plug-in every core surface works and
offers nothing of the demo's."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import rubricsearch.app.plugins as plugins_module
from rubricsearch.app.cli import build_parser
from rubricsearch.app.demo.candidates import write_candidates
from rubricsearch.app.demo.plugin import DemoPlugin
from rubricsearch.app.plugins import GROUP, Plugin, first, plugins
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import TEST_LABEL, AppState
from tests.api_helpers import ADMIN_KEY, client_for


def commands() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return set(sub.choices)  # type: ignore[arg-type]


@pytest.fixture
def no_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    plugins.cache_clear()
    monkeypatch.setattr(plugins_module, "entry_points", lambda group: [])
    yield
    plugins.cache_clear()


@pytest.fixture
def broken_and_demo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    points = [EntryPoint("demo", "rubricsearch.app.demo.plugin:plugin", GROUP),
              EntryPoint("a-broken", "rubricsearch.no_such_module:plugin", GROUP),
              EntryPoint("b-stranger", "rubricsearch.app.settings:Settings", GROUP)]
    plugins.cache_clear()
    monkeypatch.setattr(plugins_module, "entry_points", lambda group: points if group == GROUP else [])
    yield
    plugins.cache_clear()


def test_the_demo_is_installed_as_a_plugin() -> None:
    assert [type(p) for p in plugins()] == [DemoPlugin]
    assert {"demo", "train-demo-models", "serve", "make-test-model"} <= commands()


def test_a_broken_or_foreign_plugin_is_left_out(broken_and_demo: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rubricsearch.app"):
        found = plugins()
    assert [type(p) for p in found] == [DemoPlugin]
    assert "a-broken" in caplog.text and "b-stranger" in caplog.text


def test_without_plugins_the_core_offers_nothing_of_the_demo(no_plugins: None, tmp_path: Path) -> None:
    assert plugins() == ()
    assert "demo" not in commands() and "train-demo-models" not in commands() and "serve" in commands()
    assert first(lambda p: p.fallback_model(tmp_path, "embedding")) is None
    write_candidates(tmp_path)  # the demo's files are there, but nothing reads them
    settings = Settings(_env_file=None, data_dir=tmp_path, auth={"admin_api_keys": [ADMIN_KEY]})
    state = AppState.build(settings, embedder=False, reranker=False)
    try:
        state.test_models = True
        assert state.models_label == TEST_LABEL
        with client_for(state) as c:
            assert 'class="candidate-pick"' not in c.get("/").text
            login = c.get("/admin").text
            assert "demo-admin-key" not in login and "RUBRICSEARCH_AUTH__ADMIN_API_KEYS" in login
    finally:
        state.close()


def test_with_the_demo_plugin_the_same_state_offers_its_parts(tmp_path: Path) -> None:
    write_candidates(tmp_path)
    settings = Settings(_env_file=None, data_dir=tmp_path, auth={"admin_api_keys": [ADMIN_KEY]})
    state = AppState.build(settings, embedder=False, reranker=False)
    try:
        with client_for(state) as c:
            assert c.get("/").text.count('class="candidate-pick"') == 3
            assert f"<code>{tmp_path / 'demo-admin-key'}</code>" in c.get("/admin").text
    finally:
        state.close()


def test_a_plugin_answers_only_what_it_overrides(tmp_path: Path) -> None:
    bare = Plugin()
    assert bare.fallback_model(tmp_path, "embedding") is None and bare.compare_candidates(tmp_path) == []
    assert bare.models_label(tmp_path, {"embedding": "x"}) is None and bare.admin_key_file(tmp_path) is None
    assert DemoPlugin().models_label(tmp_path, {"embedding": "x"}) is None  # not the demo's models: no label
