"""tinyattn.layer's default sparsity recipe: a caller who sets only ``page_budget`` gets one sink page where the
budget is at least 16 pages (and still selects a page besides the sink and recent pages), none below that; every
entry point resolves it the same way, and an explicit ``num_sink_pages`` is kept as given. The rule's figures
(1 page, 16 pages) are the ones docs/accuracy.md ("Defaults") states."""

import pytest
import torch

from tinyattn.layer import (DEFAULT_NUM_SINK_PAGES, DEFAULT_SINK_MIN_BUDGET, PagedAttention, SparsityConfig,
    default_num_sink_pages)
from tinyattn.models import LlamaRuntime
from tinyattn import reference

from model_fixtures import model  # noqa: F401  (module-scoped fixtures)
from paged_problems import BACKENDS, make_problem


# (page_budget, num_recent_pages) -> the sink pages the documented rule gives
CASES = [(None, 1, 1), (1, 1, 0), (3, 1, 0), (8, 1, 0), (15, 1, 0), (16, 1, 1), (64, 1, 1), (16, 0, 1), (16, 14, 1),
         (16, 15, 0), (17, 15, 1)]


def test_the_default_is_one_sink_page_from_16_pages():
    assert (DEFAULT_NUM_SINK_PAGES, DEFAULT_SINK_MIN_BUDGET) == (1, 16)


@pytest.mark.parametrize("budget,recent,sinks", CASES)
def test_sparsity_config_resolves_the_default(budget, recent, sinks):
    assert default_num_sink_pages(budget, recent) == sinks
    cfg = SparsityConfig(page_budget=budget, num_recent_pages=recent)
    assert cfg.num_sink_pages == sinks
    assert SparsityConfig(page_budget=budget, num_recent_pages=recent, num_sink_pages=0).num_sink_pages == 0


def test_a_bad_field_is_named_when_the_sink_count_is_left_unset():
    with pytest.raises(ValueError, match="num_recent_pages: expected an int >= 0, got '2'"):
        SparsityConfig(page_budget=16, num_recent_pages="2")
    with pytest.raises(TypeError, match="page_budget: expected an int, got str"):
        SparsityConfig(page_budget="16")


def test_an_explicit_sink_count_is_kept_and_checked():
    assert SparsityConfig(page_budget=8, num_sink_pages=3).num_sink_pages == 3
    with pytest.raises(ValueError, match="page_budget"):
        SparsityConfig(page_budget=2, num_sink_pages=2)          # 2 sinks + 1 recent > 2: the ops' rule


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(rerank="int4"), dict(rerank="int4", candidates=2.0)])
def test_selection_settings_without_a_budget_are_refused(kw):
    """As ``PagedAttentionPlan.plan``: with no ``page_budget`` every step is dense, so a ``top_p`` or a re-rank would
    silently do nothing (a fault hunt found the config, the runtime and the HF cache accepting them)."""
    with pytest.raises(ValueError, match="page_budget: expected an int .* got None"):
        SparsityConfig(**kw)
    assert SparsityConfig(page_budget=8, **kw).page_budget == 8


def test_runtime_and_engine_take_the_default(model):  # noqa: F811
    from tinyattn.engine import Engine

    assert LlamaRuntime(model, page_budget=16).sparsity.num_sink_pages == 1
    assert LlamaRuntime(model, page_budget=4).sparsity.num_sink_pages == 0
    assert LlamaRuntime(model, page_budget=16, num_sink_pages=0).sparsity.num_sink_pages == 0
    assert Engine(model, num_pages=16, page_budget=16, backend="torch").sparsity.num_sink_pages == 1
    assert Engine(model, num_pages=16, page_budget=4, backend="torch").sparsity.num_sink_pages == 0


def _listed_pages(model, **kw):  # noqa: F811
    """The pages every sparse step of a short greedy run lists, under a policy that scores later pages higher
    (so page 0 is the worst scored page of every step)."""
    import torch

    from tinyattn.selection import SelectionPolicy

    seen = []

    class LaterFirst(SelectionPolicy):
        name = "later-first"

        def select(self, ctx):
            scores = torch.arange(ctx.max_pages, dtype=torch.float32).expand(ctx.q4.shape[0], ctx.num_kv_heads, -1)
            seen.append(ctx.select_top(scores.contiguous()))
            return seen[-1]

    rt = LlamaRuntime(model, page_size=2, page_budget=16, policy=LaterFirst(), backend="torch", **kw)
    rt.generate([[1] + list(range(30, 70))], max_new_tokens=3, eos_id=None)
    assert seen
    return seen


def test_the_default_sink_page_is_really_kept(model):  # noqa: F811
    """Left unset, the sink page is listed at every step though it scores worst; with ``num_sink_pages=0`` it is
    not (21-22 pages of 2 tokens, budget 16: the recent page and the 15 best scored)."""
    assert all(bool((p == 0).any(-1).all()) for p in _listed_pages(model))
    assert not any(bool((p == 0).any()) for p in _listed_pages(model, num_sink_pages=0))


def test_hf_cache_takes_the_default():
    transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
    from tinyattn.integrations.hf import TinyAttnCache

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    config._attn_implementation = "tinyattn"
    assert TinyAttnCache(config, page_budget=16).num_sink_pages == 1
    assert TinyAttnCache(config, page_budget=4).num_sink_pages == 0
    assert TinyAttnCache(config).num_sink_pages == 1                          # dense: recorded, not used
    assert TinyAttnCache(config, page_budget=16, num_sink_pages=0).num_sink_pages == 0


def test_vllm_settings_take_the_default():
    from tinyattn.integrations.vllm import settings_from_env

    assert settings_from_env({"TINYATTN_PAGE_BUDGET": "64"}).num_sink_pages == 1
    assert settings_from_env({"TINYATTN_PAGE_BUDGET": "4"}).num_sink_pages == 0
    assert settings_from_env({"TINYATTN_PAGE_BUDGET": "64", "TINYATTN_SINK_PAGES": "0"}).num_sink_pages == 0
    with pytest.raises(ValueError, match="TINYATTN_PAGE_BUDGET"):
        settings_from_env({"TINYATTN_PAGE_BUDGET": "2", "TINYATTN_SINK_PAGES": "2"})


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_layer_ignores_the_page_budget(backend):
    """A sliding layer of a sparse decode step attends densely over its window: the budget and the policy do not
    change its output (it equals the dense windowed op), while a full layer of the same step selects."""
    p = make_problem(9, batch=2, seq_lens=[37, 26], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    q = p.q[:, 0]
    for policy in ("quest", "streaming"):
        attn = PagedAttention(SparsityConfig(page_budget=2, policy=policy), backend=backend)
        attn.begin(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, decode=True)
        sliding = attn(0, q, p.k_cache, p.v_cache, k_min, k_max, window_left=9)
        full = attn(1, q, p.k_cache, p.v_cache, k_min, k_max)
        want = reference.paged_attention(q, *p.args[1:], window_left=9)
        torch.testing.assert_close(sliding, want, atol=2e-5, rtol=1e-5)
        assert not torch.allclose(full, reference.paged_attention(q, *p.args[1:]), atol=1e-3)
