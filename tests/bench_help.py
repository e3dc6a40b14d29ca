"""``python tests/bench_help.py SCRIPT...``: each bench script's ``--help`` as ``python SCRIPT --help`` runs it (its
folder first on ``sys.path``, the current folder and the environment as given), in a child forked from one process
that imported the third-party libraries the scripts share, so each does not pay torch's and transformers' imports
again. Nothing of ours is imported before the fork: each child finds the product and its sibling bench modules
itself. Prints ``FAILED name: stderr tail`` for each script that did not exit 0; exits 1 if any did.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

SHARED = ("numpy", "torch", "transformers", "PIL.Image", "httpx", "fastapi", "sqlalchemy", "pydantic_settings")


def child(script: Path, err: Path) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.argv = [str(script), "--help"]
        sys.path[0] = str(script.parent)  # what ``python SCRIPT`` puts first
        try:
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(scripts: list[str]) -> int:
    for name in SHARED:
        __import__(name)
    failed = 0
    for i, script in enumerate(map(Path, scripts)):
        err = Path(f"help-{i}.err").resolve()
        pid = os.fork()
        if pid == 0:
            child(script, err)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed += 1
            print(f"FAILED {script.name}: {err.read_text(errors='replace')[-400:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
