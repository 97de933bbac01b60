"""PagedKVCache: allocation, all-or-nothing extend, freeing, incremental bounding boxes vs a full recompute."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference
from tinyattn.cache import CacheFullError, PagedKVCache


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


def test_write_checks_shapes():
    cache = PagedKVCache(1, 2, 4, page_size=4, num_pages=4)
    a = cache.add_sequence()
    slots = cache.extend([a], 2)
    with pytest.raises(ValueError, match=r"k: expected shape \(2, 2, 4\) \[N, Hkv, D\], got \(2, 4\)"):
        cache.write(0, slots, torch.zeros(2, 4), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="layer: expected an int in"):
        cache.write(3, slots, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))
