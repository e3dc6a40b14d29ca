"""``rubricsearch demo``: a working server with a generated reference set, on a fresh machine, in one command;
``rubricsearch train-demo-models``: the demo's two models alone.

The server is up at once; meanwhile (:mod:`app.warmup`) it trains the demo models when the configured
Qwen3-VL models are not here (first run only), loads the models, indexes the reference set
"demo-animals", drawn by :mod:`app.demo.faces` (nothing is downloaded), and gives it its judgments and
calibration as any team's set gets them (:mod:`app.demo.judgments`). Pages show that progress and
searches get 503 with Retry-After until then. Re-running reuses what the data directory already holds.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rubricsearch.app.demo import KEY_FILE

DEMO_SET = "demo-animals"
SECRET_FILE = "demo-session-secret"


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="build the demo reference set and start the server with the web UI")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="default: RUBRICSEARCH_DATA_DIR, else ./data (where every other command looks)")
    p.add_argument("--host", default=None, help="default: RUBRICSEARCH_HOST (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: RUBRICSEARCH_PORT (8000)")
    p.add_argument("--images", type=int, default=40, help="how many generated images the demo set holds")
    p.add_argument("--no-serve", action="store_true", help="train the models if needed, build the demo set, then exit")
    p.set_defaults(func=run)
    t = sub.add_parser("train-demo-models",
                       help="train the small demo embedding and reranker checkpoints on generated faces (CPU, "
                       "no network)")
    t.add_argument("dir", help="output directory (DIR/demo-embedding and DIR/demo-reranker; reused if current)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--tower-steps", type=int, default=None,
                   help="vision tower pre-training steps (default: the demo recipe's)")
    t.add_argument("--steps", type=int, default=None, help="embedder training steps (default: the demo recipe's)")
    t.add_argument("--reranker-steps", type=int, default=None,
                   help="reranker training steps (default: the demo recipe's)")
    t.add_argument("--seed", type=int, default=None, help="the plan's seed (default: the demo's)")
    t.add_argument("--force", action="store_true", help="retrain even if DIR holds a current checkpoint")
    t.add_argument("--policy-size", type=int, nargs=3, default=None, metavar=("FACES", "QUERIES", "SHORTLIST"),
                   help="measure the rerank policy on fewer held-out faces, queries per kind and shortlisted faces "
                   "(default: the demo's 120 25 20; tests check the machinery on a few)")
    t.set_defaults(func=train)


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
    from rubricsearch.app.settings import Settings

    env = Settings()
    # groups given here are merged field by field with what the environment sets
    overrides: dict[str, Any] = {"models": {}, "auth": {}}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    if "RUBRICSEARCH_MODELS__FALLBACK_TO_TEST_MODELS" not in os.environ:
        overrides["models"]["fallback_to_test_models"] = True
    if args.host:
        overrides["host"] = args.host
    if args.port:
        overrides["port"] = args.port
    data_dir = Path(overrides.get("data_dir", env.data_dir))
    data_dir.mkdir(parents=True, exist_ok=True)
    generated = None
    if not env.auth.admin_api_keys:
        generated = _secret_file(data_dir / KEY_FILE, 24)
        overrides["auth"]["admin_api_keys"] = [generated]
    if env.auth.session_secret is None:
        overrides["auth"]["session_secret"] = _secret_file(data_dir / SECRET_FILE, 32)
    return Settings(**overrides), generated


def ensure_demo_set(state: Any, count: int, *, out: Any = None,
                    progress: Callable[[float], None] | None = None) -> str:
    """Create and ingest "demo-animals" unless it already holds ``count`` indexed images; returns its id."""
    out = out or sys.stdout
    from rubricsearch.app.demo.faces import demo_images
    from rubricsearch.app.state import foreground_runner
    from rubricsearch.indexer.catalog import ImageStatus, count_images, get_set_by_name
    from rubricsearch.retrieval.errors import NotFound

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
        if progress is not None:
            progress(update.progress)
        pct = round(update.progress * 100)
        if pct != last:
            print(f"  {pct:3d}%  {update.done} indexed, {update.skipped} skipped, {update.failed} failed", file=out)
            last = pct
    final = service.get_job(job.id)
    if final.failed:
        print(f"warning: {final.failed} demo images failed to ingest (see the admin page)", file=out)
    return str(ref.id)


def calibrate_demo_set(state: Any, set_id: str, count: int, *, out: Any = None) -> None:
    """The demo set's judgments from its faces' true attributes, and its calibration fitted on them
    (:mod:`app.demo.judgments`)."""
    from rubricsearch.app.demo.judgments import ensure_judgments

    out = out or sys.stdout
    done = ensure_judgments(state, set_id, count)
    fit = "fitted" if done.refitted else "kept"
    print(f"{done.judgments} judgments derived from the faces' attributes ({done.recorded} new); calibration "
          f"v{done.calibration_version} {fit} ({done.status})", file=out)


def models_to_train(settings: Any) -> list[str]:
    """The configured local models that are neither a local checkpoint nor in the Hugging Face cache (a
    file-system check, no network), when the fallback may serve the demo models instead and those are not
    trained yet: then the demo trains them (once; then reused)."""
    from rubricsearch.app.demo.checkpoints import demo_checkpoint
    from rubricsearch.app.model_loading import hub_model_available

    if not settings.models.fallback_to_test_models:
        return []
    missing = [name for name, backend in ((settings.models.embedding_model, settings.backend("embedding")),
                                          (settings.models.reranker_model, settings.backend("reranker")))
               if backend == "local" and not hub_model_available(name)]
    trained = all(demo_checkpoint(settings.data_dir, kind) is not None for kind in ("embedding", "reranker"))
    return [] if trained else missing


def prepare(warmup: Any, settings: Any, images: int, *, train_args: Sequence[str] = ()) -> Any:
    """Train the demo models if needed, load the models and index the demo set, reporting to ``warmup``;
    returns the state to serve. ``train_args`` go to the training command (tests train a few steps)."""
    from rubricsearch.app.state import AppState

    missing = models_to_train(settings)
    state = AppState.preparing(settings)
    warmup.stores = state  # sets, jobs and images are served while the models are prepared
    try:
        if missing:
            print(f"{', '.join(map(repr, missing))} not available offline: training the demo embedder and "
                  "reranker on generated faces (a few CPU-minutes, once; the web UI shows the progress) …")
            _train(warmup, settings, train_args)
        warmup.check()
        warmup.report("loading the models")
        started = time.monotonic()
        state.load()
        print(f"models ready in {time.monotonic() - started:.1f} s")
        if state.models_label:
            print(f"NOTE: {state.models_label} (the configured models could not be loaded; the UI shows a banner)")
        warmup.check()
        warmup.report("indexing the demo set", 0.0)
        set_id = ensure_demo_set(state, images, progress=lambda f: warmup.report("indexing the demo set", f))
        warmup.check()
        warmup.report("calibrating the demo set on its judgments")
        calibrate_demo_set(state, set_id, images)
        warmup.check()
    except BaseException:
        state.close()
        raise
    return state


def _train(warmup: Any, settings: Any, train_args: Sequence[str]) -> None:
    """The demo models, trained in a child process that the server's stop interrupts."""
    from rubricsearch.app.demo.checkpoints import DEMO_MODELS_DIR
    from rubricsearch.app.demo.trainer import TrainingFailed, interrupt, train_in_child

    phase = "demo models training"
    warmup.report(phase)
    children: list[subprocess.Popen[str]] = []

    def stop() -> None:
        for child in children:
            interrupt(child)

    def spawned(child: subprocess.Popen[str]) -> None:
        children.append(child)
        if warmup.stopping:  # the server stopped while the child was starting
            interrupt(child)

    warmup.on_stop.append(stop)
    try:
        train_in_child(settings.data_dir / DEMO_MODELS_DIR, lambda f, left: warmup.report(phase, f, left),
                       threads=min(4, os.cpu_count() or 1), extra=train_args, started=spawned)
    except TrainingFailed:
        warmup.check()  # stopped by the server: not a failure
        raise


def run(args: argparse.Namespace, *, train_args: Sequence[str] = ()) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from rubricsearch.app.demo.candidates import write_candidates
    from rubricsearch.app.warmup import Warmup

    settings, generated_key = demo_settings(args)
    print(f"data directory: {settings.data_dir.resolve()}")
    candidates = write_candidates(settings.data_dir)
    warmup = Warmup(lambda w: prepare(w, settings, args.images, train_args=train_args), first="preparing the demo")
    if args.no_serve:
        warmup.run().close()
        _summary(settings, generated_key, candidates, "the web UI, when served")
        return 0
    _summary(settings, generated_key, candidates, "up now; it shows the progress until the models are ready")
    return serve(settings, warmup)


def _summary(settings: Any, generated_key: str | None, candidates: Path, note: str) -> None:
    url = f"http://{settings.host}:{settings.port}/"
    print()
    print(f"  compare page : {url}   ({note})")
    print(f"  admin page   : {url}admin")
    if generated_key:
        print(f"  admin key    : {generated_key}   (generated; kept in {settings.data_dir / KEY_FILE})")
    else:
        print("  admin key    : one of RUBRICSEARCH_AUTH__ADMIN_API_KEYS")
    print(f"  candidates   : {candidates.resolve()} (offered on the compare page too)")
    print()


def serve(settings: Any, warmup: Any) -> int:
    """Serve while ``warmup`` prepares; a preparation that fails stops the server (exit status 1)."""
    import uvicorn

    from rubricsearch.app.main import create_app

    app = create_app(settings, warmup=warmup)
    # No access log: the terminal tells the demo's story (progress, then ready), not every page's polls.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    warmup.on_failure.append(lambda _message: setattr(server, "should_exit", True))
    server.run()
    if warmup.failure is not None:
        print(f"error: the demo could not be prepared: {warmup.failure}", file=sys.stderr)
        return 1
    return 0


def train(args: argparse.Namespace) -> int:
    import dataclasses

    from rubricsearch.app.demo.checkpoints import DemoPlan, build_all
    from rubricsearch.app.demo.policy import PolicySize

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = DemoPlan() if args.seed is None else DemoPlan(seed=args.seed)
    if args.tower_steps is not None:
        plan = dataclasses.replace(plan, embedder=dataclasses.replace(plan.embedder, tower_steps=args.tower_steps))
    if args.steps is not None:
        plan = dataclasses.replace(plan, embedder=dataclasses.replace(plan.embedder, steps=args.steps))
    if args.reranker_steps is not None:
        plan = dataclasses.replace(plan, reranker=dataclasses.replace(plan.reranker, steps=args.reranker_steps))
    size = PolicySize(*args.policy_size) if args.policy_size else PolicySize()
    for role, path in build_all(Path(args.dir), plan, threads=args.threads, force=args.force,
                                policy_size=size).items():
        print(f"demo {role} checkpoint: {path}")
    return 0
