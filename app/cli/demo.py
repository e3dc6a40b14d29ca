"""``rubricsearch demo``: a working server with a generated reference set, on a fresh machine, in one command.

It loads the configured Qwen3-VL models and falls back to offline test checkpoints when they cannot be
loaded (the UI then shows a banner). The reference set "demo-animals" is drawn by :mod:`app.demo.faces`,
so nothing is downloaded for it; re-running reuses what the data directory already holds.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

DEMO_SET = "demo-animals"
KEY_FILE = "demo-admin-key"
SECRET_FILE = "demo-session-secret"


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="build the demo reference set and start the server with the web UI")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="default: RUBRICSEARCH_DATA_DIR, else ./data (where every other command looks)")
    p.add_argument("--host", default=None, help="default: RUBRICSEARCH_HOST (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: RUBRICSEARCH_PORT (8000)")
    p.add_argument("--images", type=int, default=40, help="how many generated images the demo set holds")
    p.add_argument("--no-serve", action="store_true", help="build the demo set, then exit")
    p.set_defaults(func=run)


def _secret_file(path: Path, nbytes: int) -> str:
    """A random secret kept in the data directory (mode 0600), so a restarted demo keeps its key."""
    if path.exists():
        value = path.read_text().strip()
        if len(value) >= 16:
            return value
    value = secrets.token_urlsafe(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")
    return value


def demo_settings(args: argparse.Namespace) -> tuple[Any, str | None]:
    """Settings from the environment plus the demo's defaults; returns (settings, generated admin key or None)."""
    from app.settings import Settings

    env = Settings()
    overrides: dict[str, Any] = {}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    if "RUBRICSEARCH_FALLBACK_TO_TEST_MODELS" not in os.environ:
        overrides["fallback_to_test_models"] = True
    if args.host:
        overrides["host"] = args.host
    if args.port:
        overrides["port"] = args.port
    data_dir = Path(overrides.get("data_dir", env.data_dir))
    data_dir.mkdir(parents=True, exist_ok=True)
    generated = None
    if not env.admin_api_keys:
        generated = _secret_file(data_dir / KEY_FILE, 24)
        overrides["admin_api_keys"] = [generated]
    if env.session_secret is None:
        overrides["session_secret"] = _secret_file(data_dir / SECRET_FILE, 32)
    return Settings(**overrides), generated


def ensure_demo_set(state: Any, count: int, *, out: Any = None) -> str:
    """Create and ingest "demo-animals" unless it already holds ``count`` indexed images; returns its id."""
    out = out or sys.stdout
    from app.demo.faces import demo_images
    from app.state import foreground_runner
    from indexer.catalog import ImageStatus, count_images, get_set_by_name
    from retrieval.errors import NotFound

    service = state.ingestion
    try:
        with state.catalog.read() as session:
            ref = get_set_by_name(session, DEMO_SET)
            indexed = count_images(session, ref.id)[ImageStatus.INDEXED]
    except NotFound:
        ref = service.create_set(DEMO_SET, description="Generated cat and fox faces (PIL drawings) for the demo")
        indexed = 0
    if indexed >= count:
        print(f"reference set {DEMO_SET!r} is ready ({indexed} images indexed)", file=out)
        return str(ref.id)
    print(f"ingesting {count} generated images into {DEMO_SET!r} …", file=out)
    job = service.create_job_from_uploads(ref.id, demo_images(count))
    if state.runner is None:  # no background workers: process in this thread
        foreground_runner(state).run_until_idle(job_id=job.id)
    last = -1
    for update in service.watch(job.id, interval_s=0.5):
        pct = round(update.progress * 100)
        if pct != last:
            print(f"  {pct:3d}%  {update.done} indexed, {update.skipped} skipped, {update.failed} failed", file=out)
            last = pct
    final = service.get_job(job.id)
    if final.failed:
        print(f"warning: {final.failed} demo images failed to ingest (see the admin page)", file=out)
    return str(ref.id)


def ensure_demo_models(settings: Any, *, out: Any = None) -> None:
    """When a configured model is neither a local checkpoint nor in the Hugging Face cache (a file-system
    check, no network), train (once; then reused) the demo embedder and reranker on generated faces, which
    the fallback then serves instead of random-weight checkpoints."""
    from app.demo.models import DEMO_MODELS_DIR, build_all
    from app.models import hub_model_available

    missing = [name for name, backend in ((settings.embedding_model, settings.embedding_backend),
                                          (settings.reranker_model, settings.reranker_backend))
               if backend == "local" and not hub_model_available(name)]
    if not settings.fallback_to_test_models or not missing:
        return
    print(f"{', '.join(map(repr, missing))} not available offline: training (or reusing) the demo embedder and "
          "reranker on generated faces (about 5 CPU-minutes the first time) …", file=out or sys.stdout)
    build_all(settings.data_dir / DEMO_MODELS_DIR, threads=min(4, os.cpu_count() or 1))


def write_candidates(data_dir: Path) -> Path:
    """A few faces that are not in the set, ready to drop onto the compare page."""
    from app.demo.faces import candidate_images

    folder = data_dir / "candidates"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in candidate_images():
        path = folder / name
        if not path.exists():
            path.write_bytes(data)
    return folder


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from app.state import AppState

    settings, generated_key = demo_settings(args)
    print(f"data directory: {settings.data_dir.resolve()}")
    ensure_demo_models(settings)
    print(f"loading models: {settings.embedding_model} and {settings.reranker_model} (this can take a while) …")
    started = time.monotonic()
    state = AppState.build(settings)
    try:
        print(f"models ready in {time.monotonic() - started:.1f} s")
        if state.models_label:
            print(f"NOTE: {state.models_label} (the configured models could not be loaded; the UI shows a banner)")
        ensure_demo_set(state, args.images)
        candidates = write_candidates(settings.data_dir)
        url = f"http://{settings.host}:{settings.port}/"
        print()
        print(f"  compare page : {url}")
        print(f"  admin page   : {url}admin")
        if generated_key:
            print(f"  admin key    : {generated_key}   (generated; kept in {settings.data_dir / KEY_FILE})")
        else:
            print("  admin key    : one of RUBRICSEARCH_ADMIN_API_KEYS")
        print(f"  candidates   : {candidates.resolve()} (images to drop onto the compare page)")
        print()
        if args.no_serve:
            return 0
        return serve(settings, state)
    finally:
        state.close()


def serve(settings: Any, state: Any) -> int:
    import uvicorn

    from app.main import create_app

    app = create_app(settings, state=state)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
    return 0

