"""Smoke test of bench/vllm_transport.py's payload section (no server): it runs at small sizes and reports every
transport for every shape. Its numbers are the bench's business, not this test's."""

from __future__ import annotations

import argparse

import pytest

from bench import vllm_transport


def test_payload_section_runs_and_reports_all_transports(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(vllm_transport, "SHAPES", [("tiny", None, None, "float32"), ("2B", 2048, 3, "bfloat16")])
    monkeypatch.setattr(vllm_transport, "IMAGES", [("64px", 64, 64)])
    args = argparse.Namespace(k=2, criteria=1, repeats=1)
    rows = vllm_transport.payload(args, vllm_transport.fingerprint())
    vllm_transport.print_payload(rows, args)
    assert [(r["shape"], r["transport"]) for r in rows] == [
        (s, t) for s in ("tiny", "2B") for t in vllm_transport.TRANSPORTS]
    by = {(r["shape"], r["transport"]): r for r in rows}
    # a key's size does not depend on the package (only its dtype's name); an inline package grows with the width
    assert by[("tiny", "keys")]["mb_per_search"] == pytest.approx(by[("2B", "keys")]["mb_per_search"], rel=0.01)
    assert by[("2B", "inline")]["mb_per_search"] > 4 * by[("tiny", "inline")]["mb_per_search"]
    assert "inline/keys bytes" in capsys.readouterr().out
