"""``gamma`` and ``top_p`` through :class:`tinyattn.layer.SparsityConfig`, :class:`tinyattn.layer.PagedAttention` and
:class:`tinyattn.models.LlamaRuntime` (issue 35): validated once, passed to the plan, and the layer's fused decode
equals the reference op with the same settings; ``top_p=1.0`` with a covering capacity generates dense's tokens."""
import pytest
import torch

import tinyattn
from tinyattn import reference as R
from tinyattn.layer import DEFAULT_GAMMA, PagedAttention, SparsityConfig
from tinyattn.models import LlamaRuntime

from model_fixtures import model, tok  # noqa: F401 (fixtures)
from paged_problems import make_problem
from paths import CKPT, TOKENIZER

needs_model = pytest.mark.skipif(not CKPT.exists() or not TOKENIZER.exists(), reason=f"{CKPT} is missing")

BACKENDS = ["torch", "triton"]


def test_sparsity_config_checks_gamma_and_top_p():
    s = SparsityConfig(page_budget=8, gamma=0.25, top_p=0.9)
    assert (s.gamma, s.top_p) == (0.25, 0.9)
    assert (SparsityConfig().gamma, SparsityConfig().top_p) == (DEFAULT_GAMMA, None)    # the recipe's (0.25)
    with pytest.raises(ValueError, match="gamma"):
        SparsityConfig(page_budget=8, gamma=1.5)
    with pytest.raises(ValueError, match="top_p"):
        SparsityConfig(page_budget=8, top_p=0.0)
    with pytest.raises(TypeError, match="top_p"):
        SparsityConfig(page_budget=8, top_p="0.9")
    with pytest.raises(ValueError, match="policy"):            # settings of the quest selection only
        SparsityConfig(page_budget=8, policy="oracle", top_p=0.9)


@pytest.mark.parametrize("given, named", [
    ({"top_p": 0.9}, "with top_p=0.9"),
    ({"gamma": 1.0}, "with gamma=1.0"),
    ({"gamma": 0.5, "top_p": 0.9}, "with gamma=0.5, top_p=0.9"),
])
def test_a_policy_other_than_quest_names_only_the_settings_given(given, named):
    # `generate --policy questmass --top-p 0.9` once answered "... with gamma=0.25, top_p=0.9": a gamma never given
    with pytest.raises(ValueError) as err:
        SparsityConfig(page_budget=8, policy="questmass", **given)
    msg = str(err.value)
    assert msg.startswith("policy: gamma, top_p and rerank are settings of the 'quest' selection, got "
                          "policy='questmass'")
    assert msg.endswith(named)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_layer_decodes_with_the_configs_gamma_and_top_p(backend):
    p = make_problem(2, batch=2, seq_lens=[37, 61], page_size=4, num_kv_heads=2, group=2, head_dim=16,
                     logit_scale=3.0)
    k_min, k_max = p.bounds()
    attn = PagedAttention(SparsityConfig(page_budget=6, num_sink_pages=0, gamma=0.25, top_p=0.7), backend=backend)
    attn.begin(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, decode=True)
    assert (attn.plan.step.gamma, attn.plan.step.top_p) == (0.25, 0.7)
    got = attn(0, p.q[:, 0], p.k_cache, p.v_cache, k_min, k_max)
    want = R.sparse_paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                    k_max=k_max, page_budget=6, gamma=0.25, top_p=0.7)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    attn.metrics = tinyattn.SelectionMetrics()                # the policy route (metrics on) selects the same pages
    attn.begin(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, decode=True)
    torch.testing.assert_close(attn(0, p.q[:, 0], p.k_cache, p.v_cache, k_min, k_max), want, atol=2e-5, rtol=1e-4)


@needs_model
def test_runtime_top_p_one_with_a_covering_capacity_generates_dense_tokens(model, tok):  # noqa: F811
    prompt = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
    dense = LlamaRuntime(model, page_size=4, backend="torch").generate([prompt], max_new_tokens=24)
    full = LlamaRuntime(model, page_size=4, page_budget=64, num_sink_pages=0, gamma=0.25, top_p=1.0,
                        backend="torch").generate([prompt], max_new_tokens=24)
    assert full.tokens == dense.tokens
    rt = LlamaRuntime(model, page_size=4, page_budget=8, gamma=0.5, top_p=0.9, backend="torch")
    assert "gamma=0.5, top_p=0.9" in repr(rt)                                     # not the default (0.25)
    assert len(rt.generate([prompt], max_new_tokens=8).tokens[0]) == 8


@needs_model
def test_generate_counts_the_pages_top_p_kept(model, tok):  # noqa: F811
    """``GenerationStats.pages_attended``: with ``top_p=None`` every (sparse layer, KV head, step) of a row longer
    than the capacity attends exactly ``page_budget`` pages (the count the formula gives); with ``top_p < 1``
    fewer on average, never more; the profiler's attention spans count the same pages."""
    import tinyattn.profiler as tp

    prompt = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside. " * 2)
    assert len(prompt) > 8 * 4
    cfg = model.config
    fixed = LlamaRuntime(model, page_size=4, page_budget=8, num_sink_pages=0, backend="torch").generate(
        [prompt], max_new_tokens=6)
    s = fixed.stats.pages_attended.summary()
    assert s["histogram"] == [0] * 8 + [cfg.n_layers * cfg.n_kv_heads * 5]        # 5 decode steps, all at 8
    assert "pages attended" in fixed.stats.format()
    rt = LlamaRuntime(model, page_size=4, page_budget=8, num_sink_pages=0, top_p=0.5, backend="torch")
    with tp.profile(oracle=False) as prof:
        out = rt.generate([prompt], max_new_tokens=6)
    s = out.stats.pages_attended.summary()
    assert s["count"] == cfg.n_layers * cfg.n_kv_heads * 5
    assert 1 <= s["min"] and s["max"] <= 8 and s["mean"] < 8
    sparse = [r for r in prof.records if r.op == "attention" and r.sparse]
    assert len(sparse) == cfg.n_layers * 5
    assert sum(r.pages for r in sparse) == sum(k * c for k, c in enumerate(s["histogram"]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_profiler_and_the_layer_count_the_pages_top_p_kept(backend):
    """One fused decode layer with ``gamma=0.25, top_p=0.7``: the profiler's attention span and
    ``PagedAttention.attended`` both count, per (row, KV head), the pages the reference ``select_pages`` keeps (its
    non ``-1`` entries), fewer than the capacity."""
    import tinyattn.profiler as tp
    from tinyattn.metrics import PagesAttended

    p = make_problem(3, batch=2, seq_lens=[37, 61], page_size=4, num_kv_heads=2, group=2, head_dim=16,
                     logit_scale=3.0)
    k_min, k_max = p.bounds()
    scores = R.page_scores(p.q[:, 0], k_min, k_max, p.block_table, p.seq_lens, page_size=4, gamma=0.25)
    want = R.select_pages(scores, p.seq_lens, page_size=4, page_budget=6, num_sink_pages=0, top_p=0.7,
                          scale=16 ** -0.5)
    kept = (want >= 0).sum(-1)                                                       # [B, Hkv]
    assert int(kept.sum()) < 2 * 2 * 6
    attn = PagedAttention(SparsityConfig(page_budget=6, num_sink_pages=0, gamma=0.25, top_p=0.7), backend=backend)
    attn.attended = PagesAttended()
    attn.begin(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, decode=True)
    with tp.profile(oracle=False) as prof:
        attn(0, p.q[:, 0], p.k_cache, p.v_cache, k_min, k_max)
    (span,) = [r for r in prof.records if r.op == "attention"]
    assert span.pages == int(kept.sum()) and span.sparse
    assert attn.attended.summary()["histogram"] == torch.bincount(kept.flatten(), minlength=7).tolist()[
        : int(kept.max()) + 1]
