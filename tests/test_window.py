"""Sliding-window attention (``window_left``, FlashInfer's convention) in the ops, both backends.

A query at absolute position ``p`` (bottom-right causal: ``p = seq_len - Tq + t``) sees the keys at positions
``[p - window_left, p]``; ``-1`` means no window. Expected values come from the reference loops
(``tinyattn.reference``), from plain masked softmax written here, or from facts that hold without any code
(a window of 0 returns the query's own value; a window covering the context is full attention).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference
from tinyattn.layer import PagedAttention, SparsityConfig
from paged_problems import make_problem, problems

BACKENDS = ["torch", "triton"]
EXAMPLES = {"torch": 40, "triton": 12}      # the interpreter is slow: fewer, small examples


def windows(page_size: int):
    """Windows around the interesting sizes: 0 (the query alone), below / at / above a page, beyond any context."""
    return st.one_of(st.sampled_from([-1, 0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size, 10**6]),
                     st.integers(0, 40))


def assert_close_to_reference(out, lse, ref_out, ref_lse, atol=2e-5):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))           # -inf exactly where nothing is seen
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=atol, rtol=1e-5)


def args(p):
    return p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens


# ------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_window_matches_reference(backend):
    """Ragged rows, empty rows, prefill (Tq > 1), GQA, windows below a page, at a page and past the context."""
    @settings(max_examples=EXAMPLES[backend], deadline=None)
    @given(data=st.data())
    def check(data):
        p = data.draw(problems(max_query_tokens=5, head_dims=(8, 24), max_pages_per_row=5))
        w = data.draw(windows(p.page_size))
        out, lse = tinyattn.paged_attention(*args(p), window_left=w, return_lse=True, backend=backend)
        ref_out, ref_lse = reference.paged_attention(*args(p), window_left=w, return_lse=True)
        assert_close_to_reference(out, lse, ref_out, ref_lse)
        fast = tinyattn.paged_attention(*args(p), window_left=w, backend=backend)      # the no-lse path
        torch.testing.assert_close(fast, ref_out, atol=2e-5, rtol=1e-5)

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_window_with_listed_pages_matches_reference(backend):
    """Listed pages attended within the window: the window is a mask on top of the selection."""
    @settings(max_examples=EXAMPLES[backend], deadline=None)
    @given(data=st.data())
    def check(data):
        p = data.draw(problems(max_query_tokens=3, head_dims=(8, 16), max_pages_per_row=5))
        w = data.draw(windows(p.page_size))
        B, Hkv, width = p.seq_lens.shape[0], p.num_kv_heads, p.block_table.shape[1]
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
        idx = torch.stack([torch.stack([torch.randperm(width, generator=g)[:3] for _ in range(Hkv)])
                           for _ in range(B)]).to(torch.int32)
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        out, lse = tinyattn.sparse_paged_attention(*args(p), page_indices=idx, window_left=w, return_lse=True,
                                                   backend=backend)
        ref_out, ref_lse = reference.sparse_paged_attention(*args(p), page_indices=idx, window_left=w,
                                                            return_lse=True)
        assert_close_to_reference(out, lse, ref_out, ref_lse)

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_window_selected_by_boxes_matches_reference(backend):
    """Selection by the Quest bound with a window: pages before the earliest query's window rank last."""
    @settings(max_examples=EXAMPLES[backend], deadline=None)
    @given(data=st.data())
    def check(data):
        p = data.draw(problems(max_query_tokens=2, head_dims=(8, 16), max_pages_per_row=6, page_sizes=(1, 2, 4)))
        w = data.draw(windows(p.page_size))
        k_min, k_max = p.bounds()
        kw = dict(k_min=k_min, k_max=k_max, page_budget=data.draw(st.integers(2, 5)),    # >= the Tq <= 2 query pages
                  num_recent_pages=data.draw(st.integers(0, 1)), window_left=w, return_lse=True)
        ref_out, ref_lse = reference.sparse_paged_attention(*args(p), **kw)
        out, lse = tinyattn.sparse_paged_attention(*args(p), backend=backend, **kw)
        assert_close_to_reference(out, lse, ref_out, ref_lse)

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_zero_returns_each_querys_own_value(backend):
    """``window_left = 0``: every query sees only itself, so its output is its own value and its lse the logit."""
    p = make_problem(1, batch=3, seq_lens=[7, 1, 12], page_size=4, num_kv_heads=2, group=3, head_dim=8,
                     num_query_tokens=1)
    q = p.q.expand(3, 3, *p.q.shape[2:]).contiguous()                         # Tq = 3 (row of length 1: 1 query)
    q = q + torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    out, lse = tinyattn.paged_attention(q, *args(p)[1:], window_left=0, return_lse=True, backend=backend)
    G = 3
    for b, n in enumerate(p.seq_lens.tolist()):
        for t in range(3):
            pos = n - 3 + t
            if pos < 0:                                                      # a query before the row: sees nothing
                assert (out[b, t] == 0).all() and torch.isinf(lse[b, t]).all()
                continue
            page, slot = int(p.block_table[b, pos // 4]), pos % 4
            for hq in range(q.shape[2]):
                v = p.v_cache[page, slot, hq // G]
                k = p.k_cache[page, slot, hq // G]
                torch.testing.assert_close(out[b, t, hq], v, atol=1e-6, rtol=0)
                torch.testing.assert_close(lse[b, t, hq], (q[b, t, hq] @ k) / math.sqrt(8), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_covering_the_context_is_full_attention(backend):
    p = make_problem(3, batch=2, seq_lens=[13, 6], page_size=4, num_kv_heads=1, group=2, head_dim=16,
                     num_query_tokens=3)
    full = tinyattn.paged_attention(*args(p), backend=backend)
    for w in (12, 13, 2**31 - 1):
        torch.testing.assert_close(tinyattn.paged_attention(*args(p), window_left=w, backend=backend), full,
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_query_tokens", [1, 4])
def test_pages_wholly_before_the_window_are_never_read(backend, num_query_tokens):
    """NaN in every page before the earliest query's window: the output is still the reference's. A walk or gather
    that read those pages would turn ``0 * NaN`` into NaN, so this proves that they are skipped."""
    S, W = 4, 5
    lens = [30, 21]
    p = make_problem(4, batch=2, seq_lens=lens, page_size=S, num_kv_heads=2, group=2, head_dim=8,
                     num_query_tokens=num_query_tokens)
    ref = reference.paged_attention(*args(p), window_left=W)
    k, v = p.k_cache.clone(), p.v_cache.clone()
    for b, n in enumerate(lens):
        first_key = n - num_query_tokens - W
        for j in range(first_key // S):                                      # wholly before every window
            k[int(p.block_table[b, j])] = float("nan")
            v[int(p.block_table[b, j])] = float("nan")
    out = tinyattn.paged_attention(p.q, k, v, p.block_table, p.seq_lens, window_left=W, backend=backend)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_plan_runs_layers_with_different_windows(backend):
    """Hybrid models: layers of one step with different windows (full, sliding, a window of 0) share one plan."""
    p = make_problem(5, batch=2, seq_lens=[19, 11], page_size=4, num_kv_heads=2, group=2, head_dim=8,
                     num_query_tokens=1)
    plan = tinyattn.PagedAttentionPlan(backend=backend)
    plan.plan(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
    g = torch.Generator().manual_seed(0)
    for w in (-1, 6, 0, 6, -1, 17, 3):
        q = torch.randn(2, 4, 8, generator=g)
        out = plan.run(q, p.k_cache, p.v_cache, window_left=w)
        ref = reference.paged_attention(q, *args(p)[1:], window_left=w)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_windowed_decode_matches_a_plain_masked_softmax():
    """An independent formula: one contiguous sequence, softmax over the last ``window_left + 1`` keys."""
    torch.manual_seed(0)
    n, S, D, W = 23, 4, 8, 6
    keys, values, q = torch.randn(n, D), torch.randn(n, D), torch.randn(D)
    pages = -(-n // S)
    k_cache = torch.zeros(pages, S, 1, D)
    v_cache = torch.zeros(pages, S, 1, D)
    k_cache.view(-1, D)[:n], v_cache.view(-1, D)[:n] = keys, values
    table = torch.arange(pages, dtype=torch.int32)[None]
    out = tinyattn.paged_attention(q.view(1, 1, D), k_cache, v_cache, table, torch.tensor([n], dtype=torch.int32),
                                   window_left=W, backend="torch")
    w = torch.softmax(keys[n - 1 - W:] @ q / math.sqrt(D), 0)
    torch.testing.assert_close(out.view(D), w @ values[n - 1 - W:], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------- backward
def grads(fn, p, dtype, w, page_indices=None, backend=None):
    q, k, v = (x.detach().to(dtype).clone().requires_grad_() for x in (p.q, p.k_cache, p.v_cache))
    kw = dict(window_left=w, return_lse=True)
    if backend is not None:
        kw["backend"] = backend
    if page_indices is None:
        out, lse = fn.paged_attention(q, k, v, p.block_table, p.seq_lens, **kw)
    else:
        out, lse = fn.sparse_paged_attention(q, k, v, p.block_table, p.seq_lens, page_indices=page_indices, **kw)
    g = torch.Generator().manual_seed(7)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)      # the same draws for any dtype
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    loss = (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse).sum()
    if not loss.requires_grad:                            # the reference keeps no graph when no row sees a key
        return tuple(torch.zeros_like(x) for x in (q, k, v))
    return torch.autograd.grad(loss, (q, k, v), allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_backward_with_a_window_matches_reference_autograd(backend, sparse):
    """dq, dk, dv against float64 autograd through the reference loops; pages before the window get exact zeros."""
    S, W = 4, 5
    p = make_problem(6, batch=2, seq_lens=[22, 9], page_size=S, num_kv_heads=2, group=2, head_dim=8,
                     num_query_tokens=3, poison=1e30)
    idx = None
    if sparse:
        idx = torch.tensor([[[0, 3, 5], [4, 5, -1]], [[1, 2, -1], [0, 2, 1]]], dtype=torch.int32)
    got = grads(tinyattn, p, torch.float32, W, idx, backend)
    want = grads(reference, p, torch.float64, W, idx)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=name)
    for b, n in enumerate(p.seq_lens.tolist()):                     # pages wholly before the window: no gradient
        for j in range((n - 3 - W) // S):
            page = int(p.block_table[b, j])
            assert (got[1][page] == 0).all() and (got[2][page] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_property_with_windows(backend):
    """Random ragged problems and windows (dense): gradients equal float64 reference autograd, never NaN."""
    @settings(max_examples={"torch": 15, "triton": 5}[backend], deadline=None)
    @given(data=st.data())
    def check(data):
        p = data.draw(problems(max_query_tokens=3, head_dims=(8,), max_pages_per_row=4, page_sizes=(1, 2, 4)))
        w = data.draw(windows(p.page_size))
        got = grads(tinyattn, p, torch.float32, w, backend=backend)
        want = grads(reference, p, torch.float64, w)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert not torch.isnan(a).any(), name
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=name)

    check()


def test_gradcheck_torch_backend_with_a_window():
    p = make_problem(8, batch=2, seq_lens=[7, 5], page_size=2, num_kv_heads=1, group=2, head_dim=4,
                     num_query_tokens=2, extra_pages=0, spare_columns=0, poison=0.0)
    q, k, v = (x.double().requires_grad_() for x in (p.q, p.k_cache, p.v_cache))

    def f(q, k, v):
        return tinyattn.paged_attention(q, k, v, p.block_table, p.seq_lens, window_left=2, backend="torch")

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5)


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("bad, error", [(-2, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError)])
def test_bad_window_left_raises_naming_it(bad, error):
    p = make_problem(0, batch=1, seq_lens=[5], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    k_min, k_max = p.bounds()
    calls = [
        lambda: tinyattn.paged_attention(*args(p), window_left=bad),
        lambda: tinyattn.sparse_paged_attention(*args(p), k_min=k_min, k_max=k_max, page_budget=1, window_left=bad),
        lambda: reference.paged_attention(*args(p), window_left=bad),
        lambda: tinyattn.PagedAttentionPlan(backend="torch").plan(
            p.block_table, p.seq_lens, num_q_heads=1, num_kv_heads=1, head_dim=8, page_size=4).run(
            p.q[:, 0], p.k_cache, p.v_cache, window_left=bad),
    ]
    for call in calls:
        with pytest.raises(error, match="window_left"):
            call()
    attn = PagedAttention(backend="torch").begin(p.block_table, p.seq_lens, num_q_heads=1, num_kv_heads=1,
                                                 head_dim=8, page_size=4)
    with pytest.raises(error, match="window_left"):
        attn(0, p.q[:, 0], p.k_cache, p.v_cache, window_left=bad)


def test_windowed_selection_by_boxes_refuses_sink_pages():
    p = make_problem(0, batch=1, seq_lens=[20], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    k_min, k_max = p.bounds()
    for fn in (tinyattn, reference):
        with pytest.raises(ValueError, match="num_sink_pages"):
            fn.sparse_paged_attention(*args(p), k_min=k_min, k_max=k_max, page_budget=3, num_sink_pages=1,
                                      window_left=4)
    # listed pages carry no forced sinks: allowed
    idx = torch.tensor([[[0, 3, 4]]], dtype=torch.int32)
    tinyattn.sparse_paged_attention(*args(p), page_indices=idx, num_sink_pages=1, window_left=4)


# ------------------------------------------------------------------------------------------- the layer
@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_layer_ignores_the_page_budget(backend):
    """A sliding layer of a sparse decode step attends densely over its window: the budget and the policy do not
    change its output (it equals the dense windowed op), while a full layer of the same step selects."""
    p = make_problem(9, batch=2, seq_lens=[37, 26], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    q = p.q[:, 0]
    for policy in ("quest", "streaming"):
        attn = PagedAttention(SparsityConfig(page_budget=2, policy=policy), backend=backend)
        attn.begin(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, decode=True)
        sliding = attn(0, q, p.k_cache, p.v_cache, k_min, k_max, window_left=9)
        full = attn(1, q, p.k_cache, p.v_cache, k_min, k_max)
        want = reference.paged_attention(q, *args(p)[1:], window_left=9)
        torch.testing.assert_close(sliding, want, atol=2e-5, rtol=1e-5)
        assert not torch.allclose(full, reference.paged_attention(q, *args(p)[1:]), atol=1e-3)


def test_profiler_counts_the_pages_of_the_window():
    """A windowed dense call reads the pages from the one holding the window's first key: lens 70 and 33, pages of
    8, window_left 20 -> first keys 49 and 12 -> pages 6..8 (3) and 1..4 (4), 2 KV heads."""
    import tinyattn.profiler as tp

    p = make_problem(0, batch=2, seq_lens=[70, 33], page_size=8, num_kv_heads=2, group=2, head_dim=16)
    with tp.profile(oracle=False) as prof:
        tinyattn.paged_attention(p.q[:, 0], *args(p)[1:], window_left=20, backend="torch")
        tinyattn.paged_attention(p.q[:, 0], *args(p)[1:], backend="torch")
    windowed, full = prof.records
    assert windowed.pages == (3 + 4) * 2 and full.pages == (9 + 5) * 2
    assert windowed.bytes < full.bytes


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
def test_opcheck_custom_ops_with_a_window(backend, dtype):
    """The custom ops' schema, fake kernels and autograd registration with the ``window_left`` argument."""
    from tinyattn.ops import custom_ops as A
    from tinyattn.ops.selection import torch_impl as core

    p = make_problem(14, batch=2, seq_lens=[7, 3], page_size=2, num_kv_heads=1, group=2, head_dim=8,
                     num_query_tokens=2, dtype=dtype, poison=0.5)
    pi = core.canonical_page_indices(torch.tensor([[[0, 2, 3]], [[1, -1, 0]]]), p.seq_lens, 2)
    q, k, v = (x.detach().clone().requires_grad_() for x in (p.q, p.k_cache, p.v_cache))
    for indices in (pi, None):
        torch.library.opcheck(A.paged_attention_fwd, (q, k, v, p.block_table, p.seq_lens, indices, 0.5, backend, 2))
    out, lse = A.paged_attention_fwd(q.detach(), k.detach(), v.detach(), p.block_table, p.seq_lens, pi, 0.5,
                                     backend, 2)
    torch.library.opcheck(A.paged_attention_bwd, (torch.randn_like(out), None, q.detach(), k.detach(), v.detach(),
                                                  p.block_table, p.seq_lens, pi, out, lse, 0.5, backend, 2))


def test_long_windowed_prefill_runs_in_query_blocks_and_matches_reference():
    """Torch backend, Tq far above the window: the plan cuts the queries into blocks (each reads only its window);
    ragged rows (one shorter than Tq: its first queries see nothing), with and without lse, and a second layer
    with another window under the same plan."""
    p = make_problem(10, batch=2, seq_lens=[700, 450], page_size=4, num_kv_heads=2, group=2, head_dim=8,
                     num_query_tokens=600)
    plan = tinyattn.PagedAttentionPlan(backend="torch")
    plan.plan(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
              num_query_tokens=600)
    for w in (20, 7):
        ref_out, ref_lse = reference.paged_attention(*args(p), window_left=w, return_lse=True)
        out, lse = plan.run(p.q, p.k_cache, p.v_cache, window_left=w, return_lse=True)
        assert len(plan._impl._blocks[w]) == 3                                  # 600 queries in blocks of 256
        assert_close_to_reference(out, lse, ref_out, ref_lse)
        torch.testing.assert_close(plan.run(p.q, p.k_cache, p.v_cache, window_left=w), ref_out, atol=2e-5,
                                   rtol=1e-5)
