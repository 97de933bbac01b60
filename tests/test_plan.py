"""PagedAttentionPlan (plan once per step, run per layer) and the one attention layer, against the reference.

Expected values come from ``tinyattn.reference`` (independent loop twins). The plan's torch fast path has
its own selection (a stable sort) and its own gather tables, so every property is checked on it directly.
"""

import contextlib
import math

import pytest
import torch

from hypothesis import given, settings, strategies as st

import tinyattn
from tinyattn import reference as R
from tinyattn.layer import PagedAttention, SparsityConfig
from tinyattn.ops.selection import torch_impl as core
from tinyattn.ops.selection import torch_impl as T
from tinyattn.ops.plan import PagedAttentionPlan

from paged_problems import make_problem

BACKENDS = ["torch", "triton"]


def _problem(seed, B, Hq, Hkv, D, S, lens, Tq=1, dtype=torch.float32):
    """A pool with pages scattered by randperm, NaN in every slot no row owns, boxes from the reference."""
    g = torch.Generator().manual_seed(seed)
    P = max(1, max(math.ceil(n / S) for n in lens) + 1)                # one spare table column per row
    N = B * P + 3
    perm = torch.randperm(N, generator=g)
    table = perm[: B * P].view(B, P).to(torch.int32)
    k = torch.full((N, S, Hkv, D), float("nan"), dtype=dtype)
    v = torch.full((N, S, Hkv, D), float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        for pos in range(n):
            k[table[b, pos // S], pos % S] = torch.randn(Hkv, D, generator=g).to(dtype)
            v[table[b, pos // S], pos % S] = torch.randn(Hkv, D, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    k_min = torch.zeros(N, Hkv, D, dtype=dtype)
    k_max = torch.zeros(N, Hkv, D, dtype=dtype)
    R.update_page_metadata(k, table, seq_lens, k_min, k_max)
    q = torch.randn(B, Tq, Hq, D, generator=g).to(dtype)
    return q, k, v, table, seq_lens, k_min, k_max


shapes = st.tuples(st.integers(1, 3), st.sampled_from([(2, 1), (4, 2), (6, 2), (3, 3)]),
                   st.sampled_from([4, 8, 24]), st.sampled_from([4, 8, 16]))


@settings(deadline=None, max_examples=25)
@given(shapes=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_plan_run_matches_reference_torch(shapes, data, seed):
    B, (Hq, Hkv), D, S = shapes
    Tq = data.draw(st.sampled_from([1, 1, 3]))
    lens = [data.draw(st.integers(Tq, 6 * S)) for _ in range(B)]
    budget = data.draw(st.integers(2, 6))
    sinks = data.draw(st.integers(0, 1))
    q, k, v, table, sl, k_min, k_max = _problem(seed, B, Hq, Hkv, D, S, lens, Tq)
    need = max(math.ceil(n / S) - (n - Tq) // S for n in lens)        # pages holding the queries
    budget = max(budget, need + sinks)
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                                    page_size=S, num_query_tokens=Tq, page_budget=budget,
                                                    num_sink_pages=sinks)
    qq = q[:, 0] if Tq == 1 else q
    dense_ref, dense_lse = R.paged_attention(qq, k, v, table, sl, return_lse=True)
    sparse_ref, sparse_lse = R.sparse_paged_attention(qq, k, v, table, sl, k_min=k_min, k_max=k_max,
                                                      page_budget=budget, num_sink_pages=sinks, return_lse=True)
    for kwargs, ref, ref_lse in (({}, dense_ref, dense_lse), (dict(k_min=k_min, k_max=k_max), sparse_ref, sparse_lse)):
        out = plan.run(qq, k, v, **kwargs)                               # the fast path (SDPA)
        out2, lse = plan.run(qq, k, v, return_lse=True, **kwargs)        # the NaN-safe core with lse
        for o in (out, out2):
            assert not torch.isnan(o).any()
            torch.testing.assert_close(o, ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-4)


@settings(deadline=None, max_examples=30)
@given(P=st.integers(1, 20), budget=st.integers(1, 8), sinks=st.integers(0, 2), recent=st.integers(0, 2),
       seed=st.integers(0, 2**16), n_ties=st.integers(0, 3))
def test_fused_selection_is_select_pages(P, budget, sinks, recent, seed, n_ties):
    """The plan's selection (the stable sort of the PyTorch path) keeps exactly the
    pages of the reference select_pages (ties to the lower page, NaN as -inf, forced recent and sink pages)."""
    S, Hkv, D = 4, 2, 4
    if sinks + max(recent, 1) > budget:
        return
    g = torch.Generator().manual_seed(seed)
    n = P * S - int(torch.randint(0, S, (1,), generator=g))
    q, k, v, table, sl, k_min, k_max = _problem(seed, 1, 2, Hkv, D, S, [n])
    # ties: copy some pages' boxes onto others, and one NaN box
    for _ in range(n_ties):
        a, b = torch.randint(0, P, (2,), generator=g).tolist()
        k_min[table[0, a]], k_max[table[0, a]] = k_min[table[0, b]], k_max[table[0, b]]
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=2, num_kv_heads=Hkv, head_dim=D,
                                                    page_size=S, page_budget=budget, num_sink_pages=sinks,
                                                    num_recent_pages=recent)
    if not plan.selects:
        return
    q0 = q[:, 0]
    plan.run(q0, k, v, k_min=k_min, k_max=k_max)
    got = core.canonical_page_indices(plan._impl.select(q0[:, None], k_min, k_max), sl, S)
    scores = R.page_scores(q0, k_min, k_max, table, sl, page_size=S)
    want = R.select_pages(scores, sl, page_size=S, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent)
    assert torch.equal(got.to(torch.int32), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_reused_across_layers_and_steps(backend):
    """One plan, several layers (different pools), then a re-plan with other shapes: same as the public ops."""
    plan = PagedAttentionPlan(backend=backend)
    for step, (B, lens) in enumerate(((2, [40, 17]), (3, [41, 18, 90]), (1, [5]))):
        q0, k0, v0, table, sl, k_min0, k_max0 = _problem(10 * step, B, 4, 2, 8, 8, lens)
        k1, v1 = k0 * -2.0, v0 + 1.0               # a second layer: other values, same pages (NaN stays NaN)
        k_min1, k_max1 = torch.zeros_like(k_min0), torch.zeros_like(k_max0)
        R.update_page_metadata(k1, table, sl, k_min1, k_max1)
        layers = [(q0, k0, v0, None, None, k_min0, k_max0), (q0 * 0.5, k1, v1, None, None, k_min1, k_max1)]
        plan.plan(table, sl, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=8, page_budget=3)
        for q, k, v, _, _, k_min, k_max in layers:
            # the same table for every layer of a step: the pools differ, the geometry does not
            out = plan.run(q[:, 0], k, v, k_min=k_min, k_max=k_max)
            ref = R.sparse_paged_attention(q[:, 0], k, v, table, sl, k_min=k_min, k_max=k_max, page_budget=3)
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
    ref = R.sparse_paged_attention(q[:, 0], k, v, table, sl, k_min=k_min, k_max=k_max, page_budget=3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("policy", ["quest", "streaming", "h2o"])
def test_layer_decision(policy):
    """PagedAttention: dense layers dense, sparse layers select with the policy, prefill dense."""
    q, k, v, table, sl, k_min, k_max = _problem(3, 2, 4, 2, 8, 8, [70, 41])
    attn = PagedAttention(SparsityConfig(page_budget=3, dense_layers=1, policy=policy), backend="torch")
    attn.begin(table, sl, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=8, trusted=False)
    dense = attn(0, q[:, 0], k, v, k_min, k_max)
    torch.testing.assert_close(dense, R.paged_attention(q[:, 0], k, v, table, sl), atol=2e-5, rtol=1e-4)
    sparse = attn(1, q[:, 0], k, v, k_min, k_max)
    if policy == "quest":
        ref = R.sparse_paged_attention(q[:, 0], k, v, table, sl, k_min=k_min, k_max=k_max, page_budget=3,
                                       num_sink_pages=attn.sparsity.num_sink_pages)   # the default recipe's
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


@pytest.mark.parametrize("sparse", [False, True])
def test_repeated_calls_skip_checks_only_for_unchanged_tables(sparse):
    """The public ops validate a (block_table, seq_lens) pair once per thread; changed values (in place, or a
    new tensor) are validated again, and a reused plan never serves stale tables."""
    q, k, v, table, sl, k_min, k_max = _problem(5, 2, 4, 2, 8, 8, [40, 17])
    kw = dict(k_min=k_min, k_max=k_max, page_budget=2) if sparse else {}
    op = tinyattn.sparse_paged_attention if sparse else tinyattn.paged_attention
    ref_op = R.sparse_paged_attention if sparse else R.paged_attention
    for _ in range(2):
        torch.testing.assert_close(op(q[:, 0], k, v, table, sl, **kw), ref_op(q[:, 0], k, v, table, sl, **kw),
                                   atol=2e-5, rtol=1e-4)
    sl[1] = 10_000                                          # in place: the version counter moves
    with pytest.raises(ValueError, match="seq_lens"):
        op(q[:, 0], k, v, table, sl, **kw)
    sl[1] = 9                                               # a valid change: a new answer, not the cached one
    torch.testing.assert_close(op(q[:, 0], k, v, table, sl, **kw), ref_op(q[:, 0], k, v, table, sl, **kw),
                               atol=2e-5, rtol=1e-4)
    bad = table.clone()
    bad[0, 0] = 10_000                                      # a new tensor with a bad page id
    with pytest.raises(ValueError, match="block_table"):
        op(q[:, 0], k, v, bad, sl, **kw)


def test_remembered_call_still_checks_every_other_argument():
    """After a validated call is remembered (same tables), a call that differs in any other argument - a
    ``True`` budget for ``1``, a NaN scale, a q of another dtype, boxes of another shape - is checked afresh."""
    q, k, v, table, sl, k_min, k_max = _problem(8, 2, 4, 2, 8, 8, [40, 17])
    q0 = q[:, 0]
    kw = dict(k_min=k_min, k_max=k_max, page_budget=1, num_recent_pages=1)
    for _ in range(2):
        tinyattn.sparse_paged_attention(q0, k, v, table, sl, **kw)
    with pytest.raises(TypeError, match="page_budget"):
        tinyattn.sparse_paged_attention(q0, k, v, table, sl, **dict(kw, page_budget=True))
    with pytest.raises(ValueError, match="scale"):
        tinyattn.sparse_paged_attention(q0, k, v, table, sl, scale=float("nan"), **kw)
    with pytest.raises(TypeError, match="k_cache"):
        tinyattn.sparse_paged_attention(q0.double(), k, v, table, sl, **kw)
    with pytest.raises(ValueError, match="k_min"):
        tinyattn.sparse_paged_attention(q0, k, v, table, sl, **dict(kw, k_min=k_min[:-1]))
    tinyattn.paged_attention(q0, k, v, table, sl)
    with pytest.raises(TypeError, match="scale"):
        tinyattn.paged_attention(q0, k, v, table, sl, scale="0.5")


@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**16), budget=st.integers(2, 12), sinks=st.integers(0, 2), n_ties=st.integers(0, 20),
       B=st.integers(1, 2))
def test_long_rows_select_like_select_pages(seed, budget, sinks, n_ties, B):
    """Rows of more than 64 pages take the packed-key top-k: the same pages as select_pages (ties to the lower
    page, a NaN bound as -inf), and the same output as the reference, with a row shorter than the other."""
    S, Hkv, D = 2, 2, 4
    g = torch.Generator().manual_seed(seed)
    lens = [int(torch.randint(130, 180, (1,), generator=g)), 41][:B]
    q, k, v, table, sl, k_min, k_max = _problem(seed, B, 4, Hkv, D, S, lens)
    for _ in range(n_ties):                        # equal boxes -> equal bounds
        a, b = torch.randint(0, 60, (2,), generator=g).tolist()
        k_min[table[0, a]], k_max[table[0, a]] = k_min[table[0, b]], k_max[table[0, b]]
    k_max[table[0, 3]] = float("nan")              # a NaN bound counts as -inf
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=4, num_kv_heads=Hkv, head_dim=D,
                                                    page_size=S, page_budget=budget + sinks, num_sink_pages=sinks)
    q0 = q[:, 0]
    out = plan.run(q0, k, v, k_min=k_min, k_max=k_max)
    got = torch.sort(plan._impl.select(q0[:, None], k_min, k_max), dim=-1).values.to(torch.int32)
    assert "packed" in plan._impl._keys                    # the long-row form ran
    scores = R.page_scores(q0, k_min, k_max, table, sl, page_size=S)
    want = R.select_pages(scores, sl, page_size=S, page_budget=budget + sinks, num_sink_pages=sinks)
    n = (sl.long() + S - 1) // S
    got = torch.where(got < n[:, None, None], got, -1)                 # a short row pads with invalid pages
    got = torch.sort(torch.where(got < 0, 10**6, got), dim=-1).values
    assert torch.equal(torch.where(got == 10**6, -1, got), want)
    ref = R.sparse_paged_attention(q0, k, v, table, sl, page_indices=want)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_tables_written_behind_autograds_back_are_seen():
    """A host buffer shared with seq_lens (torch.from_numpy, as serving loops reuse one) changes without a
    version bump: the op still answers for the new values and still rejects bad ones."""
    import numpy as np
    q, k, v, table, _, _, _ = _problem(6, 2, 2, 1, 8, 4, [5, 11])
    host = np.array([5, 11], dtype=np.int32)
    sl = torch.from_numpy(host)
    tinyattn.paged_attention(q[:, 0], k, v, table, sl)
    host[1] = 6
    torch.testing.assert_close(tinyattn.paged_attention(q[:, 0], k, v, table, sl),
                               R.paged_attention(q[:, 0], k, v, table, sl), atol=2e-5, rtol=1e-4)
    host[1] = 1000
    with pytest.raises(ValueError, match="seq_lens"):
        tinyattn.paged_attention(q[:, 0], k, v, table, sl)


def test_inference_mode_tables_and_fp64_masks():
    """Tables made under torch.inference_mode work; fp64 with a mask (unequal lengths) matches the reference
    (SDPA needs the mask in the query's dtype)."""
    q, k, v, table, sl, k_min, k_max = _problem(7, 2, 4, 2, 8, 4, [10, 23], dtype=torch.float64)
    with torch.inference_mode():
        table_i, sl_i = table.clone(), sl.clone()
    for op, kw, ref in ((tinyattn.paged_attention, {}, R.paged_attention(q[:, 0], k, v, table, sl)),
                        (tinyattn.sparse_paged_attention, dict(k_min=k_min, k_max=k_max, page_budget=2),
                         R.sparse_paged_attention(q[:, 0], k, v, table, sl, k_min=k_min, k_max=k_max,
                                                  page_budget=2))):
        torch.testing.assert_close(op(q[:, 0], k, v, table_i, sl_i, backend="torch", **kw), ref,
                                   atol=1e-10, rtol=1e-10)


def test_run_ignores_duplicate_pages_and_checks_q():
    q, k, v, table, sl, _, _ = _problem(8, 1, 2, 1, 8, 4, [10])
    plan = PagedAttentionPlan(backend="torch").plan(table, sl, num_q_heads=2, num_kv_heads=1, head_dim=8,
                                                    page_size=4)
    dup = torch.tensor([[[0, 0, 2]]], dtype=torch.int32)
    want = R.sparse_paged_attention(q[:, 0], k, v, table, sl, page_indices=torch.tensor([[[0, 2]]]))
    torch.testing.assert_close(plan.run(q[:, 0], k, v, page_indices=dup), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(plan.run(q[:, 0].clone().requires_grad_(), k, v, page_indices=dup), want,
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"q: expected shape \[B=1, Hq=2, D=8\]"):
        plan.run(torch.randn(2, 2, 8), k, v)


@pytest.mark.parametrize("pages", [20, 90])          # the sort path and the packed-key top-k
def test_nan_bound_ties_with_a_real_minus_inf(pages):
    """NaN counts as -inf, ties to the lower page: a NaN page before a -inf page is kept first, on both selection
    forms, exactly as select_pages (a real -inf once became -FLT_MAX through nan_to_num and outranked NaN)."""
    S = 2
    q, k, v, table, sl, _, _ = _problem(9, 1, 2, 1, 4, S, [pages * S])
    keys = T.selection_keys(sl, pages, page_size=S, page_budget=3, num_sink_pages=0, num_recent_pages=1,
                            num_query_tokens=1)
    scores = torch.full((1, 1, pages), float("-inf"))           # every bound -inf ...
    scores[0, 0, 0] = float("nan")                               # ... but page 0's, NaN: ties with -inf, kept first
    scores[0, 0, 7] = float("inf")
    got = torch.sort(T.top_pages(scores, keys), dim=-1).values.to(torch.int32)
    want = R.select_pages(scores, sl, page_size=S, page_budget=3)
    assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, float("inf"), float("-inf")])),
                min_size=1, max_size=40),
       st.sampled_from([torch.float32, torch.float64]))
def test_float_order_key_orders_like_the_scores(values, dtype):
    """The int64 selection key orders exactly as the fp32 scores with NaN as -inf and -0.0 equal to 0.0
    (expected order from Python's own float comparisons), and leaves its input untouched."""
    from tinyattn.ops.selection import torch_impl as core
    x = torch.tensor(values, dtype=dtype)
    before = x.clone()
    key = core.float_order_key(x).tolist()
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
            return R.sparse_paged_attention(q[:, 0], k, v, table, sl, page_budget=3, scale=scale, **kw)
        return R.paged_attention(q[:, 0], k, v, table, sl, scale=scale)

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


def test_public_op_reads_the_tables_it_is_given_after_buffer_reuse():
    """The public ops reuse a plan while the table values repeat; a caller that then rewrites its old int64 buffers
    and passes new tensors gets the answer of the new tensors (the plan's host tables are copies, not views)."""
    q, k, v, table, sl, _, _ = _problem(9, 2, 4, 2, 8, 4, [13, 7])
    q, k, v = q[:, 0].double(), k.double(), v.double()
    a, lens = table.long(), sl.long()
    tinyattn.paged_attention(q, k, v, a, lens)                      # fp64: the PyTorch path builds host tables
    b, lens_b = a.clone(), lens.clone()
    a[:] = a.flip(0)
    lens[:] = lens.flip(0)
    got = tinyattn.paged_attention(q, k, v, b, lens_b, window_left=3)
    torch.testing.assert_close(got, R.paged_attention(q, k, v, b, lens_b, window_left=3))


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
