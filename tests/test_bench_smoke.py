"""Every maintained bench starts, runs the product's settings, and prints well-formed numbers: each runs here as a
subprocess on a tiny random checkpoint on the CPU at a small size, so an import, a flag or a product API that
breaks fails the suite instead of the next GPU lease. Timings are not checked (they are the benches' business)."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import PERFORMANCE, apply_overrides
from rubricsearch.app.settings import ModelSettings

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"(-?\d+(?:\.\d+)?)"
PAST = "bf6bcf4"  # an ancestor of every later commit: the benches' flags and printed settings came after it


def bench(script: str, *args: str, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUBRICSEARCH_")}  # the product's defaults
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**env, "PYTHONPATH": str(ROOT), "OUT": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def numbers(pattern: str, text: str) -> list[float]:
    found = re.search(pattern, text)
    assert found, f"no line matching {pattern!r} in:\n{text[-3000:]}"
    values = [float(v) for v in found.groups()]
    assert all(math.isfinite(v) and v >= 0 for v in values), found.group(0)
    return values


def settings_of(text: str) -> dict[str, str]:
    line = next(line for line in text.splitlines() if line.startswith("settings: "))
    return dict(part.split("=", 1) for part in line.removeprefix("settings: ").split("   (")[0].split())


def test_a_bench_refuses_an_unknown_or_invalid_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUBRICSEARCH_NOPE", raising=False)
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        apply_overrides(["nope=1"])
    # restored afterwards, whatever apply_overrides set
    monkeypatch.setenv("RUBRICSEARCH_MODELS__PREPROCESS", "official")
    with pytest.raises(Exception, match="preprocess"):
        apply_overrides(["models.preprocess=sideways"])
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        apply_overrides(["preprocess=official"])  # a flat name from before the groups



def test_a_bench_scratch_dir_goes_when_the_bench_exits_even_failed() -> None:
    """GBs of checkpoints and data must not stay behind on a GPU box: the folder exists while the bench runs and
    is gone after it exits, here by an error."""
    code = ("from bench.common import scratch_dir; d = scratch_dir('rs-scratch-test-'); (d / 'w.bin').write_bytes(b'x')"
            "; print(d, d.is_dir(), flush=True); raise SystemExit(3)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 3, proc.stderr
    path, existed = proc.stdout.split()
    assert existed == "True" and Path(path).name.startswith("rs-scratch-test-") and not Path(path).exists()


@pytest.mark.slow
def test_ingest_throughput_runs_the_product_settings_and_a_set_one(tmp_path: Path) -> None:
    out = bench("ingest_throughput.py", "--size", "tiny", "--images", "6", "--kind", "mixed", "--side", "96",
                "--baselines", "--set", "models.device=cpu", "--batch-size", "4",
                "--json", str(tmp_path / "r.json"))
    printed = settings_of(out)
    assert printed["models.device"] == "cpu*" and printed["claim"] == "4"
    # no star: the product's default
    assert printed["models.preprocess"] == ModelSettings.model_fields["preprocess"].default
    n, _, rate = numbers(rf"ingest: {NUMBER} images in {NUMBER}s = {NUMBER} images/s", out)
    assert n == 6 and rate > 0
    numbers(rf"official class path \(16 images per call\)\s+{NUMBER}\s+{NUMBER}x", out)
    result = json.loads((tmp_path / "r.json").read_text())
    assert set(result["settings"]) == set(PERFORMANCE) and result["settings"]["models.device"] == "cpu"
    assert result["ingest"]["images_per_s"] > 0 and result["baselines"]["raw_images_per_s"] > 0


def test_ingest_rates_keep_three_digits_below_ten_images_a_second() -> None:
    """12-MP photos on the CPU ingest at about 0.17 images/s: one decimal would print 0.2 for 0.15 and 0.24 alike."""
    from bench.ingest_throughput import rate

    assert [rate(r) for r in (0.1712, 1.234, 11.83, 190.14)] == ["0.171", "1.23", "11.8", "190.1"]


@pytest.mark.slow
def test_search_latency_runs_and_never_encodes_a_reference(tmp_path: Path) -> None:
    out = bench("search_latency.py", "--size", "tiny", "--references", "6", "--repeats", "1", "--side", "64",
                "--top-k", "3", "--top-n", "3", "--baselines", "--set", "models.device=cpu",
                "--json", str(tmp_path / "r.json"))
    assert settings_of(out)["models.engine"] == "auto"  # the product's default, printed as resolved
    for case in ("rubric only, no rerank", "candidate only", "rubric + candidate", "3 criteria + candidate"):
        numbers(rf"{re.escape(case)}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}", out)
    assert numbers(rf"stage / own = {NUMBER}", out)[0] > 0
    # the stage as the timed searches ran it (no per-piece timers) is the one divided by the pieces' own time
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["query_stage_ms"] == result["cases"]["rubric + candidate"]["query_embedding"]
    assert result["query_stage_over_own"] == pytest.approx(result["query_stage_ms"] / result["own_ms"])
    # the split's parts are each timed, not one left over from another: none can be negative
    decode, prepare, rest = (numbers(rf"{part} {NUMBER}", out)[0]
                             for part in ("decode", "resize and patches", "rest"))
    assert decode > 0 and prepare >= 0 and rest >= 0, out
    assert "vision-encoder runs for references during all searches: 0;" in out
    baselines = json.loads((tmp_path / "r.json").read_text())["baselines"]
    assert all(row["official_ms"] > 0 and row["flop_limit_ms"] > 0 for row in baselines.values())


@pytest.mark.slow
def test_core_reuse_runs() -> None:
    out = bench("core_reuse.py", "--size", "tiny", "--set", "models.device=cpu", "--ns", "1,2", "--ks", "3",
                "--repeats", "1",
                "--side", "64")
    assert settings_of(out)["models.device"] == "cpu*"
    numbers(rf"\n2\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}x", out)
    numbers(rf"\n3\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}ms\s+{NUMBER}x", out)


@pytest.mark.slow
def test_ann_recall_runs() -> None:
    out = bench("ann_recall.py", "--sizes", "10k", "--data", "clustered", "--queries", "10", "--ef", "32",
                "--dim", "16")
    assert "settings: " in out
    recall = numbers(r"10k clustered\s+32(?:\s+[\d.]+){8}\s+([\d.]+)", out)[0]
    assert recall <= 1


@pytest.mark.slow
def test_load_search_runs_without_server_errors(tmp_path: Path) -> None:
    out = bench("load_search.py", "--side", "64", "--references", "4", "--clients", "1", "--seconds", "2",
                "--ingest-during", "2", "--json", str(tmp_path / "r.json"))
    assert settings_of(out)["workers"] == "1"
    (level,) = json.loads((tmp_path / "r.json").read_text())
    assert level["clients"] == 1 and level["searches_per_s"] > 0 and level["5xx"] == 0


@pytest.mark.slow
def test_soak_runs() -> None:
    out = bench("soak.py", "--minutes", "0.1", "--clients", "1", "--references", "4", "--batch", "2",
                "--ingest-every", "2", "--sample-every", "2")
    assert "settings: " in out
    found = re.search(r"status classes (\{.*\})", out)
    assert found, out[-2000:]
    codes = ast.literal_eval(found.group(1))
    assert codes.get("2xx", 0) > 0 and codes.get("5xx", 0) == 0, codes
    for key in ("rss_mib", "rss_minus_caches_mib", "fds", "threads"):
        numbers(rf"{key}\s+after warm-up\s+{NUMBER} -> end\s+{NUMBER}: growth", out)


@pytest.mark.slow
def test_the_gpu_report_runs_its_sections_beside_an_older_commit() -> None:
    """The report's entry point at smoke size, A/B against the commit this work started from (exported with git
    archive): both columns filled by this tree's bench code (that commit's own benches take other flags), their
    ratio printed."""
    out = bench("gpu_report.py", "--smoke", "--only", "ingest_448,search_448", "--against", PAST, timeout=600)
    header = next(line for line in out.splitlines() if line.startswith("section"))
    assert "this tree" in header and PAST in header and "ratio" in header
    rate = numbers(rf"ingest_448\s+images/s \(median\)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x", out)
    assert rate[0] > 0 and rate[1] > 0
    numbers(rf"search_448\s+rubric \+ candidate: p50 ms\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x", out)
    assert "failed" not in out.split("== GPU report")[-1]
    walls = out.split("wall s")[-1]  # each section's wall time per tree, then the total
    sections = [sum(numbers(rf"\n{name}\s+{NUMBER}\s+{NUMBER}\n", walls)) for name in ("ingest_448", "search_448")]
    total = numbers(rf"\ntotal\s+budget 540\s+{NUMBER}", walls)[0]
    assert 0 < sum(sections) <= total


@pytest.mark.slow
def test_the_gpu_report_keeps_to_its_budget() -> None:
    """A section still running when the budget is spent is stopped and the rest skipped, so the report ends inside
    its device call; the table and the wall times still print, naming what did not run."""
    out = bench("gpu_report.py", "--smoke", "--only", "search_448,ingest_448,search_photo", "--budget", "15",
                timeout=300)
    total = numbers(rf"\ntotal\s+budget 15\s+{NUMBER}", out)[0]
    assert total <= 15 + 10, out[-3000:]  # the budget, the last section's stop and the table
    # which section the budget catches depends on the box's pace: one is stopped midway, or the rest are skipped
    stopped = "stopped at the report's budget" in out and "(failed)" in out
    assert stopped or "skipped" in out.split("wall s")[-1], out[-3000:]


@pytest.mark.slow
def test_a_slow_official_baseline_is_timed_by_its_first_calls(tiny_embedding_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Where one official call is slow (12-MP photos on a GPU), its first call counts and two calls' images are
    timed (no warm-up); a fast one is warmed up and timed over every file. Here "slow" is every call (SLOW_S 0)."""
    from bench import baselines
    from bench.images import make_files
    from rubricsearch.retrieval.qwen.model.loading import load_qwen

    loaded = load_qwen(tiny_embedding_dir, dtype="float32", device="cpu")
    files = make_files(5, 64, "square")
    fast = baselines.ingest_baselines(loaded, files, raw_batch=5, official_batch=2)
    assert not fast["official_cold"] and fast["official_images"] == 5
    monkeypatch.setattr(baselines, "SLOW_S", 0.0)
    slow = baselines.ingest_baselines(loaded, files, raw_batch=5, official_batch=2)
    assert slow["official_cold"] and slow["official_images"] == 4 and slow["official_images_per_s"] > 0


def test_a_slow_search_baseline_is_timed_by_its_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A search path is warmed up once and then timed once; where its first call is slow it is that call alone."""
    from bench import baselines

    calls: list[str] = []
    timer = baselines.FirstCallTimer(lambda: None)
    assert [timer(lambda: calls.append("a"), "fast")[1], timer(lambda: calls.append("b"), "fast")[1]] == [False] * 2
    assert calls == ["a", "a", "b"]  # a warm-up, then one timed run per case
    monkeypatch.setattr(baselines, "SLOW_S", 0.0)
    calls.clear()
    assert [timer(lambda: calls.append("c"), "slow")[1], timer(lambda: calls.append("d"), "slow")[1]] == [True, False]
    assert calls == ["c", "d"]  # the first call is the measurement, the next case runs once


def test_gpu_memory_runs_the_app_through_ingestion_and_search(tiny_embedding_dir: Path,
                                                              tiny_reranker_dir: Path) -> None:
    out = bench("gpu_memory.py", "--embedding", str(tiny_embedding_dir), "--reranker", str(tiny_reranker_dir),
                "--images", "3", "--size", "64")
    assert "settings: defaults, 3 images of 64 px" in out
    for stage in ("loaded", "ingested 3", "searched"):  # no GPU here: the process's peak RSS
        assert numbers(rf"{stage}: peak RSS {NUMBER} MiB", out)[0] > 0


def test_every_bench_script_answers_help_from_anywhere(tmp_path: Path) -> None:
    """``python bench/X.py --help`` as the docs write it: from another folder and with no PYTHONPATH, each script
    finds the installed product and its sibling bench modules (each forked from one process that imported torch
    and the other shared libraries once: tests/bench_help.py)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    scripts = sorted(p for p in (ROOT / "bench").glob("*.py") if '__name__ == "__main__"' in p.read_text())
    helper = ROOT / "tests" / "bench_help.py"
    proc = subprocess.run([sys.executable, str(helper), *map(str, scripts)], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=300)
    assert len(scripts) >= 20 and proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
