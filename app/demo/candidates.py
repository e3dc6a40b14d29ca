"""The demo's candidate faces (split "candidate", none of them in the reference set): written to the data
directory by ``rubricsearch demo`` and offered on the compare page, each titled with its true attributes so a
person can judge the ranking it gets."""

from __future__ import annotations

import base64
from pathlib import Path

from rubricsearch.app.demo.faces import CANDIDATES, candidate_images
from rubricsearch.app.plugins import Offered

CANDIDATES_DIR = "candidates"  # under the data dir
MAX_BYTES = 256 * 1024  # a hand-placed file bigger than a drawn face is not one of ours


def write_candidates(data_dir: Path) -> Path:
    """Write the candidate faces (kept when already there); returns their folder."""
    folder = data_dir / CANDIDATES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in candidate_images():
        path = folder / name
        if not path.exists():
            path.write_bytes(data)
    return folder


def offered(data_dir: Path) -> list[Offered]:
    """The candidates the demo wrote into ``data_dir`` (none when the demo never ran there)."""
    folder = data_dir / CANDIDATES_DIR
    found: list[Offered] = []
    for face in CANDIDATES:
        path = folder / f"candidate-{face.name}"
        try:
            if not path.is_file() or path.stat().st_size > MAX_BYTES:
                continue
            data = path.read_bytes()
        except OSError:
            continue
        found.append(Offered(path.name, face.describe(),
                             "data:image/png;base64," + base64.b64encode(data).decode("ascii")))
    return found
