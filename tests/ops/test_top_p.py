"""The adaptive budget ``top_p`` (issue 35; Twilight, arXiv 2502.02770): ``select_pages(..., top_p=p, scale=s)``
keeps, after the forced pages, the fewest best-scoring pages whose estimated mass ``softmax(s · score)`` (with the
forced pages') reaches ``p``, within ``page_budget``; on the torch form (sort + cumsum), the Triton filter kernel
(interpreter) and the two-stage path, against the loop reference; ``sparse_paged_attention(..., top_p=p)`` attends
exactly the pages that selection keeps; graph mode stays allocation- and sync-free.

The forms sum the masses in other orders (fp32 vs the reference's fp64), so a page whose cumulative mass lands within
rounding of ``p`` may go either way: the property tests hold each form between the reference at ``p - 1e-4`` and
at ``p + 1e-4`` (the selection is nested in ``p``), and exactly where no threshold is near.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference as R
from tinyattn.kernels import chunk_topk
from tinyattn.ops import custom_ops
from tinyattn.ops.selection import reference as selection_reference

from host_calls import check_graph_step, graph_mode_pool, graph_mode_step, watch_host_calls
from paged_problems import make_problem

BACKENDS = ["torch", "triton"]          # triton runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
EPS = 1e-4


def _as_sets(pages: torch.Tensor) -> list:
    B, H, _ = pages.shape
    return [[{int(j) for j in pages[b, h].tolist() if j >= 0} for h in range(H)] for b in range(B)]


def _assert_canonical(pages: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """Ascending, ``-1`` padded, distinct, never past the row's end."""
    for b, n in enumerate(seq_lens.tolist()):
        for row in pages[b].tolist():
            kept = [j for j in row if j >= 0]
            assert row == kept + [-1] * (len(row) - len(kept))
            assert kept == sorted(set(kept)) and all(j < -(-n // page_size) for j in kept)


def _assert_between_references(got, scores, seq_lens, opts, top_p, scale):
    """``ref(p - EPS) ⊆ got ⊆ ref(p + EPS)`` per (row, KV head), and the output canonical."""
    _assert_canonical(got, seq_lens, opts["page_size"])
    low = R.select_pages(scores, seq_lens, top_p=max(top_p - EPS, 1e-6), scale=scale, **opts)
    high = R.select_pages(scores, seq_lens, top_p=min(top_p + EPS, 1.0), scale=scale, **opts)
    for g, lo, hi in zip(_as_sets(got), _as_sets(low), _as_sets(high)):
        for a, b, c in zip(g, lo, hi):
            assert b <= a <= c, (a, b, c)


@st.composite
def score_problems(draw):
    """Scores of every kind the rule must survive: flat, peaked, integer ties, NaN, +-inf, normal; ragged rows
    (empty ones included), GQA-free ``[B, Hkv, P]`` with forced pages (recent, sinks, ``Tq`` query pages)."""
    page_size = draw(st.sampled_from([1, 2, 4]))
    B, Hkv, P = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 12))
    lens = [draw(st.integers(0, P * page_size)) for _ in range(B)]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["flat", "peaked", "ties", "nan", "inf", "normal"]))
    scores = torch.randn(B, Hkv, P, generator=g) * draw(st.sampled_from([0.5, 3.0, 20.0]))
    if kind == "flat":
        scores = torch.full((B, Hkv, P), draw(st.sampled_from([0.0, -3.0, 7.5])))
    elif kind == "peaked":
        scores[..., draw(st.integers(0, P - 1))] = 40.0
    elif kind == "ties":
        scores = torch.randint(-2, 3, (B, Hkv, P), generator=g).float()
    elif kind == "nan":
        scores[torch.rand(B, Hkv, P, generator=g) < 0.3] = float("nan")
    elif kind == "inf":
        r = torch.rand(B, Hkv, P, generator=g)
        scores[r < 0.2] = float("-inf")
        scores[r > 0.9] = float("inf")
    Tq = draw(st.integers(1, 2))
    sinks, recent = draw(st.integers(0, 1)), draw(st.integers(0, 2))
    query_pages = -(-(Tq + page_size - 1) // page_size)
    least = max(sinks + max(recent, 1), query_pages)
    budget = draw(st.integers(least, max(least, P + 1)))
    opts = dict(page_size=page_size, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent,
                num_query_tokens=Tq)
    return scores, torch.tensor(lens, dtype=torch.int32), opts


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(score_problems(), st.sampled_from([0.1, 0.5, 0.8, 0.95, 1.0]), st.sampled_from([0.125, 1.0, 3.0]),
       st.sampled_from(BACKENDS))
def test_select_pages_with_top_p_matches_the_reference(problem, top_p, scale, backend):
    scores, lens, opts = problem
    got = tinyattn.select_pages(scores, lens, top_p=top_p, scale=scale, backend=backend, **opts)
    assert got.shape == (*scores.shape[:2], opts["page_budget"]) and got.dtype == torch.int32
    _assert_between_references(got, scores, lens, opts, top_p, scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_p_on_hand_made_rows(backend):
    """Masses worked out by hand: scale 1, scores log(m) so that softmax gives m exactly-ish."""
    m = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2])              # the last page is the forced recent one (0.2)
    scores = m.log()[None, None]
    lens = torch.tensor([5], dtype=torch.int32)
    opts = dict(page_size=1, page_budget=5, backend=backend, scale=1.0)
    # forced 0.2; then page 1 (0.4) -> 0.6, page 3 (0.25) -> 0.85, page 2 (0.1) -> 0.95, page 0 (0.05) -> 1.0
    for p, want in [(0.15, [4]), (0.5, [1, 4]), (0.7, [1, 3, 4]), (0.9, [1, 2, 3, 4]), (0.99, [0, 1, 2, 3, 4])]:
        got = tinyattn.select_pages(scores, lens, top_p=p, **opts)
        assert got[0, 0].tolist() == want + [-1] * (5 - len(want)), p
    # the capacity caps it: budget 3 keeps the forced page and the two best at p = 0.99
    got = tinyattn.select_pages(scores, lens, top_p=0.99, page_size=1, page_budget=3, backend=backend, scale=1.0)
    assert got[0, 0].tolist() == [1, 3, 4]
    # a sink page's mass counts before any scored page: sink 0 (0.05) + recent (0.2) = 0.25 < 0.3 -> page 1 too
    got = tinyattn.select_pages(scores, lens, top_p=0.3, num_sink_pages=1, **opts)
    assert got[0, 0].tolist() == [0, 1, 4, -1, -1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_minus_inf_rows_keep_the_capacity_and_empty_rows_keep_nothing(backend):
    scores = torch.full((2, 1, 6), float("-inf"))
    lens = torch.tensor([24, 0], dtype=torch.int32)
    got = tinyattn.select_pages(scores, lens, page_size=4, page_budget=3, top_p=0.5, scale=1.0, backend=backend)
    assert got[:, 0].tolist() == [[0, 1, 5], [-1, -1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_p_one_with_a_covering_capacity_is_the_plain_selection(backend):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 2, 9, generator=g) * 4
    scores[0, 1, 2] = float("nan")
    lens = torch.tensor([33, 9, 0], dtype=torch.int32)
    for budget in (3, 9, 12):                         # below, at and above the page count
        opts = dict(page_size=4, page_budget=budget, num_sink_pages=1, backend=backend)
        plain = tinyattn.select_pages(scores, lens, **opts)
        assert torch.equal(tinyattn.select_pages(scores, lens, top_p=1.0, scale=0.3, **opts), plain)
        assert torch.equal(plain, R.select_pages(scores, lens, **{k: v for k, v in opts.items() if k != "backend"}))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_the_selection_grows_with_p(backend):
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 2, 16, generator=g) * 2
    lens = torch.tensor([64, 40], dtype=torch.int32)
    previous = None
    for p in (0.05, 0.2, 0.4, 0.6, 0.8, 0.9, 0.99, 1.0):
        got = _as_sets(tinyattn.select_pages(scores, lens, page_size=4, page_budget=12, top_p=p, scale=1.0,
                                             backend=backend))
        if previous is not None:
            assert all(a <= b for row_a, row_b in zip(previous, got) for a, b in zip(row_a, row_b))
        previous = got


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    got = tinyattn.select_pages(torch.zeros(0, 2, 4), torch.zeros(0, dtype=torch.int32), page_size=4,
                                page_budget=2, top_p=0.5, scale=1.0, backend=backend)
    assert got.shape == (0, 2, 2)
    q, kv = torch.randn(0, 4, 8), torch.randn(3, 4, 2, 8)
    out = tinyattn.sparse_paged_attention(q, kv, kv, torch.zeros(0, 2, dtype=torch.int32),
                                          torch.zeros(0, dtype=torch.int32), k_min=torch.zeros(3, 2, 8),
                                          k_max=torch.zeros(3, 2, 8), page_budget=2, top_p=0.5, backend=backend)
    assert out.shape == q.shape


@pytest.mark.parametrize("top_p,error", [(0.0, ValueError), (-0.5, ValueError), (1.5, ValueError),
                                         (float("nan"), ValueError), ("0.5", TypeError), (True, TypeError)])
def test_a_bad_top_p_is_an_error_naming_top_p(top_p, error):
    p = make_problem(0, batch=1, seq_lens=[9], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    scores = torch.zeros(1, 1, p.block_table.shape[1])
    with pytest.raises(error, match="top_p"):
        tinyattn.select_pages(scores, p.seq_lens, page_size=4, page_budget=2, top_p=top_p, scale=1.0)
    with pytest.raises(error, match="top_p"):
        tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                        k_max=k_max, page_budget=2, top_p=top_p)
    with pytest.raises(error, match="top_p"):
        tinyattn.PagedAttentionPlan().plan(p.block_table, p.seq_lens, num_q_heads=2, num_kv_heads=1, head_dim=8,
                                           page_size=4, page_budget=2, top_p=top_p)


@pytest.mark.parametrize("rule", [dict(top_p=0.5), dict(gamma=0.25), dict(gamma=0)])
def test_box_rules_without_a_selection_by_boxes_are_errors(rule):
    """gamma / top_p where no selection by boxes happens (listed page_indices, a plan without page_budget) would be
    ignored: each is a ValueError naming it, as the CASES.md pass found them silently dropped."""
    name = next(iter(rule))
    p = make_problem(0, batch=1, seq_lens=[9], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    with pytest.raises(ValueError, match=f"^{name}: expected .* with page_indices"):
        tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                        page_indices=torch.zeros(1, 1, 2, dtype=torch.int32), **rule)
    with pytest.raises(ValueError, match=f"^{name}: expected .* without page_budget"):
        tinyattn.PagedAttentionPlan().plan(p.block_table, p.seq_lens, num_q_heads=2, num_kv_heads=1, head_dim=8,
                                           page_size=4, **rule)
    # the defaults stay accepted on both (gamma = 1.0 given explicitly, top_p = None)
    tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                    page_indices=torch.zeros(1, 1, 2, dtype=torch.int32), gamma=1.0, top_p=None)
    tinyattn.PagedAttentionPlan().plan(p.block_table, p.seq_lens, num_q_heads=2, num_kv_heads=1, head_dim=8,
                                       page_size=4, gamma=1, top_p=None)


def test_top_p_needs_a_positive_scale():
    scores, lens = torch.zeros(1, 1, 4), torch.tensor([16], dtype=torch.int32)
    with pytest.raises(ValueError, match="scale"):
        tinyattn.select_pages(scores, lens, page_size=4, page_budget=2, top_p=0.5)
    for scale in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="scale"):
            tinyattn.select_pages(scores, lens, page_size=4, page_budget=2, top_p=0.5, scale=scale)
    p = make_problem(0, batch=1, seq_lens=[9], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    with pytest.raises(ValueError, match="scale"):
        tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                        k_max=k_max, page_budget=2, top_p=0.5, scale=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                        page_indices=torch.zeros(1, 1, 2, dtype=torch.int32), top_p=0.5)


def _problem(seed, lens, Tq=1, group=2):
    p = make_problem(seed, batch=len(lens), seq_lens=list(lens), page_size=4, num_kv_heads=2, group=group,
                     head_dim=16, num_query_tokens=Tq, logit_scale=3.0)
    k_min, k_max = p.bounds()
    return p, k_min, k_max


@pytest.mark.parametrize("backend,stages", [("torch", 1), pytest.param("triton", 1, marks=pytest.mark.slow),
                                            ("triton", 2)])
@pytest.mark.parametrize("gamma,top_p,Tq", [(1.0, 0.6, 1), pytest.param(0.25, 0.9, 1, marks=pytest.mark.slow),
                                            pytest.param(0.25, 0.5, 3, marks=pytest.mark.slow),
                                            pytest.param(0.0, 0.8, 2, marks=pytest.mark.slow)])
def test_sparse_attention_attends_the_pages_select_pages_keeps(backend, stages, gamma, top_p, Tq, monkeypatch):
    """``sparse_paged_attention(top_p=p)`` = attention over ``select_pages(page_scores(..., gamma), ..., top_p=p,
    scale)``'s pages (the same backend), and the reference; Triton's one- and two-stage selections both."""
    monkeypatch.setattr(chunk_topk, "use_two_stage", lambda *a, **k: stages == 2)
    p, k_min, k_max = _problem(7, (0, 45, 70), Tq=Tq)
    scale = 0.3
    args = (p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    got = tinyattn.sparse_paged_attention(*args, k_min=k_min, k_max=k_max, page_budget=8, gamma=gamma, top_p=top_p,
                                          scale=scale, backend=backend)
    scores = tinyattn.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=4, gamma=gamma,
                                  backend=backend)
    pages = tinyattn.select_pages(scores, p.seq_lens, page_size=4, page_budget=8, num_query_tokens=Tq, top_p=top_p,
                                  scale=scale, backend=backend)
    assert (pages >= 0).sum() < (pages >= -1).sum()                          # top-p dropped some pages here
    want = tinyattn.sparse_paged_attention(*args, page_indices=pages, scale=scale, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    ref = R.sparse_paged_attention(*args, k_min=k_min, k_max=k_max, page_budget=8, gamma=gamma, top_p=top_p,
                                   scale=scale)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_with_a_window_and_top_p_matches_the_reference(backend):
    p, k_min, k_max = _problem(3, (37, 61))
    plan = tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, page_budget=6,
        gamma=0.25, top_p=0.7)
    for window in (-1, 13, 30):
        got = plan.run(p.q[:, 0], p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, window_left=window)
        want = R.sparse_paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                        k_max=k_max, page_budget=6, gamma=0.25, top_p=0.7, window_left=window)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_prunes_rows_that_fit_the_budget_and_uses_the_run_scale(backend):
    """With ``top_p < 1`` a row within its capacity is pruned too; the mass uses the scale ``run`` attends with."""
    p, k_min, k_max = _problem(4, (29, 30))
    plan = tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, page_budget=12,
        top_p=0.5)
    assert plan.selects
    for scale in (None, 0.05):
        got = plan.run(p.q[:, 0], p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, scale=scale)
        want = R.sparse_paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                        k_max=k_max, page_budget=12, top_p=0.5, scale=scale)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    dense = tinyattn.paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend=backend)
    assert not torch.allclose(got, dense, atol=1e-3)                      # pages were dropped


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_custom_op_selects_what_the_eager_plan_selects(backend):
    """``tinyattn::select_pages_planned`` (the compiled route) with ``gamma`` / ``top_p`` / ``scale``, and a
    ``torch.compile`` (aot_eager, fullgraph) of the sparse op with both, equal eager."""
    p, k_min, k_max = _problem(5, (45, 70))
    q4 = p.q
    got = custom_ops.select_pages_planned(q4, k_min, k_max, p.block_table, p.seq_lens, 4, 8, 0, 1, -1, backend,
                                          0.25, 0.7, 0.3)
    scores = R.page_scores(q4, k_min, k_max, p.block_table, p.seq_lens, page_size=4, gamma=0.25)
    want = R.select_pages(scores, p.seq_lens, page_size=4, page_budget=8, top_p=0.7, scale=0.3)
    assert torch.equal(got, want)
    torch._dynamo.reset()

    def f(x):
        return tinyattn.sparse_paged_attention(x, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                               k_max=k_max, page_budget=8, gamma=0.25, top_p=0.7, scale=0.3,
                                               backend=backend)
    eager = f(q4[:, 0])
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q4[:, 0]), eager,
                               atol=1e-6, rtol=1e-6)


# ---- graph mode (the watcher of tests/host_calls.py) ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2])
def test_graph_mode_with_gamma_and_top_p_allocates_nothing_and_never_syncs(monkeypatch, stages):
    """The graph-mode contract (tests/ops/test_plan.py) with the box estimate and top-p, on the Triton path's
    one- and two-stage selections: after one warm-up step, plan() + run() with new tables allocate no tensor, read
    no value on the host, keep every buffer's storage, and equal the reference."""
    use = stages == 2
    cap_b, cap_p, S, budget = 2, 24, 4, 5
    plans = tinyattn.PagedAttentionPlan(backend="triton")
    g = torch.Generator().manual_seed(0)
    k, v, k_min, k_max, _ = graph_mode_pool(g, page_size=S, key_scale=2)
    out = torch.empty(cap_b, 4, 16)
    ptrs = None
    for step in range(4):
        table, lens, q = graph_mode_step(g, step, batch=cap_b, page_size=S)
        seen = []
        monkeypatch.setattr(chunk_topk, "use_two_stage", lambda *a, **kw: use)
        if step > 0:
            watch_host_calls(monkeypatch, seen)
        plans.plan(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=S, page_budget=budget,
                   trusted=True, max_batch=cap_b, max_pages_per_seq=cap_p, gamma=0.25, top_p=0.8)
        got = plans.run(q, k, v, k_min=k_min, k_max=k_max, out=out)
        monkeypatch.undo()
        ptrs = check_graph_step(step, seen, got, out, plans, ptrs)
        assert "kept" in ptrs and (("ws_key" in ptrs) == use)
        want = R.sparse_paged_attention(q, k, v, table, lens, k_min=k_min, k_max=k_max, page_budget=budget,
                                        gamma=0.25, top_p=0.8)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([("torch", 1), ("triton", 1), ("triton", 2)]),
       st.sampled_from([0.0, 0.25, 1.0]), st.sampled_from([0.3, 0.7, 0.95]), st.integers(1, 3), st.integers(1, 2),
       st.sampled_from([-1, 0, 5, 11]), st.integers(2, 6))
def test_the_plans_selection_is_the_reference_selection(seed, path, gamma, top_p, group, Tq, window, budget):
    """The fused plan selection (``tinyattn::select_pages_planned``: the torch plan, the Triton one- and two-stage
    paths) with ``gamma``, ``top_p``, GQA, ``Tq > 1``, windows and empty rows, between the reference at
    ``top_p ± 1e-4``. Integer queries and boxes make every score exact in fp32 (ties frequent), so the forms differ
    only in how they sum the masses."""
    backend, stages = path
    lens = [0, 7 + Tq, 23, 37]
    p = make_problem(seed, batch=4, seq_lens=lens, page_size=2, num_kv_heads=2, group=group, head_dim=8,
                     num_query_tokens=Tq)
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, p.q.shape, generator=g).float()
    k_min = torch.randint(-2, 2, (p.k_cache.shape[0], 2, 8), generator=g).float()
    k_max = k_min + 2 * torch.randint(0, 2, k_min.shape, generator=g).float()
    budget = max(budget, -(-(Tq + 1) // 2) + 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk_topk, "use_two_stage", lambda *a, **k: stages == 2)
        got = custom_ops.select_pages_planned(q, k_min, k_max, p.block_table, p.seq_lens, 2, budget, 0, 1, window,
                                              backend, gamma, top_p, 0.3)
    scores = R.page_scores(q, k_min, k_max, p.block_table, p.seq_lens, page_size=2, gamma=gamma)
    selection_reference.mask_pages_before_window(scores, p.seq_lens, page_size=2, num_query_tokens=Tq, window_left=window)
    opts = dict(page_size=2, page_budget=budget, num_query_tokens=Tq)
    _assert_between_references(got, scores, p.seq_lens, opts, top_p, 0.3)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_flow_through_the_pages_top_p_keeps(backend):
    """Autograd (the torch forms; the Triton custom op with its backward kernel) over a top-p selection equals the
    gradient over the same pages listed."""
    p, k_min, k_max = _problem(9, (37, 50))
    q = p.q[:, 0]
    pages = tinyattn.select_pages(tinyattn.page_scores(q, k_min, k_max, p.block_table, p.seq_lens, page_size=4,
                                                       gamma=0.25, backend=backend),
                                  p.seq_lens, page_size=4, page_budget=8, top_p=0.6, scale=0.25, backend=backend)
    grads = []
    for kw in (dict(k_min=k_min, k_max=k_max, page_budget=8, gamma=0.25, top_p=0.6), dict(page_indices=pages)):
        x = q.clone().requires_grad_(True)
        out = tinyattn.sparse_paged_attention(x, p.k_cache, p.v_cache, p.block_table, p.seq_lens, scale=0.25,
                                              backend=backend, **kw)
        out.square().sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-6)
    assert grads[0].abs().sum() > 0
