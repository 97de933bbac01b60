"""The oracle's own checks: the reference loops (``tinyattn.reference``) against sources that share no code with them.

Proven here, on the shared harness (tests/paged_problems.py: ragged rows, poisoned slots, GQA, Tq > 1): dense and
sparse attention equal fp64 SDPA over the row's keys gathered by walking the block table (bottom-right causal mask
and sliding window built by hand, GQA by repeating K/V), lse included; the page score bounds every key's logit
(fp64) and is exact for a one-key page; the selection of a hand-worked example; the boxes exclude padding slots;
duplicate listed pages are refused. Everything else in tests/ops compares against the reference, so these are what
make it an oracle.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyattn import reference

from paged_problems import contiguous_kv, make_problem, problems, random_page_indices, windows


def sdpa_row(q_row, k, v, scale, window_left=-1, visible=None):
    """fp64 ``(out [Tq, Hq, D], lse [Tq, Hq])`` of one row: q_row ``[Tq, Hq, D]``, k / v ``[n, Hkv, D]``; the
    bottom-right causal mask and the window built explicitly, ``visible`` ``[n]`` bool (listed pages) on top; GQA by
    repeating K/V. Rows of queries that see no key are NaN (SDPA's fully masked rows): the caller skips them."""
    Tq, Hq, D = q_row.shape
    n, Hkv, _ = k.shape
    k = k.repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)           # [Hq, n, D]
    v = v.repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
    q = q_row.double().transpose(0, 1)                                  # [Hq, Tq, D]
    q_pos = torch.arange(n - Tq, n)[:, None]
    k_pos = torch.arange(n)[None, :]
    mask = k_pos <= q_pos                                               # [Tq, n]
    if window_left >= 0:
        mask &= k_pos >= q_pos - window_left
    if visible is not None:
        mask &= visible[None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    logits = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(logits, -1).transpose(0, 1)


def check_against_sdpa(p, out, lse, window_left, scale, listed=None):
    for b in range(p.q.shape[0]):
        n, Tq = int(p.seq_lens[b]), p.q.shape[1]
        for h in range(p.num_kv_heads):
            G = p.q.shape[2] // p.num_kv_heads
            heads = slice(h * G, (h + 1) * G)
            visible = torch.zeros(n, dtype=torch.bool)
            pages = range(p.num_valid_pages(b)) if listed is None else [j for j in listed[b, h].tolist() if j >= 0]
            for j in pages:
                visible[j * p.page_size:(j + 1) * p.page_size] = True
            q_pos = torch.arange(n - Tq, n)
            first = q_pos - window_left if window_left >= 0 else torch.zeros_like(q_pos)
            sees = torch.tensor([bool(visible[max(int(f), 0):max(int(t) + 1, 0)].any()) for f, t in zip(first, q_pos)],
                                dtype=torch.bool)
            # a query that sees no key: zeros and lse = -inf
            assert torch.equal(out[b, ~sees, heads], torch.zeros_like(out[b, ~sees, heads]))
            assert torch.isneginf(lse[b, ~sees, heads]).all()
            if not sees.any():
                continue
            k, v = contiguous_kv(p, b)
            want, want_lse = sdpa_row(p.q[b, :, heads], k[:, h:h + 1], v[:, h:h + 1], scale, window_left, visible)
            torch.testing.assert_close(out[b, sees, heads].double(), want[sees], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b, sees, heads].double(), want_lse[sees], atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(problems(max_query_tokens=5), st.data())
def test_paged_attention_matches_fp64_sdpa(p, data):
    window_left = data.draw(windows(p.page_size))
    scale = p.q.shape[-1] ** -0.5
    out, lse = reference.paged_attention(*p.args, return_lse=True, window_left=window_left)
    check_against_sdpa(p, out, lse, window_left, scale)


@settings(max_examples=25, deadline=None)
@given(problems(max_query_tokens=3), st.data())
def test_sparse_paged_attention_matches_fp64_sdpa_over_the_listed_pages(p, data):
    window_left = data.draw(windows(p.page_size))
    listed = random_page_indices(p, 3, data.draw(st.integers(0, 2**31 - 1)))
    scale = 0.7 * p.q.shape[-1] ** -0.5
    out, lse = reference.sparse_paged_attention(*p.args, page_indices=listed, scale=scale, return_lse=True,
                                                window_left=window_left)
    check_against_sdpa(p, out, lse, window_left, scale, listed)


@settings(max_examples=25, deadline=None)
@given(problems(max_query_tokens=3))
def test_page_score_is_an_upper_bound_of_every_key(p):
    k_min, k_max = p.bounds()
    scores = reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=p.page_size)
    G = p.q.shape[2] // p.num_kv_heads
    for b in range(p.q.shape[0]):
        k, _ = contiguous_kv(p, b)
        for t in range(k.shape[0]):
            j = t // p.page_size
            for h in range(p.num_kv_heads):
                logits = p.q[b, :, h * G:(h + 1) * G].double() @ k[t, h]           # [Tq, G]
                assert scores[b, h, j] >= logits.max() - 1e-4 * (1 + logits.abs().max())
        assert torch.isneginf(scores[b, :, p.num_valid_pages(b):]).all()


def test_bound_is_tight_for_a_single_key_page():
    """A page of one token: min == max == k, so ub == q·k exactly (an independent closed form)."""
    p = make_problem(0, batch=2, seq_lens=[5, 1], page_size=1, num_kv_heads=2, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    scores = reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=1)
    k, _ = contiguous_kv(p, 0)
    expected = torch.einsum("hgd,thd->htg", p.q[0, 0].double().reshape(2, 2, 8), k).amax(-1)   # [Hkv, n]
    torch.testing.assert_close(scores[0, :, :5], expected.float())


def test_select_pages_hand_worked_example():
    # 1 row, 6 valid pages (seq_len 21, page 4), budget 4, 1 sink, 1 recent: sink 0, recent 5, then the two best
    scores = torch.tensor([[[0.0, 9.0, 1.0, 9.0, 7.0, -5.0, 100.0]]])      # page 6 is past the end
    kept = reference.select_pages(scores, torch.tensor([21]), page_size=4, page_budget=4, num_sink_pages=1)
    assert kept.tolist() == [[[0, 1, 3, 5]]]                                 # tie 1 vs 3: both fit
    kept = reference.select_pages(scores, torch.tensor([21]), page_size=4, page_budget=3, num_sink_pages=1)
    assert kept.tolist() == [[[0, 1, 5]]]                                    # tie: the lower index wins
    kept = reference.select_pages(scores, torch.tensor([21]), page_size=4, page_budget=8)
    assert kept.tolist() == [[[0, 1, 2, 3, 4, 5, -1, -1]]]                   # budget above the pages: all of them


def test_update_page_metadata_excludes_padding_slots():
    p = make_problem(1, batch=2, seq_lens=[6, 3], page_size=4, num_kv_heads=1, group=1, head_dim=8, poison=1e30)
    k_min, k_max = p.bounds()
    for b in range(2):
        k, _ = contiguous_kv(p, b)
        for j in range(p.num_valid_pages(b)):
            phys = int(p.block_table[b, j])
            torch.testing.assert_close(k_max[phys], k[4 * j: 4 * j + 4].amax(0).float())
            torch.testing.assert_close(k_min[phys], k[4 * j: 4 * j + 4].amin(0).float())


def test_reference_rejects_duplicate_page_indices():
    p = make_problem(2, batch=1, seq_lens=[12], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    dup = torch.tensor([[[0, 0, 2]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="page_indices"):
        reference.sparse_paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, page_indices=dup)


@pytest.mark.parametrize("gamma,top_p", [(1.0, None), (0.25, 0.5)])
def test_no_query_tokens_score_minus_inf_and_attend_nothing(gamma, top_p):
    """``Tq = 0`` (legal: the ops return empty outputs): a page's score is a max over no query, so ``-inf`` on every
    page, and the sparse op with boxes returns ``[B, 0, Hq, D]``. The reference raised torch's "max(): Expected
    reduction dim" here while both backends answered; the backends are held to the same values."""
    import tinyattn

    p = make_problem(4, batch=2, seq_lens=[7, 3], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    q0 = p.q[:, :0]                                                    # [B, 0, Hq, D]
    want = torch.full((2, 2, p.block_table.shape[1]), float("-inf"))
    for backend in (None, "torch", "triton"):
        fn = reference.page_scores if backend is None else tinyattn.page_scores
        kw = {} if backend is None else dict(backend=backend)
        assert torch.equal(fn(q0, k_min, k_max, p.block_table, p.seq_lens, page_size=4, gamma=gamma, **kw), want)
        fn = reference.sparse_paged_attention if backend is None else tinyattn.sparse_paged_attention
        out, lse = fn(q0, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min, k_max=k_max, page_budget=1,
                      gamma=gamma, top_p=top_p, return_lse=True, **kw)
        assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 0, 4)
