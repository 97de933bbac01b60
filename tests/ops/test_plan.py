"""The per-step plan (``tinyattn.ops.plan``: ``PagedAttentionPlan.plan`` once per step, ``run`` per layer) and
the one attention layer, on both backends, against the reference.

Proven here: plan / run equals the reference (dense, sparse, listed pages, windows, Tq > 1, packed and sorted
selection keys, the one- and two-stage Triton selections); ``plan()`` copies its tables (changing them in place
afterwards leaves every ``run()`` computing the planned step, identically on both backends); int64 page ids past
int32 are ignored like any id past the row's end; a plan is reused across layers and across steps of other sizes;
a layer's scale is passed down, not stored; graph mode allocates nothing and never syncs on the host (watched with
:mod:`host_calls`) and keeps its buffers; ``run`` dispatches once and checks its own arguments; the autograd route
gives the reference's gradients. Expected values come from ``tinyattn.reference`` (independent loop twins) on the
tables as planned.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn.layer import PagedAttention, SparsityConfig
from tinyattn.ops.plan import PagedAttentionPlan
from tinyattn.ops.selection import torch_impl as selection_torch
from tinyattn.ops import plan as plan_module
from tinyattn import reference

from host_calls import check_graph_step, graph_mode_pool, graph_mode_step, watch_host_calls
from paged_problems import SLOW_TRITON, make_problem, relocate


BACKENDS = ["torch", "triton"]


def _problem(seed, B, Hq, Hkv, D, page_size, lens, Tq=1, dtype=torch.float32):
    """A pool with pages scattered by randperm, NaN in every slot no row owns, boxes from the reference."""
    g = torch.Generator().manual_seed(seed)
    max_pages_per_seq = max(1, max(math.ceil(n / page_size) for n in lens) + 1)                # one spare table column per row
    N = B * max_pages_per_seq + 3
    perm = torch.randperm(N, generator=g)
    table = perm[: B * max_pages_per_seq].view(B, max_pages_per_seq).to(torch.int32)
    k = torch.full((N, page_size, Hkv, D), float("nan"), dtype=dtype)
    v = torch.full((N, page_size, Hkv, D), float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        for pos in range(n):
            k[table[b, pos // page_size], pos % page_size] = torch.randn(Hkv, D, generator=g).to(dtype)
            v[table[b, pos // page_size], pos % page_size] = torch.randn(Hkv, D, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    k_min = torch.zeros(N, Hkv, D, dtype=dtype)
    k_max = torch.zeros(N, Hkv, D, dtype=dtype)
    reference.update_page_metadata(k, table, seq_lens, k_min, k_max)
    q = torch.randn(B, Tq, Hq, D, generator=g).to(dtype)
    return q, k, v, table, seq_lens, k_min, k_max


shapes = st.tuples(st.integers(1, 3), st.sampled_from([(2, 1), (4, 2), (6, 2), (3, 3)]),
                   st.sampled_from([4, 8, 24]), st.sampled_from([4, 8, 16]))


@settings(deadline=None, max_examples=25)
@given(shapes=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_plan_run_matches_reference_torch(shapes, data, seed):
    B, (Hq, Hkv), D, page_size = shapes
    Tq = data.draw(st.sampled_from([1, 1, 3]))
    lens = [data.draw(st.integers(Tq, 6 * page_size)) for _ in range(B)]
    budget = data.draw(st.integers(2, 6))
    sinks = data.draw(st.integers(0, 1))
    q, k, v, table, sl, k_min, k_max = _problem(seed, B, Hq, Hkv, D, page_size, lens, Tq)
    need = max(math.ceil(n / page_size) - (n - Tq) // page_size for n in lens)        # pages holding the queries
    budget = max(budget, need + sinks)
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                                    page_size=page_size, num_query_tokens=Tq, page_budget=budget,
                                                    num_sink_pages=sinks)
    qq = q[:, 0] if Tq == 1 else q
    dense_ref, dense_lse = reference.paged_attention(qq, k, v, table, sl, return_lse=True)
    sparse_ref, sparse_lse = reference.sparse_paged_attention(qq, k, v, table, sl, k_min=k_min, k_max=k_max,
                                                      page_budget=budget, num_sink_pages=sinks, return_lse=True)
    for kwargs, ref, ref_lse in (({}, dense_ref, dense_lse), (dict(k_min=k_min, k_max=k_max), sparse_ref, sparse_lse)):
        out = plan.run(qq, k, v, **kwargs)                               # the fast path (SDPA)
        out2, lse = plan.run(qq, k, v, return_lse=True, **kwargs)        # the NaN-safe core with lse
        for o in (out, out2):
            assert not torch.isnan(o).any()
            torch.testing.assert_close(o, ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-4)


@settings(deadline=None, max_examples=30)
@given(num_valid_pages=st.integers(1, 20), budget=st.integers(1, 8), sinks=st.integers(0, 2), recent=st.integers(0, 2),
       seed=st.integers(0, 2**16), n_ties=st.integers(0, 3))
def test_fused_selection_is_select_pages(num_valid_pages, budget, sinks, recent, seed, n_ties):
    """The plan's selection (the stable sort of the PyTorch path) keeps exactly the
    pages of the reference select_pages (ties to the lower page, NaN as -inf, forced recent and sink pages)."""
    page_size, Hkv, D = 4, 2, 4
    if sinks + max(recent, 1) > budget:
        return
    g = torch.Generator().manual_seed(seed)
    n = num_valid_pages * page_size - int(torch.randint(0, page_size, (1,), generator=g))
    q, k, v, table, sl, k_min, k_max = _problem(seed, 1, 2, Hkv, D, page_size, [n])
    # ties: copy some pages' boxes onto others, and one NaN box
    for _ in range(n_ties):
        a, b = torch.randint(0, num_valid_pages, (2,), generator=g).tolist()
        k_min[table[0, a]], k_max[table[0, a]] = k_min[table[0, b]], k_max[table[0, b]]
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=2, num_kv_heads=Hkv, head_dim=D,
                                                    page_size=page_size, page_budget=budget, num_sink_pages=sinks,
                                                    num_recent_pages=recent)
    if not plan.selects:
        return
    q0 = q[:, 0]
    plan.run(q0, k, v, k_min=k_min, k_max=k_max)
    got = selection_torch.canonical_page_indices(plan._impl.select(q0[:, None], k_min, k_max), sl, page_size)
    scores = reference.page_scores(q0, k_min, k_max, table, sl, page_size=page_size)
    want = reference.select_pages(scores, sl, page_size=page_size, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent)
    assert torch.equal(got.to(torch.int32), want)


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_plan_reused_across_layers_and_steps(backend):
    """One plan, several layers (different pools), then a re-plan with other shapes: same as the public ops."""
    plan = PagedAttentionPlan(backend=backend)
    for step, (B, lens) in enumerate(((2, [40, 17]), (3, [41, 18, 90]), (1, [5]))):
        q0, k0, v0, table, sl, k_min0, k_max0 = _problem(10 * step, B, 4, 2, 8, 8, lens)
        k1, v1 = k0 * -2.0, v0 + 1.0               # a second layer: other values, same pages (NaN stays NaN)
        k_min1, k_max1 = torch.zeros_like(k_min0), torch.zeros_like(k_max0)
        reference.update_page_metadata(k1, table, sl, k_min1, k_max1)
        layers = [(q0, k0, v0, None, None, k_min0, k_max0), (q0 * 0.5, k1, v1, None, None, k_min1, k_max1)]
        plan.plan(table, sl, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=8, page_budget=3)
        for q, k, v, _, _, k_min, k_max in layers:
            # the same table for every layer of a step: the pools differ, the geometry does not
            out = plan.run(q[:, 0], k, v, k_min=k_min, k_max=k_max)
            ref = reference.sparse_paged_attention(q[:, 0], k, v, table, sl, k_min=k_min, k_max=k_max, page_budget=3)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


def test_run_makes_no_host_sync(monkeypatch):
    """plan.run (torch backend, dense and sparse, with and without lse) reads no tensor value on the host."""
    q, k, v, table, sl, k_min, k_max = _problem(0, 2, 8, 4, 8, 16, [200, 77])
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=8, num_kv_heads=4, head_dim=8,
                                                    page_size=16, page_budget=4)
    plan.run(q[:, 0], k, v)          # the first call in a process probes SDPA's empty-row result once
    calls = []

    def forbid(name):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, **kw):
            calls.append(name)
            return real(self, *a, **kw)
        return wrapped

    for name in _SYNCS:
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    monkeypatch.setattr(torch, "nonzero", forbid("nonzero"))
    for kwargs in ({}, dict(k_min=k_min, k_max=k_max)):
        for lse in (False, True):
            plan.run(q[:, 0], k, v, return_lse=lse, **kwargs)
    monkeypatch.undo()
    assert calls == []


def test_triton_run_allocates_nothing_with_out(monkeypatch):
    """With ``out=`` the Triton path of run allocates no tensor (split-K partials, scores, pages: the plan's)."""
    q, k, v, table, sl, k_min, k_max = _problem(1, 2, 4, 2, 8, 8, [60, 33])
    plan = PagedAttentionPlan(backend="triton").plan(table, sl, num_q_heads=4, num_kv_heads=2, head_dim=8,
                                                     page_size=8, page_budget=3)
    out = torch.empty_like(q[:, 0])
    plan.run(q[:, 0], k, v, k_min=k_min, k_max=k_max, out=out)        # warm (compiles under the interpreter)
    made = []
    for name in ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "ones", "tensor"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _n=name, **kw: (made.append(_n), _real(*a, **kw))[1])
    got = plan.run(q[:, 0], k, v, k_min=k_min, k_max=k_max, out=out)
    monkeypatch.undo()
    assert made == [] and got is out
    ref = reference.sparse_paged_attention(q[:, 0], k, v, table, sl, k_min=k_min, k_max=k_max, page_budget=3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("policy", ["quest", "streaming", "h2o"])
def test_layer_decision(policy):
    """PagedAttention: dense layers dense, sparse layers select with the policy, prefill dense."""
    q, k, v, table, sl, k_min, k_max = _problem(3, 2, 4, 2, 8, 8, [70, 41])
    attn = PagedAttention(SparsityConfig(page_budget=3, dense_layers=1, policy=policy), backend="torch")
    attn.begin(table, sl, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=8, trusted=False)
    dense = attn(0, q[:, 0], k, v, k_min, k_max)
    torch.testing.assert_close(dense, reference.paged_attention(q[:, 0], k, v, table, sl), atol=2e-5, rtol=1e-4)
    sparse = attn(1, q[:, 0], k, v, k_min, k_max)
    if policy == "quest":
        ref = reference.sparse_paged_attention(q[:, 0], k, v, table, sl, k_min=k_min, k_max=k_max, page_budget=3,
                                       num_sink_pages=attn.sparsity.num_sink_pages,   # the default recipe's
                                       gamma=attn.sparsity.gamma)
        torch.testing.assert_close(sparse, ref, atol=2e-5, rtol=1e-4)
    else:
        assert not torch.allclose(sparse, dense)                    # 3 of 9 pages: not the dense answer
    attn.begin(table, sl, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=8, decode=False)
    torch.testing.assert_close(attn(1, q[:, 0], k, v, k_min, k_max), dense, atol=2e-5, rtol=1e-4)


def test_plan_rejects_bad_tables():
    plan = PagedAttentionPlan(backend="torch")
    table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        plan.plan(table, torch.tensor([10, 99], dtype=torch.int32), num_q_heads=2, num_kv_heads=1, head_dim=4,
                  page_size=8)
    with pytest.raises(ValueError, match="num_q_heads"):
        plan.plan(table, torch.tensor([1, 2], dtype=torch.int32), num_q_heads=3, num_kv_heads=2, head_dim=4,
                  page_size=8)
    with pytest.raises(TypeError, match="block_table"):
        plan.plan(table.float(), torch.tensor([1, 2]), num_q_heads=2, num_kv_heads=1, head_dim=4, page_size=8)


@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**16), budget=st.integers(2, 12), sinks=st.integers(0, 2), n_ties=st.integers(0, 20),
       B=st.integers(1, 2))
def test_long_rows_select_like_select_pages(seed, budget, sinks, n_ties, B):
    """Rows of more than 64 pages take the packed-key top-k: the same pages as select_pages (ties to the lower
    page, a NaN bound as -inf), and the same output as the reference, with a row shorter than the other."""
    page_size, Hkv, D = 2, 2, 4
    g = torch.Generator().manual_seed(seed)
    lens = [int(torch.randint(130, 180, (1,), generator=g)), 41][:B]
    q, k, v, table, sl, k_min, k_max = _problem(seed, B, 4, Hkv, D, page_size, lens)
    for _ in range(n_ties):                        # equal boxes -> equal bounds
        a, b = torch.randint(0, 60, (2,), generator=g).tolist()
        k_min[table[0, a]], k_max[table[0, a]] = k_min[table[0, b]], k_max[table[0, b]]
    k_max[table[0, 3]] = float("nan")              # a NaN bound counts as -inf
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=4, num_kv_heads=Hkv, head_dim=D,
                                                    page_size=page_size, page_budget=budget + sinks, num_sink_pages=sinks)
    q0 = q[:, 0]
    out = plan.run(q0, k, v, k_min=k_min, k_max=k_max)
    got = torch.sort(plan._impl.select(q0[:, None], k_min, k_max), dim=-1).values.to(torch.int32)
    assert "packed" in plan._impl._keys                    # the long-row form ran
    scores = reference.page_scores(q0, k_min, k_max, table, sl, page_size=page_size)
    want = reference.select_pages(scores, sl, page_size=page_size, page_budget=budget + sinks, num_sink_pages=sinks)
    n = (sl.long() + page_size - 1) // page_size
    got = torch.where(got < n[:, None, None], got, -1)                 # a short row pads with invalid pages
    got = torch.sort(torch.where(got < 0, 10**6, got), dim=-1).values
    assert torch.equal(torch.where(got == 10**6, -1, got), want)
    ref = reference.sparse_paged_attention(q0, k, v, table, sl, page_indices=want)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_run_ignores_duplicate_pages_and_checks_q():
    q, k, v, table, sl, _, _ = _problem(8, 1, 2, 1, 8, 4, [10])
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=2, num_kv_heads=1, head_dim=8,
                                                    page_size=4)
    dup = torch.tensor([[[0, 0, 2]]], dtype=torch.int32)
    want = reference.sparse_paged_attention(q[:, 0], k, v, table, sl, page_indices=torch.tensor([[[0, 2]]]))
    torch.testing.assert_close(plan.run(q[:, 0], k, v, page_indices=dup), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(plan.run(q[:, 0].clone().requires_grad_(), k, v, page_indices=dup), want,
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"q: expected shape \[B=1, Hq=2, D=8\]"):
        plan.run(torch.randn(2, 2, 8), k, v)


@pytest.mark.parametrize("pages", [20, 90])          # the sort path and the packed-key top-k
def test_nan_bound_ties_with_a_real_minus_inf(pages):
    """NaN counts as -inf, ties to the lower page: a NaN page before a -inf page is kept first, on both selection
    forms, exactly as select_pages (a real -inf once became -FLT_MAX through nan_to_num and outranked NaN)."""
    page_size = 2
    q, k, v, table, sl, _, _ = _problem(9, 1, 2, 1, 4, page_size, [pages * page_size])
    keys = selection_torch.selection_keys(sl, pages, page_size=page_size, page_budget=3, num_sink_pages=0, num_recent_pages=1,
                            num_query_tokens=1)
    scores = torch.full((1, 1, pages), float("-inf"))           # every bound -inf ...
    scores[0, 0, 0] = float("nan")                               # ... but page 0's, NaN: ties with -inf, kept first
    scores[0, 0, 7] = float("inf")
    got = torch.sort(selection_torch.top_pages(scores, keys), dim=-1).values.to(torch.int32)
    want = reference.select_pages(scores, sl, page_size=page_size, page_budget=3)
    assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, float("inf"), float("-inf")])),
                min_size=1, max_size=40),
       st.sampled_from([torch.float32, torch.float64]))
def test_float_order_key_orders_like_the_scores(values, dtype):
    """The int64 selection key orders exactly as the fp32 scores with NaN as -inf and -0.0 equal to 0.0
    (expected order from Python's own float comparisons), and leaves its input untouched."""
    from tinyattn.ops.selection import torch_impl as selection_torch
    x = torch.tensor(values, dtype=dtype)
    before = x.clone()
    key = selection_torch.float_order_key(x).tolist()
    as_f32 = [float("-inf") if v != v else float(torch.tensor(v, dtype=torch.float32)) for v in values]
    for i in range(len(values)):
        for j in range(len(values)):
            assert (key[i] < key[j]) == (as_f32[i] < as_f32[j])
            assert (key[i] == key[j]) == (as_f32[i] == as_f32[j])
    assert torch.equal(x.nan_to_num(), before.nan_to_num()) and torch.equal(x.isnan(), before.isnan())


@pytest.mark.parametrize("boxes", [False, True], ids=["dense", "sparse"])
def test_a_layer_scale_is_not_kept_for_the_next_layers(boxes):
    """A layer with its own softmax scale (GPT-2's per-layer scaling) runs with it, and the layers after it with the
    plan's scale again, whatever order the decode hot path saw them in (its cached step arguments hold no scale)."""
    q, k, v, table, sl, k_min, k_max = _problem(7, 2, 8, 4, 16, 4, [30, 13])
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=8, num_kv_heads=4, head_dim=16,
                                                    page_size=4, page_budget=3)
    kw = dict(k_min=k_min, k_max=k_max) if boxes else {}

    def ref(scale=None):
        if boxes:
            return reference.sparse_paged_attention(q[:, 0], k, v, table, sl, page_budget=3, scale=scale, **kw)
        return reference.paged_attention(q[:, 0], k, v, table, sl, scale=scale)

    for order in (("plan", 0.5, "plan"), (0.5, "plan", 0.5)):
        for scale in order:
            got = plan.run(q[:, 0], k, v, **kw) if scale == "plan" else plan.run(q[:, 0], k, v, scale=scale, **kw)
            torch.testing.assert_close(got, ref(None if scale == "plan" else scale), atol=2e-5, rtol=1e-4)


def test_a_failed_plan_does_not_run_the_last_step():
    """plan() that raises leaves the plan unplanned: run raises instead of answering with the last step's tables."""
    q, k, v, table, sl, k_min, k_max = _problem(8, 2, 4, 2, 8, 4, [9, 5])
    plan = PagedAttentionPlan(backend="torch")
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, num_pages=k.shape[0])
    plan.plan(table, sl, **kw).run(q[:, 0], k, v)
    bad = table.clone()
    bad[0, 0] = 999
    with pytest.raises(ValueError, match="block_table"):
        plan.plan(bad, sl, **kw)
    with pytest.raises(RuntimeError, match="plan"):
        plan.run(q[:, 0], k, v)


def test_run_refuses_an_integer_query():
    q, k, v, table, sl, _, _ = _problem(10, 1, 4, 2, 8, 4, [9])
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
    with pytest.raises(TypeError, match="q: expected a floating dtype"):
        plan.run(q[:, 0].to(torch.int32), k, v)


def test_run_names_mismatched_pool_and_box_dtypes():
    q, k, v, table, sl, k_min, k_max = _problem(11, 1, 4, 2, 8, 4, [9])
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
                                                    page_budget=1)
    with pytest.raises(TypeError, match="v_cache: expected dtype torch.float32"):
        plan.run(q[:, 0], k, v.half())
    with pytest.raises(TypeError, match="k_max: expected dtype torch.float32"):
        plan.run(q[:, 0], k, v, k_min=k_min, k_max=k_max.half())


# ---- the plan's contract with its tables: plan() copies them; graph mode allocates nothing and never syncs ----------
def _contract_problem(seed=0, lens=(37, 61)):
    p = make_problem(seed, batch=len(lens), seq_lens=list(lens), page_size=4, num_kv_heads=2, group=2, head_dim=16)
    k_min, k_max = p.bounds()
    return p, k_min, k_max


def _contract_plan(p, backend, **kw):
    return tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_tables_changed_after_plan_give_the_planned_step(backend, sparse):
    """A caller reuses its table buffers for the next step before the last run() of this one: the rows grow past
    the budget and point at other pages. Every run (first and later, selecting or dense) still computes the
    planned step; before issue 25 the budget was ignored for a grown row and the backends disagreed."""
    p, k_min, k_max = _contract_problem()
    q = p.q[:, 0]
    planned_table, planned_lens = p.block_table.clone(), p.seq_lens.clone()
    budget = 6
    kw = dict(page_budget=budget) if sparse else {}
    run_kw = dict(k_min=k_min, k_max=k_max) if sparse else {}
    if sparse:
        want = reference.sparse_paged_attention(q, p.k_cache, p.v_cache, planned_table, planned_lens, k_min=k_min,
                                        k_max=k_max, page_budget=budget)
    else:
        want = reference.paged_attention(q, p.k_cache, p.v_cache, planned_table, planned_lens)
    plan = _contract_plan(p, backend, **kw)
    first = plan.run(q, p.k_cache, p.v_cache, **run_kw)
    # the caller's buffers now describe another step: longer rows, other pages
    p.seq_lens.add_(3)
    p.block_table.copy_(torch.flip(p.block_table, dims=[1]))
    second = plan.run(q, p.k_cache, p.v_cache, **run_kw)
    for out in (first, second):
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(plan.block_table.long(), planned_table.long())
    assert torch.equal(plan.seq_lens.long(), planned_lens.long())


def test_both_backends_answer_the_same_after_in_place_changes():
    """The same planned step with the same in-place change answers the same on both backends."""
    outs = []
    for backend in BACKENDS:
        p, k_min, k_max = _contract_problem(3)
        plan = _contract_plan(p, backend, page_budget=5)
        p.seq_lens.fill_(p.block_table.shape[1] * 4)                 # every row grown to the table's capacity
        outs.append(plan.run(p.q[:, 0], p.k_cache, p.v_cache, k_min=k_min, k_max=k_max))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_page_index_past_int32_is_ignored(backend):
    """An int64 page_indices entry of 2**32 + 1 is past every row's end: ignored, not read as page 1 after an
    int32 cast (the removed C++ path did that). Checked through plan.run and the public op."""
    p, _, _ = _contract_problem(4)
    q = p.q[:, 0]
    big = 2**32 + 1
    listed = torch.tensor([[[0, 2, big], [big, 3, -1]], [[1, big, 4], [0, 5, big]]], dtype=torch.int64)
    kept = torch.where(listed == big, -1, listed)
    want = reference.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, page_indices=kept)
    plan = _contract_plan(p, backend)
    torch.testing.assert_close(plan.run(q, p.k_cache, p.v_cache, page_indices=listed), want, atol=2e-5, rtol=1e-4)
    got = tinyattn.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, page_indices=listed,
                                          backend=backend)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_run_dispatches_once(backend, monkeypatch):
    """run() makes one call into the implementation chosen at plan() time, with or without a gradient (the
    implementation routes autograd itself: the torch forms are differentiable, the Triton backend goes through
    the custom op)."""
    p, k_min, k_max = _contract_problem(5)
    plan = _contract_plan(p, backend, page_budget=4)
    impl = plan._impl
    calls = []
    real = impl.run
    monkeypatch.setattr(impl, "run", lambda *a, **k: (calls.append("run"), real(*a, **k))[1])
    plan.run(p.q[:, 0], p.k_cache, p.v_cache, k_min=k_min, k_max=k_max)
    out = plan.run(p.q[:, 0].clone().requires_grad_(), p.k_cache, p.v_cache, k_min=k_min, k_max=k_max)
    assert calls == ["run", "run"] and out.grad_fn is not None
    assert type(impl).__name__ == {"torch": "TorchPlan", "triton": "TritonPlan"}[backend]


def test_per_layer_scale_is_passed_down_not_stored():
    """A layer's own scale changes that call only; the plan's scale (and the next call) are untouched."""
    p, _, _ = _contract_problem(6)
    q = p.q[:, 0]
    plan = _contract_plan(p, "torch")
    before = plan.scale
    got = plan.run(q, p.k_cache, p.v_cache, scale=0.05)
    assert plan.scale == before
    torch.testing.assert_close(got, reference.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, scale=0.05),
                               atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(plan.run(q, p.k_cache, p.v_cache),
                               reference.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens),
                               atol=2e-5, rtol=1e-4)


def test_no_compiled_code_in_the_package():
    """No C, C++ or CUDA source ships, and nothing builds an extension (issue 25, DESIGN.md §5)."""
    from pathlib import Path

    root = Path(plan_module.__file__).resolve().parents[1]
    sources = [f for f in root.rglob("*") if f.suffix in {".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh"}]
    assert sources == []
    offenders = [f for f in root.rglob("*.py") if "cpp_extension" in f.read_text() or "ninja" in f.read_text()]
    assert offenders == []


@pytest.mark.slow
def test_graph_mode_steps_allocate_nothing_and_never_sync(monkeypatch):
    """Issue 26 (graph mode, Triton path under the interpreter): after one warm-up step, plan() + run() of later
    steps with new tables (other lengths, other pages) within the capacity allocate no tensor and read no value
    on the host, the buffers keep their storage (a captured CUDA graph stays valid), and every step equals the
    reference."""
    cap_b, cap_p, page_size, budget = 2, 24, 4, 3
    plans = tinyattn.PagedAttentionPlan(backend="triton")
    g = torch.Generator().manual_seed(0)
    k, v, k_min, k_max, _ = graph_mode_pool(g, page_size=page_size)
    out = torch.empty(cap_b, 4, 16)
    ptrs = None
    for step in range(4):
        table, lens, q = graph_mode_step(g, step, batch=cap_b, page_size=page_size)
        seen = []
        if step > 0:
            watch_host_calls(monkeypatch, seen)
        plans.plan(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=page_size, page_budget=budget,
                   trusted=True, max_batch=cap_b, max_pages_per_seq=cap_p)
        got = plans.run(q, k, v, k_min=k_min, k_max=k_max, out=out)
        monkeypatch.undo()
        ptrs = check_graph_step(step, seen, got, out, plans, ptrs)
        want = reference.sparse_paged_attention(q, k, v, table, lens, k_min=k_min, k_max=k_max, page_budget=budget)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


# ---- CASES.md's fault kinds on the plan itself: copied tables, the selection template, packed / sorted keys, the
# one- and two-stage Triton selections, graph-mode capacity, reuse across steps, the autograd route ---------------
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _case_problem(seed, lens, *, page_size=4, num_kv_heads=2, group=2, head_dim=16, num_query_tokens=1, **kw):
    return make_problem(seed, batch=len(lens), seq_lens=list(lens), page_size=page_size, num_kv_heads=num_kv_heads,
                        group=group, head_dim=head_dim, num_query_tokens=num_query_tokens, **kw)


def _boxes(p, poison_unused=float("nan")):
    """Exact fp32 boxes of the rows' pages; the boxes of pages no row holds are poisoned."""
    k_min, k_max = p.bounds()
    used = {int(p.block_table[b, j]) for b, n in enumerate(p.seq_lens.tolist()) for j in range(-(-n // p.page_size))}
    unused = [i for i in range(k_min.shape[0]) if i not in used]
    k_min[unused] = poison_unused
    k_max[unused] = poison_unused
    return k_min, k_max


def _case_plan(backend, p, *, num_query_tokens=1, **kw):
    return tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=p.q.shape[2], num_kv_heads=p.num_kv_heads, head_dim=p.q.shape[3],
        page_size=p.page_size, num_query_tokens=num_query_tokens, **kw)


def _q(p, num_query_tokens):
    return p.q if num_query_tokens > 1 else p.q[:, 0]


def _close(got, want, dtype=torch.float32):
    if isinstance(want, tuple):
        assert not torch.isnan(got[0]).any() and not torch.isnan(got[1]).any()
        torch.testing.assert_close(got[0].float(), want[0].float(), **TOL[dtype])
        torch.testing.assert_close(got[1].float(), want[1].float(), **TOL[dtype])
    else:
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _want(p, q, *, k_min=None, k_max=None, page_budget=None, page_indices=None, **kw):
    """The reference on fp32 copies of the problem (low-precision pools compared at their tolerance)."""
    k, v = p.k_cache.float(), p.v_cache.float()
    qf = q.float() if q.dtype != torch.float64 else q
    if q.dtype == torch.float64:
        k, v = p.k_cache.double(), p.v_cache.double()
    if page_indices is not None:
        return reference.sparse_paged_attention(qf, k, v, p.block_table, p.seq_lens, page_indices=page_indices, **kw)
    if page_budget is not None:
        return reference.sparse_paged_attention(qf, k, v, p.block_table, p.seq_lens, k_min=k_min.to(qf.dtype),
                                        k_max=k_max.to(qf.dtype), page_budget=page_budget, **kw)
    return reference.paged_attention(qf, k, v, p.block_table, p.seq_lens, **kw)


CASES = {
    # name: (lens, problem options, plan options, run options)
    "ragged_tails": ([1, 3, 4, 5, 8, 9], {}, {}, {}),
    "empty_rows_dense": ([0, 9, 0, 5], {}, {}, {}),
    "empty_rows_selecting": ([0, 29, 0, 5], {}, dict(page_budget=3), {}),
    "rows_below_the_budget": ([5, 29, 2], {}, dict(page_budget=4), {}),
    "tq3_selecting": ([29, 30, 13], dict(num_query_tokens=3), dict(page_budget=4), {}),
    "tq5_sinks_recent": ([40, 33], dict(num_query_tokens=5), dict(page_budget=5, num_sink_pages=1,
                                                                  num_recent_pages=2), {}),
    "tq2_empty_row": ([0, 33, 7], dict(num_query_tokens=2), dict(page_budget=4), {}),
    "rows_shorter_than_tq": ([2, 33, 7], dict(num_query_tokens=4), dict(page_budget=4), {}),
    "window_dense": ([29, 30, 13, 0], {}, {}, dict(window_left=5)),
    "window_zero": ([29, 30, 13, 1], {}, {}, dict(window_left=0)),
    "window_selecting": ([29, 30, 13, 0], {}, dict(page_budget=3), dict(window_left=5)),
    "window_tq3_selecting": ([29, 30, 13], dict(num_query_tokens=3), dict(page_budget=4), dict(window_left=6)),
    "window_tq3_dense": ([29, 30, 13, 1], dict(num_query_tokens=3), {}, dict(window_left=2)),
    "gqa_3": ([29, 30, 13], dict(group=3), dict(page_budget=3), {}),
    "mqa": ([29, 30, 13], dict(num_kv_heads=1, group=5), dict(page_budget=3), {}),
    "head_dim_8": ([29, 30, 13], dict(head_dim=8), dict(page_budget=3), {}),
    "head_dim_80": ([29, 30, 13], dict(head_dim=80), dict(page_budget=3), {}),
    "fp16": ([29, 30, 13], dict(dtype=torch.float16), dict(page_budget=3), {}),
    "bf16": ([29, 30, 13], dict(dtype=torch.bfloat16), dict(page_budget=3), {}),
    "fp16_tq2": ([29, 30, 13], dict(dtype=torch.float16, num_query_tokens=2), dict(page_budget=4), {}),
    "huge_poison": ([29, 30, 13], dict(poison=1e30), dict(page_budget=3), {}),
    "negative_huge_poison": ([29, 30, 13], dict(poison=-1e30), dict(page_budget=3), {}),
    # P > 64: the torch backend's packed int64 keys (topk) instead of the sort; short and empty rows beside long
    "packed_keys": ([300, 5, 0, 150], dict(head_dim=8), dict(page_budget=6), {}),
    "packed_keys_tq3": ([300, 9, 150], dict(head_dim=8, num_query_tokens=3), dict(page_budget=6,
                                                                                 num_recent_pages=2), {}),
    "packed_keys_window": ([300, 9, 150], dict(head_dim=8, num_query_tokens=2), dict(page_budget=6),
                           dict(window_left=13)),
}


@pytest.mark.parametrize("backend, name", [                  # the packed keys (P > 64) are slow in the interpreter
    pytest.param(backend, name, marks=[pytest.mark.slow] if backend == "triton" and name.startswith("packed") else [])
    for name in CASES for backend in BACKENDS])
def test_planned_step_matches_the_reference(backend, name):
    lens, prob, plan_kw, run_kw = CASES[name]
    p = _case_problem(len(name), lens, **prob)
    Tq = prob.get("num_query_tokens", 1)
    dtype = prob.get("dtype", torch.float32)
    k_min, k_max = _boxes(p)
    q = _q(p, Tq)
    sel = dict(k_min=k_min.to(dtype), k_max=k_max.to(dtype)) if "page_budget" in plan_kw else {}
    got = _case_plan(backend, p, num_query_tokens=Tq, **plan_kw).run(q, p.k_cache, p.v_cache, return_lse=True,
                                                                **sel, **run_kw)
    want = _want(p, q, k_min=k_min, k_max=k_max, return_lse=True, **plan_kw, **run_kw)
    _close(got, want, dtype)


@pytest.mark.parametrize("backend", SLOW_TRITON)
@pytest.mark.parametrize("fill", [0.0, float("nan"), float("inf"), float("-inf")])
def test_boxes_with_ties_nan_and_infinite_bounds(backend, fill):
    """Kind 7: three pages of row 0 share one box (ties, NaN = -inf, +-inf bounds); with and without a sink."""
    p = _case_problem(4, [29, 30, 13])
    q = p.q[:, 0]
    k_min, k_max = p.bounds()
    pages = p.block_table[0, 2:5].long()
    k_min[pages] = fill
    k_max[pages] = fill
    for sinks in (0, 1):
        got = _case_plan(backend, p, page_budget=3, num_sink_pages=sinks).run(q, p.k_cache, p.v_cache, k_min=k_min,
                                                                          k_max=k_max)
        _close(got, _want(p, q, k_min=k_min, k_max=k_max, page_budget=3, num_sink_pages=sinks))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window_left", [-1, 6])
@pytest.mark.parametrize("num_query_tokens", [1, 2])
def test_listed_pages_with_duplicates_minus_one_and_int64_past_int32(backend, window_left, num_query_tokens):
    """Kinds 5 and 7: listed pages with duplicates, -1, ids past the row's end and past int32 (2**40), an empty
    row; the reference gets the de-duplicated list."""
    p = _case_problem(5, [29, 0, 13], num_query_tokens=num_query_tokens)
    listed = torch.tensor([[[0, 0, 2, -1], [3, 3, 3, 1]], [[7, -1, -1, 1], [1, 0, 9, 9]],
                           [[0, 0, 0, 0], [2**40, 1, 2**40, -1]]], dtype=torch.int64)
    dedup = torch.tensor([[sorted({j for j in r if 0 <= j < 2**31}) + [-1] * (4 - len({j for j in r
                                                                                      if 0 <= j < 2**31}))
                           for r in row] for row in listed.tolist()])
    q = _q(p, num_query_tokens)
    got = _case_plan(backend, p, num_query_tokens=num_query_tokens).run(q, p.k_cache, p.v_cache, page_indices=listed,
                                                                    window_left=window_left, return_lse=True)
    _close(got, _want(p, q, page_indices=dedup, window_left=window_left, return_lse=True))


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_one_stage_triton_selection_with_windows_and_nan_boxes(backend):
    """``B * Hkv >= 132``: the Triton plan selects in one stage (bound kernel, window mask, top-k kernel), the path
    the interpreter's small problems never take otherwise (they select in two stages)."""
    lens = [(i * 7) % 40 for i in range(34)]
    p = _case_problem(6, lens, num_kv_heads=4, group=1, head_dim=8, num_query_tokens=2)
    k_min, k_max = _boxes(p)
    g = torch.Generator().manual_seed(1)
    nan_pages = torch.rand(k_min.shape[0], generator=g) < 0.3
    k_min[nan_pages] = float("nan")
    k_max[nan_pages] = float("nan")
    for window_left in (-1, 5):
        got = _case_plan(backend, p, num_query_tokens=2, page_budget=3).run(p.q, p.k_cache, p.v_cache, k_min=k_min,
                                                                       k_max=k_max, window_left=window_left,
                                                                       return_lse=True)
        _close(got, _want(p, p.q, k_min=k_min, k_max=k_max, page_budget=3, window_left=window_left,
                          return_lse=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("int64", [False, True])
def test_rows_at_high_page_ids(backend, int64):
    p = relocate(_case_problem(3, [29, 30, 13]), num_pages=4000, spare_columns=2, poison=float("nan"), seed=1)
    k_min = torch.full((4000, 2, 16), float("nan"))
    k_max = k_min.clone()
    reference.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
    q = p.q[:, 0]
    bt, sl = (p.block_table.long(), p.seq_lens.long()) if int64 else (p.block_table, p.seq_lens)
    plan = tinyattn.PagedAttentionPlan(backend=backend).plan(bt, sl, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                            page_size=4, page_budget=3)
    _close(plan.run(q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max),
           _want(p, q, k_min=k_min, k_max=k_max, page_budget=3))
    _close(plan.run(q, p.k_cache, p.v_cache), _want(p, q))


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_non_contiguous_q_pools_boxes_and_out(backend):
    p = _case_problem(1, [29, 30, 13])
    k_min, k_max = p.bounds()
    q = p.q[:, 0]
    nan = float("nan")
    q_view = torch.cat([q, torch.full_like(q, nan)], -1)[..., :16]                       # a slice
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)                                  # a transpose view
    k_view = torch.cat([p.k_cache, torch.full_like(p.k_cache, nan)], -1)[..., :16]
    v_view = torch.cat([torch.full_like(p.v_cache, nan), p.v_cache], -1)[..., 16:]
    lo, hi = torch.cat([k_min, k_min], -1)[..., :16], torch.cat([k_max, k_max], -1)[..., :16]
    out = torch.zeros(3, 16, 4).transpose(1, 2)
    assert not any(x.is_contiguous() for x in (q_view, q_t, k_view, v_view, lo, out))
    plan = _case_plan(backend, p, page_budget=3)
    want = _want(p, q, k_min=k_min, k_max=k_max, page_budget=3)
    for qq in (q_view, q_t):
        _close(plan.run(qq, k_view, v_view, k_min=lo, k_max=hi), want)
    plan.run(q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, out=out)
    _close(out, want)
    _close(plan.run(q_t, k_view, v_view), _want(p, q))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float_pool_of_another_dtype_than_q_raises(backend):
    """DESIGN.md §2: the pools hold ``q``'s dtype (or int8 / fp8 with scales). ``run`` with an fp16 pool under an
    fp32 ``q`` raised an interpreter/compiler error on the Triton plan ("Both operands must be same dtype") and ran
    on the torch plan: now a TypeError naming ``k_cache`` on both, as the public ops raise."""
    p = _case_problem(3, [29, 30, 13])
    k_min, k_max = p.bounds()
    plan = _case_plan(backend, p, page_budget=3)
    for kw in ({}, dict(k_min=k_min, k_max=k_max)):
        with pytest.raises(TypeError, match="k_cache: expected dtype float32"):
            plan.run(p.q[:, 0], p.k_cache.half(), p.v_cache.half(), **kw)


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_one_plan_reused_across_steps_of_other_sizes(backend):
    plan = tinyattn.PagedAttentionPlan(backend=backend)
    for seed, lens, Tq, budget in [(5, [29, 30, 13], 1, 3), (6, [9], 1, 2), (7, [40, 3, 0, 17, 22], 2, 4),
                                   (8, [5, 5], 1, None), (9, [60, 61], 3, 5), (10, [13, 2, 7], 1, 3)]:
        p = _case_problem(seed, lens, num_query_tokens=Tq)
        k_min, k_max = _boxes(p)
        q = _q(p, Tq)
        plan.plan(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                  num_query_tokens=Tq, page_budget=budget)
        sel = dict(k_min=k_min, k_max=k_max) if budget else {}
        _close(plan.run(q, p.k_cache, p.v_cache, return_lse=True, **sel),
               _want(p, q, k_min=k_min, k_max=k_max, page_budget=budget, return_lse=True))
        _close(plan.run(q, p.k_cache, p.v_cache, window_left=5), _want(p, q, window_left=5))


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_graph_mode_steps_that_shrink_the_batch_and_the_rows(backend):
    """Graph mode: capacity 6 rows x 20 pages; later steps have fewer rows, shorter tables, empty rows; fp64 runs
    the torch plan over the Triton plan's capacity-wide tables."""
    plan = tinyattn.PagedAttentionPlan(backend=backend)
    for seed, lens, budget in [(11, [29, 30, 13, 50], 3), (12, [9, 20], 3), (13, [57], 4), (14, [0, 33, 5], 3),
                               (15, [1, 2, 3, 4, 5, 6], 3)]:
        p = _case_problem(seed, lens)
        k_min, k_max = _boxes(p)
        q = p.q[:, 0]
        plan.plan(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                  page_budget=budget, max_batch=6, max_pages_per_seq=20, trusted=True)
        out = torch.empty_like(q)
        _close(plan.run(q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, out=out, return_lse=True),
               _want(p, q, k_min=k_min, k_max=k_max, page_budget=budget, return_lse=True))
        _close(plan.run(q, p.k_cache, p.v_cache, out=out), _want(p, q))
        lo, hi = torch.nan_to_num(k_min).double(), torch.nan_to_num(k_max).double()
        _close(plan.run(q.double(), p.k_cache.double(), p.v_cache.double(), k_min=lo, k_max=hi),
               _want(p, q.double(), k_min=lo, k_max=hi, page_budget=budget), torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Tq, lens, budget, window_left", [(1, [29, 30, 13], 3, -1), (3, [29, 0, 13], 4, -1),
                                                           (2, [29, 30], 4, 5), (1, [29, 30, 13], None, 4)])
def test_gradients_with_selection_shared_pages_and_poisoned_slots(backend, Tq, lens, budget, window_left):
    """Selection + backward; rows 0 and 1 share their first three pages (prefix sharing: gradients accumulate);
    unused slots hold NaN (no NaN may reach dq, nor the gradient of any valid slot)."""
    p = _case_problem(16, lens, num_query_tokens=Tq)
    bt = p.block_table.clone()
    if lens[1] > 0:
        bt[1, :3] = bt[0, :3]
    k_min = torch.zeros(p.k_cache.shape[0], 2, 16)
    k_max = torch.zeros_like(k_min)
    reference.update_page_metadata(p.k_cache, bt, p.seq_lens, k_min, k_max)
    q0 = _q(p, Tq)
    w = torch.randn(q0.shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for impl in ("plan", "reference"):
        q, k, v = (x.clone().requires_grad_() for x in (q0, p.k_cache, p.v_cache))
        if impl == "plan":
            plan = tinyattn.PagedAttentionPlan(backend=backend).plan(
                bt, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, num_query_tokens=Tq,
                page_budget=budget)
            o = plan.run(q, k, v, window_left=window_left, **(dict(k_min=k_min, k_max=k_max) if budget else {}))
        elif budget:
            o = reference.sparse_paged_attention(q, k, v, bt, p.seq_lens, k_min=k_min, k_max=k_max, page_budget=budget,
                                         window_left=window_left)
        else:
            o = reference.paged_attention(q, k, v, bt, p.seq_lens, window_left=window_left)
        (o * w).sum().backward()
        grads.append([o.detach(), q.grad, torch.nan_to_num(k.grad, nan=7.0), torch.nan_to_num(v.grad, nan=7.0)])
    assert not torch.isnan(grads[0][1]).any()
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("backend", SLOW_TRITON)
@pytest.mark.parametrize("policy", ["quest", "oracle", "streaming"])
def test_layer_keeps_the_planned_tables(backend, policy):
    p = _case_problem(7, [29, 0, 30, 13])
    k_min, k_max = p.bounds()
    q = p.q[:, 0]
    planned = p.block_table.clone(), p.seq_lens.clone()
    attn = PagedAttention(SparsityConfig(page_budget=3, policy=policy), backend=backend)
    attn.begin(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    first = attn(0, q, p.k_cache, p.v_cache, k_min, k_max)
    p.seq_lens.add_(2)
    p.block_table.copy_(p.block_table.flip(1))
    _close(attn(0, q, p.k_cache, p.v_cache, k_min, k_max), first)
    if policy == "quest":
        want = reference.sparse_paged_attention(q, p.k_cache, p.v_cache, *planned, k_min=k_min, k_max=k_max, page_budget=3,
                                        num_sink_pages=attn.sparsity.num_sink_pages,    # the default recipe's
                                        gamma=attn.sparsity.gamma)
        _close(first, want)


_LISTED = [[[0, 3, -1], [1, 2, 5]]] * 3           # [B=3, Hkv=2, K=3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_indices, error, match", [
    (torch.tensor([[[0, 3, -1]]] * 3), ValueError, r"page_indices: expected shape \[B=3, Hkv=2, K\]"),   # Hkv 1
    (torch.tensor(_LISTED[:1]), ValueError, r"page_indices: expected shape \[B=3, Hkv=2, K\]"),          # B 1
    (torch.tensor([[0, 3, -1]] * 3), ValueError, r"page_indices: expected shape \[B=3, Hkv=2, K\]"),     # 2-D
    (torch.tensor(_LISTED, dtype=torch.float32), TypeError, "page_indices: expected dtype"),
    (torch.ones(3, 2, 3, dtype=torch.bool), TypeError, "page_indices: expected dtype"),
])
def test_run_rejects_page_indices_of_another_shape_or_dtype(backend, page_indices, error, match):
    """A ``[B, 1, K]`` / ``[1, Hkv, K]`` / ``[B, K]`` list was broadcast by the torch plan (or failed deep inside it)
    and read past its end by the Triton kernel (a silently wrong answer); float / bool lists were read as pages."""
    p = _case_problem(1, [29, 30, 13])
    with pytest.raises(error, match=match):
        _case_plan(backend, p).run(p.q[:, 0], p.k_cache, p.v_cache, page_indices=page_indices)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                          ("0.5", TypeError), (True, TypeError)])
def test_run_rejects_a_bad_scale_override(backend, scale, error):
    """``run(scale=...)`` (a layer's own scale) is checked like ``plan(scale=...)``: NaN / inf gave NaN outputs, a
    string was parsed."""
    p = _case_problem(1, [29, 30, 13])
    with pytest.raises(error, match="scale: expected"):
        _case_plan(backend, p).run(p.q[:, 0], p.k_cache, p.v_cache, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_rejects_integer_boxes_and_an_out_of_another_dtype(backend):
    """Integer boxes were scored as numbers; an int ``out`` received the output truncated to integers."""
    p = _case_problem(1, [29, 30, 13])
    k_min, k_max = p.bounds()
    plan = _case_plan(backend, p, page_budget=3)
    q = p.q[:, 0]
    with pytest.raises(TypeError, match="k_min: expected a floating dtype"):
        plan.run(q, p.k_cache, p.v_cache, k_min=k_min.int(), k_max=k_max.int())
    for dtype in (torch.int32, torch.float16):
        with pytest.raises(TypeError, match="out: expected dtype float32"):
            plan.run(q, p.k_cache, p.v_cache, out=torch.zeros(q.shape, dtype=dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window_left", [-1, 2])
@pytest.mark.parametrize("budget", [None, 3])
def test_no_lse_path_with_empty_rows_and_very_negative_logits(backend, window_left, budget):
    """Without ``return_lse`` the torch plan runs SDPA with an additive ``-inf`` mask: an empty row, queries that
    see nothing and logits near -1e8 must still give the reference (zeros, no NaN)."""
    p = _case_problem(4, [29, 0, 13], num_query_tokens=2, logit_scale=1e4)
    k_min, k_max = p.bounds()
    sel = dict(k_min=k_min, k_max=k_max) if budget else {}
    got = _case_plan(backend, p, num_query_tokens=2, page_budget=budget).run(p.q, p.k_cache, p.v_cache,
                                                                         window_left=window_left, **sel)
    want = _want(p, p.q, k_min=k_min, k_max=k_max, page_budget=budget, window_left=window_left)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("Tq, budget", [(1, None), (1, 5), (2, 6)])
def test_torch_plan_in_chunks_matches_the_reference(monkeypatch, Tq, budget):
    """The torch plan's split-K path (ops/chunked.py: chunks of keys merged by lse), forced on a small step: empty
    row, ragged tails, NaN in unused slots, selection, with and without lse."""
    from tinyattn.ops.attention import torch_impl as chunked
    monkeypatch.setattr(chunked, "MIN_BYTES", 0)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 16 * 4 * 2 * 16 * 4)       # 16 keys per chunk here
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    p = _case_problem(9, [61, 0, 37, 3], num_query_tokens=Tq)
    k_min, k_max = _boxes(p)
    q = _q(p, Tq)
    sel = dict(k_min=k_min, k_max=k_max) if budget else {}
    plan = _case_plan("torch", p, num_query_tokens=Tq, page_budget=budget)
    assert chunked.chunk_keys(64, 8, 16) == 16
    _close(plan.run(q, p.k_cache, p.v_cache, return_lse=True, **sel),
           _want(p, q, k_min=k_min, k_max=k_max, page_budget=budget, return_lse=True))
    _close(plan.run(q, p.k_cache, p.v_cache, **sel), _want(p, q, k_min=k_min, k_max=k_max, page_budget=budget))


# ---- the plan's own checks ---------------------------------------------------------------------------------------
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
        ref = reference.paged_attention(q, *p.args[1:], window_left=w)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
