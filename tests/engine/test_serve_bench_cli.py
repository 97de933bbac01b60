"""``python -m tinyattn serve-bench`` through a subprocess: help and a tiny run writing JSON, CSV and PNG."""

from __future__ import annotations

import csv
import json

import pytest

from commands import run_cli

pytestmark = pytest.mark.slow         # each test starts python -m tinyattn


def test_serve_bench_help_explains_every_option():
    proc = run_cli("serve-bench", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m tinyattn serve-bench" in proc.stdout and "examples:" in proc.stdout
    for opt in ("--request-rate", "--num-requests", "--data", "--prompt-len", "--output-len", "--output-len-dist",
                "--configs", "--num-pages", "--page-budget", "--max-num-batched-tokens", "--json", "--csv", "--plot",
                "--exit-threshold", "--recompute"):
        assert opt in proc.stdout, opt
    for word in ("ttft_p50_ms", "tpot_p99_ms", "output_throughput_tok_s", "preemptions", "Poisson"):
        assert word in proc.stdout, word


def test_serve_bench_tiny_run(tmp_path):
    pytest.importorskip("matplotlib", reason="the PNGs need the plots extra")
    proc = run_cli("serve-bench", "--num-requests", "5", "--request-rate", "200", "--output-len", "12",
                   "--num-pages", "8", "--configs", "dense,quest+exit", "--nll-stories", "1", "--nll-context", "40",
                   "--gamma", "0.5", "--top-p", "0.9",      # gamma: not the default (0.25)
                   "--no-progress", "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"),
                   "--plot", str(tmp_path / "r.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| dense | 5/5 |" in proc.stdout and "| quest+exit | 5/5 |" in proc.stdout
    saved = json.loads((tmp_path / "r.json").read_text())
    rows = saved["rows"]
    assert (saved["settings"]["gamma"], saved["settings"]["top_p"]) == (0.5, 0.9)
    assert "gamma 0.5, top_p 0.9" in proc.stdout
    assert [r["config"] for r in rows] == ["dense", "quest+exit"]
    for r in rows:
        assert r["completed"] == r["num_requests"] == 5 and r["peak_kv_pages"] <= 8
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["output_throughput_tok_s"] > 0 and r["nll"] > 0
    with open(tmp_path / "r.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_serve_bench_pool_too_small_is_a_clean_error(tmp_path):
    proc = run_cli("serve-bench", "--num-requests", "2", "--num-pages", "1", "--output-len", "40", "--no-progress",
                   cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--num-pages 1: a request of" in proc.stderr and "pages of 16 tokens" in proc.stderr
