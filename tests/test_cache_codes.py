"""PagedKVCache(key_codes=True): the 4-bit key codes of issue 35's second stage (docs/design_rerank.md §3), kept by
the cache and read by the re-ranked selection of PagedAttention.

Proven here, on both write backends (``triton`` under TRITON_INTERPRET=1) and float, bf16-box and int8 caches: after
a prefill and token-by-token decode writes, every full page's codes equal the reference encoder's over the cache's
own pool and boxes, and a partial page is not coded until the write that fills it; a truncation into a full page
re-opens it and the write that fills it again codes the new keys; ``fork``, ``copy_pages`` and ``resize`` carry the
codes with the pages; ``kv_bytes`` counts them. ``PagedAttention`` with ``SparsityConfig(rerank="int4")`` over the
cache equals ``sparse_paged_attention(..., rerank="int4", k_code=...)`` of the same inputs, on its fused path and
on the metrics path (which selects op by op), and both attend the same pages. The rule itself (codes, mass,
selection) against the loop references: tests/ops/test_rerank.py.
"""
import pytest
import torch

import tinyattn
from tinyattn import PagedKVCache
from tinyattn import reference as R
from tinyattn.layer import PagedAttention, SparsityConfig
from tinyattn.selection import SelectionMetrics

from paged_problems import SLOW_TRITON

POISON = 0xA5                   # the codes' bytes before any write: a page never coded keeps them
KINDS = {"fp32": dict(), "bf16-boxes": dict(box_dtype="bf16"), "int8": dict(kv_cache_dtype="int8")}


def _cache(kind="fp32", *, num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=24):
    cache = PagedKVCache(num_layers, num_kv_heads, head_dim, page_size=page_size, num_pages=num_pages,
                         key_codes=True, **KINDS[kind])
    for code in cache.k_code:
        code.fill_(POISON)
    return cache


def _write(cache, seq_ids, counts, gen, backend, shift=0.0):
    """Extend ``seq_ids`` by ``counts`` tokens and write random keys (``+ shift``) and values in every layer."""
    slots = cache.extend(seq_ids, counts)
    for layer in range(cache.num_layers):
        k = torch.randn(len(slots), cache.num_kv_heads, cache.head_dim, generator=gen) * 2 + shift
        v = torch.randn(len(slots), cache.num_kv_heads, cache.head_dim, generator=gen)
        cache.write(layer, slots, k, v, backend=backend)
    return slots


def _reference_codes(cache, layer, pages):
    """``[len(pages), page_size, Hkv, D/2]``: the reference encoder over ``pages`` (their last slots) from the
    cache's pool, boxes and scales as they are now."""
    S = cache.page_size
    out = torch.zeros_like(cache.k_code[layer])
    slots = torch.tensor([p * S + S - 1 for p in pages], dtype=torch.int64)
    R.encode_key_codes(cache.k_cache[layer], slots, cache.k_min[layer], cache.k_max[layer], out,
                       k_scale=cache.k_scale[layer] if cache.quantized else None)
    return out[pages]


def _full_and_partial(cache, seq):
    """``(full pages, the partial last page or None)`` of ``seq``, physical ids."""
    n, pages = cache.length(seq), cache.pages(seq)
    full = pages[: n // cache.page_size]
    return full, (pages[-1] if n % cache.page_size else None)


def _check_codes(cache, seq_ids, never_filled=()):
    """Every full page's codes are the reference's; the pages of ``never_filled`` still hold the poison."""
    for layer in range(cache.num_layers):
        for seq in seq_ids:
            full, _ = _full_and_partial(cache, seq)
            if full:
                assert torch.equal(cache.k_code[layer][full], _reference_codes(cache, layer, full)), (layer, seq)
        for page in never_filled:
            assert bool((cache.k_code[layer][page] == POISON).all()), (layer, page)


@pytest.mark.parametrize("backend", SLOW_TRITON)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_full_pages_hold_the_reference_codes_after_prefill_and_decode(backend, kind):
    gen = torch.Generator().manual_seed(0)
    cache = _cache(kind)
    a, b = cache.add_sequence(), cache.add_sequence()
    _write(cache, [a, b], [13, 7], gen, backend)                       # a: 3 full pages + 1; b: 1 full + 3
    partial = [_full_and_partial(cache, s)[1] for s in (a, b)]
    _check_codes(cache, [a, b], never_filled=partial)
    filled = set()
    for _ in range(6):                                                 # decode, token by token
        _write(cache, [a, b], 1, gen, backend)
        for s in (a, b):
            if cache.length(s) % cache.page_size == 0:
                filled.add(cache.pages(s)[-1])
        open_pages = [p for p in (_full_and_partial(cache, s)[1] for s in (a, b)) if p is not None]
        _check_codes(cache, [a, b], never_filled=open_pages)
    # a's page 3 fills at 16 tokens; b's page 1 at 8 and the page after it at 12
    assert filled == {partial[0], partial[1], cache.pages(b)[2]}
    assert all(not bool((cache.k_code[0][p] == POISON).all()) for p in filled)


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_a_truncated_page_is_coded_again_when_it_fills(backend):
    gen = torch.Generator().manual_seed(1)
    cache = _cache()
    a = cache.add_sequence()
    _write(cache, [a], 13, gen, backend)
    page0, page1 = cache.pages(a)[:2]
    before = [code.clone() for code in cache.k_code]
    cache.truncate(a, 6)                                               # page 1 holds 2 of its 4 tokens again
    _write(cache, [a], 1, gen, backend, shift=5.0)
    for layer in range(2):                                             # not full yet: the old codes, untouched
        assert torch.equal(cache.k_code[layer][page1], before[layer][page1])
    _write(cache, [a], 1, gen, backend, shift=5.0)                     # fills page 1 with other keys
    _check_codes(cache, [a])
    for layer in range(2):
        assert torch.equal(cache.k_code[layer][page0], before[layer][page0])
        assert not torch.equal(cache.k_code[layer][page1], before[layer][page1])
    # the freed pages go to another sequence, and are coded with its keys when it fills them
    b = cache.add_sequence()
    _write(cache, [b], 9, gen, backend, shift=-3.0)
    _check_codes(cache, [a, b])


@pytest.mark.parametrize("backend", SLOW_TRITON)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_overwriting_a_slot_of_a_full_page_codes_the_page_again(backend, kind):
    """``write`` may overwrite a slot (its docstring): in a full page the new key grows the box every code of the
    page is relative to, so the whole page is coded again (it was not: stale codes, found by a fault hunt); a
    partial page is still left for the write that fills it."""
    gen = torch.Generator().manual_seed(11)
    cache = _cache(kind)
    seq = cache.add_sequence()
    slots = _write(cache, [seq], 10, gen, backend)                   # pages 0, 1 full; page 2 holds 2 tokens
    full, partial = _full_and_partial(cache, seq)
    for layer in range(cache.num_layers):
        k = torch.full((2, cache.num_kv_heads, cache.head_dim), 9.0)
        k[1] = -9.0
        before = cache.k_code[layer][partial].clone()
        cache.write(layer, slots[[1, 9]], k, torch.randn(2, cache.num_kv_heads, cache.head_dim, generator=gen),
                    backend=backend)                                   # slot 1 of page 0, slot 1 of partial page 2
        assert torch.equal(cache.k_code[layer][full], _reference_codes(cache, layer, full))
        assert torch.equal(cache.k_code[layer][partial], before)       # never coded before it fills
        assert bool((cache.k_code[layer][full[0], 1] != 0).any())       # the new key's codes, at the box's top


def test_fork_copy_pages_and_resize_carry_the_codes():
    gen = torch.Generator().manual_seed(2)
    cache = _cache(num_pages=16)
    a = cache.add_sequence()
    _write(cache, [a], 13, gen, "torch")
    full_a, _ = _full_and_partial(cache, a)
    codes_a = [code[full_a].clone() for code in cache.k_code]
    whole = cache.fork(a)                                              # pages of its own, codes copied
    full_w, _ = _full_and_partial(cache, whole)
    assert set(full_w).isdisjoint(full_a)
    for layer in range(2):
        assert torch.equal(cache.k_code[layer][full_w], codes_a[layer])
    part = cache.fork(a, 6)                                            # ends inside a's full page 1
    _write(cache, [part], 2, gen, "torch", shift=4.0)                  # fills its copy with other keys
    _check_codes(cache, [a, whole, part])
    for layer in range(2):
        assert torch.equal(cache.k_code[layer][cache.pages(part)[0]], codes_a[layer][0])
        assert not torch.equal(cache.k_code[layer][cache.pages(part)[1]], codes_a[layer][1])
        assert torch.equal(cache.k_code[layer][full_a], codes_a[layer])     # the source is untouched
    # copy_pages: one for one, every layer
    used = {p for s in (a, whole, part) for p in cache.pages(s)}
    free = [p for p in range(cache.num_pages) if p not in used]
    cache.copy_pages(full_a, free[:3])
    for layer in range(2):
        assert torch.equal(cache.k_code[layer][free[:3]], codes_a[layer])
    # resize: grown and shrunk, the pages in use keep their codes; new pages hold none
    snapshot = [code.clone() for code in cache.k_code]
    used = sorted(used)
    cache.resize(40)
    assert all(code.shape == (40, 4, 2, 4) and code.dtype == torch.uint8 for code in cache.k_code)
    for layer in range(2):
        assert torch.equal(cache.k_code[layer][used], snapshot[layer][used])
        assert bool((cache.k_code[layer][16:] == 0).all())
    cache.resize(max(used) + 1)
    for layer in range(2):
        assert torch.equal(cache.k_code[layer][used], snapshot[layer][used])
    _write(cache, [whole], 3, gen, "torch")                            # fills whole's last page after the resize
    _check_codes(cache, [a, whole, part])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kv_bytes_count_the_codes(kind):
    L, Hkv, D, S, P = 3, 2, 16, 8, 10
    coded = PagedKVCache(L, Hkv, D, page_size=S, num_pages=P, key_codes=True, **KINDS[kind])
    plain = PagedKVCache(L, Hkv, D, page_size=S, num_pages=P, **KINDS[kind])
    assert coded.kv_bytes - plain.kv_bytes == L * P * S * Hkv * D // 2          # one byte per two channels
    assert plain.k_code == [] and len(coded.k_code) == L


def test_bad_key_code_settings_are_named():
    with pytest.raises(ValueError, match="key_codes"):
        PagedKVCache(1, 2, 8, page_size=4, num_pages=4, key_codes=True, page_boxes=False)
    with pytest.raises(ValueError, match="key_codes"):
        PagedKVCache(1, 2, 7, page_size=4, num_pages=4, key_codes=True)
    with pytest.raises(ValueError, match="rerank"):
        SparsityConfig(page_budget=4, policy="streaming", rerank="int4")
    with pytest.raises(ValueError, match="rerank"):
        SparsityConfig(page_budget=4, rerank="int8")
    with pytest.raises(ValueError, match="candidates"):
        SparsityConfig(page_budget=4, rerank="int4", candidates=0.5)
    with pytest.raises(TypeError, match="candidates"):
        SparsityConfig(page_budget=4, rerank="int4", candidates="2")


# ---- the layer over the cache --------------------------------------------------------------------------------------
class _Recording(SelectionMetrics):
    """SelectionMetrics that also keeps the pages each sparse layer attended."""

    def __init__(self):
        super().__init__()
        self.pages = {}

    def record(self, ctx, page_indices):
        self.pages[ctx.layer] = page_indices.clone()
        super().record(ctx, page_indices)


def _as_sets(pages, seq_lens, page_size):
    out = []
    for b in range(pages.shape[0]):
        n = -(-int(seq_lens[b]) // page_size)
        out.append([{int(j) for j in pages[b, h].tolist() if 0 <= j < n} for h in range(pages.shape[1])])
    return out


@pytest.mark.parametrize("backend, top_p", [("torch", None), ("torch", 0.6),
                                            pytest.param("triton", 0.6, marks=pytest.mark.slow)])
def test_paged_attention_with_rerank_over_the_cache(backend, top_p):
    gen = torch.Generator().manual_seed(3)
    cache = _cache(num_pages=40)
    ids = [cache.add_sequence() for _ in range(3)]
    _write(cache, ids, [45, 30, 58], gen, "torch")                     # prefill
    _write(cache, ids, 1, gen, "torch")                                # this decode step's tokens
    table, lens = cache.block_table(ids), cache.seq_lens(ids)
    cfg = SparsityConfig(page_budget=4, num_sink_pages=1, rerank="int4", candidates=2.0, top_p=top_p)
    fused = PagedAttention(cfg, backend=backend)
    metrics = _Recording()
    op_by_op = PagedAttention(cfg, backend=backend, metrics=metrics)
    for attn in (fused, op_by_op):
        attn.begin(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, decode=True)
    assert fused.plan.selects
    differs = []
    for layer in range(cache.num_layers):
        q = torch.randn(3, 4, 8, generator=gen) * 2
        layer_args = (q, cache.k_cache[layer], cache.v_cache[layer], cache.k_min[layer], cache.k_max[layer])
        want = tinyattn.sparse_paged_attention(
            q, cache.k_cache[layer], cache.v_cache[layer], table, lens, k_min=cache.k_min[layer],
            k_max=cache.k_max[layer], page_budget=4, num_sink_pages=1, gamma=cfg.gamma, top_p=top_p, rerank="int4",
            candidates=2.0, k_code=cache.k_code[layer], backend=backend)
        got = fused(layer, *layer_args, k_code=cache.k_code[layer])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        chosen = _as_sets(fused.plan.last_selection, lens, 4)
        got = op_by_op(layer, *layer_args, k_code=cache.k_code[layer])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert _as_sets(metrics.pages[layer], lens, 4) == chosen
        if top_p is not None:
            assert any(len(s) < 4 for row in chosen for s in row)     # top-p pruned some (row, KV head)
        plain = tinyattn.sparse_paged_attention(
            q, cache.k_cache[layer], cache.v_cache[layer], table, lens, k_min=cache.k_min[layer],
            k_max=cache.k_max[layer], page_budget=4, num_sink_pages=1, gamma=cfg.gamma, top_p=top_p, backend=backend)
        differs.append(not torch.allclose(plain, want, atol=1e-4))
    assert any(differs)                 # the re-rank changed the pages somewhere: the comparison can tell
    # a config with rerank needs the codes
    fused.begin(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, decode=True)
    with pytest.raises((TypeError, ValueError), match="k_code"):
        fused(0, q, cache.k_cache[0], cache.v_cache[0], cache.k_min[0], cache.k_max[0])


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_prefill_steps_and_dense_layers_read_no_codes(backend):
    """With ``rerank`` set, a prefill step (every layer dense) and the leading ``dense_layers`` of a decode step
    attend densely whatever ``k_code`` is passed; the sparse layers re-rank."""
    gen = torch.Generator().manual_seed(4)
    cache = _cache(num_layers=2, num_pages=40)
    ids = [cache.add_sequence() for _ in range(2)]
    _write(cache, ids, [41, 35], gen, "torch")
    cfg = SparsityConfig(page_budget=4, dense_layers=1, rerank="int4", candidates=2.0)
    attn = PagedAttention(cfg, backend=backend)
    _write(cache, ids, 3, gen, "torch")                                # a prefill chunk of 3 tokens
    table, lens = cache.block_table(ids), cache.seq_lens(ids)
    attn.begin(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, num_query_tokens=3)
    for layer in range(2):
        q = torch.randn(2, 3, 4, 8, generator=gen)
        args = (q, cache.k_cache[layer], cache.v_cache[layer])
        got = attn(layer, *args, cache.k_min[layer], cache.k_max[layer], k_code=cache.k_code[layer])
        torch.testing.assert_close(got, tinyattn.paged_attention(*args, table, lens, backend=backend), atol=1e-6,
                                   rtol=1e-6)
    _write(cache, ids, 1, gen, "torch")                                # a decode step
    table, lens = cache.block_table(ids), cache.seq_lens(ids)
    attn.begin(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, decode=True)
    for layer in range(2):
        q = torch.randn(2, 4, 8, generator=gen)
        args = (q, cache.k_cache[layer], cache.v_cache[layer])
        got = attn(layer, *args, cache.k_min[layer], cache.k_max[layer], k_code=cache.k_code[layer])
        if layer == 0:
            want = tinyattn.paged_attention(*args, table, lens, backend=backend)
        else:
            want = tinyattn.sparse_paged_attention(*args, table, lens, k_min=cache.k_min[layer],
                                                   k_max=cache.k_max[layer], page_budget=4, gamma=cfg.gamma,
                                                   rerank="int4", candidates=2.0, k_code=cache.k_code[layer],
                                                   backend=backend)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
