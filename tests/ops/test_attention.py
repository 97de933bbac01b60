"""Attention (``tinyattn.ops.attention``: dense and sparse paged attention) on both backends against the reference.

Proven here, for the Triton kernels in the interpreter and the torch backend, with expected values from
``tinyattn.reference`` (fp32 loops), fp64 math or plain masked softmax written in the test:

- dense / sparse outputs and lse over drawn problems (:func:`paged_problems.laid_out_problems`: ragged rows around
  page boundaries, page sizes 1..32, head dims that are not powers of two, GQA / MQA, Tq > 1, shuffled and in-order
  tables, poisoned slots, non-contiguous q / out / interleaved K and V); selecting every page equals dense; physical
  page order does not matter;
- CASES.md kinds 1-7 on the public ops: ragged tails, poisoned slots and spare table columns, empty rows (zeros and
  lse = -inf), very negative logits, large page ids and offsets past 2**31 elements, odd head dims, strided q, int64
  tables, fp16 / bf16 within twice torch's own error, the natural-log lse, listed pages with duplicates;
- empty inputs (B = 0, width-0 tables, an empty pool, Tq = 0, a budget of 0);
- split-K: the Triton split (``num_splits``) and the torch backend's cache-sized key chunks merge to the same answer;
- the torch plan's routes (fresh / chunked prefill with SDPA, dense decode, views of an in-order pool);
- sliding windows (``window_left``) and long windowed prefills in query blocks.

Tolerance (STYLE.md, flash-attention's rule): a kernel's max error against the fp32 reference is at most 2x that of
the same attention computed by PyTorch in the input dtype, plus a small floor.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn.kernels.attention import choose_num_splits
from tinyattn.ops.attention import torch_impl as attention_torch
from tinyattn.ops.attention import triton_impl as attention_triton
from tinyattn.ops.kv_cache import triton_impl as kv_cache_triton
from tinyattn.ops.plan import PagedAttentionPlan
from tinyattn.ops.selection import triton_impl as selection_triton
from tinyattn import reference

from paged_problems import (BACKENDS, SLOW_TRITON, empty_batch, interleave_kv, laid_out_problems, make_problem,
    problems, relayout, relocate, tiers, windows)


ATOL_FLOOR = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def empty_out(q: torch.Tensor, layout: str):
    """NaN-filled ``out`` like q (in ``layout``) and ``lse`` (transposed view), so unwritten entries show."""
    out = relayout(torch.full(q.shape, math.nan, dtype=q.dtype), layout)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan).transpose(1, 2)
    return out, lse


def n_pages(seq_len: int, page_size: int) -> int:
    return -(-int(seq_len) // page_size)


def random_selection(p, budget: int, seed: int) -> torch.Tensor:
    """Canonical page_indices [B, Hkv, budget]: a random subset of each row's valid pages, ascending, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv = p.q.shape[0], p.num_kv_heads
    idx = torch.full((B, Hkv, budget), -1, dtype=torch.int32)
    for b in range(B):
        n = n_pages(p.seq_lens[b], p.page_size)
        for h in range(Hkv):
            keep = int(torch.randint(0, min(n, budget) + 1, (1,), generator=g))
            pages = torch.randperm(n, generator=g)[:keep].sort().values
            idx[b, h, :keep] = pages.to(torch.int32)
    return idx


# ----------------------------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------------------------
def lowp_attention(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale):
    """Attention done by PyTorch in the input dtype (logits, softmax and P @ V rounded): torch's own error."""
    B, Tq, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros_like(q)
    for b in range(B):
        n_tok = int(seq_lens[b])
        for h in range(Hkv):
            if page_indices is None:
                pages = range(n_pages(n_tok, page_size))
            else:
                pages = [int(j) for j in page_indices[b, h] if 0 <= int(j) < n_pages(n_tok, page_size)]
            if not pages:
                continue
            phys = block_table[b, list(pages)].long()
            pos = (torch.tensor(list(pages))[:, None] * page_size + torch.arange(page_size)).reshape(-1)
            keep = pos < n_tok
            k = k_cache[phys, :, h].reshape(-1, D)[keep]
            v = v_cache[phys, :, h].reshape(-1, D)[keep]
            qg = q[b, :, h * G:(h + 1) * G]  # [Tq, G, D]
            logits = (qg @ k.T) * scale  # [Tq, G, N] in q.dtype
            q_pos = n_tok - Tq + torch.arange(Tq)
            mask = pos[keep][None, None, :] <= q_pos[:, None, None]
            probs = torch.softmax(logits.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0)
            out[b, :, h * G:(h + 1) * G] = probs @ v
    return out


def ref_attention(p, q, k, v, page_indices, scale):
    """fp32 reference output and lse (the reference upcasts; we hand it fp32 copies to keep out in fp32)."""
    args = (q.float(), k.float(), v.float(), p.block_table, p.seq_lens)
    if page_indices is None:
        return reference.paged_attention(*args, scale=scale, return_lse=True)
    return reference.sparse_paged_attention(*args, page_indices=page_indices, scale=scale, return_lse=True)


def run_attention(p, q, k, v, page_indices, scale, layout="contiguous", num_splits=None):
    out, lse = empty_out(q, layout)
    attention_triton.paged_attention(q, k, v, p.block_table, p.seq_lens, page_indices=page_indices, scale=scale, out=out,
                      lse=lse, num_splits=num_splits)
    return out, lse


def check_attention(p, out, lse, page_indices, scale, q, k, v):
    """NaN check, empty rows, then error vs the fp32 reference bounded by 2x torch's low-precision error."""
    assert not out.isnan().any() and not lse.isnan().any()
    ref_out, ref_lse = ref_attention(p, q, k, v, page_indices, scale)
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead)  # lse = -inf exactly where no key is visible
    assert (out.float()[dead] == 0).all()
    err = (out.float() - ref_out).abs().max().item() if out.numel() else 0.0
    if q.dtype == torch.float32:
        base = 0.0
    else:
        lowp = lowp_attention(q, k, v, p.block_table, p.seq_lens, page_indices, scale)
        base = (lowp.float() - ref_out).abs().max().item()
    assert err <= 2 * base + ATOL_FLOOR[q.dtype], (err, base)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# the Triton kernels against the reference (drawn problems), split-K, 64-bit offsets
# ----------------------------------------------------------------------------------------------------------------
@tiers(2, 20)
def test_dense_attention_matches_reference(examples):
    @settings(max_examples=examples, deadline=None)
    @given(laid_out_problems(), st.sampled_from([None, 1, 2, 3, 7]), st.booleans())
    def check(case, num_splits, interleaved):
        p, layout = case
        q = relayout(p.q, layout)
        k, v = interleave_kv(p.k_cache, p.v_cache) if interleaved else (p.k_cache, p.v_cache)
        scale = p.q.shape[-1] ** -0.5
        out, lse = run_attention(p, q, k, v, None, scale, layout, num_splits)
        check_attention(p, out, lse, None, scale, q, k, v)

    check()


@tiers(4, 20)
def test_sparse_attention_matches_reference(examples):
    @settings(max_examples=examples, deadline=None)
    @given(laid_out_problems(), st.integers(1, 6), st.sampled_from([None, 1, 3]), st.integers(0, 2**31 - 1))
    def check(case, budget, num_splits, seed):
        p, layout = case
        q = relayout(p.q, layout)
        idx = random_selection(p, budget, seed)
        scale = 0.7 * p.q.shape[-1] ** -0.5
        out, lse = run_attention(p, q, p.k_cache, p.v_cache, idx, scale, layout, num_splits)
        check_attention(p, out, lse, idx, scale, q, p.k_cache, p.v_cache)

    check()


@tiers(2, 5)
def test_bf16_attention_matches_reference(examples):
    @settings(max_examples=examples, deadline=None)
    @given(laid_out_problems(dtypes=("bf16",), max_pages_per_row=3), st.sampled_from([None, 2]))
    def check(case, num_splits):
        p, layout = case
        scale = p.q.shape[-1] ** -0.5
        out, lse = run_attention(p, p.q, p.k_cache, p.v_cache, None, scale, layout, num_splits)
        check_attention(p, out, lse, None, scale, p.q, p.k_cache, p.v_cache)

    check()


@tiers(3, 10)
def test_selecting_every_page_equals_dense(examples):
    @settings(max_examples=examples, deadline=None)
    @given(laid_out_problems(dtypes=("fp32", "fp16")), st.integers(0, 3))
    def check(case, extra):
        p, _ = case
        B, Hkv, page_size = p.q.shape[0], p.num_kv_heads, p.page_size
        idx = torch.full((B, Hkv, p.block_table.shape[1] + extra), -1, dtype=torch.int32)
        for b in range(B):
            n = n_pages(p.seq_lens[b], page_size)
            idx[b, :, :n] = torch.arange(n, dtype=torch.int32)
        scale = p.q.shape[-1] ** -0.5
        dense = run_attention(p, p.q, p.k_cache, p.v_cache, None, scale, num_splits=1)
        sparse = run_attention(p, p.q, p.k_cache, p.v_cache, idx, scale, num_splits=1)
        # the same token stream, only extra fully-masked tiles (alpha = 1, p = 0): bitwise equal
        assert torch.equal(dense[0], sparse[0]) and torch.equal(dense[1], sparse[1])

    check()


@tiers(3, 10)
def test_permuting_physical_pages_leaves_output_unchanged(examples):
    @settings(max_examples=examples, deadline=None)
    @given(laid_out_problems(dtypes=("fp32", "fp16")), st.booleans(), st.integers(0, 2**31 - 1))
    def check(case, sparse, seed):
        p, _ = case
        g = torch.Generator().manual_seed(seed)
        num_pages = p.k_cache.shape[0]
        perm = torch.randperm(num_pages, generator=g)  # page i moves to perm[i]
        k2, v2 = torch.empty_like(p.k_cache), torch.empty_like(p.v_cache)
        k2[perm], v2[perm] = p.k_cache, p.v_cache
        bt2 = p.block_table.clone()
        for b in range(bt2.shape[0]):
            n = n_pages(p.seq_lens[b], p.page_size)
            bt2[b, :n] = perm[p.block_table[b, :n].long()].to(torch.int32)
        idx = random_selection(p, 4, seed) if sparse else None
        scale = p.q.shape[-1] ** -0.5
        a = run_attention(p, p.q, p.k_cache, p.v_cache, idx, scale)
        out, lse = empty_out(p.q, "contiguous")
        attention_triton.paged_attention(p.q, k2, v2, bt2, p.seq_lens, page_indices=idx, scale=scale, out=out, lse=lse)
        assert torch.equal(a[0], out) and torch.equal(a[1], lse)

    check()


@pytest.mark.slow
@pytest.mark.parametrize("dtype,sparse", [(torch.float32, False), (torch.float32, True), (torch.float16, False)])
def test_split_k_gives_the_same_answer(dtype, sparse):
    # rows of 5 and 4 iterations of BLOCK_N = 64 tokens, a short one and an empty one: with 7 splits
    # some splits of every row are empty and must merge as weight 0
    p = make_problem(7, batch=4, seq_lens=[300, 5, 0, 200], page_size=16, num_kv_heads=2, group=3,
                     head_dim=40, num_query_tokens=3, dtype=dtype)
    idx = random_selection(p, 16, 3) if sparse else None
    scale = 40 ** -0.5
    outs = [run_attention(p, p.q, p.k_cache, p.v_cache, idx, scale, num_splits=s) for s in (1, 2, 3, 7)]
    check_attention(p, *outs[0], idx, scale, p.q, p.k_cache, p.v_cache)
    for out, lse in outs[1:]:
        # partials are merged in fp32: only the final rounding to the output dtype differs
        torch.testing.assert_close(out, outs[0][0], atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=1e-3)
        torch.testing.assert_close(lse, outs[0][1], atol=1e-5, rtol=1e-5)


def test_num_splits_heuristic():
    # short contexts and full grids: no split; long decode with a small batch: fill the SMs
    assert choose_num_splits(num_programs=8, max_tokens=256, block_n=64, num_sms=132) == 1
    assert choose_num_splits(num_programs=512, max_tokens=1 << 15, block_n=64, num_sms=132) == 1
    s = choose_num_splits(num_programs=8, max_tokens=1 << 15, block_n=64, num_sms=132)
    assert 8 <= s <= 64 and 8 * s >= 132


def test_empty_rows_and_very_negative_logits():
    # rows: empty, shorter than Tq (first queries see nothing), normal; logits around -1e4 stay finite
    p = make_problem(1, batch=3, seq_lens=[0, 2, 9], page_size=4, num_kv_heads=1, group=2, head_dim=16,
                     num_query_tokens=4)
    k = p.k_cache.clone()
    k[p.k_cache.isfinite()] = k[p.k_cache.isfinite()].abs() + 1.0
    q = -p.q.abs() - 1.0  # q.k < 0 everywhere, scaled by 300: logits ~ -1e4
    for num_splits in (1, 3):
        out, lse = run_attention(p, q, k, p.v_cache, None, 300.0, num_splits=num_splits)
        check_attention(p, out, lse, None, 300.0, q, k, p.v_cache)
        assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :2]).all()
        assert (lse[2] < -1000).all() and lse[2].isfinite().all()


def big_pool(page_size, num_kv_heads, head_dim, dtype, num_used):
    """A pool of > 2**31 elements per page stride step whose last ``num_used`` pages are the only ones touched.

    ``new_empty`` of a few GiB only reserves address space (pages are committed when written), and the
    interpreter hands CPU storages to the kernel without copying. K and V interleave page by page
    (page stride 2 * page_size * Hkv * D), so ``page_id * stride`` is above 2**31 for every used page.
    """
    page_elems = page_size * num_kv_heads * head_dim
    num_pages = (2**31) // (2 * page_elems) + num_used + 1
    buf = torch.zeros(0, dtype=dtype).new_empty(num_pages * 2 * page_elems)
    kv = buf.view(num_pages, 2, page_size, num_kv_heads, head_dim)
    return kv[:, 0], kv[:, 1], num_pages


def test_pages_past_2_pow_31_elements():
    """64-bit offsets (CASES.md 3): the same pages at ids whose element offset exceeds 2**31 give the same answer."""
    p = make_problem(3, batch=2, seq_lens=[37, 20], page_size=8, num_kv_heads=2, group=2, head_dim=64,
                     num_query_tokens=2, dtype=torch.float16, poison=0.0)
    small_pool_pages = p.k_cache.shape[0]
    k_big, v_big, num_pages = big_pool(8, 2, 64, torch.float16, small_pool_pages)
    base = num_pages - small_pool_pages  # every used id * page stride > 2**31
    assert base * k_big.stride(0) > 2**31
    k_big[base:], v_big[base:] = p.k_cache, p.v_cache
    bt_big = p.block_table.clone()
    for b in range(2):
        n = n_pages(p.seq_lens[b], 8)
        bt_big[b, :n] += base
    scale = 0.125
    for idx in (None, random_selection(p, 3, 0)):
        small = run_attention(p, p.q, p.k_cache, p.v_cache, idx, scale)
        out, lse = empty_out(p.q, "contiguous")
        attention_triton.paged_attention(p.q, k_big, v_big, bt_big, p.seq_lens, page_indices=idx, scale=scale, out=out, lse=lse)
        assert torch.equal(small[0], out) and torch.equal(small[1], lse)
    # metadata and scores read the same pool (and bounds with a page stride just as large)
    lo, hi, _ = big_pool(8, 2, 64, torch.float16, small_pool_pages)
    k_min, k_max = lo[:, 0], hi[:, 0]  # [num_pages, Hkv, D], page stride 2 * page_size * Hkv * D
    kv_cache_triton.update_page_metadata(k_big, bt_big, p.seq_lens, k_min, k_max)
    ref_min, ref_max = torch.zeros(small_pool_pages, 2, 64, dtype=torch.float16), torch.zeros(small_pool_pages, 2, 64, dtype=torch.float16)
    kv_cache_triton.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, ref_min, ref_max)
    used = bt_big[0, :5].long()
    assert torch.equal(k_min[used], ref_min[used - base]) and torch.equal(k_max[used], ref_max[used - base])
    s_big, s_small = torch.empty(2, 2, bt_big.shape[1]), torch.empty(2, 2, bt_big.shape[1])
    selection_triton.page_scores(p.q, k_min, k_max, bt_big, p.seq_lens, page_size=8, out=s_big)
    selection_triton.page_scores(p.q, ref_min, ref_max, p.block_table, p.seq_lens, page_size=8, out=s_small)
    assert torch.equal(s_big, s_small)


# ---- the public ops against the reference: CASES.md kinds 1-7 (ragged tails, poisoned slots, empty rows, very negative
# logits, large page ids, odd head dims / GQA / MQA, strided q, int64 tables, low precision, lse, listed pages) ----------
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_ragged_tails_around_page_boundaries(backend, page_size):
    lens = [1, page_size - 1 or 1, page_size, page_size + 1, 2 * page_size, 2 * page_size + 3]
    p = make_problem(10 + page_size, batch=len(lens), seq_lens=lens, page_size=page_size, num_kv_heads=2, group=2,
                     head_dim=16, spare_columns=2)
    assert_matches(*run_both(p, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_ignores_pool_table_size_and_poisoned_slots(backend):
    p = make_problem(7, batch=3, seq_lens=[5, 9, 16], page_size=4, num_kv_heads=1, group=3, head_dim=8)
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    base, base_lse = tinyattn.paged_attention(*args, return_lse=True, backend=backend)
    for seed, (poison, num_pages, spare) in enumerate([(float("nan"), 9, 0), (1e30, 60, 5), (-1e30, 12, 2)]):
        moved = relocate(p, num_pages=num_pages, spare_columns=spare, poison=poison, seed=seed)
        out, lse = tinyattn.paged_attention(moved.q, moved.k_cache, moved.v_cache, moved.block_table,
                                            moved.seq_lens, return_lse=True, backend=backend)
        torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, base_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_give_zeros_and_neg_inf_lse(backend):
    p = make_problem(20, batch=3, seq_lens=[0, 6, 0], page_size=4, num_kv_heads=2, group=2, head_dim=16,
                     num_query_tokens=1)
    (out, lse), want = run_both(p, backend)
    assert_matches((out, lse), want)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert torch.isneginf(lse[[0, 2]]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_queries_before_the_first_key_see_nothing(backend):
    p = make_problem(21, batch=2, seq_lens=[2, 5], page_size=4, num_kv_heads=1, group=2, head_dim=8,
                     num_query_tokens=4)      # row 0: queries at positions -2, -1 see nothing
    (out, lse), want = run_both(p, backend)
    assert_matches((out, lse), want)
    assert torch.isneginf(lse[0, :2]).all() and torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_very_negative_logits_are_not_masked_by_a_finite_minus_infinity(backend):
    # all logits around -1e5: a kernel using -1e4 as "minus infinity" would get them wrong
    p = make_problem(22, batch=2, seq_lens=[7, 12], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    p.k_cache = p.k_cache.abs() + 1.0
    p.q = -p.q.abs() * 3e4
    assert_matches(*run_both(p, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_table_with_large_page_ids(backend):
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(8, 4, 2), (24, 1, 3), (80, 2, 5), (96, 1, 1), (40, 3, 1)])
def test_odd_head_dims_gqa_ratios_and_mqa(backend, head_dim, num_kv_heads, group):
    p = make_problem(40 + head_dim, batch=2, seq_lens=[13, 6], page_size=4, num_kv_heads=num_kv_heads,
                     group=group, head_dim=head_dim, num_query_tokens=2)
    assert_matches(*run_both(p, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_q_gives_the_same_answer(backend):
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
def test_int64_tables_are_accepted(backend):
    p = make_problem(51, batch=2, seq_lens=[5, 11], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    got = tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table.long(), p.seq_lens.long(),
                                   backend=backend)
    torch.testing.assert_close(got, reference.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_error_within_twice_torch_own_error(backend, dtype):
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
def test_lse_is_natural_log_and_scaled_once(backend):
    p = make_problem(61, batch=1, seq_lens=[3], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    _, lse = tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, scale=0.5,
                                      return_lse=True, backend=backend)
    k = p.k_cache[p.block_table[0, 0], :3, 0].float()
    expected = torch.logsumexp(0.5 * (k @ p.q[0, 0, 0].float()), 0)          # independent closed form
    torch.testing.assert_close(lse[0, 0, 0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_covering_every_page_equals_dense(backend):
    p = make_problem(70, batch=3, seq_lens=[33, 7, 0], page_size=4, num_kv_heads=2, group=2, head_dim=16)
    k_min, k_max = p.bounds()
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    sparse = tinyattn.sparse_paged_attention(*args, k_min=k_min, k_max=k_max, page_budget=9, backend=backend)
    dense = tinyattn.paged_attention(*args, backend=backend)
    torch.testing.assert_close(sparse, dense, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicates_and_pages_past_the_end_are_ignored(backend):
    p = make_problem(71, batch=2, seq_lens=[20, 9], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    clean = torch.tensor([[[0, 2, 4, -1]], [[1, 2, -1, -1]]], dtype=torch.int32)
    messy = torch.tensor([[[4, 2, 2, 0, 0, 99]], [[2, -1, 1, 7, 2, 3]]], dtype=torch.int32)   # row 1 has 3 pages
    args = (p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    got = tinyattn.sparse_paged_attention(*args, page_indices=messy, backend=backend)
    want = reference.sparse_paged_attention(*args, page_indices=clean)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


# ---- empty inputs (B = 0, a table of width 0, an empty pool, Tq = 0, a budget of 0): zeros and lse = -inf (DESIGN.md §2)
def test_torch_backend_empty_batch_dense():
    q, k, v, bt, sl = empty_batch()
    out, lse = tinyattn.paged_attention(q, k, v, bt, sl, backend="torch", return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


def test_torch_backend_empty_batch_sparse():
    q, k, v, bt, sl = empty_batch()
    out = tinyattn.sparse_paged_attention(q, k, v, bt, sl, k_min=k[:, 0], k_max=k[:, 0], page_budget=2,
                                          backend="torch")
    assert out.shape == (0, 2, 8)


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
    ref_out, ref_lse = reference.paged_attention(q, k, k, bt, sl, return_lse=True)
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
    ref_out, ref_lse = reference.sparse_paged_attention(q, k, v, bt, sl, page_indices=pi, return_lse=True)
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(lse, ref_lse)


def test_torch_backend_zero_query_tokens():
    q = torch.randn(2, 0, 1, 8)
    k = torch.randn(1, 4, 1, 8)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    sl = torch.zeros(2, dtype=torch.int32)
    out, lse = tinyattn.paged_attention(q, k, k, bt, sl, backend="torch", return_lse=True)
    assert out.shape == (2, 0, 1, 8) and lse.shape == (2, 0, 1)


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


# ---- the vectorised torch backend against the reference on drawn problems (ragged, poisoned, GQA, fp16 / bf16, fp64) --
TORCH_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def assert_no_nan(*tensors):
    for t in tensors:
        assert not torch.isnan(t).any()


@settings(max_examples=40, deadline=None)
@given(problems(dtypes=("fp32", "fp16", "bf16"), max_query_tokens=4))
def test_torch_backend_dense_matches_reference(p):
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    out, lse = tinyattn.paged_attention(*args, return_lse=True, backend="torch")
    ref, ref_lse = reference.paged_attention(*args, return_lse=True)
    assert_no_nan(out, lse)
    torch.testing.assert_close(out.float(), ref.float(), **TORCH_TOL[p.q.dtype])
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
    torch.testing.assert_close(out, ref, **TORCH_TOL[torch.float32])
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


# ---- large steps attend in cache-sized chunks of keys (the torch backend's split-K): thresholds shrunk so small
# problems take the chunked path; the same output and lse as the reference ---------------------------------------
def _tiny_chunks(mp):
    """Every gather is 'large' and a chunk holds 16 keys (one to a few pages)."""
    mp.setattr(attention_torch, "MIN_BYTES", 0)
    mp.setattr(attention_torch, "CHUNK_BYTES", 1)
    mp.setattr(attention_torch, "MAX_THREADS", 1 << 20)       # whatever torch's thread count


@pytest.fixture
def tiny_chunks(monkeypatch):
    _tiny_chunks(monkeypatch)


def _chunk_calls(monkeypatch):
    calls = []
    real = attention_torch.attend_chunked

    def counting(*args, **kwargs):
        calls.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_torch, "attend_chunked", counting)
    return calls


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(0, 70), min_size=1, max_size=3),
       page_size=st.sampled_from([4, 16]), group=st.sampled_from([1, 3]), Tq=st.sampled_from([1, 2]),
       budget=st.sampled_from([None, 2, 3]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_chunked_steps_match_the_reference(seed, lens, page_size, group, Tq, budget, dtype):
    """Dense and Quest-sparse steps, rows of unequal and zero length, NaN in every unowned slot, Tq = 1 or 2,
    fp32 / fp64: out and lse equal the reference's, and the chunked path really ran."""
    if Tq > 1:
        lens = [max(n, Tq) for n in lens]
        budget = None if budget is None else max(budget, 2 + -(-Tq // page_size))
    p = make_problem(seed, batch=len(lens), seq_lens=lens, page_size=page_size, num_kv_heads=2, group=group,
                     head_dim=8, num_query_tokens=Tq, dtype=dtype)
    with pytest.MonkeyPatch.context() as mp:
        _tiny_chunks(mp)
        calls = _chunk_calls(mp)
        _check_against_reference(p, Tq, budget, dtype)
    assert calls or max(lens) == 0, "the chunked path did not run"


def _check_against_reference(p, Tq, budget, dtype):
    q = p.q[:, 0] if Tq == 1 else p.q
    if budget is None:
        out, lse = tinyattn.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, return_lse=True,
                                            backend="torch")
        want, want_lse = reference.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, return_lse=True)
    else:
        k_min = torch.zeros(p.k_cache.shape[0], 2, 8, dtype=dtype)
        k_max = torch.zeros_like(k_min)
        reference.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
        kw = dict(k_min=k_min, k_max=k_max, page_budget=budget)
        out, lse = tinyattn.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                   return_lse=True, backend="torch", **kw)
        want, want_lse = reference.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                  return_lse=True, **kw)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(lse, want_lse, **tol)


def test_fast_path_chunks_too(tiny_chunks, monkeypatch):
    """The decode fast path (no lse) of a plan, dense and sparse, also runs in chunks and matches the reference."""
    p = make_problem(3, batch=2, seq_lens=[150, 97], page_size=16, num_kv_heads=2, group=4, head_dim=16)
    k_min = torch.zeros(p.k_cache.shape[0], 2, 16)
    k_max = torch.zeros_like(k_min)
    reference.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
    plan = PagedAttentionPlan(backend="torch").plan(p.block_table, p.seq_lens, num_q_heads=8, num_kv_heads=2,
                                                    head_dim=16, page_size=16, page_budget=4)
    calls = _chunk_calls(monkeypatch)
    q = p.q[:, 0]
    torch.testing.assert_close(plan.run(q, p.k_cache, p.v_cache),
                               reference.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(plan.run(q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max),
                               reference.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                        k_min=k_min, k_max=k_max, page_budget=4),
                               atol=1e-5, rtol=1e-4)
    assert calls == [16, 16]


def test_chunk_size_from_bytes():
    """Below MIN_BYTES of keys: one piece; above: chunks of about CHUNK_BYTES, whole pages of 16."""
    assert attention_torch.chunk_keys(1024, 4, 64) is None                       # 1 MiB of K
    c = attention_torch.chunk_keys(4096, 64, 128)                                # 128 MiB of K
    assert c % 16 == 0 and c * 64 * 128 * 4 <= attention_torch.CHUNK_BYTES
    assert attention_torch.chunk_keys(10**6, 10**4, 128) == 16                   # never below one page of 16


def test_no_chunks_above_max_threads(monkeypatch):
    """A large gather is chunked with torch on MAX_THREADS threads or fewer, and runs in one piece above."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(attention_torch, "MAX_THREADS", threads)
    assert attention_torch.chunk_keys(4096, 64, 128) is not None                 # 128 MiB of K
    monkeypatch.setattr(attention_torch, "MAX_THREADS", threads - 1)
    assert attention_torch.chunk_keys(4096, 64, 128) is None


def test_one_piece_above_max_threads_matches_the_reference(monkeypatch):
    """The same large dense and sparse steps without chunks (more threads than MAX_THREADS) equal the reference."""
    monkeypatch.setattr(attention_torch, "MIN_BYTES", 0)
    monkeypatch.setattr(attention_torch, "MAX_THREADS", 0)
    calls = _chunk_calls(monkeypatch)
    p = make_problem(7, batch=2, seq_lens=[150, 0], page_size=16, num_kv_heads=2, group=4, head_dim=8)
    _check_against_reference(p, 1, None, torch.float32)
    _check_against_reference(p, 1, 3, torch.float32)
    assert calls == []


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_chunks_of_a_quantized_pool(tiny_chunks, monkeypatch, fmt):
    """An int8 / fp8 pool in chunks: each chunk dequantizes what it gathers; equal to the reference on the
    dequantized pool (garbage codes and NaN scales where no row owns a slot)."""
    from paged_problems import dequantized_args, quantize_problem

    p = make_problem(5, batch=2, seq_lens=[61, 0], page_size=8, num_kv_heads=2, group=2, head_dim=8)
    kq, vq, ks, vs = quantize_problem(p, fmt)
    calls = _chunk_calls(monkeypatch)
    q, k, v, table, sl = dequantized_args(p, kq, vq, ks, vs)
    out, lse = tinyattn.paged_attention(q[:, 0], kq, vq, table, sl, k_scale=ks, v_scale=vs, return_lse=True,
                                        backend="torch")
    want, want_lse = reference.paged_attention(q[:, 0], k, v, table, sl, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-4)
    assert calls


# ---- the torch plan's routes: a fresh prefill (causal SDPA), a chunked prefill / prefix reuse (SDPA under the step's
# mask), a dense decode, through gathered rows and through views of an in-order pool; the empty prefill-shaped step --
def _check_route(p, window_left=-1):
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
    _check_route(p)


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(1, 60), min_size=1, max_size=3),
       page_size=st.sampled_from([2, 16]), in_order=st.booleans(), window=st.sampled_from([-1, 0, 5]))
def test_dense_decode_and_batched_prefill(seed, lens, page_size, in_order, window):
    """Decode rows of any lengths (one in-order row reads pool views), and a batch of fresh prefills of one length."""
    p = make_problem(seed, batch=len(lens), seq_lens=lens, page_size=page_size, num_kv_heads=2, group=2,
                     head_dim=8, in_order=in_order)
    _check_route(p, window)
    n = min(lens)
    p = make_problem(seed, batch=len(lens), seq_lens=[n] * len(lens), page_size=page_size, num_kv_heads=2, group=2,
                     head_dim=8, num_query_tokens=n, in_order=in_order)
    _check_route(p, window)


@pytest.mark.parametrize("num_query_tokens", [1, 3])
def test_empty_batch_of_a_prefill_shaped_step(num_query_tokens):
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


# ---- sliding windows (window_left, FlashInfer's convention: a query at position p sees keys [p - window_left, p];
# -1: no window) against the reference, plain masked softmax, and facts that need no code -------------------------
WINDOW_EXAMPLES = {"torch": 40, "triton": 12}      # the interpreter is slow: fewer, small examples


def assert_close_to_reference(out, lse, ref_out, ref_lse, atol=2e-5):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))           # -inf exactly where nothing is seen
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=atol, rtol=1e-5)


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_dense_window_matches_reference(backend):
    """Ragged rows, empty rows, prefill (Tq > 1), GQA, windows below a page, at a page and past the context."""
    @settings(max_examples=WINDOW_EXAMPLES[backend], deadline=None)
    @given(data=st.data())
    def check(data):
        p = data.draw(problems(max_query_tokens=5, head_dims=(8, 24), max_pages_per_row=5))
        w = data.draw(windows(p.page_size))
        out, lse = tinyattn.paged_attention(*p.args, window_left=w, return_lse=True, backend=backend)
        ref_out, ref_lse = reference.paged_attention(*p.args, window_left=w, return_lse=True)
        assert_close_to_reference(out, lse, ref_out, ref_lse)
        fast = tinyattn.paged_attention(*p.args, window_left=w, backend=backend)      # the no-lse path
        torch.testing.assert_close(fast, ref_out, atol=2e-5, rtol=1e-5)

    check()


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_sparse_window_with_listed_pages_matches_reference(backend):
    """Listed pages attended within the window: the window is a mask on top of the selection."""
    @settings(max_examples=WINDOW_EXAMPLES[backend], deadline=None)
    @given(data=st.data())
    def check(data):
        p = data.draw(problems(max_query_tokens=3, head_dims=(8, 16), max_pages_per_row=5))
        w = data.draw(windows(p.page_size))
        B, Hkv, width = p.seq_lens.shape[0], p.num_kv_heads, p.block_table.shape[1]
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
        idx = torch.stack([torch.stack([torch.randperm(width, generator=g)[:3] for _ in range(Hkv)])
                           for _ in range(B)]).to(torch.int32)
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        out, lse = tinyattn.sparse_paged_attention(*p.args, page_indices=idx, window_left=w, return_lse=True,
                                                   backend=backend)
        ref_out, ref_lse = reference.sparse_paged_attention(*p.args, page_indices=idx, window_left=w,
                                                            return_lse=True)
        assert_close_to_reference(out, lse, ref_out, ref_lse)

    check()


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_sparse_window_selected_by_boxes_matches_reference(backend):
    """Selection by the Quest bound with a window: pages before the earliest query's window rank last."""
    @settings(max_examples=WINDOW_EXAMPLES[backend], deadline=None)
    @given(data=st.data())
    def check(data):
        p = data.draw(problems(max_query_tokens=2, head_dims=(8, 16), max_pages_per_row=6, page_sizes=(1, 2, 4)))
        w = data.draw(windows(p.page_size))
        k_min, k_max = p.bounds()
        kw = dict(k_min=k_min, k_max=k_max, page_budget=data.draw(st.integers(2, 5)),    # >= the Tq <= 2 query pages
                  num_recent_pages=data.draw(st.integers(0, 1)), window_left=w, return_lse=True)
        ref_out, ref_lse = reference.sparse_paged_attention(*p.args, **kw)
        out, lse = tinyattn.sparse_paged_attention(*p.args, backend=backend, **kw)
        assert_close_to_reference(out, lse, ref_out, ref_lse)

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_zero_returns_each_querys_own_value(backend):
    """``window_left = 0``: every query sees only itself, so its output is its own value and its lse the logit."""
    p = make_problem(1, batch=3, seq_lens=[7, 1, 12], page_size=4, num_kv_heads=2, group=3, head_dim=8,
                     num_query_tokens=1)
    q = p.q.expand(3, 3, *p.q.shape[2:]).contiguous()                         # Tq = 3 (row of length 1: 1 query)
    q = q + torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    out, lse = tinyattn.paged_attention(q, *p.args[1:], window_left=0, return_lse=True, backend=backend)
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
    full = tinyattn.paged_attention(*p.args, backend=backend)
    for w in (12, 13, 2**31 - 1):
        torch.testing.assert_close(tinyattn.paged_attention(*p.args, window_left=w, backend=backend), full,
                                   atol=1e-6, rtol=0)


def test_windowed_decode_matches_a_plain_masked_softmax():
    """An independent formula: one contiguous sequence, softmax over the last ``window_left + 1`` keys."""
    torch.manual_seed(0)
    n, page_size, D, W = 23, 4, 8, 6
    keys, values, q = torch.randn(n, D), torch.randn(n, D), torch.randn(D)
    pages = -(-n // page_size)
    k_cache = torch.zeros(pages, page_size, 1, D)
    v_cache = torch.zeros(pages, page_size, 1, D)
    k_cache.view(-1, D)[:n], v_cache.view(-1, D)[:n] = keys, values
    table = torch.arange(pages, dtype=torch.int32)[None]
    out = tinyattn.paged_attention(q.view(1, 1, D), k_cache, v_cache, table, torch.tensor([n], dtype=torch.int32),
                                   window_left=W, backend="torch")
    w = torch.softmax(keys[n - 1 - W:] @ q / math.sqrt(D), 0)
    torch.testing.assert_close(out.view(D), w @ values[n - 1 - W:], atol=1e-6, rtol=1e-6)


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
        ref_out, ref_lse = reference.paged_attention(*p.args, window_left=w, return_lse=True)
        out, lse = plan.run(p.q, p.k_cache, p.v_cache, window_left=w, return_lse=True)
        assert len(plan._impl._blocks[w]) == 3                                  # 600 queries in blocks of 256
        assert_close_to_reference(out, lse, ref_out, ref_lse)
        torch.testing.assert_close(plan.run(p.q, p.k_cache, p.v_cache, window_left=w), ref_out, atol=2e-5,
                                   rtol=1e-5)


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
