"""int8 / fp8 page scales after every operation that removes tokens (issue 28, item 1; kvcached#362's case).

A quantized page's scale must fit what the page holds after truncate, ``TinyAttnCache.crop``, ``drop_pages`` and
the engine's recompute: the expected values are an independent quantize-dequantize of the kept tokens written here
with plain torch math (the rule of :mod:`tinyattn.ops.quant`: int8 ``scale = absmax / 127``, round to nearest;
fp8 e4m3 ``absmax / 448`` on a fresh page, scales moved by powers of two), never read from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from tinyattn.cache import PagedKVCache

FORMATS = ["int8", "fp8_e4m3"]
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


def stored(c, seq, layer=0):
    """(keys, values) the cache holds for ``seq`` as attention reads them: ``code.float() * scale``, [n, Hkv, D]."""
    n, out = c.length(seq), []
    for pool, scale in ((c.k_cache[layer], c.k_scale[layer]), (c.v_cache[layer], c.v_scale[layer])):
        rows = [pool[p].float() * scale[p][None, :, None] for p in c.pages(seq)]
        out.append(torch.cat(rows)[:n])
    return out


def qdq(x, fmt, scale=None):
    """Plain-torch quantize-dequantize of ``x`` [n, Hkv, D] with one scale per head (default: a fresh page's)."""
    if scale is None:
        scale = x.abs().amax(dim=(0, 2)) / QMAX[fmt]
    s = scale[None, :, None]
    y = x / s.clamp_min(torch.finfo(torch.float32).tiny)
    if fmt == "int8":
        y = y.round().clamp(-127, 127)
    else:
        y = y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return y * s, scale


def expected_after_cut(kept, old_scale, fmt):
    """The kept tokens of a cut page, re-quantized as tinyattn's rule says: int8 as a fresh page would
    (``absmax / 127``); fp8 by the largest power-of-two shrink of the old scale that still holds them."""
    if fmt == "int8":
        return qdq(kept, fmt)
    absmax = kept.abs().amax(dim=(0, 2))
    shrink = 2.0 ** torch.floor(torch.log2(448 * old_scale / absmax)).clamp_min(0)
    return qdq(kept, fmt, old_scale / shrink)


def check_fits(c, seq, layers=None):
    """Every page of ``seq`` holds a scale that fits its tokens: int8 ``absmax / 127`` (so quantizing the
    held values afresh gives them back), fp8 at least ``absmax / 448`` and below twice it (powers of two), up to
    e4m3's rounding of the largest held value (half a spacing, ``2**-4`` relative)."""
    S = c.page_size
    for layer in range(c.num_layers) if layers is None else layers:
        for x, scales in zip(stored(c, seq, layer), (c.k_scale[layer], c.v_scale[layer])):
            for j, p in enumerate(c.pages(seq)):
                if p < 0:
                    continue
                tile = x[j * S:(j + 1) * S]
                absmax = tile.abs().amax(dim=(0, 2))
                fresh = absmax / QMAX[c.kv_cache_dtype]
                if c.kv_cache_dtype == "int8":
                    torch.testing.assert_close(scales[p], fresh, rtol=1e-6, atol=0)
                    again, _ = qdq(tile, "int8")
                    torch.testing.assert_close(again, tile, rtol=1e-5, atol=1e-7)
                else:
                    assert (scales[p] >= fresh * (1 - 1e-6)).all() and (scales[p] < 2 * fresh / (1 - 2**-4)).all(), \
                        (layer, j, scales[p], fresh)


def _rollback_cache(fmt, blowup, seed=0):
    """One layer, page_size 8: 5 ordinary tokens, then 3 tokens ``blowup`` x larger in the same page."""
    g = torch.Generator().manual_seed(seed)
    Hkv, D = 2, 16
    c = PagedKVCache(1, Hkv, D, page_size=8, num_pages=4, kv_cache_dtype=fmt)
    seq = c.add_sequence()
    k, v = torch.randn(8, Hkv, D, generator=g), torch.randn(8, Hkv, D, generator=g)
    k[5:] *= blowup
    v[5:] *= blowup
    c.write(0, c.extend([seq], 5), k[:5], v[:5])
    c.write(0, c.extend([seq], 3), k[5:], v[5:])
    new = torch.randn(3, Hkv, D, generator=g), torch.randn(3, Hkv, D, generator=g)
    return c, seq, new


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("blowup", [100.0, 4.0])
def test_truncate_refits_the_scale_of_the_cut_page(fmt, blowup):
    """kvcached#362: cut tokens ``blowup`` x larger than the kept ones. After truncate the page equals an
    independent quantize-dequantize of the kept tokens, and new tokens written after the rollback have a
    round-trip error within 1.5x of the same tokens written into a fresh page."""
    c, seq, (k_new, v_new) = _rollback_cache(fmt, blowup)
    before = stored(c, seq)
    old_scales = c.k_scale[0][c.pages(seq)[0]].clone(), c.v_scale[0][c.pages(seq)[0]].clone()
    c.truncate(seq, 5)
    page = c.pages(seq)[0]
    for x, x_old, scale, old in zip(stored(c, seq), before, (c.k_scale[0], c.v_scale[0]), old_scales):
        want, want_scale = expected_after_cut(x_old[:5], old, fmt)
        torch.testing.assert_close(scale[page], want_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(c.k_min[0][page], stored(c, seq)[0].amin(0))      # the box: of the refit keys
    assert torch.equal(c.k_max[0][page], stored(c, seq)[0].amax(0))
    c.write(0, c.extend([seq], 3), k_new, v_new)
    check_fits(c, seq)
    # a fresh page given the same kept values, then the same new tokens
    fresh = PagedKVCache(1, 2, 16, page_size=8, num_pages=4, kv_cache_dtype=fmt)
    f = fresh.add_sequence()
    kept = stored(c, seq)
    fresh.write(0, fresh.extend([f], 5), kept[0][:5], kept[1][:5])
    fresh.write(0, fresh.extend([f], 3), k_new, v_new)
    for got, ref, x in zip(stored(c, seq), stored(fresh, f), (k_new, v_new)):
        err, err_fresh = (got[5:] - x).abs().mean(), (ref[5:] - x).abs().mean()
        assert err <= 1.5 * err_fresh, (float(err), float(err_fresh))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fork_inside_a_page_refits_the_copy_and_leaves_the_source(fmt):
    """fork(seq, n) ending inside a page runs the same refit on the copy; the source page keeps its codes."""
    c, seq, _ = _rollback_cache(fmt, 100.0)
    before = stored(c, seq)
    old = c.k_scale[0][c.pages(seq)[0]].clone(), c.v_scale[0][c.pages(seq)[0]].clone()
    b = c.fork(seq, 5)
    for x, x_old, o in zip(stored(c, b), before, old):
        torch.testing.assert_close(x, expected_after_cut(x_old[:5], o, fmt)[0], rtol=1e-6, atol=1e-7)
    for x, x_old in zip(stored(c, seq), before):
        assert torch.equal(x, x_old)


@pytest.mark.parametrize("fmt", FORMATS)
def test_drop_pages_then_reuse_starts_a_fresh_scale(fmt):
    """A dropped page that held huge tokens goes back to the pool; the page that next receives tokens (the same
    physical page, the allocator is a stack) quantizes them as a fresh page would."""
    g = torch.Generator().manual_seed(3)
    c = PagedKVCache(2, 2, 16, page_size=4, num_pages=3, kv_cache_dtype=fmt)
    seq = c.add_sequence()
    x = torch.randn(12, 2, 16, generator=g)
    x[:4] *= 100.0
    slots = c.extend([seq], 12)
    for layer in range(2):
        c.write(layer, slots, x, -x)
    big = c.pages(seq)[0]
    c.drop_pages(seq, [0])
    new = torch.randn(3, 2, 16, generator=g)
    slots = c.extend([seq], 3)
    assert c.pages(seq)[-1] == big                           # the dropped page is reused
    for layer in range(2):
        c.write(layer, slots, new, 2 * new)
        k, v = stored(c, seq, layer)
        torch.testing.assert_close(k[12:], qdq(new, fmt)[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v[12:], qdq(2 * new, fmt)[0], rtol=1e-6, atol=1e-7)
    check_fits(c, seq)


@pytest.mark.parametrize("fmt", FORMATS)
def test_hf_crop_refits_the_scales(fmt):
    """``TinyAttnCache.crop`` (speculative decoding's rollback in transformers): every layer's cut page equals
    an independent re-quantization of its kept tokens, and a forward after the crop leaves scales that fit."""
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("tinyattn.integrations.hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=36, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="tinyattn").eval()
    cache = hf.TinyAttnCache(model.config, page_size=16, kv_cache_dtype=fmt, backend="torch")
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    pool, seq = cache.pool, cache._seq_ids[0]
    page = pool.pages(seq)[1]
    before = [stored(pool, seq, layer) for layer in range(2)]
    old = [(pool.k_scale[layer][page].clone(), pool.v_scale[layer][page].clone()) for layer in range(2)]
    cache.crop(-10)                                          # 20 kept: page 1 keeps 4 of its 14 tokens
    assert pool.length(seq) == 20
    for layer in range(2):
        for x, x_old, o in zip(stored(pool, seq, layer), before[layer], old[layer]):
            want, _ = expected_after_cut(x_old[16:20], o, fmt)
            torch.testing.assert_close(x[16:20], want, rtol=1e-6, atol=1e-7)
            assert torch.equal(x[:16], x_old[:16])           # the full page is untouched
    check_fits(pool, seq)
    with torch.no_grad():
        model(ids[:, 20:23], cache=cache, use_cache=True)
    check_fits(pool, seq)


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_recompute_leaves_scales_that_fit(fmt):
    """The engine under preemption (its recompute frees a request's pages and rebuilds them later): after every
    step, every page of every live request holds a scale that fits its tokens."""
    from tinyattn.engine import Engine, SamplingParams
    from tinyattn.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(dim=32, hidden_dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=256))
    engine = Engine(model, page_size=8, num_pages=10, page_budget=2, backend="torch", kv_cache_dtype=fmt)
    g = torch.Generator().manual_seed(0)
    for n in (9, 13, 17, 6):
        engine.add_request(torch.randint(1, 64, (n,), generator=g).tolist(), SamplingParams(20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.cache.sequences:
            check_fits(engine.cache, seq)
    assert engine.stats.preemptions >= 1
