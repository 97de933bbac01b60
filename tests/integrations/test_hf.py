"""Hugging Face transformers integration (tinyattn.integrations.hf) on tiny random models built locally.

Each family is checked against its stock SDPA attention with the same weights. Weights are drawn with a
large init range so that attention is peaked and a small page budget really changes the result.
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("tinyattn.integrations.hf")
from transformers.generation.streamers import BaseStreamer  # noqa: E402

TinyAttnCache = hf.TinyAttnCache
VOCAB = 96
TOL = 1e-4    # logits: prefill is bitwise stock SDPA, decode differs by fp32 rounding only (~1e-6 seen)


def _config(family):
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=36, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2,
                                        max_position_embeddings=256, initializer_range=0.3, **common)
    if family == "mistral":
        return transformers.MistralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          sliding_window=4096, initializer_range=0.3, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                        initializer_range=0.3, **common)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, initializer_range=0.3,
                                       **common)
    if family == "opt":
        return transformers.OPTConfig(hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                                      word_embed_proj_dim=32, max_position_embeddings=256, init_std=0.3, **common)
    raise ValueError(family)


_MODELS = {}


def models(family):
    """(tinyattn model, stock sdpa model) with identical weights, cached per family."""
    if family not in _MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation="sdpa").eval()
        tiny = copy.deepcopy(model)
        tiny.set_attn_implementation("tinyattn")
        _MODELS[family] = tiny, model
    return _MODELS[family]


def cache(model, **kw):
    kw.setdefault("page_size", 4)
    kw.setdefault("backend", "torch")
    return TinyAttnCache(model.config, **kw)


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


def left_pad(prompts):
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    return ids, mask


GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)


def generate(model, ids, mask=None, max_new_tokens=6, **kw):
    if ids.dim() == 1:
        ids = ids[None]
    if mask is None:
        mask = torch.ones_like(ids)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, **GREEDY, **kw)


def max_logit_diff(a, b, row_a=slice(None), row_b=slice(None)):
    return max((x[row_a] - y[row_b]).abs().max().item() for x, y in zip(a.logits, b.logits))


FAMILIES = ["llama", "gpt2", "opt"]


# -------------------------------------------------------------------- equality with stock attention
@pytest.mark.parametrize("family", FAMILIES + ["mistral", "qwen2"])
def test_full_budget_equals_stock(family):
    tiny, stock = models(family)
    ids = prompt(13, seed=1)
    ref = generate(stock, ids, max_new_tokens=8)
    c = cache(tiny, page_budget=64)                               # budget covers the context: sparse == dense
    out = generate(tiny, ids, max_new_tokens=8, cache=c)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < TOL
    assert c.seq_lens().tolist() == [13 + 8 - 1]                  # the last token is never fed back
    assert c.get_seq_length() == 20


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_decode_equals_stock_and_small_budget_differs(family):
    tiny, stock = models(family)
    ids = prompt(30, seed=2)
    ref = generate(stock, ids)
    dense = generate(tiny, ids, cache=cache(tiny, page_budget=None))
    assert max_logit_diff(dense, ref) < TOL
    sparse = generate(tiny, ids, cache=cache(tiny, page_budget=2))
    assert all(torch.isfinite(x).all() for x in sparse.logits)
    assert max_logit_diff(sparse, ref) > 1e-3                     # 2 of 8 pages: the sparse path really ran
    layers = tiny.config.num_hidden_layers
    all_dense = generate(tiny, ids, cache=cache(tiny, page_budget=2, dense_layers=layers))
    assert max_logit_diff(all_dense, ref) < TOL


# -------------------------------------------------------------------- padding and batching
@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_equals_each_sequence_alone(family):
    tiny, _ = models(family)
    prompts = [prompt(n, seed=10 + n) for n in (5, 11, 17, 1)]
    ids, mask = left_pad(prompts)
    opts = dict(page_budget=2, num_sink_pages=1)                 # sparse: padding must not leak into selection
    batch = generate(tiny, ids, mask, max_new_tokens=7, cache=cache(tiny, **opts))
    T = ids.shape[1]
    for i, p in enumerate(prompts):
        alone = generate(tiny, p, max_new_tokens=7, cache=cache(tiny, **opts))
        assert torch.equal(batch.sequences[i, T:], alone.sequences[0, len(p):]), f"row {i}"
        assert max_logit_diff(batch, alone, i, 0) < TOL, f"row {i}"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_generation_across_page_boundary(family, offset):
    tiny, stock = models(family)
    P = 8
    ids = prompt(P + offset, seed=20 + offset)
    ref = generate(stock, ids, max_new_tokens=4)                  # crosses P-1 -> P -> P+1 while decoding
    out = generate(tiny, ids, max_new_tokens=4, cache=cache(tiny, page_size=P, page_budget=2))
    assert torch.equal(out.sequences, ref.sequences)              # <= 2 pages: the whole context is selected
    assert max_logit_diff(out, ref) < TOL


def test_right_padding_equals_stock():
    """Issue 33: right padding used to raise; it now gives stock's tokens (tests/integrations/test_hf_generation.py
    covers every generation mode)."""
    tiny, stock = models("llama")
    ids = torch.stack([prompt(6, 1), prompt(6, 2)])
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    out = generate(tiny, ids, mask, cache=cache(tiny, page_budget=4))
    assert torch.equal(out.sequences, generate(stock, ids, mask).sequences)


def test_chunked_prefill_equals_stock():
    tiny, stock = models("llama")
    ids, mask = left_pad([prompt(9, 3), prompt(21, 4)])
    ref = generate(stock, ids, mask)
    out = generate(tiny, ids, mask, cache=cache(tiny, page_budget=64), prefill_chunk_size=8)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < TOL


# -------------------------------------------------------------------- generate features
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_beam_search_equals_stock(family):
    tiny, stock = models(family)
    ids, mask = left_pad([prompt(7, 5), prompt(12, 6)])
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    ref = generate(stock, ids, mask, **kw)
    out = generate(tiny, ids, mask, cache=cache(tiny, page_budget=64), **kw)
    assert torch.equal(out.sequences, ref.sequences)


def test_sampling_num_return_sequences_equals_stock():
    tiny, stock = models("gpt2")
    ids = prompt(10, 7)
    kw = dict(do_sample=True, num_return_sequences=3, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(123)
    ref = stock.generate(ids[None], attention_mask=torch.ones(1, 10, dtype=torch.long), **kw)
    torch.manual_seed(123)
    c = cache(tiny, page_budget=64)
    out = tiny.generate(ids[None], attention_mask=torch.ones(1, 10, dtype=torch.long), cache=c, **kw)
    assert torch.equal(out, ref)
    assert c.batch_size == 3


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append("end")


def test_streamer_sees_every_token():
    tiny, _ = models("llama")
    ids = prompt(9, 8)
    streamer = _Collect()
    out = tiny.generate(ids[None], max_new_tokens=5, do_sample=False, streamer=streamer, pad_token_id=0,
                        eos_token_id=None, cache=cache(tiny, page_budget=2))
    assert streamer.chunks[0] == ids.tolist() and streamer.chunks[-1] == "end"
    assert sum(streamer.chunks[1:-1], []) == out[0, 9:].tolist()


# -------------------------------------------------------------------- cache operations
def test_reorder_crop_and_growth_match_recomputation():
    tiny, _ = models("llama")
    ids = torch.stack([prompt(10, 30), prompt(10, 31), prompt(10, 32)])
    c = cache(tiny, page_budget=2, num_pages=3)                   # far too small: the pool must grow
    with torch.no_grad():
        tiny(ids, cache=c, use_cache=True)
        c.reorder_cache(torch.tensor([2, 2, 0]))
        assert c.seq_lens().tolist() == [10, 10, 10]
        step = torch.tensor([[5], [6], [7]])
        got = tiny(step, cache=c, use_cache=True).logits
        fresh = cache(tiny, page_budget=2)
        tiny(ids[[2, 2, 0]], cache=fresh, use_cache=True)
        want = tiny(step, cache=fresh, use_cache=True).logits
        assert (got - want).abs().max() < TOL
        for layer in range(tiny.config.num_hidden_layers):       # bounds of every page still exact
            k, _ = c.to_dense(layer)
            k2, _ = fresh.to_dense(layer)
            assert torch.allclose(k, k2, atol=1e-6)
        # crop back by 3 columns (inside a page), then decode again: same as never having had them
        c.crop(-3)
        assert c.get_seq_length() == 8 and c.seq_lens().tolist() == [8, 8, 8]
        with pytest.raises(ValueError, match="tokens_to_remove"):
            c.crop(2)
        pool, table, lens = c.pool, c.block_table(), c.seq_lens()
        for layer in range(pool.num_layers):
            k_min, k_max = pool.k_min[layer].clone(), pool.k_max[layer].clone()
            import tinyattn
            tinyattn.update_page_metadata(pool.k_cache[layer], table, lens, k_min, k_max, backend="torch")
            used = table[table >= 0].long()
            assert torch.equal(k_min[used], pool.k_min[layer][used])
            assert torch.equal(k_max[used], pool.k_max[layer][used])
        again = tiny(ids[[2, 2, 0], 8:], cache=c, use_cache=True).logits
        assert (again[:, -1] - tiny(ids[[2, 2, 0]]).logits[:, -1]).abs().max() < TOL
        c.batch_repeat_interleave(2)
        assert c.batch_size == 6 and c.seq_lens().tolist() == [10] * 6
        c.batch_select_indices(torch.tensor([5, 0]))
        assert c.batch_size == 2


def test_the_pool_grows_in_place_and_never_leaks_a_page():
    """Growth, beam reordering and crop go through PagedKVCache's own operations (resize, fork, truncate):
    one pool object, sequence ids kept where rows stay, every page either free or held by exactly one row."""
    tiny, _ = models("llama")
    ids = torch.stack([prompt(10, 40), prompt(10, 41)])
    c = cache(tiny, page_budget=2, num_pages=6)
    with torch.no_grad():
        tiny(ids, cache=c, use_cache=True)                          # 2 x 3 pages of 4 tokens: the pool is full
        pool, table = c.pool, c.block_table().tolist()
        for t in range(3):                                           # the 3rd step needs 2 pages: doubles in place
            tiny(torch.tensor([[5 + t], [6 + t]]), cache=c, use_cache=True)
        assert c.pool is pool and pool.num_pages == 12 and pool.k_cache[0].shape[0] == 12
        assert [row[:3] for row in c.block_table().tolist()] == table   # pages did not move

        def held():
            pages = [p for sid in c._seq_ids for p in pool.pages(sid)]
            assert len(pages) == len(set(pages)) and pool.num_free_pages + len(pages) == pool.num_pages
            return pages

        first = list(c._seq_ids)
        c.reorder_cache(torch.tensor([1, 1]))                        # row 1 kept, one fork of it; row 0 freed
        assert c.pool is pool and c._seq_ids[0] == first[1] and c._seq_ids[1] not in first
        assert len(held()) == 8
        c.crop(-8)                                                   # 13 -> 5 tokens: 2 pages per row
        assert c.pool is pool and c.seq_lens().tolist() == [5, 5] and len(held()) == 4
        k0, _ = c.to_dense(0)
        assert torch.equal(k0[0], k0[1])                             # the fork holds the same keys


def test_without_cache_is_stock_sdpa():
    tiny, stock = models("opt")
    ids = prompt(12, 9)[None]
    with torch.no_grad():
        assert torch.equal(tiny(ids, use_cache=False).logits, stock(ids, use_cache=False).logits)


def test_errors_are_clear():
    tiny, stock = models("llama")
    ids = prompt(6, 1)[None]
    with pytest.raises(ValueError, match="attn_implementation"):
        with torch.no_grad():
            stock(ids, cache=TinyAttnCache(stock.config, page_size=4), use_cache=True)
    with pytest.raises(ValueError, match="page_budget"):
        TinyAttnCache(tiny.config, page_budget=1, num_sink_pages=1, num_recent_pages=1)
    with pytest.raises(ValueError, match="page_size"):
        TinyAttnCache(tiny.config, page_size=0)
    c = cache(tiny, page_budget=4)
    with torch.no_grad():
        tiny(ids, cache=c, use_cache=True)
        with pytest.raises(ValueError, match="batch size changed"):
            tiny(torch.cat([ids, ids]), cache=c, use_cache=True)
    k = torch.zeros(1, tiny.config.num_key_value_heads, 1, tiny.config.hidden_size // tiny.config.num_attention_heads)
    with pytest.raises(ValueError, match="layer_idx"):          # a bool is no layer index (True is not layer 1)
        c.update(k, k, True)


def test_past_key_values_alias_and_multi_turn_continuation():
    """The brief's spelling (past_key_values=) works, and a second generate() call continues the cache."""
    tiny, stock = models("llama")
    ids, mask = left_pad([prompt(7, 1), prompt(12, 2)])
    c = cache(tiny, page_budget=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)      # transformers 5.x: "use `cache` instead"
        first = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                              eos_token_id=None, past_key_values=c)
    assert c.get_seq_length() == ids.shape[1] + 2
    more = torch.tensor([[5, 6, 7], [8, 9, 10]])
    ids2 = torch.cat([first, more], 1)
    mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=torch.long)], 1)
    out = generate(tiny, ids2, mask2, max_new_tokens=4, cache=c)      # prefill of 4 tokens into a full cache
    ref = generate(stock, ids2, mask2, max_new_tokens=4)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < TOL


def test_mistral_sliding_window_beyond_the_window_equals_stock():
    """Every Mistral layer slides (window 8): rows past the window attend to its last 8 tokens, as stock."""
    cfg = _config("mistral")
    cfg.sliding_window = 8
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    tiny = copy.deepcopy(stock)
    tiny.set_attn_implementation("tinyattn")
    ids = prompt(11, 1)
    ref = generate(stock, ids, max_new_tokens=9)
    out = generate(tiny, ids, max_new_tokens=9, cache=cache(tiny))
    assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out, ref) < TOL


# -------------------------------------------------------------------- hybrid models: sliding-window + NoPE layers
def hybrid_models(layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
                  no_rope_layers=(1, 0, 1, 1), window=5, attn="sdpa"):
    """(tinyattn, stock) SmolLM3 models with identical weights: per-layer windows and NoPE layers, as
    tinyattn.integrations.convert writes a hybrid tinyattn model."""
    cfg = transformers.SmolLM3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=256, layer_types=list(layer_types),
                                     use_sliding_window=True, sliding_window=window,
                                     no_rope_layers=list(no_rope_layers), initializer_range=0.3, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    tiny = copy.deepcopy(stock)
    tiny.set_attn_implementation("tinyattn")
    return tiny, stock


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hybrid_dense_equals_stock_past_the_window(attn):
    """Prefill of 13 tokens, then 12 decode steps (window 5, pages of 4): every step equals stock attention."""
    tiny, stock = hybrid_models(attn=attn)
    ids = prompt(13, seed=3)
    ref = generate(stock, ids, max_new_tokens=12)
    out = generate(tiny, ids, max_new_tokens=12, cache=cache(tiny))
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < TOL


def test_hybrid_left_padded_batch_and_a_continued_cache_equal_stock():
    """Left padding under a sliding mask, then a second generate on the same cache: a prefill of several tokens
    into a non-empty cache, windowed through the paged op."""
    tiny, stock = hybrid_models()
    ids, mask = left_pad([prompt(9, 4), prompt(4, 5)])
    c = cache(tiny)
    first = generate(tiny, ids, mask, max_new_tokens=5, cache=c)
    assert torch.equal(first.sequences, generate(stock, ids, mask, max_new_tokens=5).sequences)
    ids2 = torch.cat([first.sequences, torch.tensor([[5, 6, 7], [8, 9, 10]])], 1)
    mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=torch.long)], 1)
    out = generate(tiny, ids2, mask2, max_new_tokens=6, cache=c)
    ref = generate(stock, ids2, mask2, max_new_tokens=6)
    assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out, ref) < TOL


def test_sliding_layers_ignore_the_page_budget():
    """Sliding layers attend densely inside their window whatever the budget: a model that slides in every layer
    decodes with a 2-page budget exactly as stock (if the budget applied, Quest would drop pages of the window);
    with a full-attention NoPE layer, the budget does act (on that layer)."""
    tiny, stock = hybrid_models(layer_types=("sliding_attention",) * 3, no_rope_layers=(1, 1, 1), window=7)
    ids = prompt(30, seed=6)
    ref = generate(stock, ids, max_new_tokens=8)
    out = generate(tiny, ids, max_new_tokens=8, cache=cache(tiny, page_budget=2))
    assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out, ref) < TOL
    tiny, stock = hybrid_models()
    ref = generate(stock, ids, max_new_tokens=8)
    sparse = generate(tiny, ids, max_new_tokens=8, cache=cache(tiny, page_budget=2))
    assert all(torch.isfinite(x).all() for x in sparse.logits)
    assert max_logit_diff(sparse, ref) > 1e-3


def test_triton_backend_short():
    """The same sparse decode through the Triton kernels (interpreter on CPU) and the torch backend."""
    pytest.importorskip("triton")
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on a CPU machine")
    tiny, _ = models("llama")
    ids = prompt(9, 11)
    ref = generate(tiny, ids, max_new_tokens=3, cache=cache(tiny, page_budget=2, backend="torch"))
    out = generate(tiny, ids, max_new_tokens=3, cache=cache(tiny, page_budget=2, backend="triton"))
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < TOL


def test_triton_backend_hybrid_short():
    """A hybrid's sliding layers (window 5) and sparse NoPE layer through the Triton kernels (interpreter on CPU):
    the torch backend's tokens and logits."""
    pytest.importorskip("triton")
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on a CPU machine")
    tiny, _ = hybrid_models()
    ids = prompt(10, 12)
    ref = generate(tiny, ids, max_new_tokens=3, cache=cache(tiny, page_budget=2, backend="torch"))
    out = generate(tiny, ids, max_new_tokens=3, cache=cache(tiny, page_budget=2, backend="triton"))
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) < TOL


def test_reusing_a_cache_for_a_smaller_batch_raises_a_clear_error():
    """generate() with a cache of a bigger batch used to fail inside transformers (a reshape of 0 new tokens): it
    raises tinyattn's error instead; direct forward calls raise the documented batch-size error."""
    tiny, _ = models("llama")
    ids, mask = left_pad([prompt(7, 1), prompt(12, 2)])
    c = cache(tiny, page_budget=4)
    with torch.no_grad():
        generate(tiny, ids, mask, max_new_tokens=2, cache=c)
        with pytest.raises(ValueError, match="TinyAttnCache: no new token .* batch of 2 rows"):
            generate(tiny, prompt(6, 1), max_new_tokens=2, cache=c)              # smaller batch, shorter input
        with pytest.raises(ValueError, match="batch size changed from 2 to 1"):
            generate(tiny, prompt(20, 3), max_new_tokens=2, cache=c)             # smaller batch, longer input
        with pytest.raises(ValueError, match="batch size changed from 2 to 1"):
            tiny(prompt(6, 1)[None], cache=c, use_cache=True)


# -------------------------------------------------------------------- KV formats (int8, fp8, bf16 pools)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8_e4m3"])
def test_kv_cache_dtype_stays_near_stock(fmt):
    """The pool in another format: the decode logits stay near stock attention's (dense and with a budget), the
    pool holds the format, beam search (fork) and crop keep working, and to_dense dequantizes."""
    from tinyattn.ops import quant

    tiny, stock = models("llama")
    ids = prompt(21, seed=5)
    ref = generate(stock, ids, max_new_tokens=6)
    c = cache(tiny, kv_cache_dtype=fmt)
    out = generate(tiny, ids, max_new_tokens=6, cache=c)
    assert c.pool.kv_cache_dtype == fmt and c.pool.k_cache[0].dtype == quant.storage_dtype(
        fmt, torch.float32)
    scale = max(x.abs().max().item() for x in ref.logits)
    assert max_logit_diff(out, ref) < {"bf16": 0.02, "int8": 0.03, "fp8_e4m3": 0.25}[fmt] * scale   # random weights, D = 8
    keys, values = c.to_dense(0)
    assert keys.dtype == (torch.bfloat16 if fmt == "bf16" else torch.float32) and keys.shape[2] == 21 + 6 - 1
    sparse = generate(tiny, ids, max_new_tokens=6, cache=cache(tiny, page_budget=2, kv_cache_dtype=fmt))
    assert all(torch.isfinite(x).all() for x in sparse.logits)
    beams = generate(tiny, ids, max_new_tokens=4, num_beams=2, cache=cache(tiny, page_budget=3, kv_cache_dtype=fmt))
    assert all(torch.isfinite(x).all() for x in beams.logits)


def test_kv_cache_dtype_unknown_is_a_value_error():
    tiny, _ = models("llama")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \('auto', 'fp16', 'bf16', 'int8', "
                                         r"'fp8_e4m3'\), got 'e4m3'"):
        TinyAttnCache(tiny.config, kv_cache_dtype="e4m3")
