"""The reference twins against independent sources: SDPA on a contiguous cache, brute-force max of q·k."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from tinyattn import reference
from paged_problems import make_problem, problems


def contiguous_kv(p, b):
    """Row b's keys/values gathered into [n, Hkv, D] by walking its pages (independent of the reference)."""
    n = int(p.seq_lens[b])
    idx = [int(p.block_table[b, t // p.page_size]) * p.page_size + t % p.page_size for t in range(n)]
    flat_k = p.k_cache.reshape(-1, *p.k_cache.shape[2:])
    flat_v = p.v_cache.reshape(-1, *p.v_cache.shape[2:])
    return flat_k[idx].float(), flat_v[idx].float()


def sdpa_row(q_row, k, v, scale):
    """q_row [Tq, Hq, D]; bottom-right causal mask built explicitly; GQA by repeating K/V."""
    Tq, Hq, D = q_row.shape
    n, Hkv, _ = k.shape
    k = k.repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)           # [Hq, n, D]
    v = v.repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
    q = q_row.float().transpose(0, 1)                                   # [Hq, Tq, D]
    q_pos = torch.arange(n - Tq, n)[:, None]
    mask = torch.arange(n)[None, :] <= q_pos                            # [Tq, n]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


@settings(max_examples=25, deadline=None)
@given(problems(max_query_tokens=5))
def test_paged_attention_matches_sdpa(p):
    scale = p.q.shape[-1] ** -0.5
    out, lse = reference.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, return_lse=True)
    for b in range(p.q.shape[0]):
        n, Tq = int(p.seq_lens[b]), p.q.shape[1]
        if n < Tq:                                 # some queries see nothing: zeros, lse -inf
            dead = Tq - n
            assert torch.equal(out[b, :dead], torch.zeros_like(out[b, :dead]))
            assert torch.isneginf(lse[b, :dead]).all()
        if n == 0:
            continue
        alive = slice(max(Tq - n, 0), Tq)
        k, v = contiguous_kv(p, b)
        expected = sdpa_row(p.q[b, alive], k, v, scale)
        torch.testing.assert_close(out[b, alive], expected, atol=1e-5, rtol=1e-5)


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
                logits = p.q[b, :, h * G:(h + 1) * G].float() @ k[t, h]           # [Tq, G]
                assert scores[b, h, j] >= logits.max() - 1e-4 * (1 + logits.abs().max())
        n_pages = -(-int(p.seq_lens[b]) // p.page_size)
        assert torch.isneginf(scores[b, :, n_pages:]).all()


def test_bound_is_tight_for_a_single_key_page():
    """A page of one token: min == max == k, so ub == q·k exactly (an independent closed form)."""
    p = make_problem(0, batch=2, seq_lens=[5, 1], page_size=1, num_kv_heads=2, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    scores = reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=1)
    k, _ = contiguous_kv(p, 0)
    expected = torch.einsum("hgd,thd->htg", p.q[0, 0].float().reshape(2, 2, 8), k).amax(-1)   # [Hkv, n]
    torch.testing.assert_close(scores[0, :, :5], expected)


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
        for j in range(-(-int(p.seq_lens[b]) // 4)):
            phys = int(p.block_table[b, j])
            torch.testing.assert_close(k_max[phys], k[4 * j: 4 * j + 4].amax(0))
            torch.testing.assert_close(k_min[phys], k[4 * j: 4 * j + 4].amin(0))


def test_reference_rejects_duplicate_page_indices():
    p = make_problem(2, batch=1, seq_lens=[12], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    dup = torch.tensor([[[0, 0, 2]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="page_indices"):
        reference.sparse_paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, page_indices=dup)
