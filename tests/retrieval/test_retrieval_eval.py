"""The retrieval evaluation harness (tinyattn/retrieval/evaluate.py, report.py) on a tiny random model and a fake
sample generator: row fields and counts, the budget conversion, the cache rollback between configurations,
agreement with LlamaRuntime.generate (an independent decode loop), determinism, and the JSON / CSV / PNG outputs."""

from __future__ import annotations

import csv
import json
import random
import sys
from fractions import Fraction

import pytest
import torch

from tinyattn.models import LlamaConfig, LlamaModel, LlamaRuntime, SparsityConfig
from tinyattn.retrieval.evaluate import (TASK_FIELDS, TaskResult, evaluate_tasks, greedy_decode, page_budget_for,
                                         parse_fraction, prefill, sample_seed)
from tinyattn.retrieval.report import format_task_table, plot_task_results
from tinyattn.retrieval.tasks import Sample
from tinyattn.selection import RandomPolicy

VOCAB = 32


FakeSample = Sample          # the real record, filled by the fake generator below


def fake_make_sample(task, *, context_tokens, depth, seed, tokenizer=None):
    """A needle of 3 tokens at ``depth`` in random filler; the answer is the needle (tokens 1 is BOS)."""
    rng = random.Random(seed)
    prompt = [1] + [rng.randrange(4, VOCAB) for _ in range(context_tokens - 1)]
    needle = [rng.randrange(4, VOCAB) for _ in range(3)]
    at = 1 + round(depth * (context_tokens - 5))
    prompt[at:at + 3] = needle
    return FakeSample(task, prompt, needle, context_tokens, depth, [(at, at + 3)])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=128)
    m = LlamaModel(cfg)
    for p in m.parameters():                     # larger weights: sharper attention, more varied greedy tokens
        p.data.normal_(0, 0.3)
    return m.eval()


SMALL = dict(tasks=["passkey", "multikey"], contexts=[40, 64], depths=[0.0, 1.0], budgets=["1/2", "1/4"],
             page_sizes=[4, 8], samples=2, backend="torch", progress=False, make_sample=fake_make_sample,
             decode_prompt_tokens=1)


@pytest.fixture(scope="module")
def small(model):
    return evaluate_tasks(model, policies=["dense", "quest", "h2o", "random"], **SMALL)


# ---------------------------------------------------------------------------------------------- budgets
@pytest.mark.parametrize("context,page_size,fraction,expected", [
    (8192, 16, "1/16", 32),     # 512 pages / 16
    (8192, 32, "1/128", 2),     # 256 pages / 128
    (1024, 16, "1/128", 1),     # 64 pages / 128 = 0.5 -> 1 (ceil)
    (100, 16, "1/2", 4),        # 6.25 pages / 2 = 3.125 -> 4
    (96 * 16, 16, "1/3", 32),   # exact: 96 / 3 = 32, not 33
    (64, 16, "1", 4),
])
def test_page_budget_for(context, page_size, fraction, expected):
    assert page_budget_for(context, page_size, fraction) == expected


def test_page_budget_for_raises_to_the_minimal_legal_budget():
    # 1/128 of 64 pages is 1 page; a sink page and two recent pages need 3
    assert page_budget_for(1024, 16, "1/128", num_sink_pages=1, num_recent_pages=2) == 3
    assert page_budget_for(1024, 16, "1/128", num_sink_pages=0, num_recent_pages=0) == 1


@pytest.mark.parametrize("text,value", [("1/16", Fraction(1, 16)), ("0.0625", Fraction(1, 16)), (" 1/8 ", Fraction(1, 8)),
                                        (0.5, Fraction(1, 2)), ("1", Fraction(1))])
def test_parse_fraction(text, value):
    assert parse_fraction(text) == value


@pytest.mark.parametrize("bad", ["0", "-1/8", "2", "1/0", "abc", ""])
def test_parse_fraction_errors_name_the_value(bad):
    with pytest.raises(ValueError, match="budget fraction.*" + repr(bad).replace("/", "/")[1:-1]):
        parse_fraction(bad)


def test_sample_seed_is_stable_and_distinct():
    assert sample_seed(0, "passkey", 1024, 0.5, 0) == sample_seed(0, "passkey", 1024, 0.5, 0)
    seeds = {sample_seed(s, t, c, d, i) for s in (0, 1) for t in ("passkey", "multikey") for c in (1024, 2048)
             for d in (0.0, 0.5) for i in range(3)}
    assert len(seeds) == 2 * 2 * 2 * 2 * 3
    import binascii

    assert sample_seed(0, "passkey", 1024, 0.5, 0) == binascii.crc32(b"0/passkey/1024/0.5/0")


# ---------------------------------------------------------------------------------------------- rows
def test_row_fields_and_counts(small):
    rows = small.rows
    # per (task, context, depth, page size): dense + 3 sparse policies x 2 budgets
    assert len(rows) == 2 * 2 * 2 * 2 * (1 + 3 * 2)
    for r in rows:
        d = r.as_dict()
        assert tuple(d) == TASK_FIELDS
        assert r.samples == 2
        assert 0.0 <= r.accuracy <= r.token_accuracy <= 1.0 or r.accuracy <= r.token_accuracy
        if r.policy == "dense":
            assert (r.page_budget, r.budget_fraction, r.token_budget) == (None, None, None)
        else:
            assert r.page_budget == page_budget_for(r.context, r.page_size, r.budget_fraction)
            assert r.token_budget == r.page_budget * r.page_size
    assert small.tasks == ["passkey", "multikey"]
    assert small.budget_fractions == [0.5, 0.25]
    assert small.policies == ["dense", "quest", "h2o", "random"]


def test_accuracy_and_token_accuracy_against_the_runtime(model):
    """Answers that are dense greedy decoding (LlamaRuntime.generate) score 1; answers shifted by one token id
    score 0, with the per-token accuracy counting the positions that still match."""
    def dense_answer(prompt, n):
        rt = LlamaRuntime(model, page_size=4, backend="torch")
        return rt.generate([prompt], max_new_tokens=n, eos_id=None).tokens[0]

    def right(task, **kw):
        s = fake_make_sample(task, **kw)
        return FakeSample(task, s.prompt, dense_answer(s.prompt, 4), s.context_tokens, s.depth, s.needle_positions)

    def half_wrong(task, **kw):             # the first two tokens right, the last two wrong
        s = right(task, **kw)
        answer = s.answer[:2] + [(t + 1) % VOCAB for t in s.answer[2:]]
        return FakeSample(task, s.prompt, answer, s.context_tokens, s.depth, s.needle_positions)

    opts = dict(SMALL, tasks=["passkey"], contexts=[40], page_sizes=[4], decode_prompt_tokens=0)
    res = evaluate_tasks(model, policies=["dense"], **dict(opts, make_sample=right))
    assert [(r.accuracy, r.token_accuracy) for r in res.rows] == [(1.0, 1.0)] * 2
    res = evaluate_tasks(model, policies=["dense"], **dict(opts, make_sample=half_wrong))
    assert [(r.accuracy, r.token_accuracy) for r in res.rows] == [(0.0, 0.5)] * 2


# ---------------------------------------------------------------------------------------------- decode paths
@pytest.mark.parametrize("policy", ["quest", "meanstd", "oracle", "streaming", "h2o", "random"])
def test_each_config_matches_a_fresh_runtime_generate(model, policy):
    """decode_prompt_tokens=0 is LlamaRuntime.generate's schedule (dense prefill of the whole prompt, then
    sparse decode): the harness, which prefills once and rolls the cache back between configurations, must give
    the runtime's tokens for every budget (each a fresh cache and, for h2o, a prefill observed afresh)."""
    from tinyattn.retrieval.evaluate import _Config, _run_sample

    sample = fake_make_sample("passkey", context_tokens=61, depth=0.1, seed=7)
    budgets = [2, 3, 5]
    configs = [_Config(policy, Fraction(b, 16), b) for b in budgets]
    for b in budgets:
        rt = LlamaRuntime(model, page_size=4, page_budget=b, num_sink_pages=1, num_recent_pages=1, dense_layers=1,
                          backend="torch", policy=RandomPolicy(seed=11) if policy == "random" else policy)
        expected = rt.generate([sample.prompt], max_new_tokens=6, eos_id=None).tokens[0]
        target = FakeSample("passkey", sample.prompt, expected, 61, 0.1, [])
        outcomes = _run_sample(model, target, 4, configs, seed=11, num_sink_pages=1, num_recent_pages=1,
                               dense_layers=1, backend="torch", prefill_tokens=61, prefill_chunk=16)
        assert outcomes[budgets.index(b)] == (True, 1.0), (policy, b, outcomes)


def test_rollback_gives_the_same_decode_as_a_fresh_prefill(model):
    """Decoding a configuration after others ran on the same (rolled-back) cache equals decoding it alone."""
    from tinyattn.retrieval.evaluate import _Config, _run_sample

    sample = fake_make_sample("passkey", context_tokens=50, depth=0.5, seed=3)
    configs = [_Config("quest", Fraction(1, 4), 4), _Config("oracle", Fraction(1, 8), 2),
               _Config("dense", None, None), _Config("h2o", Fraction(1, 4), 4), _Config("quest", Fraction(1, 8), 2)]
    kw = dict(seed=5, num_sink_pages=0, num_recent_pages=1, dense_layers=0, backend="torch", prefill_tokens=48,
              prefill_chunk=8)
    together = _run_sample(model, sample, 4, configs, **kw)
    alone = [_run_sample(model, sample, 4, [c], **kw)[0] for c in configs]
    assert together == alone


def test_dense_equals_a_budget_covering_every_page(model):
    """Budget fraction 1 keeps every page of the prompt; with prompts that leave room in their last page for the
    decoded tokens (35 + 4 <= 5 pages of 8, 59 + 4 <= 8 pages) that is every page: every policy decodes as dense."""
    def answer_is_dense(task, **kw):
        s = fake_make_sample(task, **kw)
        cache = model.new_cache(page_size=8, num_pages=16)
        sid = cache.add_sequence()
        from tinyattn.layer import PagedAttention
        logits = prefill(model, cache, sid, s.prompt[:-1], attention=PagedAttention(backend="torch"))
        (ans,) = greedy_decode(model, cache, [sid], [s.prompt[-1:]], [5], attention=PagedAttention(backend="torch"),
                               first_logits=logits[None])
        return FakeSample(task, s.prompt, ans, s.context_tokens, s.depth, [])

    res = evaluate_tasks(model, **dict(SMALL, budgets=["1"], page_sizes=[8], contexts=[35, 59],
                                       make_sample=answer_is_dense),
                         policies=["dense", "quest", "meanstd", "oracle", "streaming", "h2o", "random"])
    assert {(r.accuracy, r.token_accuracy) for r in res.rows} == {(1.0, 1.0)}


def test_deterministic_across_runs(model, small):
    again = evaluate_tasks(model, policies=["dense", "quest", "h2o", "random"], **SMALL)
    assert [r.as_dict() for r in again.rows] == [r.as_dict() for r in small.rows]


@pytest.mark.slow
def test_batch_size_does_not_change_the_rows(model, small):
    """Samples decoded together (rows of one batch leave it at different steps) score as decoded alone; only
    random's draws depend on the batch."""
    for batch_size in (1, 3):
        res = evaluate_tasks(model, policies=["dense", "quest", "h2o", "random"], **dict(SMALL, batch_size=batch_size))
        assert [r.as_dict() for r in res.rows if r.policy != "random"] == [
            r.as_dict() for r in small.rows if r.policy != "random"]


def test_greedy_decode_batch_of_ragged_rows(model):
    """Rows with different feeds and answer lengths in one batch give the tokens of each row decoded alone."""
    from tinyattn.layer import PagedAttention

    prompts = [fake_make_sample("passkey", context_tokens=n, depth=0.5, seed=n) for n in (30, 41, 52)]
    feeds, lengths, split = [[], [7, 8, 9], [5]], [4, 1, 6], [30, 38, 51]

    def run(rows):
        cache = model.new_cache(page_size=4, num_pages=60)
        ids = [cache.add_sequence() for _ in rows]
        attn = PagedAttention(SparsityConfig(page_budget=3), backend="torch")
        first = torch.stack([prefill(model, cache, i, prompts[r].prompt[:split[r]], attention=PagedAttention(
            backend="torch"), chunk=16) for i, r in zip(ids, rows)])
        return greedy_decode(model, cache, ids, [feeds[r] for r in rows], [lengths[r] for r in rows],
                             attention=attn, first_logits=first)

    together = run([0, 1, 2])
    assert [len(t) for t in together] == lengths
    assert together == [run([r])[0] for r in range(3)]


def test_samples_use_the_documented_seeds(model):
    seen = []

    def spy(task, **kw):
        seen.append((task, kw["context_tokens"], kw["depth"], kw["seed"]))
        return fake_make_sample(task, **kw)

    evaluate_tasks(model, **dict(SMALL, make_sample=spy), policies=["dense"])
    expected = [(t, c, d, sample_seed(0, t, c, d, i)) for t in ("passkey", "multikey") for c in (40, 64)
                for d in (0.0, 1.0) for i in range(2)]
    assert seen == expected


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("override,pattern", [
    (dict(contexts=[]), r"contexts: expected a non-empty list of ints >= 2, got \[\]"),
    (dict(contexts=[1]), r"contexts: .*got \[1\]"),
    (dict(depths=[1.5]), r"depths: expected .* in \[0, 1\], got \[1.5\]"),
    (dict(budgets=["3/2"]), r"budget fraction: expected a value in \(0, 1\], got '3/2'"),
    (dict(page_sizes=[0]), r"page_sizes: .*got \[0\]"),
    (dict(policies=["quest", "lru"]), r"policies: expected names among dense, quest.*got 'lru'"),
    (dict(samples=0), r"samples: expected an int >= 1, got 0"),
    (dict(decode_prompt_tokens=-1), r"decode_prompt_tokens: expected 'question' or an int >= 0, got -1"),
    (dict(dense_layers=3), r"dense_layers: expected at most the model's n_layers \(2\), got 3"),
    (dict(num_sink_pages=-1), r"num_sink_pages"),
    (dict(budgets=[]), r"budgets: expected at least one fraction"),
])
def test_bad_options_raise_naming_them(model, override, pattern):
    with pytest.raises(ValueError, match=pattern):
        evaluate_tasks(model, **dict(SMALL, **override))


def test_bad_samples_raise(model):
    def short(task, **kw):
        return FakeSample(task, [1], [5], 1, 0.0, [])

    def out_of_vocab(task, **kw):
        s = fake_make_sample(task, **kw)
        return FakeSample(task, s.prompt, [VOCAB + 3], s.context_tokens, s.depth, [])

    with pytest.raises(ValueError, match="prompt of 1 tokens; decode_prompt_tokens=1 needs at least 2"):
        evaluate_tasks(model, **dict(SMALL, make_sample=short, decode_prompt_tokens=1))
    with pytest.raises(ValueError, match=r"make_sample\('passkey'\) returned a prompt without a newline token \(3\)"):
        evaluate_tasks(model, **dict(SMALL, make_sample=short, decode_prompt_tokens="question"))
    with pytest.raises(ValueError, match=rf"token ids in \[\d+, {VOCAB + 3}\], outside the model's vocabulary"):
        evaluate_tasks(model, **dict(SMALL, make_sample=out_of_vocab))


# ---------------------------------------------------------------------------------------------- outputs
def test_json_csv_round_trip(small, tmp_path):
    small.save_json(tmp_path / "r.json")
    small.save_csv(tmp_path / "r.csv")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["samples"] == 2 and data["meta"]["budgets"] == ["1/2", "1/4"]
    assert len(data["rows"]) == len(small.rows) and tuple(data["rows"][0]) == TASK_FIELDS
    assert TaskResult.load_json(tmp_path / "r.json").rows == small.rows
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(small.rows) and tuple(rows[0]) == TASK_FIELDS


def test_mean_accuracy_weights_by_samples():
    from tinyattn.retrieval.evaluate import TaskRow

    rows = [TaskRow("passkey", "quest", 64, d, 4, 2, 0.5, 8, acc, acc, n) for d, acc, n in
            [(0.0, 1.0, 3), (1.0, 0.0, 1)]]
    assert TaskResult(rows).accuracy(task="passkey", policy="quest") == 0.75
    assert TaskResult(rows).accuracy(task="multikey") != TaskResult(rows).accuracy(task="multikey")  # NaN
    with pytest.raises(ValueError, match="select: expected fields among task, .*got 'budget'"):
        TaskResult(rows).select(budget=2)


def test_table(small):
    text = format_task_table(small)
    assert "passkey, page_size=4" in text and "multikey, page_size=8" in text
    head = "| context | budget | page_budget (tokens) | quest | h2o | random | dense |"
    assert text.count(head) == 4
    r = small.select(task="passkey", context=64, page_size=8, policy="quest", budget_fraction=0.25)
    assert f"| 64 | 1/4 | {r[0].page_budget} ({r[0].token_budget}) |" in text


@pytest.mark.slow
def test_plots_are_written(small, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNGs need the plots extra")
    paths = plot_task_results(small, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted([f"{kind}_{t}_ps{ps}.png" for kind in ("heatmap", "budget")
                            for t in ("passkey", "multikey") for ps in (4, 8)])
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_name_the_extra(small, tmp_path, monkeypatch):
    """A Python caller without matplotlib gets the install line of the plots extra, not a bare import error."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # import matplotlib -> ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError, match=r'plots extra: pip install -e "\.\[plots\]"'):
        plot_task_results(small, tmp_path)


# ---------------------------------------------------------------------------------------------- the question
def test_question_is_decoded_from_the_last_newline(model):
    """decode_prompt_tokens='question' decodes from the prompt's last newline token on: the same rows as giving
    that many tokens as an int."""
    question = [9, 10, 11, 12, 13, 14]

    def with_question(task, **kw):
        s = fake_make_sample(task, **kw)
        prompt = s.prompt[:-7] + [3] + question       # newline (3 in the character vocabulary), then the question
        prompt[5] = 3                                  # an earlier newline (a paragraph break) is not the question's
        return FakeSample(task, prompt, s.answer, len(prompt), s.depth, s.needle_positions)

    opts = dict(SMALL, make_sample=with_question, tasks=["passkey"], page_sizes=[4])
    by_question = evaluate_tasks(model, **dict(opts, decode_prompt_tokens="question"), policies=["dense", "quest"])
    by_count = evaluate_tasks(model, **dict(opts, decode_prompt_tokens=1 + len(question)), policies=["dense", "quest"])
    assert [r.as_dict() for r in by_question.rows] == [r.as_dict() for r in by_count.rows]


def test_question_of_the_shipped_tasks():
    """The shipped tasks' prompts end with a newline and the question: the prefill stops right before it."""
    from tinyattn.retrieval import TASKS, make_sample
    from tinyattn.retrieval.evaluate import _newline_id, _prefill_length

    nl = _newline_id(None)
    for task in TASKS:
        s = make_sample(task, context_tokens=600, depth=0.5, seed=3)
        n = _prefill_length(s, task, "question", nl)
        question = s.text[n - 1:]                     # the text has no BOS: prompt token n is character n - 1
        assert question.startswith("\nWhat is the pass key") and "\n" not in question[1:], (task, question)


# ---------------------------------------------------------------------------------------------- hybrid models
@pytest.fixture(scope="module")
def hybrid():
    """The shipped model's architecture in small: sliding-window RoPE layers around a full-attention NoPE layer."""
    torch.manual_seed(1)
    cfg = LlamaConfig(dim=32, hidden_dim=48, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=128,
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=6,
                      nope_layers=(1,))
    m = LlamaModel(cfg)
    for p in m.parameters():
        p.data.normal_(0, 0.4)
    return m.eval()


@pytest.mark.parametrize("policy", ["quest", "h2o", "streaming", "oracle"])
def test_hybrid_model_matches_the_runtime(hybrid, policy):
    """On a sliding + NoPE model the chunked prefill (chunks of 5 tokens, shorter than the window) and the
    rolled-back cache give LlamaRuntime.generate's tokens for every budget."""
    from tinyattn.retrieval.evaluate import _Config, _run_sample

    sample = fake_make_sample("passkey", context_tokens=70, depth=0.2, seed=9)
    budgets = [2, 4]
    configs = [_Config("dense", None, None)] + [_Config(policy, Fraction(b, 18), b) for b in budgets]
    for i, b in enumerate([None] + budgets):
        rt = LlamaRuntime(hybrid, page_size=4, page_budget=b, backend="torch", policy=policy, num_sink_pages=0)
        expected = rt.generate([sample.prompt], max_new_tokens=5, eos_id=None).tokens[0]
        target = FakeSample("passkey", sample.prompt, expected, 70, 0.2, [])
        outcomes = _run_sample(hybrid, target, 4, configs, seed=0, num_sink_pages=0, num_recent_pages=1,
                               dense_layers=0, backend="torch", prefill_tokens=70, prefill_chunk=5)
        assert outcomes[i] == (True, 1.0), (policy, b, outcomes)


def test_contexts_past_the_training_length_warn(model):
    with pytest.warns(UserWarning, match="contexts reach 200 tokens, past the model's training context max_seq_len=128"):
        evaluate_tasks(model, **dict(SMALL, contexts=[200], tasks=["passkey"], depths=[0.5], samples=1,
                                     page_sizes=[16]), policies=["dense"])
