"""Adversarial edge cases found by probing (each asserts the contracted behaviour).

Empty inputs (B = 0, a block table of width 0, an empty page pool, Tq = 0) are legal by DESIGN.md §2
(`seq_lens` of 0 allowed, empty rows output zeros and lse = -inf); the Triton backend handles them, the
torch backend (the CPU default) must too.
"""
import pytest
import torch

import tinyattn
from tinyattn import reference as R


def _empty_batch(D=8, Hq=2, Hkv=1, ps=4, P=3):
    q = torch.randn(0, Hq, D)
    k = torch.randn(P, ps, Hkv, D)
    v = torch.randn(P, ps, Hkv, D)
    bt = torch.zeros(0, 2, dtype=torch.int32)
    sl = torch.zeros(0, dtype=torch.int32)
    return q, k, v, bt, sl


def test_torch_backend_empty_batch_dense():
    q, k, v, bt, sl = _empty_batch()
    out, lse = tinyattn.paged_attention(q, k, v, bt, sl, backend="torch", return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


def test_torch_backend_empty_batch_sparse():
    q, k, v, bt, sl = _empty_batch()
    out = tinyattn.sparse_paged_attention(q, k, v, bt, sl, k_min=k[:, 0], k_max=k[:, 0], page_budget=2,
                                          backend="torch")
    assert out.shape == (0, 2, 8)


def test_torch_backend_empty_batch_backward():
    q, k, v, bt, sl = _empty_batch()
    q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
    tinyattn.paged_attention(q, k, v, bt, sl, backend="torch").sum().backward()
    assert torch.count_nonzero(k.grad) == 0 and torch.count_nonzero(v.grad) == 0


@pytest.mark.parametrize("sparse", [False, True])
def test_torch_backend_zero_width_table_empty_pool(sparse):
    # every row has seq_len 0: the table may have width 0 and the pool may hold no page
    q = torch.randn(2, 2, 8)
    k = torch.randn(0, 4, 1, 8)
    bt = torch.zeros(2, 0, dtype=torch.int32)
    sl = torch.zeros(2, dtype=torch.int32)
    kw = dict(k_min=k[:, 0], k_max=k[:, 0], page_budget=2) if sparse else {}
    fn = tinyattn.sparse_paged_attention if sparse else tinyattn.paged_attention
    out, lse = fn(q, k, k, bt, sl, backend="torch", return_lse=True, **kw)
    ref_out, ref_lse = R.paged_attention(q, k, k, bt, sl, return_lse=True)
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.isneginf(lse).all() and torch.equal(lse, ref_lse)


def test_torch_backend_page_indices_of_width_zero():
    # a budget-0 page list selects nothing: zeros and lse = -inf (the Triton backend does this)
    torch.manual_seed(0)
    q = torch.randn(2, 2, 8)
    k = torch.randn(4, 4, 1, 8)
    v = torch.randn(4, 4, 1, 8)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    sl = torch.tensor([6, 3], dtype=torch.int32)
    pi = torch.zeros(2, 1, 0, dtype=torch.int32)
    out, lse = tinyattn.sparse_paged_attention(q, k, v, bt, sl, page_indices=pi, backend="torch", return_lse=True)
    ref_out, ref_lse = R.sparse_paged_attention(q, k, v, bt, sl, page_indices=pi, return_lse=True)
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(lse, ref_lse)


def test_torch_backend_zero_query_tokens():
    q = torch.randn(2, 0, 1, 8)
    k = torch.randn(1, 4, 1, 8)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    sl = torch.zeros(2, dtype=torch.int32)
    out, lse = tinyattn.paged_attention(q, k, k, bt, sl, backend="torch", return_lse=True)
    assert out.shape == (2, 0, 1, 8) and lse.shape == (2, 0, 1)


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


# ------------------------------------------------------------------ findings of the CASES.md trial (session 3)
def test_triton_backward_keeps_its_own_selection():
    """Triton: the selection buffer is rewritten by the next call's kernel (no version bump), so a backward after
    another sparse call must still use its own pages: dq equals the reference's."""
    torch.manual_seed(1)
    S, N = 4, 12
    k, v = torch.randn(N, S, 1, 8), torch.randn(N, S, 1, 8)
    bt = torch.arange(N, dtype=torch.int32).view(2, 6)
    sl = torch.tensor([23, 18], dtype=torch.int32)
    kmin, kmax = torch.zeros(N, 1, 8), torch.zeros(N, 1, 8)
    tinyattn.update_page_metadata(k, bt, sl, kmin, kmax, backend="torch")
    q, q2 = torch.randn(2, 2, 8), 3 * torch.randn(2, 2, 8)
    qa = q.clone().requires_grad_()
    out = tinyattn.sparse_paged_attention(qa, k, v, bt, sl, k_min=kmin, k_max=kmax, page_budget=2, backend="triton")
    tinyattn.sparse_paged_attention(q2, k, v, bt, sl, k_min=kmin, k_max=kmax, page_budget=2, backend="triton")
    out.sum().backward()
    qr = q.clone().requires_grad_()
    R.sparse_paged_attention(qr, k, v, bt, sl, k_min=kmin, k_max=kmax, page_budget=2).sum().backward()
    torch.testing.assert_close(qa.grad, qr.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batch_and_no_query_tokens(backend):
    """B = 0 and Tq = 0 return empty outputs on both backends (the Triton plan used to divide by zero)."""
    k = v = torch.randn(4, 4, 2, 8)
    out = tinyattn.paged_attention(torch.randn(0, 2, 8), k, v, torch.zeros(0, 2, dtype=torch.int32),
                                   torch.zeros(0, dtype=torch.int32), backend=backend)
    assert out.shape == (0, 2, 8)
    out = tinyattn.paged_attention(torch.randn(1, 0, 2, 8), k, v, torch.zeros(1, 2, dtype=torch.int32),
                                   torch.tensor([3], dtype=torch.int32), backend=backend)
    assert out.shape == (1, 0, 2, 8)


def test_plan_run_checks_its_shapes_and_the_pool_size():
    """run: v_cache / boxes of another shape, k_min without k_max, boxes with page_indices, a wrong out=, and a
    pool smaller than the (checked) table's largest id are ValueErrors, never an out-of-bounds read."""
    from tinyattn.ops.plan import PagedAttentionPlan
    k = v = torch.randn(7, 4, 1, 8)
    q = torch.randn(2, 2, 8)
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    sl = torch.tensor([9, 5], dtype=torch.int32)
    box = torch.zeros(7, 1, 8)
    p = PagedAttentionPlan(backend="torch").plan(bt, sl, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
                                                 page_budget=1)
    with pytest.raises(ValueError, match="v_cache"):
        p.run(q, k, v[:3].clone())
    with pytest.raises(ValueError, match="k_min, k_max"):
        p.run(q, k, v, k_min=box)
    with pytest.raises(ValueError, match="k_min"):
        p.run(q, k, v, k_min=box[:2], k_max=box[:2])
    with pytest.raises(ValueError, match="page_indices"):
        p.run(q, k, v, k_min=box, k_max=box, page_indices=torch.zeros(2, 1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        p.run(q, k, v, out=torch.empty(2, 2, 4))
    big = torch.tensor([[0, 1, 10**6], [3, 4, 5]], dtype=torch.int32)
    p.plan(big, sl, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    with pytest.raises(ValueError, match="block_table"):
        p.run(q, k, v)


def test_trusted_prefill_chunk_still_checks_its_query_pages():
    """A trusted plan with Tq > 1 whose budget cannot hold the queries' own pages raises like the public op (the
    torch backend has the lengths on the host: no sync)."""
    from tinyattn.ops.plan import PagedAttentionPlan
    bt = torch.arange(8, dtype=torch.int32)[None]
    sl = torch.tensor([30], dtype=torch.int32)
    with pytest.raises(ValueError, match="page_budget: expected at least 4"):
        PagedAttentionPlan(backend="torch").plan(bt, sl, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
                                                 num_query_tokens=12, page_budget=2, trusted=True)
