"""The torch plan's attention routes against the reference: a fresh prefill (every row's queries are all its
tokens: causal SDPA), a chunked prefill or prefix reuse (SDPA under the step's mask), a dense decode, each through
gathered rows and, for one row whose pages lie in the pool in order, through views of the pool (no gather); NaN in
every slot no row owns. Also the empty batch of a prefill-shaped step."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference
from paged_problems import make_problem


def _check(p, window_left=-1):
    q = p.q[:, 0] if p.q.shape[1] == 1 else p.q
    args = (q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    out = tinyattn.paged_attention(*args, backend="torch", window_left=window_left)
    want = reference.paged_attention(*args, window_left=window_left)
    assert torch.isfinite(out).all()
    tol = dict(atol=2e-2, rtol=2e-2) if q.dtype != torch.float32 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.float(), want.float(), **tol)


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 2**31 - 1), length=st.integers(1, 70), page_size=st.sampled_from([1, 4, 16]),
       group=st.sampled_from([1, 3]), fresh=st.booleans(), in_order=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_prefill_of_one_row(seed, length, page_size, group, fresh, in_order, dtype):
    """Tq = length (fresh: causal SDPA) or a chunk of the last tokens (a mask); pages in pool order or shuffled."""
    tq = length if fresh else max(1, length // 2)
    p = make_problem(seed, batch=1, seq_lens=[length], page_size=page_size, num_kv_heads=2, group=group,
                     head_dim=8, num_query_tokens=tq, dtype=dtype, in_order=in_order)
    _check(p)


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(1, 60), min_size=1, max_size=3),
       page_size=st.sampled_from([2, 16]), in_order=st.booleans(), window=st.sampled_from([-1, 0, 5]))
def test_dense_decode_and_batched_prefill(seed, lens, page_size, in_order, window):
    """Decode rows of any lengths (one in-order row reads pool views), and a batch of fresh prefills of one length."""
    p = make_problem(seed, batch=len(lens), seq_lens=lens, page_size=page_size, num_kv_heads=2, group=2,
                     head_dim=8, in_order=in_order)
    _check(p, window)
    n = min(lens)
    p = make_problem(seed, batch=len(lens), seq_lens=[n] * len(lens), page_size=page_size, num_kv_heads=2, group=2,
                     head_dim=8, num_query_tokens=n, in_order=in_order)
    _check(p, window)


@pytest.mark.parametrize("num_query_tokens", [1, 3])
def test_empty_batch(num_query_tokens):
    """B = 0 is a normal step of a serving loop: every op returns empty results, on prefill-shaped queries too."""
    q = torch.randn(0, num_query_tokens, 4, 8)
    k = torch.randn(5, 4, 2, 8)
    table, lens = torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    k_min, k_max = k.amin(1), k.amax(1)
    scores = tinyattn.page_scores(q, k_min, k_max, table, lens, page_size=4, backend="torch")
    assert scores.shape == (0, 2, 3)
    out = tinyattn.paged_attention(q, k, k, table, lens, backend="torch")
    assert out.shape == q.shape
    out = tinyattn.sparse_paged_attention(q, k, k, table, lens, k_min=k_min, k_max=k_max, page_budget=2,
                                          backend="torch")
    assert out.shape == q.shape


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), num_kv_heads=st.sampled_from([1, 4]),
       page_size=st.sampled_from([1, 4, 16]), num_query_tokens=st.sampled_from([1, 3]),
       window_left=st.sampled_from([-1, 0, 5]), data=st.data())
def test_every_page_rows_equal_the_listed_pages(seed, batch, num_kv_heads, page_size, num_query_tokens, window_left,
                                                data):
    """page_rows(pages=None, num_pages=P), the plan's per-step table in fewer ops, gives exactly the rows, positions
    and visibility of the explicit pages 0..P-1 (empty rows, ragged tails, causal queries, windows)."""
    from tinyattn.ops.attention.torch_impl import page_rows

    g = torch.Generator().manual_seed(seed)
    width = data.draw(st.integers(1, 6))
    lens = data.draw(st.lists(st.integers(0, width * page_size), min_size=batch, max_size=batch))
    block_table = torch.randint(0, 50, (batch, width), dtype=torch.int32, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    num_pages = data.draw(st.integers(1, width))
    rules = dict(page_size=page_size, num_kv_heads=num_kv_heads, num_query_tokens=num_query_tokens,
                 window_left=window_left)
    listed = page_rows(block_table, seq_lens, torch.arange(num_pages).expand(batch, num_kv_heads, num_pages), **rules)
    every = page_rows(block_table, seq_lens, None, num_pages=num_pages, **rules)
    for want, got in zip(listed, every):
        assert got.shape == want.shape and torch.equal(got, want)
