"""The benchmark scripts run end to end on a tiny random model (their numbers are not checked: timing is noisy)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.integration
def test_scoring_cost_runs_with_every_attention_sized_feature_skipped():
    """--skip-features replaces each feature's torch function by zeros of its output's shape, whatever arguments
    the library passes it (the stand-ins broke once when a function gained a positional argument)."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_scoring_cost.py"), "--scorer", "init:query_aware",
                             "--random-weights", "--layers", "2", "--contexts", "512", "--repeats", "1",
                             "--scorer-precision", "medium",
                             "--skip-features", "window_attention,expected_attention,output_norm"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["context"] == 512 and record["score_s"] > 0
    assert record["operators"]["operators_per_layer"] > 0 and "operators per layer" in result.stdout
    low, high = record["score_share_range"]
    assert 0 < low <= record["score_share"] <= high
    assert record["skipped_features"] == ["window_attention", "expected_attention", "output_norm"]


def test_cache_bytes_reports_kv_at_the_keep_ratio_for_both_allocations():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_cache_bytes.py"), "--base", "tiny-random-llama",
                             "--scorer", "init:seed", "--contexts", "1024", "--keeps", "0.5"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["allocation"] for row in rows] == ["per_head", "joint"]
    for row in rows:
        assert abs(row["kv_share"] - 0.5) < 0.01 and row["nbytes_share"] >= row["kv_share"]
