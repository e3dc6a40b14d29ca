"""pytest plugin: the session's demo models (the default plan, the ``demo_models`` fixture) train in a background
process from the end of collection (from the session's start when the whole suite runs), at the lowest CPU
priority; the ``bench`` fixture serves them over the 120 evaluation faces to every module that measures them
(building it costs minutes: once per session).

Training takes minutes of two threads, and the rest of the suite leaves much of the 2-core box idle (it waits on
servers and subprocesses, and most of it runs one thread), so the training takes that idle time instead of
minutes of its own; at ``nice 19`` it barely slows the tests beside it. The modules that use the models run last
(``tests/conftest.py``), so the training has the whole run to finish; the fixture that waits for it gives it the
tests' priority back. The weights are the ones in-process training gives: the same ``build_all`` call with the same
threads.

``python -m tests.demo_training ROOT SEED`` is the background process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from rubricsearch.app.demo.search_eval import SearchBench

REPO = Path(__file__).resolve().parents[1]
FIXTURE = "demo_models"
CACHE = "RUBRICSEARCH_DEMO_MODELS_CACHE"  # a folder that keeps the checkpoints between runs
PLAN_SEED = "RUBRICSEARCH_DEMO_PLAN_SEED"  # bench/demo_spread.py runs the quality tests on other seeds' models
THREADS = 2


@dataclass
class Training:
    root: Path  # the models
    proc: subprocess.Popen[bytes]
    work: Path  # the log, and the models unless a cache holds them; removed at the session's end


_TRAINING = pytest.StashKey[Training]()


def plan_seed() -> int:
    return int(os.environ.get(PLAN_SEED, "0"))


def start(config: pytest.Config) -> Training:
    """The background training of this session (started now if it was not)."""
    if _TRAINING in config.stash:
        return config.stash[_TRAINING]
    work = Path(tempfile.mkdtemp(prefix="rs-demo-models-"))
    root = Path(os.environ.get(CACHE) or work / "models")
    with (work / "training.log").open("wb") as out:
        proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "tests.demo_training", str(root),
                                 str(plan_seed())], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    config.stash[_TRAINING] = Training(root, proc, work)
    return config.stash[_TRAINING]


def finished(config: pytest.Config) -> Path:
    """The folder holding the trained models, once the background training has ended well."""
    training = start(config)
    if training.proc.poll() is None:  # a test waits for it now: it runs at the priority of the tests
        for task in Path(f"/proc/{training.proc.pid}/task").glob("*"):  # Linux's priority is per thread
            with contextlib.suppress(OSError, ValueError):  # without the right to raise it, it stays low
                os.setpriority(os.PRIO_PROCESS, int(task.name), 0)
    code = training.proc.wait()
    log = (training.work / "training.log").read_text(errors="replace")
    assert code == 0, f"the demo training exited with {code}: {log[-3000:]}"
    return training.root


@pytest.fixture(scope="session")
def demo_models(request: pytest.FixtureRequest) -> dict[str, Path]:
    """Both demo models of the default plan, trained once per session in the background from the start of the
    run (in ``RUBRICSEARCH_DEMO_MODELS_CACHE`` when set, reused when it holds checkpoints of the current plan;
    ``RUBRICSEARCH_DEMO_PLAN_SEED`` picks another seed's plan); ``build_all`` finds them current."""
    from rubricsearch.app.demo.checkpoints import DemoPlan, build_all

    return build_all(finished(request.config), DemoPlan(seed=plan_seed()), threads=THREADS)


@pytest.fixture(scope="session")
def bench(demo_models: dict[str, Path]) -> Iterator[SearchBench]:
    """The demo models searching the 120 evaluation faces; read only by its users (quality measurements, the
    calibration's judged cells), so one serves them all."""
    from rubricsearch.app.demo.evaluation import eval_set
    from rubricsearch.app.demo.search_eval import SearchBench

    docs, images = eval_set(120)
    b = SearchBench(str(demo_models["embedding"]), str(demo_models["reranker"]), docs, images)
    yield b
    b.close()


def stop(training: Training) -> None:
    """End a training that is still running as Ctrl-C would: it removes its half-trained directory."""
    if training.proc.poll() is None:
        training.proc.send_signal(signal.SIGINT)
        try:
            training.proc.wait(30)
        except subprocess.TimeoutExpired:
            training.proc.kill()
            training.proc.wait()


def pytest_sessionstart(session: pytest.Session) -> None:
    # The whole suite (no paths named: the testpaths) uses the demo models, so their training starts before the
    # collection, whose imports take tens of CPU-seconds of one core, rather than after it.
    config = session.config
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and not config.option.collectonly:
        start(config)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        start(session.config)
    elif _TRAINING in session.config.stash:  # started at the session's start, but no test selected uses it
        stop(session.config.stash[_TRAINING])


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _TRAINING not in session.config.stash:
        return
    training = session.config.stash[_TRAINING]
    stop(training)  # the run ended before a test waited for it (-x, an interrupt)
    shutil.rmtree(training.work, ignore_errors=True)


def main(argv: list[str]) -> int:
    from rubricsearch.app.demo.checkpoints import DemoPlan, build_all

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the steps, for a failure's log
    root, seed = Path(argv[0]), int(argv[1])
    for role, path in build_all(root, DemoPlan(seed=seed), threads=THREADS).items():
        print(f"demo {role}: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
