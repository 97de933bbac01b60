"""The scheduling pipeline (tinyattn.engine): every expected value comes from LlamaRuntime / LlamaModel run
alone, never from the engine's own output."""

from __future__ import annotations

import copy

import pytest
import torch

from model_fixtures import model, tok  # noqa: F401  (fixtures)
from tinyattn.engine import (ApproximateAttention, EarlyExit, Engine, LayerPolicies, Plugin, SamplingParams)
from tinyattn.engine.runner import ModelRunner
from tinyattn.models import LlamaRuntime, SparsityConfig, load_stories
from paths import VALID

GREEDY64 = SamplingParams(64, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tok):
    """12 prompts of 8..41 tokens from the shipped stories (different lengths, page boundaries crossed)."""
    stories = load_stories(VALID)
    return [tok.encode(s)[: 8 + 3 * i] for i, s in enumerate((stories * 2)[:12])]


def alone(model, prompts, n, **kw):
    """Each prompt through LlamaRuntime by itself: the reference."""
    eos = kw.pop("eos_id", None)
    stop = kw.pop("stop_token_ids", ())
    rt = LlamaRuntime(model, page_size=16, backend="torch", **kw)
    return [rt.generate([p], max_new_tokens=n, eos_id=eos, stop_token_ids=stop).tokens[0] for p in prompts]


def check_pool_empty(engine):
    assert engine.cache.num_free_pages == engine.num_pages
    assert engine.cache.sequences == []
    assert not engine.scheduler.running and not engine.scheduler.waiting


# ---------------------------------------------------------------------------------------------- the forward
def test_runner_layer_loop_matches_the_model(model):
    """ModelRunner.forward's own layer loop (an early-exit hook that never fires) gives exactly LlamaModel.forward's
    logits and cache, prefill and decode (both are built from the model's blocks)."""
    sp = SparsityConfig(page_budget=2, dense_layers=1)
    c1, c2 = model.new_cache(page_size=4, num_pages=32), model.new_cache(page_size=4, num_pages=32)
    ids1 = [c1.add_sequence() for _ in range(2)]
    ids2 = [c2.add_sequence() for _ in range(2)]
    runner = ModelRunner(model, c2, sp, backend="torch", plugins=[EarlyExit(threshold=0.0, min_layer=0)])
    from tinyattn.layer import PagedAttention
    attn = PagedAttention(sp, backend="torch")
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        t = torch.randint(0, 512, (1, 7 + 4 * i), generator=g)
        a = model(t, c1, [ids1[i]], sparse=False, attention=attn, last_only=True)
        b, _ = runner.forward(t, [ids2[i]], decode=False)
        assert torch.equal(b, a)
    for _ in range(12):
        t = torch.randint(0, 512, (2, 1), generator=g)
        a = model(t, c1, ids1, sparse=True, attention=attn, last_only=True)
        b, exit_layer = runner.forward(t, ids2, decode=True)
        assert torch.equal(b, a)
        assert exit_layer.tolist() == [4, 4]
    for li in range(model.config.n_layers):
        assert torch.equal(c2.k_cache[li], c1.k_cache[li]) and torch.equal(c2.v_cache[li], c1.v_cache[li])


# ---------------------------------------------------------------------------------------------- the must-show
@pytest.mark.slow
def test_twelve_requests_small_pool_preempt_and_equal_the_runtime(model, prompts):
    """The issue's case: 12 requests, 24 pages of 16 tokens, budget 4 pages, 64 greedy tokens each: all complete,
    preemptions happen, and every request's tokens are those of LlamaRuntime running it alone (sparse decode
    included: a preempted request replays its tokens, so its K/V are rebuilt exactly)."""
    expected = alone(model, prompts, 64, page_budget=4)
    engine = Engine(model, page_size=16, num_pages=24, page_budget=4, backend="torch")
    # 12 x (prompt + 63) tokens need 63 pages: never all at once
    assert sum(-(-(len(p) + 63) // 16) for p in prompts) > 24
    got = engine.generate(prompts, GREEDY64)
    assert got == expected
    assert engine.stats.preemptions >= 1
    assert engine.stats.requests_finished == 12 and engine.stats.peak_pages <= 24
    check_pool_empty(engine)


@pytest.mark.slow
def test_stateful_policy_state_is_rebuilt_after_preemption(model, prompts):
    """H2O keeps per-sequence scores: a preempted request's are cleared and rebuilt by the replay, so its tokens
    still equal LlamaRuntime's alone; prompts prefilled in chunks of at most 7 tokens."""
    ps = prompts[6:9]
    expected = alone(model, ps, 32, page_budget=2, policy="h2o")
    engine = Engine(model, page_size=16, num_pages=7, page_budget=2, policy="h2o", backend="torch",
                    max_num_batched_tokens=7)
    assert engine.generate(ps, SamplingParams(32, ignore_eos=True)) == expected
    assert engine.stats.preemptions >= 1
    check_pool_empty(engine)


@pytest.mark.parametrize("budget", [None, 2])
@pytest.mark.slow
def test_recompute_by_prefill_and_tiny_token_budget(model, prompts, budget):
    """vLLM's recompute (prefill everything) on dense decode, and chunked prefill with 5 tokens per step."""
    ps = prompts[::2]
    expected = alone(model, ps, 40, page_budget=budget)
    for kw in (dict(recompute="prefill", page_budget=None), dict(max_num_batched_tokens=5, page_budget=budget)):
        if kw["page_budget"] != budget:
            continue
        engine = Engine(model, page_size=16, num_pages=12, backend="torch", **kw)
        assert engine.generate(ps, SamplingParams(40, ignore_eos=True)) == expected
        assert max(engine.stats.step_tokens) <= engine.scheduler.max_num_batched_tokens
        check_pool_empty(engine)


def test_arrivals_mid_decode(model, prompts):
    """Requests join while others decode (continuous batching): outputs unchanged, the batch grows and shrinks."""
    ps = prompts[:6]
    expected = alone(model, ps, 30, page_budget=2)
    engine = Engine(model, page_size=16, num_pages=64, page_budget=2, backend="torch")
    ids, got = [], {}
    for i, p in enumerate(ps):
        ids.append(engine.add_request(p, SamplingParams(30, ignore_eos=True)))
        for _ in range(7):                                  # the earlier ones are decoding by now
            got.update({o.request_id: o.tokens for o in engine.step()})
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.tokens for o in engine.step()})
    assert [got[i] for i in ids] == expected
    sizes = engine.stats.decode_batch_sizes
    assert max(sizes) > 1 and sizes[-1] == 1 and sizes.index(max(sizes)) > 0


# ---------------------------------------------------------------------------------------------- stopping
def test_eos_and_stop_tokens(model, prompts):
    ps = prompts[:4]
    full = alone(model, ps, 40)
    stop = full[0][6]                                        # a token the first request produces
    eos = full[1][4]
    expected = alone(model, ps, 40, eos_id=eos, stop_token_ids=(stop,))
    assert any(len(e) < 40 for e in expected)
    engine = Engine(model, page_size=16, num_pages=32, backend="torch", eos_token_id=eos)
    ids = [engine.add_request(p, SamplingParams(40, stop_token_ids=(stop,))) for p in ps]
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[i].tokens for i in ids] == expected
    for i, e in zip(ids, expected):
        assert outs[i].finish_reason == ("stop" if e[-1] in (stop, eos) else "length")
    # ignore_eos keeps going past EOS, not past a stop token
    got = Engine(model, page_size=16, num_pages=32, backend="torch", eos_token_id=eos).generate(
        ps, SamplingParams(40, ignore_eos=True, stop_token_ids=(stop,)))
    assert got == alone(model, ps, 40, stop_token_ids=(stop,))


def test_max_new_tokens_zero_and_one(model, prompts):
    engine = Engine(model, page_size=16, num_pages=8, backend="torch")
    assert engine.generate(prompts[:2], [SamplingParams(0), SamplingParams(1)]) == [[], alone(model, prompts[1:2], 1)[0]]
    check_pool_empty(engine)


# ---------------------------------------------------------------------------------------------- refusal, abort
def test_request_larger_than_the_pool_is_refused_naming_the_sizes(model, prompts):
    engine = Engine(model, page_size=16, num_pages=2, backend="torch")
    with pytest.raises(ValueError, match=r"41 prompt tokens \+ up to 0 generated tokens .* need 3 pages of 16 "
                                         r"tokens, the pool has 2 pages \(32 tokens\)"):
        engine.add_request(prompts[11], SamplingParams(1))
    with pytest.raises(ValueError, match=r"8 prompt tokens \+ up to 63 generated .* need 5 pages"):
        engine.add_request(prompts[0], SamplingParams(64))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        engine.add_request([1, 512], SamplingParams(1))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], SamplingParams(1))
    assert engine.stats.requests_added == 0 and not engine.has_unfinished_requests()
    assert engine.generate([prompts[0]], SamplingParams(5, ignore_eos=True)) == alone(model, prompts[:1], 5)


def test_abort_frees_pages(model, prompts):
    engine = Engine(model, page_size=16, num_pages=40, backend="torch", max_num_seqs=3)
    ids = [engine.add_request(p, SamplingParams(50, ignore_eos=True)) for p in prompts[:5]]
    for _ in range(20):
        engine.step()
    running = {r.request_id: r for r in engine.scheduler.running}
    assert set(running) == set(ids[:3]) and len(engine.scheduler.waiting) == 2
    victim = running[ids[1]]
    held = len(engine.cache.pages(victim.seq_id))
    free = engine.cache.num_free_pages
    assert engine.abort(ids[1]) and engine.cache.num_free_pages == free + held
    assert engine.abort(ids[4])                                  # still waiting: holds nothing
    assert engine.cache.num_free_pages == free + held
    assert not engine.abort(ids[1]) and not engine.abort(999)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[ids[1]].finish_reason == "abort" and 0 < len(outs[ids[1]].tokens) < 50
    assert outs[ids[4]].finish_reason == "abort" and outs[ids[4]].tokens == []
    assert outs[ids[0]].tokens == alone(model, prompts[:1], 50)[0]
    assert engine.stats.requests_aborted == 2 and engine.stats.requests_finished == 5
    check_pool_empty(engine)


# ---------------------------------------------------------------------------------------------- sampling
def test_seeded_sampling_reproducible_and_independent_of_the_batch(model, prompts):
    """A seeded request draws the same tokens alone, in a batch, and through preemptions; alone it equals
    LlamaRuntime.generate with the same seed."""
    p = prompts[3]
    params = SamplingParams(40, temperature=1.0, seed=1234, ignore_eos=True)
    rt = LlamaRuntime(model, page_size=16, backend="torch")
    expected = rt.generate([p], max_new_tokens=40, temperature=1.0, seed=1234, eos_id=None).tokens[0]
    big = Engine(model, page_size=16, num_pages=64, backend="torch")
    assert big.generate([p], params) == [expected]
    others = [SamplingParams(40, temperature=0.8, seed=s, ignore_eos=True) for s in range(5)]
    batch = prompts[:3] + [p] + prompts[4:6]
    plist = others[:3] + [params] + others[3:]
    in_batch = Engine(model, page_size=16, num_pages=64, backend="torch").generate(batch, plist)
    small = Engine(model, page_size=16, num_pages=8, backend="torch")
    tight = small.generate(batch, plist)
    assert in_batch[3] == expected and tight[3] == expected
    assert small.stats.preemptions >= 1 and tight == in_batch
    assert len({tuple(t) for t in in_batch}) == len(in_batch)       # different seeds, different draws


def test_params_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(-1)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(4, temperature=float("nan"))
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(4, stop_token_ids=(-3,))
    assert SamplingParams(4, stop_token_ids=5).stop_token_ids == (5,)


# ---------------------------------------------------------------------------------------------- stats
def test_stats_are_consistent(model, prompts):
    engine = Engine(model, page_size=16, num_pages=20, page_budget=3, backend="torch", max_num_batched_tokens=24)
    outs = engine.generate(prompts[:8], SamplingParams(30, ignore_eos=True))
    s = engine.stats
    assert s.generated_tokens == sum(map(len, outs)) == 8 * 30
    assert s.steps == len(s.step_tokens) == len(s.decode_batch_sizes)
    assert sum(s.step_tokens) == s.prefill_tokens + s.decode_rows
    # every cached token was computed once, plus once more for each one a preemption threw away
    assert s.prefill_tokens + s.decode_rows == sum(len(p) + 29 for p in prompts[:8]) + s.recomputed_tokens
    assert max(s.step_tokens) <= 24 and s.peak_pages <= 20 and s.preemptions >= 1
    assert s.requests_added == s.requests_finished == 8
    assert "preemptions" in s.format()


# ---------------------------------------------------------------------------------------------- plug-ins
def test_plugins_that_change_nothing_change_nothing(model, prompts):
    ps = prompts[:4]
    expected = alone(model, ps, 30, page_budget=2, dense_layers=1)
    for plugins in ([Plugin()],
                    [LayerPolicies({li: "quest" for li in range(1, 5)}, page_budgets={0: None})],
                    [ApproximateAttention(dense_first=1, dense_last=0, page_budgets=[2, 2, 2, 2])],
                    [EarlyExit(threshold=0.0)]):
        engine = Engine(model, page_size=16, num_pages=40, page_budget=2, dense_layers=1, backend="torch",
                        plugins=plugins)
        assert engine.generate(ps, SamplingParams(30, ignore_eos=True)) == expected, plugins
        assert engine.stats.early_exits == 0


def test_layer_policies_and_budget_schedule_equal_the_runtimes_per_layer_choice(model, prompts):
    """A plug-in that makes the sparse layers' choice equal to a runtime's (policy, budget) reproduces it; the
    configs it builds are the expected ones."""
    ps = prompts[:3]
    engine = Engine(model, page_size=16, num_pages=40, page_budget=4, backend="torch",
                    plugins=[LayerPolicies({li: "streaming" for li in range(5)}, page_budgets={li: 2 for li in range(5)})])
    assert engine.generate(ps, SamplingParams(40, ignore_eos=True)) == alone(model, ps, 40, page_budget=2,
                                                                           policy="streaming")
    approx = ApproximateAttention(dense_first=1, dense_last=1, min_budget=2)
    assert approx.budgets(8, 5) == [None, 8, 5, 2, None]
    assert approx.budgets(None, 5) == [None] * 5
    with pytest.raises(ValueError, match="expected 3 budgets"):
        ApproximateAttention(page_budgets=[4, 4]).budgets(4, 5)
    configs = ModelRunner(model, model.new_cache(page_size=16, num_pages=2), SparsityConfig(page_budget=8),
                          plugins=[approx]).layer_configs(decode=True)
    assert [c.page_budget for c in configs] == [None, 8, 5, 2, None]


def test_early_exit_always_equals_a_truncated_model(model, prompts):
    """Exiting every decode token after layer l = decoding with the model's first l+1 layers (the prompt ran
    all layers, but layers <= l never read the later ones); skipped layers still get every token's K/V."""
    l = 2
    short = copy.deepcopy(model)
    short.layers = short.layers[: l + 1]
    short.config = copy.replace(model.config, n_layers=l + 1) if hasattr(copy, "replace") else \
        type(model.config)(**{**model.config.__dict__, "n_layers": l + 1})
    ps = prompts[:3]
    first = [a[0] for a in alone(model, ps, 1)]
    rest = alone(short, [p + [t] for p, t in zip(ps, first)], 19)
    engine = Engine(model, page_size=16, num_pages=40, backend="torch",
                    plugins=[EarlyExit(threshold=100.0, min_layer=l)])
    ids = [engine.add_request(p, SamplingParams(20, ignore_eos=True)) for p in ps]
    for _ in range(4):
        engine.step()
    seqs = [r.seq_id for r in engine.scheduler.running]
    lens = engine.cache.seq_lens(seqs).tolist()
    for li in range(model.config.n_layers):                     # every cached token has K/V in every layer
        for sid, n in zip(seqs, lens):
            pages = engine.cache.pages(sid)
            k = torch.stack([engine.cache.k_cache[li][pages[t // 16], t % 16] for t in range(n)])
            assert (k.abs().sum(dim=(1, 2)) > 0).all(), li
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.tokens for o in engine.step()})
    assert [outs[i] for i in ids] == [[t] + r for t, r in zip(first, rest)]
    s = engine.stats
    assert s.early_exits == s.decode_rows == 3 * 19
    assert s.layers_skipped == s.decode_rows * (model.config.n_layers - 1 - l)


# ---------------------------------------------------------------------------------------------- NLL, serve-bench
@pytest.mark.slow
def test_teacher_forced_nll_equals_evaluate(model, tok):
    """Without plug-ins the engine's NLL is tinyattn.models.evaluate's, dense and sparse."""
    from tinyattn.engine import teacher_forced_nll
    from tinyattn.models import evaluate

    stories = load_stories(VALID)[:2]
    res = evaluate(model, tok, stories, page_size=16, page_budgets=[2], max_context=96, backend="torch",
                   repeat_probe=False, selection_metrics=False, progress=False)
    seqs = [tok.encode(s, bos=True)[:96] for s in stories]
    assert teacher_forced_nll(model, seqs, page_budget=2, backend="torch").nll == pytest.approx(res.row(2).nll, abs=1e-5)
    assert teacher_forced_nll(model, seqs, backend="torch").nll == pytest.approx(res.dense.nll, abs=1e-4)
    worse = teacher_forced_nll(model, seqs, backend="torch", plugins=[EarlyExit(0.5, min_layer=1)])
    assert worse.early_exits > 0 and worse.nll > res.dense.nll


def test_serve_bench_workload_and_configs():
    import argparse
    import math

    from tinyattn.engine.serve_bench import make_workload, parse_config

    w = make_workload([list(range(1, 100))] * 3, num_requests=200, request_rate=50.0, prompt_len=20, output_len=10,
                      output_len_dist="uniform", seed=3)
    assert all(10 <= len(p) <= 20 for p in w.prompts) and all(5 <= n <= 15 for n in w.output_lens)
    gaps = [b - a for a, b in zip(w.arrivals, w.arrivals[1:])]
    assert all(g >= 0 for g in gaps) and 0.5 / 50 < sum(gaps) / len(gaps) < 2 / 50     # mean gap 1 / rate
    w2 = make_workload([[1, 2, 3]], num_requests=4, request_rate=math.inf, prompt_len=8, output_len=6,
                       output_len_dist="fixed", seed=0)
    assert w2.arrivals == [0.0] * 4 and w2.output_lens == [6] * 4 and w2.prompts == [[1, 2, 3]] * 4
    assert parse_config("quest+exit") == ("quest", ("exit",))
    with pytest.raises(argparse.ArgumentTypeError, match="BASE"):
        parse_config("fast+exit")


def test_generate_keeps_the_outputs_of_requests_queued_before(model, prompts):
    engine = Engine(model, page_size=16, num_pages=32, backend="torch")
    early = engine.add_request(prompts[0], SamplingParams(3, ignore_eos=True))
    assert engine.generate(prompts[1:2], SamplingParams(20, ignore_eos=True)) == alone(model, prompts[1:2], 20)
    outs = engine.step()
    assert [o.request_id for o in outs] == [early] and outs[0].tokens == alone(model, prompts[:1], 3)[0]


@pytest.mark.parametrize("policy", ["questmass", "meanstd", "oracle"])
def test_other_policies_equal_the_runtime_with_chunked_prefill(model, prompts, policy):
    ps = prompts[8:10]
    rt = LlamaRuntime(model, page_size=8, page_budget=2, policy=policy, backend="torch")
    expected = [rt.generate([p], max_new_tokens=24, eos_id=None).tokens[0] for p in ps]
    engine = Engine(model, page_size=8, num_pages=32, page_budget=2, policy=policy, backend="torch",
                    max_num_batched_tokens=7)
    assert engine.generate(ps, SamplingParams(24, ignore_eos=True)) == expected


def test_engine_with_an_int8_cache_equals_the_runtime(model, prompts):
    """kv_cache_dtype reaches the engine's pool: greedy tokens equal LlamaRuntime's on the same int8 cache format,
    under preemption; an unknown format names the option."""
    runtime = LlamaRuntime(model, page_size=16, page_budget=4, backend="torch", kv_cache_dtype="int8")
    expected = [runtime.generate([p], max_new_tokens=24, eos_id=None).tokens[0] for p in prompts[:4]]
    engine = Engine(model, page_size=16, num_pages=8, page_budget=4, backend="torch", kv_cache_dtype="int8")
    assert engine.cache.kv_cache_dtype == "int8"
    got = engine.generate(prompts[:4], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert got == expected
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(model, page_size=16, num_pages=8, kv_cache_dtype="int4")


def test_engine_and_hf_cache_take_box_dtype(model):
    from tinyattn.engine import Engine

    engine = Engine(model, page_size=4, num_pages=8, page_budget=2, backend="torch", box_dtype="bf16")
    assert engine.cache.k_min[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="box_dtype: expected one of"):
        Engine(model, page_size=4, num_pages=8, box_dtype="half")
    transformers = pytest.importorskip("transformers")
    TinyAttnCache = pytest.importorskip("tinyattn.integrations.hf").TinyAttnCache
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=32)
    with pytest.raises(ValueError, match="box_dtype: expected one of"):
        TinyAttnCache(cfg, box_dtype="int8")
    assert TinyAttnCache(cfg, box_dtype="fp16").box_dtype == "fp16"


def test_gamma_and_top_p(model, prompts):
    """``Engine(gamma=, top_p=)`` (issue 35): ``top_p=1.0`` with a covering capacity gives dense's tokens (the
    runtime's dense decode, run alone); ``top_p=0.5`` over a sparse budget attends fewer pages than the capacity
    (``stats.pages_attended``), and the engine equals the runtime run alone with the same settings; bad values are
    refused naming the argument."""
    few = prompts[6:9]
    dense = alone(model, few, 16)
    covering = Engine(model, page_size=16, num_pages=40, page_budget=8, num_sink_pages=0, gamma=0.5, top_p=1.0,
                      backend="torch")
    assert covering.generate(few, SamplingParams(16, ignore_eos=True)) == dense
    want = alone(model, few, 16, page_budget=2, num_sink_pages=0, gamma=0.5, top_p=0.5)
    engine = Engine(model, page_size=8, num_pages=40, page_budget=4, num_sink_pages=0, gamma=0.5, top_p=0.5,
                    backend="torch")
    assert "gamma=0.5, top_p=0.5" in repr(engine)         # not the default (0.25)
    engine.generate(few, SamplingParams(16, ignore_eos=True))
    s = engine.stats.pages_attended.summary()
    assert s["count"] > 0 and s["max"] <= 4 and s["mean"] < 4
    assert "attended:" in engine.stats.format()
    sparse = Engine(model, page_size=16, num_pages=40, page_budget=2, num_sink_pages=0, gamma=0.5, top_p=0.5,
                    backend="torch")
    assert sparse.generate(few, SamplingParams(16, ignore_eos=True)) == want
    for kw, name, err in (({"gamma": 1.5}, "gamma", ValueError), ({"top_p": 0.0}, "top_p", ValueError),
                          ({"top_p": "0.9"}, "top_p", TypeError), ({"policy": "h2o", "top_p": 0.9}, "policy",
                                                                   ValueError)):
        with pytest.raises(err, match=name):
            Engine(model, page_size=16, num_pages=8, page_budget=2, backend="torch", **kw)


def test_generate_sees_weights_changed_between_calls(model, prompts):
    """Engine.generate reads the weights once per call (LlamaModel.frozen_weights): a weight changed in place
    between two calls is used by the second, whose tokens equal the runtime's on the changed model."""
    m = copy.deepcopy(model)
    engine = Engine(m, page_size=16, num_pages=24, page_budget=4, backend="torch")
    params = SamplingParams(12, ignore_eos=True)
    before = engine.generate(prompts[:3], params)
    assert before == alone(m, prompts[:3], 12, page_budget=4)
    with torch.no_grad():
        m.output.weight.mul_(-1.0)                  # every greedy choice changes
    after = engine.generate(prompts[:3], params)
    assert after == alone(m, prompts[:3], 12, page_budget=4) and after != before
