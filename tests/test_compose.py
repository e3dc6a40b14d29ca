"""compose.yaml, Dockerfile and .dockerignore: services, health checks, vLLM flags and env wiring.

The vLLM flags must be the ones tests/vllm_server.py proved against a real server (docs/vllm-notes.md);
every ``RUBRICSEARCH_*`` variable must name a real setting and the set must validate. ``docker compose
config`` (or the v1 ``docker-compose``) resolves the file when a compose CLI is installed; it needs no engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from rubricsearch.app.config_docs import variables
from rubricsearch.app.services import WORKER_STOP_TIMEOUT_S
from rubricsearch.app.settings import Settings
from tests.vllm_server import OFFICIAL_PIXELS, RERANK_OVERRIDES, RERANK_TEMPLATE, connector_args

REPO = Path(__file__).resolve().parents[1]
SERVICES = {"app", "worker", "postgres", "qdrant", "vllm-embedding", "vllm-reranker"}
VLLM = ("vllm-embedding", "vllm-reranker")
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` with an empty environment: every variable takes its default."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(yaml.safe_load((REPO / "compose.yaml").read_text()))


def flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


def healthy(service: dict[str, Any]) -> set[str]:
    return {name for name, dep in service["depends_on"].items() if dep.get("condition") == "service_healthy"}


def test_services_and_health_checks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == SERVICES
    for name in SERVICES - {"worker"}:  # the worker has no port; SIGTERM and restart cover it
        assert services[name]["healthcheck"]["test"], name
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"]
    assert services["qdrant"]["image"].startswith("qdrant/qdrant:")
    assert "/readyz" in " ".join(services["qdrant"]["healthcheck"]["test"])
    assert "/readyz" in " ".join(services["app"]["healthcheck"]["test"])
    for name in VLLM:
        assert services[name]["image"].startswith("vllm/vllm-openai:")
        assert "http://127.0.0.1:8000/health" in " ".join(services[name]["healthcheck"]["test"])
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"app"}  # the database, Qdrant and vLLM stay on the compose network
    declared = set(compose["volumes"])
    for name, service in services.items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert source in declared or source.startswith("./"), (name, mount)


def test_vllm_flags_are_the_verified_ones(compose: dict[str, Any]) -> None:
    notes = (REPO / "docs" / "vllm-notes.md").read_text()
    for name in VLLM:
        service = compose["services"][name]
        cmd = [str(c) for c in service["command"]]
        assert service["entrypoint"] == ["vllm", "serve"]
        assert flag(cmd, "--runner") == "pooling"
        assert "--enable-mm-embeds" in cmd
        pixels = flag(cmd, "--mm-processor-kwargs")
        assert json.loads(pixels) == OFFICIAL_PIXELS and f"'{pixels}'" in notes
        assert cmd[0] == flag(cmd, "--served-model-name")  # the name the clients ask /v1/models for
        env = service["environment"]
        assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
        assert f"hf-cache:{env['HF_HOME']}" in service["volumes"]  # one model cache for everything
        port = flag(cmd, "--port")
        assert "127.0.0.1:" + port in " ".join(service["healthcheck"]["test"])
        # packages come from the shared store, read-only, through rubricsearch's connector (the tests' config)
        config = json.loads(flag(cmd, "--ec-transfer-config"))
        package_root = Path(config["ec_connector_extra_config"]["package_root"])
        assert connector_args(package_root) == ["--ec-transfer-config", json.dumps(config)]
        mounts = {m.split(":")[1]: m.split(":") for m in service["volumes"]}
        data = mounts[str(package_root.parent)]
        assert data[0] == "rubricsearch-data" and data[2] == "ro"
        assert package_root.name == "packages" and compose["services"]["app"]["environment"][
            "RUBRICSEARCH_DATA_DIR"] == "/data" and "rubricsearch-data:/data" in compose["services"]["app"]["volumes"]
        module = config["ec_connector_module_path"].replace(".", "/") + ".py"
        namespace, code = mounts[env["PYTHONPATH"] + "/rubricsearch"], mounts[env["PYTHONPATH"] + "/retrieval"]
        assert (REPO / namespace[0]).resolve() == (REPO / "rubricsearch").resolve() and namespace[2] == "ro"
        # the namespace's link resolves in the container to the mounted folder beside it
        assert os.readlink(REPO / "rubricsearch" / "retrieval") == "../retrieval"
        in_tree = Path(module).relative_to("rubricsearch/retrieval")
        assert (REPO / code[0]).resolve() / in_tree == (REPO / "retrieval" / in_tree).resolve()
        assert code[2] == "ro" and (REPO / module).is_file()
    reranker = [str(c) for c in compose["services"]["vllm-reranker"]["command"]]
    overrides = flag(reranker, "--hf-overrides")
    assert json.loads(overrides) == RERANK_OVERRIDES and f"'{overrides}'" in notes
    template = Path(flag(reranker, "--chat-template"))
    mounts = [m.split(":") for m in compose["services"]["vllm-reranker"]["volumes"]]
    host = next(REPO / src for src, dst, *_ in mounts if template.parent == Path(dst))
    assert (host / template.name).resolve() == RERANK_TEMPLATE.resolve() and RERANK_TEMPLATE.is_file()
    embedder = [str(c) for c in compose["services"]["vllm-embedding"]["command"]]
    assert "--hf-overrides" not in embedder and "--chat-template" not in embedder


def test_app_and_worker_wiring(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose["services"]
    app, worker = services["app"], services["worker"]
    assert app["command"] == ["serve"] and app["environment"]["RUBRICSEARCH_INGEST__WORKERS"] == "0"
    assert worker["command"][0] == "worker" and worker["deploy"]["replicas"] == 2
    assert "--worker-id" not in worker["command"]  # replicas lease <hostname>:<slot> each
    assert healthy(app) == {"postgres", "qdrant", "vllm-embedding", "vllm-reranker"}
    assert healthy(worker) >= {"postgres", "qdrant", "vllm-embedding"}
    for service in (app, worker):
        env = service["environment"]
        assert env["RUBRICSEARCH_VLLM__EMBEDDING_URL"] == "http://vllm-embedding:8000"  # embeddings run there
        db = urlsplit(env["RUBRICSEARCH_DATABASE_URL"])
        pg = services["postgres"]["environment"]
        assert (db.hostname, db.username, db.password, db.path) == (
            "postgres", pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], "/" + pg["POSTGRES_DB"])
        assert urlsplit(env["RUBRICSEARCH_VECTORS__QDRANT_URL"]).hostname == "qdrant"
        for var, target in (("RUBRICSEARCH_VLLM__EMBEDDING_URL", "vllm-embedding"),
                            ("RUBRICSEARCH_VLLM__RERANKER_URL", "vllm-reranker")):
            url = urlsplit(env[var])
            cmd = [str(c) for c in services[target]["command"]]
            assert (url.hostname, str(url.port)) == (target, flag(cmd, "--port"))
        served = {t: str(services[t]["command"][0]) for t in VLLM}
        assert env["RUBRICSEARCH_MODELS__EMBEDDING_MODEL"] == served["vllm-embedding"]
        assert env["RUBRICSEARCH_MODELS__RERANKER_MODEL"] == served["vllm-reranker"]
        assert f"rubricsearch-data:{env['RUBRICSEARCH_DATA_DIR']}" in service["volumes"]  # shared blobs + packages
        assert f"hf-cache:{env['HF_HOME']}:ro" in service["volumes"]
        unknown = [k for k in env if k.startswith("RUBRICSEARCH_") and k not in variables()]
        assert not unknown, unknown
        for key in [k for k in os.environ if k.startswith("RUBRICSEARCH_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            if value is not None:  # None: passed through from the shell running compose
                monkeypatch.setenv(key, str(value))
        settings = Settings(_env_file=None)
        assert settings.vllm.embedding_url and settings.vectors.qdrant_url
        assert (settings.backend("embedding"), settings.backend("reranker"), settings.vector_backend()) == (
            "vllm", "vllm", "qdrant")  # the URLs choose the backends
        assert settings.catalog_url.startswith("postgresql")
    timeout = WORKER_STOP_TIMEOUT_S
    grace = worker["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > timeout  # SIGKILL only after the batch could finish


def test_dockerfile_and_dockerignore() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    lines = [ln.strip() for ln in dockerfile.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert 'pip install ".[qdrant,postgres]"' in dockerfile
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] not in ("USER root", "USER 0")
    assert lines[-2:] == ['ENTRYPOINT ["rubricsearch"]', 'CMD ["serve"]']
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".vllm-venv", "data", "tests"} <= ignored
    for copied in re.findall(r"^COPY (\S+)", dockerfile, flags=re.M):  # nothing copied is ignored
        assert copied not in ignored, copied


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_docker_compose_config_resolves_the_file(tmp_path: Path) -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("no compose CLI: the docker client here has no compose plugin and docker-compose is absent")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RUBRICSEARCH_", "COMPOSE_", "DOCKER_"))}
    env["DOCKER_CONFIG"] = str(tmp_path)  # no user config, no contexts: `config` never contacts an engine
    done = subprocess.run([*cli, "-f", str(REPO / "compose.yaml"), "config"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert set(resolved["services"]) == SERVICES
    reranker = [str(c) for c in resolved["services"]["vllm-reranker"]["command"]]
    assert json.loads(flag(reranker, "--hf-overrides")) == RERANK_OVERRIDES  # survived interpolation intact
    assert resolved["services"]["worker"]["deploy"]["replicas"] == 2
