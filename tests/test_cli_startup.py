"""``rubricsearch --help`` (and each command's ``--help``) answers without importing the model, web or database
stack: the commands import what they need when they run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "fastapi", "sqlalchemy", "faiss", "PIL", "numpy")
PROBE = """
import contextlib, io, json, sys
from app.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(sys.argv[2:])
    except SystemExit:
        pass
print(json.dumps({"help": out.getvalue(), "loaded": [m for m in sys.argv[1].split(",") if m in sys.modules]}))
"""


@pytest.mark.parametrize("argv", [["--help"], ["ingest", "--help"], ["search", "--help"], ["worker", "--help"]],
                         ids=lambda a: " ".join(a))
def test_help_imports_no_heavy_module(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, ",".join(HEAVY), *argv], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert "usage: rubricsearch" in report["help"]
    assert report["loaded"] == []
