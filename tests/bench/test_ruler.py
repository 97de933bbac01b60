"""bench/smollm2_ruler.py end to end on a tiny real model (stories260K as a Hugging Face folder, its 512-token
tokenizer): lm-eval's RULER samples and prompts, the runner's decoding against stock transformers, RULER's score,
resume, the attended-pages record and the report. Skipped without lm-eval (the ``eval`` extra).

Expected values come from outside the code under test: lm-eval's generator called directly under the same seed,
the task YAML's prompt rule (``input + " " + gen_prefix``), stock transformers' greedy ``generate``, a substring
test of the reference answers, Wilson intervals from a published table, and the count of pages a budget holds.
"""

import json
import random
from pathlib import Path

import pytest

from paths import load_bench

pytest.importorskip("lm_eval", reason="RULER's generators come from lm-eval (the eval extra: pip install -e '.[eval]')")
pytest.importorskip("wonderwords")
pytest.importorskip("transformers")
pytest.importorskip("scipy")

CONTEXT = 512                      # stories260K's max_seq_len; RULER leaves 128 tokens for the answer
SAMPLES = 3
POLICIES = "dense,quest,streaming,h2o"
BUDGETS = "1,1/8"                  # the whole context (must equal dense), and 4 pages


def _runner():
    return load_bench("smollm2_ruler")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The runner's first run on the tiny model: (module, out folder, model folder, argv)."""
    from tinyattn.assets import default_model_path, default_tokenizer_path
    from tinyattn.integrations.convert import convert

    base = tmp_path_factory.mktemp("ruler")
    folder = convert(default_model_path(), base / "stories260K_hf", tokenizer_path=default_tokenizer_path())
    out = base / "out"
    argv = ["--out", str(out), "--model", str(folder), "--tasks", "niah_single_1", "--contexts", str(CONTEXT),
            "--samples", str(SAMPLES), "--policies", POLICIES, "--budgets", BUDGETS, "--batch", "2",
            "--page-size", "16", "--threads", "1"]
    module = _runner()
    assert module.main(argv) == 0
    return module, out, folder, argv


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results" / f"niah_single_1_{CONTEXT}.jsonl").read_text().splitlines()]


def test_samples_are_lm_evals_own(run):
    """The stored samples are what lm-eval's niah_single_1 generator draws after random.seed(0), and each prompt is
    the doc's input, the YAML's target delimiter (a space) and its gen_prefix."""
    from lm_eval.tasks.ruler import niah_utils

    from tinyattn.retrieval import ruler

    _, out, folder, _ = run
    stored, info = ruler.load_samples(out / "samples" / f"niah_single_1_{CONTEXT}.jsonl.xz")
    random.seed(0)
    direct = niah_utils.niah_single_1(max_seq_lengths=[CONTEXT], pretrained=str(folder))["test"]
    assert len(stored) == SAMPLES and info["seed"] == 0 and info["lm_eval_task"] == "niah_single_1"
    for i, s in enumerate(stored):
        assert s["doc"]["input"] == direct[i]["input"] and s["doc"]["outputs"] == direct[i]["outputs"]
        assert s["prompt"] == direct[i]["input"] + " " + direct[i]["gen_prefix"]
        assert s["gen_kwargs"]["max_gen_toks"] == 128 and s["gen_kwargs"]["do_sample"] is False


def test_every_cell_scored_by_rulers_string_match(run):
    _, out, folder, _ = run
    from transformers import AutoTokenizer

    from tinyattn.retrieval import ruler

    tok = AutoTokenizer.from_pretrained(str(folder))
    samples = {s["index"]: s for s in ruler.load_samples(out / "samples" / f"niah_single_1_{CONTEXT}.jsonl.xz")[0]}
    rows = _rows(out)
    # per sample: stock, dense, and quest / streaming / h2o at two budgets
    assert len(rows) == SAMPLES * (2 + 3 * 2)
    for r in rows:
        answer = samples[r["index"]]["doc"]["outputs"][0]
        assert r["score"] == float(answer.lower() in r["text"].lower())          # RULER's string match
        assert tok.eos_token_id not in r["tokens"] and len(r["tokens"]) <= r["max_new_tokens"] == 16
        assert r["prompt_tokens"] == len(tok(samples[r["index"]]["prompt"]).input_ids)


def test_dense_gives_stock_transformers_tokens(run):
    """The runner's dense decode from its own prefill gives stock transformers' greedy tokens on every sample,
    and a budget of the whole context gives dense's tokens for every policy."""
    _, out, _, _ = run
    rows = _rows(out)
    by = {(r["index"], r["policy"], r["budget"]): r for r in rows}
    for i in range(SAMPLES):
        assert by[(i, "dense", None)]["tokens"] == by[(i, "hf_stock", None)]["tokens"]
        for policy in ("quest", "streaming", "h2o"):
            assert by[(i, policy, "1")]["tokens"] == by[(i, "dense", None)]["tokens"], (i, policy)


def _expected_attended(prompt: int, budget: int | None, steps: int = 15) -> tuple[float, float]:
    """Mean pages / tokens per decode step when each step keeps min(budget, pages of the row) pages, the partial
    last page among them (16-token pages; 15 sparse steps: the first of 16 tokens comes from the prefill)."""
    pages = tokens = 0
    for t in range(1, steps + 1):
        n = prompt + t
        valid = -(-n // 16)
        k = valid if budget is None else min(budget, valid)
        pages += k
        tokens += n if k == valid else (k - 1) * 16 + n - (valid - 1) * 16
    return pages / steps, tokens / steps


def test_attended_pages_follow_the_budget(run):
    """Dense and quest (fused: counted from the budget) and streaming / h2o (counted from their selections) attend
    min(page_budget, pages of the row) pages at every step."""
    _, out, _, _ = run
    for r in _rows(out):
        if r["policy"] == "hf_stock":
            assert r["pages"] is None
            continue
        assert r["page_budget"] == {None: None, "1": CONTEXT // 16, "1/8": 4}[r["budget"]]
        assert (r["pages"], r["tokens_attended"]) == pytest.approx(
            _expected_attended(r["prompt_tokens"], r["page_budget"])), r


def test_rerun_skips_done_cells_and_adds_new_ones(run):
    module, out, _, argv = run
    before = _rows(out)
    assert module.main(argv) == 0
    assert _rows(out) == before                                      # nothing redone
    assert module.main(argv + ["--policies", "questmass", "--stock", "none"]) == 0
    added = _rows(out)[len(before):]
    assert sorted((r["index"], r["policy"], r["budget"]) for r in added) == sorted(
        (i, "questmass", b) for i in range(SAMPLES) for b in ("1", "1/8"))


def test_report_tables_and_plot(run):
    pytest.importorskip("matplotlib")
    module, out, _, _ = run
    assert module.main(["--out", str(out), "--report"]) == 0
    summary = (out / "summary.md").read_text()
    assert f"## niah_single_1, {CONTEXT} tokens" in summary
    assert "| budget (pages) | quest | " in summary and "| 1/8 (4) |" in summary
    assert (out / "ruler.png").stat().st_size > 10_000
    cells = (out / "cells.csv").read_text().splitlines()
    # one line per (policy, budget) with results (stock and dense included): the module's other tests add cells to
    # the shared run, in an order pytest-xdist decides, so count what is there (at least the first run's 2 + 3 x 2)
    scored = {(r["policy"], r["budget"]) for r in _rows(out)}
    assert len(cells) == 1 + len(scored) and len(scored) >= 2 + 3 * 2


def test_plot_gives_each_policy_one_color_of_its_own(tmp_path, monkeypatch):
    """Every label keeps one color in every panel, and no two labels share one (a label outside the five fixed
    policies took matplotlib's cycle, whose first color is quest's)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from matplotlib.colors import to_hex
    module = _runner()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    labels = ["quest", "oracle", "quest:gamma=0.25", "quest:top_p=0.9"]
    cells = [dict(task=task, context=2048, policy=policy, budget=budget, score=0.5, ci_low=0.3, ci_high=0.7, samples=5)
             for task in ("niah_single_1", "niah_single_2") for policy in labels[int(task[-1]) - 1:]
             for budget in ("1/8", "1/16")]
    module.plot(cells, tmp_path / "ruler.png")
    seen = {}
    for ax in figures[0].axes:
        for bars in ax.containers:
            seen.setdefault(bars.get_label(), set()).add(to_hex(bars.lines[0].get_color()))
    assert sorted(seen) == sorted(labels)
    assert all(len(colors) == 1 for colors in seen.values())
    assert len({colors.pop() for colors in seen.values()}) == len(labels)


def test_wilson_interval_matches_published_values():
    """Wilson's (1927) closed form worked by hand, z = 1.96: 0/10 -> [0, 0.2775], 5/10 -> [0.2366, 0.7634]."""
    from tinyattn.retrieval.ruler import mean_interval, wilson_interval

    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert mean_interval([1.0] * 5 + [0.0] * 5)[2] == "wilson"
    assert mean_interval([0.5, 1.0, 0.0])[2] == "t"


@pytest.mark.slow
def test_quest_labels_take_gamma_and_top_p(run):
    """``quest:gamma=0.25`` and ``quest:gamma=0.25:top_p=0.9`` (issue 35): the settings go to SparsityConfig, not to
    the policy's constructor (questmass:gamma=... stays questmass's own); with a covering budget gamma alone gives
    dense's tokens; top_p's cells record the pages it kept: never more than the fixed budget's count, fewer over
    the whole context; a bad value stops the run before any cell, naming it."""
    module, out, _, argv = run
    assert module.selection_from_label("quest:gamma=0.25:top_p=0.9") == {"gamma": 0.25, "top_p": 0.9}
    assert module.selection_from_label("questmass:gamma=1.0") == {}
    # a bare quest label is Quest's bound (Quest §3.2: gamma = 1), whatever the recipe's default
    assert module.selection_from_label("quest") == {"gamma": 1.0}
    assert module.selection_from_label("quest:top_p=0.9") == {"gamma": 1.0, "top_p": 0.9}
    assert module.policy_from_label("questmass:gamma=1.0").gamma == 1.0
    assert module.policy_from_label("quest:gamma=0.25").name == "quest"
    labels = "quest:gamma=0.25,quest:gamma=0.25:top_p=0.9"
    assert module.main(argv + ["--policies", labels, "--stock", "none"]) == 0
    by = {(r["index"], r["policy"], r["budget"]): r for r in _rows(out)}
    for i in range(SAMPLES):
        assert by[(i, "quest:gamma=0.25", "1")]["tokens"] == by[(i, "dense", None)]["tokens"]
        for budget in ("1", "1/8"):
            fixed = by[(i, "quest:gamma=0.25", budget)]
            top = by[(i, "quest:gamma=0.25:top_p=0.9", budget)]
            assert fixed["pages"] == pytest.approx(_expected_attended(fixed["prompt_tokens"],
                                                                      fixed["page_budget"])[0])
            assert 1 <= top["pages"] <= fixed["pages"] and top["tokens_attended"] <= fixed["tokens_attended"]
        whole = by[(i, "quest:gamma=0.25:top_p=0.9", "1")]
        assert whole["pages"] < by[(i, "quest:gamma=0.25", "1")]["pages"]
    with pytest.raises(ValueError, match="top_p"):
        module.main(argv + ["--policies", "quest:top_p=1.5", "--stock", "none"])


@pytest.mark.slow
def test_rerank_labels_run_with_key_codes(run, monkeypatch):
    """``quest:gamma=0.25:rerank=int4`` and ``...:top_p=0.8:rerank=int4`` (the library's second stage): the batch's
    cache keeps 4-bit key codes (only then), the cells complete and record what they attended; a covering budget
    re-ranks every page (dense's tokens), the fixed budget attends min(budget, pages) pages at every step, and top-p
    never more than the fixed budget of the same capacity."""
    from tinyattn.models.llama import LlamaModel

    module, out, _, argv = run
    asked, new_cache = [], LlamaModel.new_cache

    def spy(self, **kw):                                        # the key_codes each cache is made with
        asked.append(kw.get("key_codes", False))
        return new_cache(self, **kw)

    monkeypatch.setattr(LlamaModel, "new_cache", spy)
    fixed_label, top_label = "quest:gamma=0.25:rerank=int4", "quest:gamma=0.25:top_p=0.8:rerank=int4"
    assert module.main(argv + ["--policies", f"{fixed_label},{top_label}", "--stock", "none"]) == 0
    assert asked and all(asked)                                  # every batch re-ranks: codes
    by = {(r["index"], r["policy"], r["budget"]): r for r in _rows(out)}
    for i in range(SAMPLES):
        assert by[(i, fixed_label, "1")]["tokens"] == by[(i, "dense", None)]["tokens"]
        for budget in ("1", "1/8"):
            fixed, top = by[(i, fixed_label, budget)], by[(i, top_label, budget)]
            assert (fixed["pages"], fixed["tokens_attended"]) == pytest.approx(
                _expected_attended(fixed["prompt_tokens"], fixed["page_budget"]))
            assert 1 <= top["pages"] <= fixed["pages"] and top["tokens_attended"] <= fixed["tokens_attended"]
    asked.clear()
    assert module.main(argv + ["--policies", "quest:gamma=0.5", "--budgets", "1/8", "--stock", "none"]) == 0
    assert asked and not any(asked)                              # no re-rank: no codes
