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
