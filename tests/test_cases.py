"""The fault kinds 1-7 of the project's CASES.md (faults real users hit in this kind of code), each as its own test, on both backends.

Expected values always come from ``tinyattn.reference`` (or from a second run whose answer must not
move). The Triton backend runs in the interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference
from paged_problems import make_problem, relocate

BACKENDS = ["torch", "triton"]
TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def run_both(p, backend, *, page_indices=None, **sparse):
    """(out, lse) of the op under test and of the reference, sparse when page_indices/k_min are given."""
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    if page_indices is None and not sparse:
        got = tinyattn.paged_attention(*args, return_lse=True, backend=backend)
        return got, reference.paged_attention(*args, return_lse=True)
    got = tinyattn.sparse_paged_attention(*args, page_indices=page_indices, return_lse=True, backend=backend, **sparse)
    return got, reference.sparse_paged_attention(*args, page_indices=page_indices, return_lse=True, **sparse)


def assert_matches(got, want, dtype=torch.float32):
    (out, lse), (ref, ref_lse) = got, want
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-3 if dtype != torch.float32 else 1e-4, rtol=1e-4)


# ---- 1. ragged tails --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_1_ragged_tails_around_page_boundaries(backend, page_size):
    lens = [1, page_size - 1 or 1, page_size, page_size + 1, 2 * page_size, 2 * page_size + 3]
    p = make_problem(10 + page_size, batch=len(lens), seq_lens=lens, page_size=page_size, num_kv_heads=2, group=2,
                     head_dim=16, spare_columns=2)
    assert_matches(*run_both(p, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_1_output_ignores_pool_table_size_and_poisoned_slots(backend):
    p = make_problem(7, batch=3, seq_lens=[5, 9, 16], page_size=4, num_kv_heads=1, group=3, head_dim=8)
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    base, base_lse = tinyattn.paged_attention(*args, return_lse=True, backend=backend)
    for seed, (poison, num_pages, spare) in enumerate([(float("nan"), 9, 0), (1e30, 60, 5), (-1e30, 12, 2)]):
        moved = relocate(p, num_pages=num_pages, spare_columns=spare, poison=poison, seed=seed)
        out, lse = tinyattn.paged_attention(moved.q, moved.k_cache, moved.v_cache, moved.block_table,
                                            moved.seq_lens, return_lse=True, backend=backend)
        torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, base_lse, atol=1e-6, rtol=1e-6)


# ---- 2. empty and fully masked rows -----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_2_empty_rows_give_zeros_and_neg_inf_lse(backend):
    p = make_problem(20, batch=3, seq_lens=[0, 6, 0], page_size=4, num_kv_heads=2, group=2, head_dim=16,
                     num_query_tokens=1)
    (out, lse), want = run_both(p, backend)
    assert_matches((out, lse), want)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert torch.isneginf(lse[[0, 2]]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_2_queries_before_the_first_key_see_nothing(backend):
    p = make_problem(21, batch=2, seq_lens=[2, 5], page_size=4, num_kv_heads=1, group=2, head_dim=8,
                     num_query_tokens=4)      # row 0: queries at positions -2, -1 see nothing
    (out, lse), want = run_both(p, backend)
    assert_matches((out, lse), want)
    assert torch.isneginf(lse[0, :2]).all() and torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_2_very_negative_logits_are_not_masked_by_a_finite_minus_infinity(backend):
    # all logits around -1e5: a kernel using -1e4 as "minus infinity" would get them wrong
    p = make_problem(22, batch=2, seq_lens=[7, 12], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    p.k_cache = p.k_cache.abs() + 1.0
    p.q = -p.q.abs() * 3e4
    assert_matches(*run_both(p, backend))


# ---- 3. offset overflow ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_3_block_table_with_large_page_ids(backend):
    """Rows whose pages sit at the top of a pool of 20k pages (int64 offsets on the index path)."""
    p = make_problem(30, batch=2, seq_lens=[9, 5], page_size=4, num_kv_heads=1, group=2, head_dim=8, extra_pages=0)
    num_pages = 20000
    k = torch.full((num_pages, 4, 1, 8), float("nan"))
    v = torch.full((num_pages, 4, 1, 8), float("nan"))
    high = torch.arange(num_pages - 5, num_pages)
    old = p.block_table.clone()
    table = torch.full_like(p.block_table, -1)
    i = 0
    for b, n in enumerate([9, 5]):
        for j in range(-(-n // 4)):
            k[high[i]], v[high[i]] = p.k_cache[old[b, j]], p.v_cache[old[b, j]]
            table[b, j] = high[i]
            i += 1
    got = tinyattn.paged_attention(p.q, k, v, table, p.seq_lens, backend=backend)
    want = reference.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


# ---- 4. shape generality -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(8, 4, 2), (24, 1, 3), (80, 2, 5), (96, 1, 1), (40, 3, 1)])
def test_4_odd_head_dims_gqa_ratios_and_mqa(backend, head_dim, num_kv_heads, group):
    p = make_problem(40 + head_dim, batch=2, seq_lens=[13, 6], page_size=4, num_kv_heads=num_kv_heads,
                     group=group, head_dim=head_dim, num_query_tokens=2)
    assert_matches(*run_both(p, backend))


# ---- 5. layout, dtype and index validation -------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_5_non_contiguous_q_gives_the_same_answer(backend):
    p = make_problem(50, batch=3, seq_lens=[5, 11, 2], page_size=4, num_kv_heads=2, group=2, head_dim=16)
    q = p.q[:, 0]
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)                     # same values, other strides
    q_slice = torch.cat([q, q], dim=-1)[..., :16]                            # a slice view
    args = (p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    want = reference.paged_attention(q, *args)
    for view in (q_t, q_slice):
        assert not view.is_contiguous()
        torch.testing.assert_close(tinyattn.paged_attention(view, *args, backend=backend), want, **TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_5_int64_tables_are_accepted(backend):
    p = make_problem(51, batch=2, seq_lens=[5, 11], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    got = tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table.long(), p.seq_lens.long(),
                                   backend=backend)
    torch.testing.assert_close(got, reference.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens))


# ---- 6. precision ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_6_low_precision_error_within_twice_torch_own_error(backend, dtype):
    """Error vs the fp32 reference at most 2x that of the same math done by PyTorch in the input dtype."""
    p32 = make_problem(60, batch=2, seq_lens=[150, 77], page_size=16, num_kv_heads=2, group=2, head_dim=64,
                       logit_scale=2.0)
    p = make_problem(60, batch=2, seq_lens=[150, 77], page_size=16, num_kv_heads=2, group=2, head_dim=64,
                     dtype=dtype, logit_scale=2.0)
    want = reference.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)   # fp32 math
    got = tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend=backend)
    # PyTorch in the input dtype: reference math done in low precision
    lowp = reference.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens).to(dtype)
    naive = _naive_lowp(p)
    base_err = (naive.float() - want.float()).abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2 * base_err + 1e-6, (err, base_err)
    assert lowp.dtype == dtype and p32.q.dtype == torch.float32


def _naive_lowp(p):
    """Attention with every op in the input dtype (as a user's eager PyTorch code would compute it)."""
    out = torch.zeros_like(p.q[:, 0])
    G = p.q.shape[2] // p.num_kv_heads
    for b in range(p.q.shape[0]):
        n = int(p.seq_lens[b])
        idx = [int(p.block_table[b, t // p.page_size]) for t in range(n)]
        k = torch.stack([p.k_cache[i, t % p.page_size] for t, i in enumerate(idx)])       # [n, Hkv, D]
        v = torch.stack([p.v_cache[i, t % p.page_size] for t, i in enumerate(idx)])
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        logits = torch.einsum("hd,nhd->hn", p.q[b, 0], k) * (p.q.shape[-1] ** -0.5)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(logits, -1), v)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_6_lse_is_natural_log_and_scaled_once(backend):
    p = make_problem(61, batch=1, seq_lens=[3], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    _, lse = tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, scale=0.5,
                                      return_lse=True, backend=backend)
    k = p.k_cache[p.block_table[0, 0], :3, 0].float()
    expected = torch.logsumexp(0.5 * (k @ p.q[0, 0, 0].float()), 0)          # independent closed form
    torch.testing.assert_close(lse[0, 0, 0], expected, atol=1e-5, rtol=1e-5)


# ---- 7. top-k / page selection ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_7_ties_go_to_the_lower_page_index(backend):
    scores = torch.tensor([[[1.0, 5.0, 5.0, 5.0, 0.0, 5.0, 2.0]]])
    got = tinyattn.select_pages(scores, torch.tensor([28], dtype=torch.int32), page_size=4, page_budget=3,
                                backend=backend)
    assert got.tolist() == [[[1, 2, 6]]]                                    # recent page 6, then 1 and 2 of the ties
    want = reference.select_pages(scores, torch.tensor([28]), page_size=4, page_budget=3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_7_padding_never_outranks_a_real_minus_inf_score(backend):
    scores = torch.tensor([[[float("-inf"), float("-inf"), float("-inf"), 9.0, 9.0]]])
    got = tinyattn.select_pages(scores, torch.tensor([10], dtype=torch.int32), page_size=4, page_budget=3,
                                num_recent_pages=1, backend=backend)
    assert got.tolist() == [[[0, 1, 2]]]                                    # pages 3, 4 are past the end


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_7_selection_properties(backend, data):
    B, Hkv, P = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    lens = torch.tensor([data.draw(st.integers(0, P * page_size)) for _ in range(B)], dtype=torch.int32)
    raw = data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, -1.0, float("-inf"), 3.5]), min_size=B * Hkv * P,
                             max_size=B * Hkv * P))
    scores = torch.tensor(raw).reshape(B, Hkv, P)
    sinks, recent = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    forced = sinks + max(recent, 1)                                  # a smaller budget raises (issue 15)
    opts = dict(page_size=page_size, page_budget=data.draw(st.integers(forced, max(forced, P + 2))),
                num_sink_pages=sinks, num_recent_pages=recent)
    got = tinyattn.select_pages(scores, lens, **opts, backend=backend)
    assert torch.equal(got, reference.select_pages(scores, lens, **opts))
    n_valid = (lens + page_size - 1) // page_size
    for b in range(B):
        for h in range(Hkv):
            kept = [j for j in got[b, h].tolist() if j >= 0]
            assert kept == sorted(set(kept)) and all(j < n_valid[b] for j in kept)
            assert len(kept) == min(opts["page_budget"], int(n_valid[b]))
            if n_valid[b]:
                assert int(n_valid[b]) - 1 in kept                          # the partial last page


@pytest.mark.parametrize("backend", BACKENDS)
def test_7_budget_covering_every_page_equals_dense(backend):
    p = make_problem(70, batch=3, seq_lens=[33, 7, 0], page_size=4, num_kv_heads=2, group=2, head_dim=16)
    k_min, k_max = p.bounds()
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    sparse = tinyattn.sparse_paged_attention(*args, k_min=k_min, k_max=k_max, page_budget=9, backend=backend)
    dense = tinyattn.paged_attention(*args, backend=backend)
    torch.testing.assert_close(sparse, dense, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_7_duplicates_and_pages_past_the_end_are_ignored(backend):
    p = make_problem(71, batch=2, seq_lens=[20, 9], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    clean = torch.tensor([[[0, 2, 4, -1]], [[1, 2, -1, -1]]], dtype=torch.int32)
    messy = torch.tensor([[[4, 2, 2, 0, 0, 99]], [[2, -1, 1, 7, 2, 3]]], dtype=torch.int32)   # row 1 has 3 pages
    args = (p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    got = tinyattn.sparse_paged_attention(*args, page_indices=messy, backend=backend)
    want = reference.sparse_paged_attention(*args, page_indices=clean)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_7_large_budgets_with_ties_match_reference(backend, data):
    """Budgets above the kernel's radix-select threshold (16 pages), with ties, -inf and NaN scores."""
    B, Hkv, P = 2, 2, data.draw(st.integers(20, 140))
    lens = torch.tensor([data.draw(st.integers(0, 4 * P)) for _ in range(B)], dtype=torch.int32)
    pool = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf"), float("nan"), 3.5, -0.0, 1e30])
    choice = torch.tensor(data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=B * Hkv * P,
                                             max_size=B * Hkv * P)))
    scores = torch.where(torch.rand(B, Hkv, P, generator=torch.Generator().manual_seed(P)) < 0.5,
                         pool[choice].reshape(B, Hkv, P), torch.randn(B, Hkv, P))
    sinks, recent = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 20))
    opts = dict(page_size=4, page_budget=data.draw(st.integers(max(17, sinks + max(recent, 1)), P + 3)),
                num_sink_pages=sinks, num_recent_pages=recent)
    got = tinyattn.select_pages(scores, lens, **opts, backend=backend)
    assert torch.equal(got, reference.select_pages(scores, lens, **opts))
