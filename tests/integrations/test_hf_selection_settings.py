"""``gamma`` / ``top_p`` (issue 35) on the Hugging Face path: :class:`TinyAttnCache` and ``enable``. Expected values:
stock transformers' greedy tokens (``attn_implementation="sdpa"``, ``DynamicCache``) on the tiny families of
tests/hf_tiny_models.py; the pages attended are counted by the cache (``pages_attended``) and by tinyattn's
profiler, independently."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("tinyattn.integrations.hf")
import tinyattn.profiler as tp  # noqa: E402

from hf_tiny_models import FAMILIES, PAD, PAGE, inputs, models  # noqa: E402

GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_top_p_one_with_a_covering_capacity_gives_stocks_tokens(family):
    model, stock = models(family)
    ids, mask = inputs("left")
    ref = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    cache = hf.TinyAttnCache(model.config, page_size=PAGE, page_budget=64, num_sink_pages=0, gamma=0.5, top_p=1.0,
                             backend="torch")
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    assert "gamma=0.5, top_p=1.0" in repr(cache)              # not the default (0.25)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_top_p_below_one_attends_fewer_pages_than_the_capacity(family):
    """Rows of 10..19 tokens (3..5 pages of 4) under a capacity of 3 pages: with ``top_p=None`` every row longer
    than the capacity attends 3 pages; with ``top_p=0.3`` the mean falls below 3 (never above it), and the profiler's
    sparse attention calls count the same pages the cache does."""
    model, _ = models(family)
    ids, mask = inputs("left")
    n_layers = model.config.get_text_config().num_hidden_layers
    fixed = hf.TinyAttnCache(model.config, page_size=PAGE, page_budget=3, num_sink_pages=0, backend="torch")
    model.generate(input_ids=ids, attention_mask=mask, cache=fixed, **GEN)
    s = fixed.pages_attended.summary()
    assert s["max"] == 3 and s["count"] > 0
    cache = hf.TinyAttnCache(model.config, page_size=PAGE, page_budget=3, num_sink_pages=0, top_p=0.3,
                             backend="torch")
    with tp.profile(oracle=False) as prof:
        model.generate(input_ids=ids, attention_mask=mask, cache=cache, **GEN)
    t = cache.pages_attended.summary()
    assert t["count"] == s["count"] and t["max"] <= 3 and t["mean"] < s["mean"]
    sparse = [r for r in prof.records if r.op == "attention" and r.sparse]
    assert len(sparse) >= n_layers                      # the profiler saw selections narrower than the rows
    counted = sum(k * c for k, c in enumerate(t["histogram"]))
    assert 0 < sum(r.pages for r in sparse) <= counted  # its sparse calls are among the cache's counted steps


def test_enable_saves_gamma_and_top_p_and_checks_them(tmp_path):
    _, stock = models("qwen2")
    model = copy.deepcopy(stock)
    for bad, match, err in ((dict(gamma=1.5), "gamma", ValueError), (dict(top_p=0.0), "top_p", ValueError),
                            (dict(top_p="high"), "top_p", TypeError),
                            (dict(page_budget=3, policy="streaming", top_p=0.9), "policy", ValueError)):
        with pytest.raises(err, match=match):
            hf.enable(model, **bad)
        assert model.config._attn_implementation == "sdpa" and not hf.is_enabled(model)
        with pytest.raises(err, match=match):
            hf.TinyAttnCache(model.config, **bad)
    hf.enable(model, page_size=PAGE, page_budget=3, num_sink_pages=0, gamma=0.5, top_p=0.9, backend="torch")  # not the default
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())[hf.CONFIG_KEY]
    assert (saved["gamma"], saved["top_p"]) == (0.5, 0.9)
    loaded = hf.enable(transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    ids, mask = inputs("left")
    out = loaded.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert (out.cache.gamma, out.cache.top_p) == (0.5, 0.9)
    assert (out.cache._attention.plan.step.gamma, out.cache._attention.plan.step.top_p) == (0.5, 0.9)
