"""The benchmark scripts of bench/ run end to end at tiny sizes (``--quick``): CSV, PNG and table written; their
default output folder is the git-ignored out/bench.

They are not timed tests (DESIGN.md §6): this only proves they run, on the torch backend, on the CPU.
"""

import ast
import csv
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from paths import REPO, load_bench

BENCH = REPO / "bench"
SCRIPTS = ["decode_attention", "kernel_breakdown", "e2e_decode"]




@pytest.mark.slow
def test_cpu_threads_runs_each_setting_in_its_own_process(tmp_path, capsys):
    """bench/cpu_threads.py: one process per setting (default, 1 thread, OMP_WAIT_POLICY=PASSIVE), a row each."""
    assert load_bench("cpu_threads").main(["--rounds", "1", "--iters", "2", "--csv", str(tmp_path / "t.csv")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert [r["setting"] for r in rows] == ["default", "1 thread", "PASSIVE"]
    assert rows[1]["threads"] == "1" and all(float(r["sparse_ms"]) > 0 for r in rows)
    assert "| PASSIVE |" in capsys.readouterr().out


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        load_bench(name).main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_run_writes_csv_and_plot(name, tmp_path, capsys, keep_threads):
    pytest.importorskip("matplotlib")
    assert load_bench(name).main(["--quick", "--threads", "1", "--repeats", "2", "--out", str(tmp_path)]) == 0
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
    assert load_bench("sliding_window").main(["--quick", "--threads", "1", "--repeats", "2", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "sliding_window.csv")))
    assert [r["method"] for r in rows] == ["full", "sparse", "sliding 128"]
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[2]["ideal"]) == 8.0      # 1024 / 128 keys
    assert "|---" in capsys.readouterr().out


@pytest.mark.slow
def test_retention_recall_tiny_run(tmp_path, capsys, keep_threads):
    """bench/retention_recall.py on a tiny random retrieval checkpoint: every (seed, policy) run, summary, PNG."""
    import json

    pytest.importorskip("matplotlib", reason="the PNG needs the plots extra")

    from tinyattn.models import LlamaConfig, LlamaModel
    from tinyattn.retrieval import CharTokenizer, save_retrieval_model

    torch.manual_seed(0)
    tok = CharTokenizer()
    cfg = LlamaConfig(dim=16, hidden_dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=tok.vocab_size,
                      layer_types=("sliding_attention", "full_attention"), sliding_window=32, nope_layers=(1,))
    ckpt = save_retrieval_model(LlamaModel(cfg), tok, tmp_path / "ckpt")
    rc = load_bench("retention_recall").main(["--model", str(ckpt), "--seeds", "0", "1", "--steps", "1", "--seq-len", "400",
                                         "--num-keys", "2", "--num-questions", "2", "--kv-budget-pages", "12",
                                         "--chunk-size", "32", "--eval-sequences", "2", "--no-progress",
                                         "--out", str(tmp_path / "out")])
    assert rc == 0
    result = json.loads((tmp_path / "out" / "retention_recall.json").read_text())
    assert len(result["runs"]) == 6 and [s["seeds"] for s in result["summary"]] == [2, 2, 2]
    kv = {s["retention"]: s["peak_kv_bytes"] for s in result["summary"]}
    assert kv["recency"] == kv["gradient"] < kv["full"]                 # equal memory for the two evicting ones
    assert (tmp_path / "out" / "retention_recall.png").stat().st_size > 0
    assert "| gradient | 2 |" in capsys.readouterr().out


@pytest.mark.slow
def test_retention_recall_without_matplotlib_writes_the_numbers(tmp_path, capsys, keep_threads, monkeypatch):
    """Without the plots extra, bench/retention_recall.py still writes its JSON, CSV and table, and says why there
    is no PNG (it used to import matplotlib itself and crash)."""
    import json

    from tinyattn.models import LlamaConfig, LlamaModel
    from tinyattn.retrieval import CharTokenizer, save_retrieval_model

    monkeypatch.setitem(sys.modules, "matplotlib", None)          # as if not installed: import fails
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    torch.manual_seed(0)
    tok = CharTokenizer()
    cfg = LlamaConfig(dim=16, hidden_dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=tok.vocab_size)
    ckpt = save_retrieval_model(LlamaModel(cfg), tok, tmp_path / "ckpt")
    out = tmp_path / "out"
    rc = load_bench("retention_recall").main(["--model", str(ckpt), "--seeds", "0", "--policies", "recency", "--steps", "1",
                                         "--seq-len", "200", "--num-keys", "1", "--num-questions", "1",
                                         "--kv-budget-pages", "8", "--chunk-size", "32", "--eval-sequences", "1",
                                         "--no-progress", "--out", str(out)])
    assert rc == 0
    assert [r["retention"] for r in json.loads((out / "retention_recall.json").read_text())["runs"]] == ["recency"]
    assert (out / "retention_recall.csv").is_file() and not (out / "retention_recall.png").exists()
    printed = capsys.readouterr().out
    assert "| recency | 1 |" in printed
    assert 'matplotlib is not installed: skipping the plot (pip install -e ".[plots]")' in printed


def test_no_bench_script_imports_matplotlib_itself():
    """Plots go through bench/common.pyplot() (None without the plots extra), so every script runs without it."""
    offenders = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name == "common.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}:{node.lineno}" for n in names if n.split(".")[0] == "matplotlib"]
    assert not offenders


def test_questmass_sweep_rows(tmp_path, keep_threads, capsys):
    out = tmp_path / "sweep.json"
    load_bench("questmass_sweep").main(["--gammas", "0.5,1", "--page-sizes", "4", "--token-budgets", "8",
                                   "--max-stories", "1", "--max-context", "24", "--json", str(out)])
    import json
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["gamma"]) for r in rows] == [("quest", None), ("questmass", 0.5), ("questmass", 1.0)]
    assert all(0 <= r["hit_rate"] <= 1 and r["nll"] > 0 for r in rows)
    assert "questmass gamma=0.5" in capsys.readouterr().out


@pytest.mark.slow
def test_ab_revisions_quick_run(tmp_path, capsys, keep_threads):
    """bench/ab_revisions.py: the package at HEAD beside the working tree's, in one process; both give the same
    outputs (the script checks) and every new row carries its speedup over the old one."""
    import shutil
    import subprocess

    root = BENCH.parent
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("needs a git checkout")
    assert load_bench("ab_revisions").main(["--quick", "--old", "HEAD", "--threads", "1", "--repeats", "2",
                                       "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "ab_revisions.csv")))
    assert [r["method"] for r in rows] == ["sdpa", "dense_old", "sparse_old", "dense_new", "sparse_new"]
    assert all(float(r["new_over_old"]) > 0 for r in rows if r["method"].endswith("_new"))
    assert "|---" in capsys.readouterr().out


def test_bench_scripts_write_to_scratch_by_default():
    common = load_bench("common")
    assert common.DEFAULT_OUT == REPO / "out" / "bench"
    for name in ("decode_attention", "kernel_breakdown", "e2e_decode"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = load_bench(name).parse_args([])
        assert args.out == REPO / "out" / "bench", name
        assert load_bench(name).parse_args(["--out", "docs/bench"]).out == Path("docs/bench")
    source = (BENCH / "profile_generate.py").read_text()
    assert "default=C.DEFAULT_OUT" in source and "shared" not in source
    run_cpu = (BENCH / "run_cpu.sh").read_text()
    assert 'OUT="${OUT:-out/bench}"' in run_cpu


def test_hf_perplexity_takes_comma_separated_budgets(capsys):
    hf_perplexity = load_bench("hf_perplexity")
    assert hf_perplexity.parse_args(["--page-budgets", "2,4,8"]).page_budgets == [2, 4, 8]
    assert hf_perplexity.parse_args([]).page_budgets == [2, 4, 8]
    assert hf_perplexity.parse_args([]).text is None                 # the shipped stories
    with pytest.raises(SystemExit):
        hf_perplexity.parse_args(["--page-budgets", "2", "4"])


def test_long_text_merge_records_what_its_parts_ran(tmp_path, capsys):
    """``smollm2_long_text.py --merge A,B``: the merged meta holds the parts' settings (page sizes 8 and 16, their
    windows and buckets), not the merging command's defaults; each part's dense rows kept once."""
    module = load_bench("smollm2_long_text")
    parts = []
    for ps in (8, 16):
        meta = dict(context=8192, windows=2, buckets="4096,5120", tokens=64, budgets="1/8", page_sizes=str(ps),
                    policies="quest:gamma=0.25", threads=1, seconds=10.0, recipes={"sink1": {}})
        rows = [dict(window=0, position=p, page_size=ps, recipe=rec, policy=pol, budget_fraction=f, page_budget=None,
                     nll=2.0 + (pol != "dense") * 0.1, dense_nll=2.0, ratio=1.0)
                for p in (4096, 5120)
                for rec, pol, f in (("dense", "dense", None), ("sink1", "quest:gamma=0.25", 0.125))]
        (tmp_path / f"ps{ps}").mkdir()
        (tmp_path / f"ps{ps}" / "long_text.json").write_text(json.dumps({"meta": meta, "rows": rows}))
        parts.append(str(tmp_path / f"ps{ps}"))
    assert module.main(["--out", str(tmp_path / "merged"), "--merge", ",".join(parts)]) == 0
    merged = json.loads((tmp_path / "merged" / "long_text.json").read_text())
    meta = merged["meta"]
    assert (meta["windows"], meta["buckets"], meta["page_sizes"], meta["seconds"]) == (2, "4096,5120", "8,16", 20.0)
    assert meta["policies"] == "quest:gamma=0.25" and meta["merged"] == parts
    assert len(merged["rows"]) == 8                          # 2 positions x (dense + sparse) x 2 page sizes


def test_host_profile_splits_the_public_op(tmp_path, capsys, keep_threads):
    """bench/host_profile.py: the per-call table times the public op, its unchecked form, a planned run and the dense
    op; the cProfile table is rooted at the public op (called once per op call) and only lists tinyattn's files;
    the torch.profiler table counts the aten ops of one call."""
    assert load_bench("host_profile").main(["--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "host_profile.md").read_text()
    assert text in capsys.readouterr().out
    per_call, by_function, by_op = text.split("\n## ")[1:]
    rows = [line.split(" | ") for line in per_call.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r[0].strip("| ") for r in rows] == ["sparse_paged_attention", "sparse, value_checks(False)",
                                               "plan.run (planned once)", "paged_attention (dense)"]
    assert all(float(r[1]) > 0 for r in rows) and rows[0][2].strip(" |") == "1.00"
    functions = [line for line in by_function.splitlines() if line.startswith("| `")]
    assert "tinyattn/ops/api.py" in functions[0] and "sparse_paged_attention`" in functions[0]
    assert functions[0].endswith("| 1 |")
    assert all(line.startswith("| `tinyattn/") for line in functions)
    assert int(by_op.rsplit("aten ops per op call: ", 1)[1].split()[0]) > 0
    import tinyattn
    assert tinyattn.ops.validation.value_checks_active()           # the unchecked form left the checks on
