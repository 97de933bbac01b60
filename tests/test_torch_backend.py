"""The vectorised CPU backend against the reference, on ragged, poisoned, GQA problems (hypothesis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference
from paged_problems import problems


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def assert_no_nan(*tensors):
    for t in tensors:
        assert not torch.isnan(t).any()


@settings(max_examples=40, deadline=None)
@given(problems(dtypes=("fp32", "fp16", "bf16"), max_query_tokens=4))
def test_dense_matches_reference(p):
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    out, lse = tinyattn.paged_attention(*args, return_lse=True, backend="torch")
    ref, ref_lse = reference.paged_attention(*args, return_lse=True)
    assert_no_nan(out, lse)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[p.q.dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(problems(max_query_tokens=3), st.integers(1, 5), st.integers(0, 2), st.integers(0, 2))
def test_scores_selection_and_sparse_match_reference(p, budget, sinks, recent):
    k_min, k_max = p.bounds()
    Tq = p.q.shape[1]
    needed = max([-(-int(n) // p.page_size) - max(int(n) - Tq, 0) // p.page_size for n in p.seq_lens] + [1])
    budget = max(budget, needed, sinks + max(recent, 1))               # a smaller budget raises (issue 15)
    scores = tinyattn.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=p.page_size, backend="torch")
    ref_scores = reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=p.page_size)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=1e-5)
    opts = dict(page_size=p.page_size, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent,
                num_query_tokens=Tq)
    kept = tinyattn.select_pages(ref_scores, p.seq_lens, **opts, backend="torch")
    assert torch.equal(kept, reference.select_pages(ref_scores, p.seq_lens, **opts))
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    out, lse = tinyattn.sparse_paged_attention(*args, page_indices=kept, return_lse=True, backend="torch")
    ref, ref_lse = reference.sparse_paged_attention(*args, page_indices=kept, return_lse=True)
    assert_no_nan(out, lse)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float64_is_computed_in_float64(dtype):
    """The torch backend keeps fp64 for gradcheck-style uses; fp32 inputs give fp32 outputs."""
    from paged_problems import make_problem
    p = make_problem(3, batch=2, seq_lens=[7, 3], page_size=4, num_kv_heads=1, group=2, head_dim=8, dtype=dtype)
    out = tinyattn.paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend="torch")
    assert out.dtype == dtype
    ref = reference.paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    torch.testing.assert_close(out, ref, atol=1e-12 if dtype == torch.float64 else 1e-5, rtol=1e-6)
