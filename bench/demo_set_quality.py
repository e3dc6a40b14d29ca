"""The verdicts the Compare page shows on the 40-face demo set (issue 50 item 2), against the faces' true attributes.

The demo set is prepared as ``rubricsearch demo`` prepares it (ingested, judged from the faces' attributes, the
calibration refitted) in a temporary data directory and searched through the API's search path
(:mod:`app.demo.set_quality`): per criterion, the precision of ``match`` and ``no match`` and the share
``uncertain`` at the calibration's thresholds, fitted on every judgment (what the page shows) and with five folds of
faces held out; the candidates' attribute twins and a blue square searched alone; and the reranker's own judgement of
a candidate alone on every pair of the set's faces (asked whatever the rerank policy decides), beside the recall
score's.

    .venv/bin/python bench/demo_set_quality.py --embedding DIR/demo-embedding --reranker DIR/demo-reranker \
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rubricsearch.app.demo.set_quality import judged_alone, judged_alone_line, measure_set, prepared_state, table


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--embedding", required=True)
    ap.add_argument("--reranker", required=True)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="demo-set-quality-") as tmp:
        state, set_id = prepared_state(args.embedding, args.reranker, Path(tmp) / "data")
        try:
            prepared = time.monotonic() - started
            quality = measure_set(state, set_id)
        finally:
            state.close()
    print(table(quality))
    print(f"(prepared in {prepared:.0f} s, measured in {time.monotonic() - started - prepared:.0f} s)")
    alone = judged_alone(args.embedding, args.reranker)
    print(judged_alone_line(alone))
    if args.json:
        args.json.write_text(json.dumps(asdict(quality) | {"judged_alone": asdict(alone)}, indent=2))


if __name__ == "__main__":
    main()
