"""The grouped settings read their nested variables, and the previous release's flat names keep working for one
release: a renamed one sets its new place (from the environment and from .env) with a warning naming the new
variable, a new name set beside it wins, and one whose value became a constant is ignored with a warning giving the
value, so a deployment that still sets it starts. Each constant's documented value is the code's."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from rubricsearch.app.config_docs import variables
from rubricsearch.app.settings import GROUPS, Settings
from rubricsearch.app.settings_renames import DEMOTED, FIXED, PREVIOUS, RENAMED, new_name

MIB = 1024 * 1024
CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("RUBRICSEARCH_"):
            monkeypatch.delenv(name)


def test_a_group_is_set_by_its_nested_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUBRICSEARCH_LIMITS__MAX_JSON_BYTES", "2MiB")
    monkeypatch.setenv("RUBRICSEARCH_MODELS__DEVICE", "cpu")
    monkeypatch.setenv("RUBRICSEARCH_AUTH__ADMIN_API_KEYS", "a" * 16 + ",b" + "b" * 16)
    settings = Settings(_env_file=None)
    assert settings.limits.max_json_bytes == 2 * MIB and settings.models.device == "cpu"
    assert [k.get_secret_value() for k in settings.auth.admin_api_keys] == ["a" * 16, "b" * 17]
    assert settings.limits.decode_pixel_budget == 128_000_000  # the rest of the group keeps its defaults


def test_a_bad_or_misspelt_grouped_value_stops_the_start_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUBRICSEARCH_LIMITS__MAX_JSON_BYTES", "12")
    with pytest.raises(ValidationError, match=r"limits\.max_json_bytes"):
        Settings(_env_file=None)
    monkeypatch.delenv("RUBRICSEARCH_LIMITS__MAX_JSON_BYTES")
    monkeypatch.setenv("RUBRICSEARCH_LIMITS__MAX_JSON_BYTE", "2MiB")
    with pytest.raises(ValidationError, match=r"limits\.max_json_byte\b"):
        Settings(_env_file=None)


def test_an_old_name_sets_the_new_place_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RUBRICSEARCH_MAX_JSON_BYTES", "3MiB")
    monkeypatch.setenv("RUBRICSEARCH_WORKERS", "5")
    with caplog.at_level(logging.WARNING), pytest.warns(DeprecationWarning) as warned:
        settings = Settings(_env_file=None)
    assert settings.limits.max_json_bytes == 3 * MIB and settings.ingest.workers == 5
    messages = [str(w.message) for w in warned]
    assert any("RUBRICSEARCH_MAX_JSON_BYTES is renamed RUBRICSEARCH_LIMITS__MAX_JSON_BYTES" in m for m in messages)
    assert any("RUBRICSEARCH_WORKERS is renamed RUBRICSEARCH_INGEST__WORKERS" in m for m in messages)
    assert "RUBRICSEARCH_LIMITS__MAX_JSON_BYTES" in caplog.text  # operators read logs, not Python warnings


def test_an_old_name_in_the_env_file_works_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = tmp_path / ".env"
    env.write_text("RUBRICSEARCH_DEVICE=cpu\nRUBRICSEARCH_SSE_HEARTBEAT_S=1\nRUBRICSEARCH_MAX_JSON_BYTES=1MiB\n")
    with pytest.warns(DeprecationWarning) as warned:
        settings = Settings(_env_file=env)
    assert settings.models.device == "cpu" and settings.limits.max_json_bytes == MIB
    assert any("RUBRICSEARCH_SSE_HEARTBEAT_S is ignored" in str(w.message) for w in warned)


def test_the_new_name_wins_over_the_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUBRICSEARCH_MAX_PIXELS", "65536")
    monkeypatch.setenv("RUBRICSEARCH_MODELS__MAX_PIXELS", "131072")
    with pytest.warns(DeprecationWarning, match="RUBRICSEARCH_MAX_PIXELS is ignored: RUBRICSEARCH_MODELS__MAX_PIXELS"):
        settings = Settings(_env_file=None)
    assert settings.models.max_pixels == 131072


def test_a_bad_value_under_an_old_name_still_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUBRICSEARCH_PORT", "0")  # unchanged name
    with pytest.raises(ValidationError, match="port"):
        Settings(_env_file=None)
    monkeypatch.delenv("RUBRICSEARCH_PORT")
    monkeypatch.setenv("RUBRICSEARCH_MAX_PIXELS", "999")
    with pytest.warns(DeprecationWarning), pytest.raises(ValidationError, match=r"models\.max_pixels"):
        Settings(_env_file=None)


def test_an_old_name_now_a_constant_is_ignored_and_the_start_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUBRICSEARCH_MAX_JSON_DEPTH", "not even a number")
    monkeypatch.setenv("RUBRICSEARCH_SSE_HEARTBEAT_S", "1")
    with pytest.warns(DeprecationWarning) as warned:
        Settings(_env_file=None)
    messages = [str(w.message) for w in warned]
    assert any(m.startswith("RUBRICSEARCH_MAX_JSON_DEPTH is ignored: the value is fixed at 64 "
                            "(rubricsearch.app.jsonbody.MAX_JSON_DEPTH)") for m in messages)
    assert any("RUBRICSEARCH_SSE_HEARTBEAT_S is ignored: the value is fixed at 15.0" in m for m in messages)


def _resolve(path: str) -> object:
    """The object at a dotted path: a module's constant, or a class attribute (``...VLLMConfig.package_keys``)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise AssertionError(f"{path} names nothing")


@pytest.mark.parametrize("old", sorted(FIXED))
def test_each_constant_is_what_the_warning_says(old: str) -> None:
    path, value, why = FIXED[old]
    actual = _resolve(path)
    rule = value == "auto" and callable(actual)  # the rule that picks the value by device
    assert rule or str(actual) == value, f"{path} is {actual!r}; settings_renames.FIXED says {value}"
    assert why and f"RUBRICSEARCH_{old.upper()}" not in variables()


def test_a_grouped_variable_now_a_constant_is_ignored_and_the_start_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Settings grouped during this release that became constants: their variables must not vanish without a word,
    nor stop the start (their group refuses unknown fields; a gone group's are ignored by Settings)."""
    monkeypatch.setenv("RUBRICSEARCH_MODELS__LM_WORKERS", "3")
    monkeypatch.setenv("RUBRICSEARCH_MODELS__DEVICE", "cpu")
    monkeypatch.setenv("RUBRICSEARCH_SEARCH__MAX_CRITERIA", "40")
    monkeypatch.setenv("RUBRICSEARCH_INGEST__STOP_TIMEOUT_S", "not even a number")
    with caplog.at_level(logging.WARNING), pytest.warns(DeprecationWarning) as warned:
        settings = Settings(_env_file=None)
    assert settings.models.device == "cpu"  # the group's other fields are read
    messages = [str(w.message) for w in warned]
    for name, constant in (("MODELS__LM_WORKERS", "batching.default_workers"), ("SEARCH__MAX_CRITERIA", "MAX_CRITERIA"),
                           ("INGEST__STOP_TIMEOUT_S", "WORKER_STOP_TIMEOUT_S")):
        assert any(m.startswith(f"RUBRICSEARCH_{name} is ignored: the value is fixed at") and constant in m
                   for m in messages), (name, messages)
    assert "RUBRICSEARCH_SEARCH__MAX_CRITERIA" in caplog.text
    assert {place for place in DEMOTED} & {(g, f) for g, cls in GROUPS.items() for f in cls.model_fields} == set()


def test_the_demoted_settings_are_the_ones_listed() -> None:
    assert {place for place in PREVIOUS.values() if place in DEMOTED} == set(DEMOTED)  # each had a flat name
    assert all(FIXED[old] == DEMOTED[place] for old, place in PREVIOUS.items() if place in DEMOTED)
    assert all(PREVIOUS[old] == place for old, place in RENAMED.items())
    settings = len(set(Settings.model_fields) - set(GROUPS)) + sum(len(cls.model_fields) for cls in GROUPS.values())
    assert settings == 35  # an operator's choices; tuning values and safety bounds are constants


def test_the_engine_switches_are_one_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerated engine's four switches became its measured choices: a deployment setting one, grouped or
    flat, starts with a warning naming the constant and RUBRICSEARCH_MODELS__ENGINE, which picks the engine."""
    monkeypatch.setenv("RUBRICSEARCH_MODELS__CUDA_GRAPHS", "false")
    monkeypatch.setenv("RUBRICSEARCH_FUSED_KERNELS", "true")
    monkeypatch.setenv("RUBRICSEARCH_MODELS__ENGINE", "local")
    with pytest.warns(DeprecationWarning) as warned:
        settings = Settings(_env_file=None)
    assert settings.models.engine == "local"
    messages = [str(w.message) for w in warned]
    for name, constant in (("MODELS__CUDA_GRAPHS", "CUDA_GRAPHS"), ("FUSED_KERNELS", "FUSED_KERNELS")):
        assert any(m.startswith(f"RUBRICSEARCH_{name} is ignored: the value is fixed at")
                   and f"rubricsearch.app.model_loading.{constant}" in m and "RUBRICSEARCH_MODELS__ENGINE" in m
                   for m in messages), (name, messages)
    with pytest.raises(ValidationError, match=r"models\.engine"):
        Settings(_env_file=None, models={"engine": "accelerated"})


def test_every_grouped_setting_has_its_old_name_and_every_old_name_a_place() -> None:
    new = {"models.engine"}  # no previous name: it replaces four switches that became constants
    places = {f"{group}.{field}" for group, cls in GROUPS.items() for field in cls.model_fields} - new
    assert {f"{group}.{field}" for group, field in RENAMED.values()} == places
    assert len(RENAMED) == len(places)  # no two old names for one place
    assert not set(RENAMED) & set(FIXED) and not set(RENAMED) & set(Settings.model_fields)
    assert len(RENAMED) + len(FIXED) + len(set(Settings.model_fields) - set(GROUPS)) == 95  # the flat settings


def test_the_changelog_lists_every_old_name() -> None:
    text = CHANGELOG.read_text()
    for old in RENAMED:
        assert f"| `RUBRICSEARCH_{old.upper()}` | `{new_name(old)}` |" in text
    for old in FIXED:
        assert f"| `RUBRICSEARCH_{old.upper()}` | `{FIXED[old][0].removeprefix('rubricsearch.')}` = " in text


def test_code_passing_a_flat_name_fails_instead_of_losing_the_value() -> None:
    with pytest.raises(TypeError, match=r"Settings\(workers=\.\.\.\) is Settings\(ingest=\{'workers': \.\.\.\}\)"):
        Settings(_env_file=None, workers=0)
    with pytest.raises(TypeError, match=r"rubricsearch\.app\.jsonbody\.MAX_JSON_DEPTH"):
        Settings(_env_file=None, max_json_depth=8)
    assert Settings(_env_file=None, ingest={"workers": 0}, data_dir=Path("x")).ingest.workers == 0


def test_the_image_limits_and_the_search_device_are_no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment still setting them starts, with a warning naming what holds the value now; one image's decoded
    pixels follow the decoding budget where that is smaller, so one image never decodes beyond the whole budget."""
    from rubricsearch.app.settings import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_QUERY_IMAGE_PIXELS

    monkeypatch.setenv("RUBRICSEARCH_LIMITS__MAX_IMAGE_PIXELS", "1000")
    monkeypatch.setenv("RUBRICSEARCH_MAX_IMAGE_BYTES", "2048")
    monkeypatch.setenv("RUBRICSEARCH_VECTORS__SEARCH_DEVICE", "faiss-gpu")
    with pytest.warns(DeprecationWarning) as warned:
        settings = Settings(_env_file=None)
    messages = " ".join(str(w.message) for w in warned)
    for name in ("LIMITS__MAX_IMAGE_PIXELS", "MAX_IMAGE_BYTES", "VECTORS__SEARCH_DEVICE"):
        assert f"RUBRICSEARCH_{name} is ignored: the value is fixed at" in messages, name
    assert (settings.image_bytes, settings.image_pixels) == (MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS)
    assert settings.request_image_pixels == MAX_QUERY_IMAGE_PIXELS < MAX_IMAGE_PIXELS
    small = Settings(_env_file=None, limits={"decode_pixel_budget": 2_000_000})
    assert small.image_pixels == small.request_image_pixels == 2_000_000
