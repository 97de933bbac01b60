"""PagedKVCache: allocation, all-or-nothing extend, freeing, incremental bounding boxes vs a full recompute."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn.cache import CacheFullError, PagedKVCache
from tinyattn import reference


def fill(cache, seq_ids, counts, gen):
    slots = cache.extend(seq_ids, counts)
    for layer in range(cache.num_layers):
        k = torch.randn(len(slots), cache.num_kv_heads, cache.head_dim, generator=gen)
        cache.write(layer, slots, k, k + 1)
    return slots


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=6),
       st.sampled_from([1, 2, 4, 8]))
def test_incremental_bounds_equal_a_full_recompute(steps, page_size):
    """Appending tokens step by step keeps exactly the boxes update_page_metadata recomputes."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(2, 2, 8, page_size=page_size, num_pages=200)
    ids = [cache.add_sequence() for _ in range(3)]
    for counts in steps:
        fill(cache, ids[: len(counts)], counts, gen)
    table, lens = cache.block_table(ids), cache.seq_lens(ids)
    for layer in range(2):
        k_min = torch.zeros_like(cache.k_min[layer])
        k_max = torch.zeros_like(cache.k_max[layer])
        reference.update_page_metadata(cache.k_cache[layer], table, lens, k_min, k_max)
        used = torch.cat([torch.tensor(cache.pages(s), dtype=torch.long) for s in ids])
        assert torch.equal(cache.k_min[layer][used], k_min[used])
        assert torch.equal(cache.k_max[layer][used], k_max[used])


def test_written_tokens_are_read_back_in_order_through_the_block_table():
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(1, 1, 4, page_size=4, num_pages=10)
    a, b = cache.add_sequence(), cache.add_sequence()
    chunks = {a: [], b: []}
    for counts in ([3, 5], [2, 0], [1, 4]):
        slots = cache.extend([a, b], counts)
        k = torch.randn(len(slots), 1, 4, generator=gen)
        cache.write(0, slots, k, -k)
        chunks[a].append(k[: counts[0]])
        chunks[b].append(k[counts[0]:])
    for seq in (a, b):
        expected = torch.cat(chunks[seq])
        pages = cache.pages(seq)
        got = torch.stack([cache.k_cache[0][pages[t // 4], t % 4] for t in range(cache.length(seq))])
        assert torch.equal(got, expected)
    assert cache.seq_lens([a, b]).tolist() == [6, 9]


def test_out_of_pages_raises_and_leaves_every_sequence_intact():
    cache = PagedKVCache(1, 1, 4, page_size=4, num_pages=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    fill(cache, [a, b], [5, 3], torch.Generator().manual_seed(2))
    before = (cache.block_table([a, b]).clone(), cache.seq_lens([a, b]).clone(), cache.num_free_pages)
    with pytest.raises(CacheFullError, match="out of pages: the request needs 3 new pages, 1 of 4 are free"):
        cache.extend([a, b], [4, 6])
    assert torch.equal(cache.block_table([a, b]), before[0])
    assert torch.equal(cache.seq_lens([a, b]), before[1])
    assert cache.num_free_pages == before[2]


def test_free_returns_pages_and_reused_pages_start_with_an_empty_box():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 1, 4, page_size=2, num_pages=3)
    a = cache.add_sequence()
    fill(cache, [a], [6], gen)
    assert cache.num_free_pages == 0
    cache.free(a)
    assert cache.num_free_pages == 3
    b = cache.add_sequence()
    slots = cache.extend([b], 1)
    k = torch.full((1, 1, 4), 0.5)
    cache.write(0, slots, k, k)
    page = cache.pages(b)[0]
    assert torch.equal(cache.k_min[0][page], k[0]) and torch.equal(cache.k_max[0][page], k[0])
    with pytest.raises(ValueError, match="seq_id: expected one of the live sequences"):
        cache.free(a)


def test_cache_feeds_the_ops_and_sparse_equals_dense_with_a_covering_budget():
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(1, 2, 16, page_size=4, num_pages=32)
    ids = [cache.add_sequence() for _ in range(3)]
    fill(cache, ids, [13, 1, 22], gen)
    q = torch.randn(3, 4, 16, generator=gen)
    args = (q, cache.k_cache[0], cache.v_cache[0], cache.block_table(ids), cache.seq_lens(ids))
    dense = tinyattn.paged_attention(*args, backend="torch")
    sparse = tinyattn.sparse_paged_attention(*args, k_min=cache.k_min[0], k_max=cache.k_max[0], page_budget=6,
                                             backend="torch")
    torch.testing.assert_close(sparse, dense)
    torch.testing.assert_close(dense, reference.paged_attention(*args))


@pytest.mark.parametrize("kwargs,match", [
    (dict(page_size=0, num_pages=4), "page_size: expected an int >= 1, got 0"),
    (dict(page_size=4, num_pages=-1), "num_pages: expected an int >= 1, got -1"),
])
def test_bad_sizes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedKVCache(1, 1, 4, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_a_cuda_cache_without_cuda_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"device: .*'cuda'.*no CUDA device.*device='cpu'"):
        PagedKVCache(1, 2, 8, page_size=4, num_pages=2, device="cuda")

def test_write_checks_shapes():
    cache = PagedKVCache(1, 2, 4, page_size=4, num_pages=4)
    a = cache.add_sequence()
    slots = cache.extend([a], 2)
    with pytest.raises(ValueError, match=r"k: expected shape \(2, 2, 4\) \[N, Hkv, D\], got \(2, 4\)"):
        cache.write(0, slots, torch.zeros(2, 4), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="layer: expected an int in"):
        cache.write(3, slots, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))


# ---- page operations: copy_pages, fork, truncate, resize, drop_pages -----------------------------------------
class Shadow:
    """An independent model of a cache: each sequence as a plain list of its tokens' (k, v) and dropped pages."""

    def __init__(self, cache):
        self.cache = cache
        self.tokens: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.dropped: dict[int, set[int]] = {}

    def add(self, seq):
        self.tokens[seq], self.dropped[seq] = [], set()

    def append(self, seqs, counts, gen):
        slots = self.cache.extend(seqs, counts)
        L, Hkv, D = self.cache.num_layers, self.cache.num_kv_heads, self.cache.head_dim
        k = torch.randn(L, len(slots), Hkv, D, generator=gen)
        v = torch.randn(L, len(slots), Hkv, D, generator=gen)
        for layer in range(L):
            self.cache.write(layer, slots, k[layer], v[layer])
        i = 0
        for seq, n in zip(seqs, counts):
            self.tokens[seq] += [(k[:, i + t], v[:, i + t]) for t in range(n)]
            i += n

    def check(self):
        c, S = self.cache, self.cache.page_size
        held = []
        for seq, toks in self.tokens.items():
            pages = c.pages(seq)
            assert c.length(seq) == len(toks) and len(pages) == -(-len(toks) // S)
            assert [j for j, p in enumerate(pages) if p < 0] == sorted(self.dropped[seq])
            table = c.block_table([seq], max_pages=len(pages) + 1)[0].tolist()
            assert table == pages + [-1]
            for j, p in enumerate(pages):
                if p < 0:
                    continue
                held.append(p)
                page_toks = toks[j * S:(j + 1) * S]
                k = torch.stack([t[0] for t in page_toks], 1)                 # [L, n, Hkv, D]
                v = torch.stack([t[1] for t in page_toks], 1)
                for layer in range(c.num_layers):
                    assert torch.equal(c.k_cache[layer][p, :len(page_toks)], k[layer])
                    assert torch.equal(c.v_cache[layer][p, :len(page_toks)], v[layer])
                    if c.k_min:                                                 # exact boxes, not just bounds
                        assert torch.equal(c.k_min[layer][p], k[layer].amin(0))
                        assert torch.equal(c.k_max[layer][p], k[layer].amax(0))
        assert len(held) == len(set(held)), "a physical page is owned twice"
        assert c.num_free_pages + len(held) == c.num_pages, "a page leaked"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "fork", "truncate", "resize", "drop", "free"]),
                          st.integers(0, 1000), st.integers(0, 1000)), min_size=1, max_size=14),
       st.sampled_from([1, 2, 4]), st.booleans())
def test_page_operations_match_an_independent_model(ops, page_size, page_boxes):
    """Random extend/write, fork, truncate, resize, drop_pages and free against a plain list per sequence:
    every held page reads back its tokens, boxes equal amin/amax of the valid keys, no page leaks or is shared."""
    gen = torch.Generator().manual_seed(len(ops))
    cache = PagedKVCache(2, 2, 3, page_size=page_size, num_pages=6, page_boxes=page_boxes)
    shadow = Shadow(cache)
    first = cache.add_sequence()
    shadow.add(first)
    for op, a, b in ops:
        seqs = sorted(shadow.tokens)
        seq = seqs[a % len(seqs)] if seqs else None
        if op == "append" or seq is None:
            if seq is None:
                seq = cache.add_sequence()
                shadow.add(seq)
            n = b % 7
            ends_in_dropped = cache.length(seq) % page_size and cache.pages(seq)[-1] < 0
            try:
                shadow.append([seq], [n], gen)
            except CacheFullError:
                pass
            except ValueError:          # a fork/truncate ended inside a dropped page: no token can go there
                assert ends_in_dropped and n
            else:
                assert not (ends_in_dropped and n)
        elif op == "fork":
            n = b % (cache.length(seq) + 1)
            try:
                new = cache.fork(seq, n)
            except CacheFullError:
                pass
            else:
                shadow.add(new)
                shadow.tokens[new] = shadow.tokens[seq][:n]
                shadow.dropped[new] = {j for j in shadow.dropped[seq] if j < -(-n // page_size)}
        elif op == "truncate":
            n = b % (cache.length(seq) + 1)
            cache.truncate(seq, n)
            shadow.tokens[seq] = shadow.tokens[seq][:n]
            shadow.dropped[seq] = {j for j in shadow.dropped[seq] if j < -(-n // page_size)}
        elif op == "resize":
            highest = max([p for s in seqs for p in cache.pages(s)] + [-1])
            target = highest + 1 + b % 8
            if target >= 1:
                cache.resize(target)
                assert cache.k_cache[0].shape[0] == target and cache.num_pages == target
        elif op == "drop":
            pages = cache.pages(seq)
            partial = len(pages) - 1 if cache.length(seq) % page_size else None
            can = [j for j, p in enumerate(pages) if p >= 0 and j != partial]
            if can:
                j = can[b % len(can)]
                cache.drop_pages(seq, [j])
                shadow.dropped[seq].add(j)
        elif op == "free":
            cache.free(seq)
            del shadow.tokens[seq], shadow.dropped[seq]
        shadow.check()


def _filled(num_pages=8, page_size=4, seed=0):
    cache = PagedKVCache(2, 1, 2, page_size=page_size, num_pages=num_pages)
    shadow = Shadow(cache)
    seq = cache.add_sequence()
    shadow.add(seq)
    shadow.append([seq], [10], torch.Generator().manual_seed(seed))       # pages of 4, 4, 2 tokens
    return cache, shadow, seq


def test_copy_pages_copies_kv_and_boxes_and_reads_before_writing():
    cache, _, seq = _filled()
    before = {name: [t.clone() for t in getattr(cache, name)] for name in ("k_cache", "v_cache", "k_min", "k_max")}
    p0, p1, _ = cache.pages(seq)
    cache.copy_pages([p0, p1], [p1, p0])                                 # a swap: overlapping lists
    for name, olds in before.items():
        for t, old in zip(getattr(cache, name), olds):
            assert torch.equal(t[p0], old[p1]) and torch.equal(t[p1], old[p0])
    cache.copy_pages(torch.tensor([p0]), [7])
    assert torch.equal(cache.k_cache[1][7], cache.k_cache[1][p0]) and torch.equal(cache.k_max[0][7], cache.k_max[0][p0])
    with pytest.raises(ValueError, match="dst: expected as many pages as src"):
        cache.copy_pages([0, 1], [2])
    with pytest.raises(ValueError, match="dst: expected distinct pages"):
        cache.copy_pages([0, 1], [2, 2])
    with pytest.raises(ValueError, match=r"src: expected physical page ids in \[0, 8\), got 8"):
        cache.copy_pages([8], [2])


def test_fork_copies_a_prefix_into_new_pages_and_both_grow_apart():
    cache, shadow, seq = _filled()
    gen = torch.Generator().manual_seed(5)
    whole = cache.fork(seq)
    part = cache.fork(seq, 6)                                            # ends inside page 1 (2 of its 4 tokens)
    assert cache.length(whole) == 10 and cache.length(part) == 6
    assert not set(cache.pages(whole)) & set(cache.pages(seq)) and len(cache.pages(part)) == 2
    assert cache.num_free_pages == 8 - 3 - 3 - 2
    k_part = torch.stack([t[0] for t in shadow.tokens[seq][4:6]], 1)     # [L, 2, Hkv, D]: the cut page's keys
    assert torch.equal(cache.k_min[0][cache.pages(part)[1]], k_part[0].amin(0))   # recomputed, not copied
    shadow.add(whole)
    shadow.add(part)
    shadow.tokens[whole], shadow.tokens[part] = list(shadow.tokens[seq]), shadow.tokens[seq][:6]
    shadow.check()
    with pytest.raises(CacheFullError, match="fork needs 3 new pages, 0 of 8 are free"):
        shadow.append([part], [2], gen)                                  # fills the last free pages
        cache.fork(seq)
    shadow.check()                                                       # nothing changed by the failed fork
    with pytest.raises(ValueError, match=r"num_tokens: expected an int in \[0, 10\]"):
        cache.fork(seq, 11)


def test_truncate_frees_whole_pages_and_recomputes_the_cut_page_box():
    cache, shadow, seq = _filled()
    free = cache.num_free_pages
    cache.truncate(seq, 5)                                               # keeps page 0 and 1 token of page 1
    assert cache.length(seq) == 5 and len(cache.pages(seq)) == 2 and cache.num_free_pages == free + 1
    shadow.tokens[seq] = shadow.tokens[seq][:5]
    k4 = shadow.tokens[seq][4][0]                                        # [L, Hkv, D]: the one key left on page 1
    page1 = cache.pages(seq)[1]
    assert torch.equal(cache.k_min[1][page1], k4[1]) and torch.equal(cache.k_max[1][page1], k4[1])
    shadow.check()
    shadow.append([seq], [6], torch.Generator().manual_seed(2))          # grows again from the cut
    shadow.check()
    cache.truncate(seq, 0)
    shadow.tokens[seq] = []
    assert cache.pages(seq) == [] and cache.num_free_pages == 8
    with pytest.raises(ValueError, match=r"length: expected an int in \[0, 0\]"):
        cache.truncate(seq, 1)


def test_resize_keeps_sequences_page_ids_and_contents():
    cache, shadow, seq = _filled(num_pages=3)
    pages = cache.pages(seq)
    with pytest.raises(CacheFullError):
        cache.extend([seq], 4)
    cache.resize(5)
    assert cache.pages(seq) == pages and cache.num_pages == 5 and cache.num_free_pages == 2
    assert cache.k_cache[0].shape == (5, 4, 1, 2) and cache.k_min[1].shape == (5, 1, 2)
    shadow.check()
    shadow.append([seq], [4], torch.Generator().manual_seed(3))          # lands on the new pages
    assert cache.pages(seq)[3] == 3
    shadow.check()
    with pytest.raises(ValueError, match="num_pages: expected more than 3 .the highest page id in use., got 3"):
        cache.resize(3)
    cache.free(seq)
    cache.resize(2)
    assert cache.num_pages == 2 and cache.num_free_pages == 2 and cache.v_cache[1].shape[0] == 2


def test_drop_pages_leaves_holes_and_keeps_positions():
    cache, shadow, seq = _filled()
    p = cache.pages(seq)
    cache.drop_pages(seq, [1])
    assert cache.pages(seq) == [p[0], -1, p[2]] and cache.length(seq) == 10
    assert cache.block_table([seq]).tolist() == [[p[0], -1, p[2]]] and cache.num_free_pages == 6
    shadow.dropped[seq].add(1)
    shadow.check()
    with pytest.raises(ValueError, match="page 1 of sequence 0 was already dropped"):
        cache.drop_pages(seq, [1])
    with pytest.raises(ValueError, match="page 2 is the partial last page"):
        cache.drop_pages(seq, [2])
    with pytest.raises(ValueError, match=r"logical_pages: expected logical pages of the sequence in \[0, 3\)"):
        cache.drop_pages(seq, [3])
    shadow.append([seq], [2], torch.Generator().manual_seed(4))          # fills page 2: now droppable
    cache.drop_pages(seq, torch.tensor([2, 0]))
    shadow.dropped[seq] |= {0, 2}
    shadow.check()
    cache.free(seq)
    assert cache.num_free_pages == 8


def test_a_cache_without_boxes_stores_kv_only():
    cache = PagedKVCache(2, 1, 2, page_size=4, num_pages=4, page_boxes=False)
    assert cache.k_min == [] and cache.k_max == []
    shadow = Shadow(cache)
    seq = cache.add_sequence()
    shadow.add(seq)
    shadow.append([seq], [6], torch.Generator().manual_seed(0))
    cache.truncate(seq, 3)
    shadow.tokens[seq] = shadow.tokens[seq][:3]
    cache.resize(6)
    shadow.check()
    assert cache.kv_bytes == 2 * 2 * 6 * 4 * 1 * 2 * 4


def test_cache_extend_numpy_int_count_is_an_int():
    np = pytest.importorskip("numpy")
    from tinyattn.cache import PagedKVCache
    c = PagedKVCache(1, 1, 2, page_size=4, num_pages=2, dtype=torch.float32, device="cpu")
    s = c.add_sequence()
    try:
        slots = c.extend([s], np.int64(2))
    except (TypeError, ValueError) as e:      # acceptable only with a message naming the argument
        assert "num_tokens" in str(e)
    else:
        assert slots.numel() == 2 and c.length(s) == 2


# ---- int8 / fp8 page scales after every operation that removes tokens (truncate, fork inside a page, drop_pages,
# TinyAttnCache.crop, the engine's recompute): an independent quantize-dequantize of the kept tokens ---------------
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
