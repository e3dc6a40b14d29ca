"""Smoke test of bench/refusal_cost.py at a 1 MiB JSON cap and 4 clients with 600 x 600 images: every hostile
request is refused with a 4xx and the server still answers (no timing or memory assertions: the bench prints
those)."""

from __future__ import annotations

import pytest

from bench.refusal_cost import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_every_hostile_request_is_a_4xx(capsys: pytest.CaptureFixture[str]) -> None:
    results = main(["--cap-mib", "1", "--image-side", "600", "--clients", "4"])
    hostile = {name: r for name, r in results.items() if "concurrent" not in name}
    assert len(hostile) >= 10
    assert all(400 <= status < 500 for status, *_ in hostile.values()), results
    (concurrent,) = set(results) - set(hostile)
    assert results[concurrent][0] in (200, 503)  # served, or refused with Retry-After over the pixel budget
    out = capsys.readouterr().out
    assert "max_json_bytes=1048576" in out and "non-default" in out and "server still answers /healthz" in out
