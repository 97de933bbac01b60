"""The benchmark scripts of bench/ run end to end at tiny sizes (``--quick``): CSV, PNG and table written.

They are not timed tests (DESIGN.md §6): this only proves they run, on the torch backend, on the CPU.
"""

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = ["decode_attention", "kernel_breakdown", "e2e_decode"]


def _load(name):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        _load(name).main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_run_writes_csv_and_plot(name, tmp_path, capsys, keep_threads):
    pytest.importorskip("matplotlib")
    assert _load(name).main(["--quick", "--threads", "1", "--repeats", "2", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / f"{name}.csv")))
    assert rows
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    assert "|---" in capsys.readouterr().out                     # the Markdown table
    if name == "decode_attention":
        methods = {r["method"] for r in rows}
        assert {"sdpa", "sdpa_gqa", "dense_paged", "sparse"} <= methods
        for r in rows:
            assert float(r["ideal_speedup"]) >= 1.0 and float(r["time_us"]) > 0
            assert r["baseline"] in ("sdpa", "sdpa_gqa")
            if r["method"] == r["baseline"]:
                assert float(r["speedup"]) == 1.0
    if name == "kernel_breakdown":
        for r in rows:   # the parts are shares of their own sum; the step is the fused call + metadata
            parts = ("metadata", "score", "topk", "attention")
            shares = sum(float(r[f"{ph}_share_of_parts"]) for ph in parts)
            assert shares == pytest.approx(1.0, abs=1e-3)
            assert float(r["parts_alone_sum_us"]) == pytest.approx(sum(float(r[f"{ph}_alone_us"]) for ph in parts),
                                                                   rel=1e-4)
            assert float(r["step_fused_us"]) == pytest.approx(float(r["fused_call_us"]) + float(r["metadata_alone_us"]),
                                                              rel=1e-4)
            assert float(r["speedup_vs_sdpa"]) == pytest.approx(float(r["sdpa_us"]) / float(r["step_fused_us"]),
                                                                rel=1e-3)


def test_sliding_window_quick_run(tmp_path, capsys, keep_threads):
    """bench/sliding_window.py: full, sparse and sliding rows; a window reads fewer bytes than the full layer."""
    assert _load("sliding_window").main(["--quick", "--threads", "1", "--repeats", "2", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "sliding_window.csv")))
    assert [r["method"] for r in rows] == ["full", "sparse", "sliding 128"]
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[2]["ideal"]) == 8.0      # 1024 / 128 keys
    assert "|---" in capsys.readouterr().out
