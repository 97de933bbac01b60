"""transformers' generation semantics with a TinyAttnCache (issue 33), on tiny random models of four families.

The scenarios are those of transformers' ``GenerationTesterMixin`` (greedy, sample, beam, beam sample, assisted and
prompt-lookup decoding, ``prefill_chunk_size``, continuing from a returned cache, ``inputs_embeds``, ``crop``, a
static cache under ``torch.compile``), run on Llama (GQA), Qwen2 (MQA), Mistral (every layer slides, window 12, so
the contexts here pass it) and GPT-2, with left padding, right padding and masks with holes (a pad token inside a
row, ``input_ids.ne(pad)``). The expected values come from the same model with stock ``attn_implementation="sdpa"``
and its default ``DynamicCache``:

- a dense TinyAttnCache and one whose budget covers the context give stock's tokens (logits within 1e-4, fp32);
- a sparse one (pages of 4 tokens, 2 per step) runs in the same mode and attends to fewer pages than the rows hold
  (tinyattn's profiler sees a selection narrower than the row).

Every tinyattn path runs the torch backend (the Triton interpreter is covered by tests/integrations/test_hf.py).
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("tinyattn.integrations.hf")
import tinyattn.profiler as tp  # noqa: E402

from hf_tiny_models import (BUDGETS, FAMILIES, PAD, PAGE, WIDTH, cache, inputs, models, prompt,  # noqa: E402
                            sparse_calls)

TOL = 1e-4            # logits: stock SDPA vs the paged op in fp32 (~1e-6 seen)
NEW = 6               # new tokens per generate call


def _kw(**extra):
    return dict(max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True,
                output_logits=True, **extra)


MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=10, num_return_sequences=2),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2, output_scores=True),
    "beam_sample": dict(do_sample=True, num_beams=2, top_k=10),
    "prefill_chunks": dict(do_sample=False, prefill_chunk_size=4),
}


def run(mode, model, ids, mask, c):
    """One generate call of ``mode``; ``c`` = the cache to pass (None: stock's DynamicCache)."""
    extra = {} if c is None else {"cache": c}
    torch.manual_seed(0)
    if mode == "inputs_embeds":
        with torch.no_grad():
            embeds = model.get_input_embeddings()(ids)
        return model.generate(inputs_embeds=embeds, attention_mask=mask, do_sample=False, **_kw(**extra))
    return model.generate(input_ids=ids, attention_mask=mask, **MODES[mode], **_kw(**extra))


def assert_same(out, ref, what=""):
    assert torch.equal(out.sequences, ref.sequences), what
    if out.logits is not None and ref.logits is not None:
        diff = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
        assert diff < TOL, f"{what}: logits differ by {diff}"


def layer_shapes(c):
    return [(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in c.layers]


_STOCK: dict = {}


def stock_run(family, mode, padding):
    key = (family, mode, padding)
    if key not in _STOCK:
        _, stock = models(family)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # "right-padding was detected"
            _STOCK[key] = run(mode, stock, *inputs(padding), None)
    return _STOCK[key]


# ---------------------------------------------------------------- every mode x padding x budget
@pytest.mark.parametrize("padding", ["left", "right", "holes"])
@pytest.mark.parametrize("mode", list(MODES) + ["inputs_embeds"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", ["dense", "covering"])
def test_generate_equals_stock(budget, family, mode, padding):
    """Points 1, 2 and 4: every generation mode on padded batches gives stock's tokens and logits, and the cache's
    layers have DynamicCache's shapes (``[B, Hkv, columns, D]``, padding columns included)."""
    if mode == "inputs_embeds" and family == "gpt2" and padding != "left":
        pytest.skip("stock GPT-2 from inputs_embeds derives no positions from a mask with holes")
    tiny, _ = models(family)
    ref = stock_run(family, mode, padding)
    c = cache(tiny, budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run(mode, tiny, *inputs(padding), c)
    assert_same(out, ref, f"{family} {mode} {padding}")
    assert out.cache is c
    assert layer_shapes(c) == layer_shapes(ref.cache)
    assert c.get_seq_length() == ref.cache.get_seq_length()


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("mode", list(MODES) + ["inputs_embeds"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_generate_runs_sparsely(family, mode, padding):
    """The same modes with 2 pages of 4 tokens per step: finite logits, stock's output shapes, and attention calls
    that read fewer pages than the rows hold."""
    tiny, _ = models(family)
    ref = stock_run(family, mode, padding)
    with warnings.catch_warnings(), tp.profile(oracle=False) as prof:
        warnings.simplefilter("ignore")
        out = run(mode, tiny, *inputs(padding), cache(tiny, "sparse"))
    assert out.sequences.shape == ref.sequences.shape
    assert all(torch.isfinite(x).all() for x in out.logits)
    if family != "mistral":          # Mistral slides in every layer: its window (12 tokens) is read densely
        assert sparse_calls(prof) > 0


# ---------------------------------------------------------------- continue, crop, chunks of padding
def continue_generation(model, ids, mask, c):
    """3 tokens, then the returned cache continues with the whole sequence as input for 3 more."""
    kw = dict(do_sample=False, pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True, max_new_tokens=3)
    first = model.generate(input_ids=ids, attention_mask=mask, **kw, **({} if c is None else {"cache": c}))
    mask2 = torch.cat([mask, torch.ones(len(ids), 3, dtype=torch.long)], 1)
    return first, model.generate(input_ids=first.sequences, attention_mask=mask2, cache=first.cache, **kw)


@pytest.mark.parametrize("padding", ["left", "right", "holes"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", ["dense", "covering", "sparse"])
def test_continue_from_returned_cache(budget, family, padding):
    """transformers' ``test_generate_continue_from_past_key_values``: the same two calls on stock's DynamicCache give
    the same tokens (with left padding also those of one 6-token call; with right padding stock's own two calls
    differ from its one call, and tinyattn follows the two calls)."""
    tiny, stock = models(family)
    ids, mask = inputs(padding)
    with warnings.catch_warnings(), tp.profile(oracle=False) as prof:
        warnings.simplefilter("ignore")
        _, ref = continue_generation(stock, ids, mask, None)
        one_call = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  pad_token_id=PAD, eos_token_id=None)
        first, out = continue_generation(tiny, ids, mask, cache(tiny, budget))
    assert out.cache is first.cache
    if padding == "left":
        assert torch.equal(ref.sequences, one_call)
    if budget == "sparse":
        assert out.sequences.shape == ref.sequences.shape
        if family != "mistral":
            assert sparse_calls(prof) > 0
    else:
        assert torch.equal(out.sequences, ref.sequences)
        assert layer_shapes(out.cache) == layer_shapes(ref.cache)


@pytest.mark.parametrize("padding", ["left", "right", "holes"])
@pytest.mark.parametrize("family", FAMILIES)
def test_crop_to_the_padding_prefix_then_refeed(family, padding):
    """Issue 33 point 1: ``crop`` down to a prefix that holds only padding in some rows (the 4 leading columns),
    then the rest fed again: every position's logits equal stock's forward over the whole batch (DynamicCache gives
    them exactly)."""
    tiny, stock = models(family)
    ids, mask = inputs(padding)
    with torch.no_grad():
        ref = stock(input_ids=ids, attention_mask=mask).logits
        c = cache(tiny)
        tiny(input_ids=ids, attention_mask=mask, cache=c, use_cache=True)
        c.crop(-(WIDTH - 4))
        assert c.get_seq_length() == 4
        got = tiny(input_ids=ids[:, 4:], attention_mask=mask, cache=c, use_cache=True).logits
    assert (got - ref[:, 4:]).abs().max() < TOL
    assert c.get_seq_length() == WIDTH and c.seq_lens().tolist() == mask.sum(1).tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", ["dense", "covering"])
def test_prefill_chunk_of_padding_only(budget, family):
    """Issue 33 point 1: ``prefill_chunk_size=4`` on a left-padded batch whose first chunk is padding in every row
    (it used to raise a size mismatch inside SDPA: the cache 'held no real token' and took the empty-cache path
    with a mask over every column)."""
    tiny, stock = models(family)
    ids, mask = inputs("left")
    assert not mask[:, :4].any()
    ref = stock.generate(input_ids=ids, attention_mask=mask, **_kw(do_sample=False, prefill_chunk_size=4))
    out = tiny.generate(input_ids=ids, attention_mask=mask, **_kw(do_sample=False, prefill_chunk_size=4,
                                                                  cache=cache(tiny, budget)))
    assert_same(out, ref)


# ---------------------------------------------------------------- custom masks
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_custom_4d_mask_into_a_filled_cache(family, kind):
    """Two branches of 2 tokens after a 9-token prompt in one forward (a tree of drafts): a custom 4D mask the pages
    cannot represent, so the step runs dense over the cache; logits equal stock DynamicCache's, and the cache
    then decodes on."""
    tiny, stock = models(family)
    ids = prompt(9, 5)[None]
    branch = torch.tensor([[7, 8, 9, 10]])
    allowed = torch.ones(1, 1, 4, 13, dtype=torch.bool)
    allowed[0, 0, :, 9:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    mask4 = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(
        torch.float32).min)
    pos = torch.tensor([[9, 10, 9, 10]])
    results = []
    for model, c in ((stock, transformers.DynamicCache(config=stock.config)), (tiny, cache(tiny))):
        with torch.no_grad():
            model(input_ids=ids, cache=c, use_cache=True)
            out = model(input_ids=branch, attention_mask=mask4, position_ids=pos, cache=c, use_cache=True).logits
        results.append(out)
    assert (results[0] - results[1]).abs().max() < TOL


def test_a_mask_that_reads_a_token_never_cached_raises_before_any_change():
    """A column whose token did not attend to itself was never written to a page; a later mask that attends to it
    cannot be served (stock keeps that token's K/V): ValueError, and the cache is as it was."""
    tiny, _ = models("llama")
    ids = prompt(6, 1)[None]
    c = cache(tiny)
    first = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    first[0, 0, 3, 3] = False                                          # token 3 does not see itself: not cached
    with torch.no_grad():
        tiny(input_ids=ids, attention_mask=first, cache=c, use_cache=True)
        assert c.seq_lens().tolist() == [5]
        bad = torch.ones(1, 1, 1, 7, dtype=torch.bool)                 # the next token reads column 3
        with pytest.raises(ValueError, match="column 3"):
            tiny(input_ids=torch.tensor([[5]]), attention_mask=bad, cache=c, use_cache=True)
        assert c.get_seq_length() == 6 and c.seq_lens().tolist() == [5]
        good = bad.clone()
        good[..., 3] = False
        out = tiny(input_ids=torch.tensor([[5]]), attention_mask=good, cache=c, use_cache=True).logits
    assert torch.isfinite(out).all() and c.get_seq_length() == 7


# ---------------------------------------------------------------- static cache + torch.compile
@pytest.mark.slow
def test_static_cache_compile_ignores_a_collected_tinyattn_cache():
    """Issue 33 point 3: a tinyattn model compiled with a static cache (transformers'
    ``test_static_cache_no_recompile_with_smaller_length``) after a TinyAttnCache on the same thread was collected:
    no recompilation (no guard on tinyattn's thread-local), stock's tokens."""
    tiny, stock = models("llama")
    ids, mask = inputs("left", rows=(1,))
    c = cache(tiny)
    tiny.generate(input_ids=ids, attention_mask=mask, cache=c, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    cfg = transformers.CompileConfig(backend="eager", fullgraph=True)
    cfg._compile_all_devices = True                  # transformers compiles on the CPU only when asked
    kw = dict(do_sample=False, pad_token_id=PAD, eos_token_id=None, cache_implementation="static",
              compile_config=cfg)
    torch._dynamo.reset()
    try:
        out = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, **kw)
        del c
        gc.collect()
        with torch.compiler.set_stance("fail_on_recompile"):
            short = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, **kw)
    finally:
        torch._dynamo.reset()
    ref = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                         eos_token_id=None)
    assert torch.equal(out, ref) and torch.equal(short, ref[:, :WIDTH + 3])


@pytest.mark.slow
def test_a_compiled_forward_with_a_tinyattn_cache_runs_its_attention_eagerly():
    """``torch.compile(model.forward)`` driven with a TinyAttnCache (generate() never compiles one: it is not
    compileable): the cache's update and attention run outside the graph, and the tokens are stock's."""
    tiny, stock = models("llama")
    model = copy.deepcopy(tiny)
    model.forward = torch.compile(model.forward, backend="eager")
    ids, mask = inputs("left")
    ref = stock.generate(input_ids=ids, attention_mask=mask, **_kw(do_sample=False))
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(input_ids=ids, attention_mask=mask, **_kw(do_sample=False, cache=cache(model)))
    finally:
        torch._dynamo.reset()
    assert_same(out, ref)


# ---------------------------------------------------------------- assisted decoding
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", ["dense", "covering", "sparse"])
def test_assisted_and_prompt_lookup_decoding(budget, family, padding):
    """Assisted decoding with an assistant that holds its own TinyAttnCache (``enable``), and prompt-lookup decoding,
    on a padded prompt (assisted decoding takes one row): stock greedy tokens and cache shapes when dense / covering
    (transformers' ``test_assisted_decoding_matches_greedy_search``); the sparse runs attend to fewer pages."""
    tiny, stock = models(family)
    assistant, _ = models(family, seed=1)                         # other weights: some drafts are rejected
    assistant = hf.enable(copy.deepcopy(assistant), page_size=PAGE, page_budget=BUDGETS[budget], backend="torch")
    ids, mask = inputs(padding, rows=(1,))
    kw = _kw(do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = stock.generate(input_ids=ids, attention_mask=mask, **kw)
        with tp.profile(oracle=False) as prof:
            assisted = tiny.generate(input_ids=ids, attention_mask=mask, assistant_model=assistant,
                                     cache=cache(tiny, budget), **kw)
            lookup = tiny.generate(input_ids=ids, attention_mask=mask, prompt_lookup_num_tokens=3,
                                   cache=cache(tiny, budget), **kw)
    for out in (assisted, lookup):
        assert out.sequences.shape == ref.sequences.shape
        if budget != "sparse":
            assert torch.equal(out.sequences, ref.sequences)
            assert layer_shapes(out.cache) == layer_shapes(ref.cache)
    if budget == "sparse" and family != "mistral":
        assert sparse_calls(prof) > 0
