"""The opt-in of issue 33 point 2: after ``tinyattn.integrations.hf.enable(model, ...)``, ``model.generate(**inputs)``,
``pipeline("text-generation", model=model)`` and an assistant model decode through a TinyAttnCache with no extra
argument; models that did not opt in are untouched; the settings survive ``save_pretrained``.

Expected values: the same model with stock ``attn_implementation="sdpa"`` and its default ``DynamicCache``. The
pipeline runs on the shipped stories260K converted to a Hugging Face checkpoint (a real model with its tokenizer).
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("tinyattn.integrations.hf")
import tinyattn.profiler as tp  # noqa: E402

from hf_tiny_models import FAMILIES, PAD, inputs, models, sparse_calls  # noqa: E402

GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True)


@pytest.fixture
def created(monkeypatch):
    """Every TinyAttnCache that enable()'s generate path makes, in order."""
    made = []

    class Recording(hf.TinyAttnCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(hf, "TinyAttnCache", Recording)
    return made


def enabled(family, **settings):
    _, stock = models(family)
    model = copy.deepcopy(stock)                     # stock's weights, loaded with "sdpa": enable switches it
    settings.setdefault("page_size", 4)
    settings.setdefault("backend", "torch")
    return hf.enable(model, **settings), stock


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_no_extra_argument(family):
    """A covering budget gives stock's tokens through a TinyAttnCache that generate() made itself; a budget of 2
    pages decodes sparsely; the stock model it was copied from still makes DynamicCaches."""
    model, stock = enabled(family, page_budget=64)
    ids, mask = inputs("left")
    ref = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    out = model.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    assert isinstance(out.cache, hf.TinyAttnCache) and out.cache.page_budget == 64 and out.cache.page_size == 4
    assert type(ref.cache) is transformers.DynamicCache and not hf.is_enabled(stock)
    sparse, _ = enabled(family, page_budget=2)
    with tp.profile(oracle=False) as prof:
        out = sparse.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert isinstance(out.cache, hf.TinyAttnCache) and out.cache.page_budget == 2
    if family != "mistral":                          # Mistral slides in every layer: its window is read densely
        assert sparse_calls(prof) > 0


def test_an_explicit_cache_use_cache_false_and_static_still_win():
    model, stock = enabled("llama", page_budget=2)
    ids, mask = inputs("left")
    mine = hf.TinyAttnCache(model.config, page_size=8, backend="torch")
    assert model.generate(input_ids=ids, attention_mask=mask, cache=mine, **GEN).cache is mine
    ref = stock.generate(input_ids=ids, attention_mask=mask, use_cache=False, max_new_tokens=4, do_sample=False,
                         pad_token_id=PAD, eos_token_id=None)
    out = model.generate(input_ids=ids, attention_mask=mask, use_cache=False, max_new_tokens=4, do_sample=False,
                         pad_token_id=PAD, eos_token_id=None)
    assert torch.equal(out, ref)                     # no cache: "tinyattn" is plain SDPA
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # "decoding with a cache that is not a TinyAttnCache"
        static = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **GEN)
    assert type(static.cache).__name__ == "StaticCache"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_enabled_assistant_gets_its_own_tinyattn_cache(family, created):
    """Assisted decoding calls the assistant's generate() itself: an enabled assistant decodes through a
    TinyAttnCache (marked for past recording, as transformers marks an assistant's cache), and the tokens are the
    main model's greedy tokens."""
    model, stock = enabled(family, page_budget=64)
    assistant_base, _ = models(family, seed=1)
    assistant = hf.enable(copy.deepcopy(assistant_base), page_size=4, page_budget=2, backend="torch")
    created.clear()                                  # enable() checks its settings by building one
    ids, mask = inputs("left", rows=(1,))
    ref = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    out = model.generate(input_ids=ids, attention_mask=mask, assistant_model=assistant, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    budgets = sorted(c.page_budget for c in created)
    assert budgets == [2, 64]                        # one for the main model, one for the assistant
    assert all(c.batch_size == 1 for c in created)


def test_enable_checks_before_it_changes_anything():
    _, stock = models("llama")
    model = copy.deepcopy(stock)
    for bad, match in ((dict(page_budget=0), "page_budget"), (dict(budget=4), "unknown"),
                       (dict(policy=object()), "policy"), (dict(page_budget=2, num_sink_pages=2), "page_budget")):
        with pytest.raises(ValueError, match=match):
            hf.enable(model, **bad)
        assert model.config._attn_implementation == "sdpa" and not hf.is_enabled(model)
        assert not hasattr(model.config, hf.CONFIG_KEY)


def test_save_pretrained_keeps_the_settings_and_disable_undoes(tmp_path):
    model, stock = enabled("qwen2", page_budget=3, num_recent_pages=2, policy="streaming")
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())[hf.CONFIG_KEY]
    assert saved == dict(page_size=4, backend="torch", page_budget=3, num_recent_pages=2, policy="streaming")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not hf.is_enabled(loaded)                 # loading changes nothing by itself: enable(model) re-applies
    hf.enable(loaded)
    ids, mask = inputs("left")
    out = loaded.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert isinstance(out.cache, hf.TinyAttnCache)
    assert (out.cache.page_budget, out.cache.num_recent_pages) == (3, 2)
    assert out.cache._attention.sparsity.policy.name == "streaming"
    hf.disable(loaded)
    again = loaded.generate(input_ids=ids, attention_mask=mask, **GEN)
    assert type(again.cache) is transformers.DynamicCache and loaded.config._attn_implementation == "sdpa"
    assert torch.equal(again.sequences, stock.generate(input_ids=ids, attention_mask=mask, **GEN).sequences)


# ---------------------------------------------------------------- pipeline, on a real checkpoint
@pytest.fixture(scope="module")
def stories_hf(tmp_path_factory):
    from tinyattn.assets import default_model_path, default_tokenizer_path
    from tinyattn.integrations.convert import convert

    return convert(default_model_path(), tmp_path_factory.mktemp("stories260K-hf"), default_tokenizer_path())


def _pipe(model, path):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")


PROMPTS = ["Once upon a time", "Tom had a red ball. He"]


def test_pipeline_decodes_sparsely_after_enable(stories_hf, created):
    """``pipeline("text-generation", model=model)`` after the opt-in: a covering budget gives stock's text; a
    budget of 2 pages of 16 tokens makes the pipeline's caches hold more pages than each decode step reads
    (the cache's block tables against tinyattn's profiler)."""
    stock = transformers.AutoModelForCausalLM.from_pretrained(stories_hf).eval()
    call = dict(max_new_tokens=60, do_sample=False, return_full_text=False)
    ref = _pipe(stock, stories_hf)(PROMPTS, **call)
    covering = hf.enable(transformers.AutoModelForCausalLM.from_pretrained(stories_hf).eval(), page_size=16,
                         page_budget=32, backend="torch")
    created.clear()                                  # enable() checks its settings by building one
    assert _pipe(covering, stories_hf)(PROMPTS, **call) == ref
    assert len(created) == len(PROMPTS)              # one generate() per prompt, each with its TinyAttnCache
    sparse = hf.enable(transformers.AutoModelForCausalLM.from_pretrained(stories_hf).eval(), page_size=16,
                       page_budget=2, backend="torch")
    created.clear()
    with tp.profile(oracle=False) as prof:
        got = _pipe(sparse, stories_hf)(PROMPTS, **call)
    assert len(got) == len(PROMPTS) and all(g[0]["generated_text"] for g in got)
    held = [int(c.block_table().ge(0).sum()) for c in created]                      # pages each row holds
    assert len(created) == len(PROMPTS) and min(held) > 2
    cfg = sparse.config
    read = [r.pages for r in prof.records if r.op == "attention" and r.sparse]      # pages x KV heads per call
    assert read and max(read) == 2 * cfg.num_key_value_heads                       # 2 pages per KV head
