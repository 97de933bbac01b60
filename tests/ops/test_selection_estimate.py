"""The box estimate ``gamma`` (issue 35): ``page_scores(..., gamma)`` = ``Σ_i a_i·k_max_i + b_i·k_min_i`` with
``a = (q + gamma|q|)/2``, ``b = (q - gamma|q|)/2`` (``q·c + gamma·|q|·r``), max over the GQA group and the queries,
on the torch form, the Triton scoring kernel and the two-stage ``chunk_topk`` kernel (interpreter), against the
loop reference; ``gamma = 1`` is Quest's bound bit for bit; ``gamma = 0`` is ``q·c`` computed by hand in fp64.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference as R
from tinyattn.kernels import chunk_topk
from tinyattn.ops.selection import torch_impl as selection_torch
from tinyattn.ops.selection import triton_impl as selection_triton

from paged_problems import make_problem, problems

BACKENDS = ["torch", "triton"]          # triton runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
GAMMAS = [0.0, 0.25, 0.5, 1.0]


def _assert_scores_close(got, want):
    """Equal where infinite or NaN, close elsewhere (the channel sums run in another order)."""
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf() & (got > 0), want.isinf() & (want > 0))
    assert torch.equal(got.isinf() & (got < 0), want.isinf() & (want < 0))
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(problems(max_query_tokens=3, page_sizes=(1, 2, 4, 8)), st.sampled_from(GAMMAS), st.sampled_from(BACKENDS))
def test_page_scores_with_gamma_match_the_reference(p, gamma, backend):
    """Ragged rows (empty ones included), GQA 1-4, Tq 1-3, poisoned pages past each row's end."""
    k_min, k_max = p.bounds()
    want = R.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=p.page_size, gamma=gamma)
    got = tinyattn.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=p.page_size, gamma=gamma,
                               backend=backend)
    _assert_scores_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gamma_zero_is_the_box_centre_logit_in_fp64(backend):
    p = make_problem(3, batch=3, seq_lens=[0, 21, 40], page_size=4, num_kv_heads=2, group=3, head_dim=16,
                     num_query_tokens=2)
    k_min, k_max = p.bounds()
    got = tinyattn.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=4, gamma=0.0, backend=backend)
    B, Tq, Hq, D = p.q.shape
    want = torch.full(got.shape, float("-inf"), dtype=torch.float64)
    for b in range(B):
        for j in range(-(-int(p.seq_lens[b]) // 4)):
            page = int(p.block_table[b, j])
            for h in range(2):
                centre = (k_min[page, h].double() + k_max[page, h].double()) / 2
                logits = [float(p.q[b, t, h * 3 + g].double() @ centre) for t in range(Tq) for g in range(3)]
                want[b, h, j] = max(logits)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got.double()[want.isfinite()], want[want.isfinite()], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_gamma_one_is_quests_bound_bit_for_bit(backend):
    """``gamma=1.0`` runs today's bound (the default) bit for bit, and the selection and attention built on it."""
    p = make_problem(5, batch=3, seq_lens=[13, 0, 57], page_size=4, num_kv_heads=2, group=2, head_dim=24,
                     num_query_tokens=1)
    k_min, k_max = p.bounds()
    args = (p.q, k_min, k_max, p.block_table, p.seq_lens)
    today = tinyattn.page_scores(*args, page_size=4, backend=backend)
    assert torch.equal(tinyattn.page_scores(*args, page_size=4, gamma=1.0, backend=backend).view(torch.int32),
                       today.view(torch.int32))
    # the Quest bound by its own formula: Σ max(q·lo, q·hi), max over the group (fp64 reference loops)
    _assert_scores_close(today, R.page_scores(*args, page_size=4))
    attend = dict(k_min=k_min, k_max=k_max, page_budget=4, backend=backend)
    out = tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, **attend)
    assert torch.equal(out, tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                                            gamma=1.0, **attend))


def test_the_estimate_formula_at_gamma_one_is_q_plus_and_q_minus_exactly():
    """``(q + |q|)/2 = q⁺`` and ``(q - |q|)/2 = q⁻`` in fp32, tiny (subnormal) and large values included, so the
    formula at ``gamma = 1`` is Quest's bound term for term (the forms keep ``clamp`` there all the same)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4096, generator=g) * torch.logspace(-40, 37, 4096)
    q = torch.cat([q, -q, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.7e38, -1.7e38])])
    assert torch.equal((q + q.abs()) / 2, q.clamp(min=0))
    assert torch.equal((q - q.abs()) / 2, q.clamp(max=0))
    pos, neg = selection_torch.box_operands(q, 1.0)
    assert torch.equal(pos, q.clamp(min=0)) and torch.equal(neg, q.clamp(max=0))


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.25, 0.75]), st.sampled_from([1, 2, 4]),
       st.sampled_from([2, 5]), st.integers(1, 3))
def test_two_stage_selection_with_gamma_is_the_reference_selection(seed, gamma, chunk, budget, Tq):
    """The fused kernel (scores + per-chunk top-k + merge) with ``gamma`` selects what ``select_pages(page_scores(...,
    gamma))`` selects; integer queries and boxes make every estimate exact in fp32 (ties frequent)."""
    p = make_problem(seed, batch=3, seq_lens=[0, 9 + Tq, 31], page_size=2, num_kv_heads=2, group=2, head_dim=8,
                     num_query_tokens=Tq)
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, p.q.shape, generator=g).float()
    k_min = torch.randint(-2, 2, (p.k_cache.shape[0], 2, 8), generator=g).float()
    k_max = k_min + 2 * torch.randint(0, 2, k_min.shape, generator=g).float()     # even widths: r integer
    B, width = p.block_table.shape
    scores = R.page_scores(q, k_min, k_max, p.block_table, p.seq_lens, page_size=2, gamma=gamma)
    want = R.select_pages(scores, p.seq_lens, page_size=2, page_budget=budget, num_query_tokens=Tq)
    meta = chunk_topk.chunk_blocks(B, 2, width, budget, Tq, 2, 8, 2, chunk=chunk)
    ws = [torch.empty(chunk_topk.workspace_shape(B, 2, meta), dtype=torch.int32) for _ in range(2)]
    out = torch.empty(B, 2, budget, dtype=torch.int32)
    selection_triton.score_and_select_pages(q, k_min, k_max, p.block_table, p.seq_lens, page_size=2,
                                            page_budget=budget, num_sink_pages=0, num_recent_pages=1, meta=meta,
                                            ws_key=ws[0], ws_page=ws[1], out=out, gamma=gamma)
    assert torch.equal(out, want)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(problems(max_query_tokens=2, page_sizes=(2, 4)), st.sampled_from([0.0, 0.25]), st.sampled_from(BACKENDS),
       st.integers(1, 4))
def test_sparse_attention_with_gamma_matches_the_reference(p, gamma, backend, budget):
    k_min, k_max = p.bounds()
    Tq = p.q.shape[1]
    budget = max(budget, -(-(Tq + p.page_size - 1) // p.page_size) + 1)          # holds every query page
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    want = R.sparse_paged_attention(*args, k_min=k_min, k_max=k_max, page_budget=budget, gamma=gamma)
    got = tinyattn.sparse_paged_attention(*args, k_min=k_min, k_max=k_max, page_budget=budget, gamma=gamma,
                                          backend=backend)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_with_gamma(backend):
    q = torch.randn(0, 1, 4, 8)
    k_min, k_max = torch.zeros(3, 2, 8), torch.ones(3, 2, 8)
    table, lens = torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    got = tinyattn.page_scores(q, k_min, k_max, table, lens, page_size=4, gamma=0.25, backend=backend)
    assert got.shape == (0, 2, 2)


@pytest.mark.parametrize("gamma,error", [(-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                         ("1", TypeError), (True, TypeError), (None, TypeError)])
def test_a_bad_gamma_is_an_error_naming_gamma_on_every_entry_point(gamma, error):
    p = make_problem(0, batch=1, seq_lens=[9], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    with pytest.raises(error, match="gamma"):
        tinyattn.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=4, gamma=gamma)
    with pytest.raises(error, match="gamma"):
        tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                        k_max=k_max, page_budget=2, gamma=gamma)
    with pytest.raises(error, match="gamma"):
        tinyattn.PagedAttentionPlan().plan(p.block_table, p.seq_lens, num_q_heads=2, num_kv_heads=1, head_dim=8,
                                           page_size=4, page_budget=2, gamma=gamma)
    with pytest.raises(error, match="gamma"):
        R.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=4, gamma=gamma)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_runs_with_gamma_select_the_reference_pages(backend):
    """A plan with ``gamma`` (one- and two-stage on Triton: B * Hkv programs leave the SMs idle) attends the pages
    of the reference selection with that estimate."""
    p = make_problem(11, batch=2, seq_lens=[45, 70], page_size=4, num_kv_heads=2, group=2, head_dim=16)
    k_min, k_max = p.bounds()
    plan = tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, page_budget=5,
        gamma=0.25)
    got = plan.run(p.q[:, 0], p.k_cache, p.v_cache, k_min=k_min, k_max=k_max)
    want = R.sparse_paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                    k_max=k_max, page_budget=5, gamma=0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
