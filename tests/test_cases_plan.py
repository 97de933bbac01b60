"""CASES.md's fault kinds tried on the per-step plan (issue 25's rewrite): ``PagedAttentionPlan.plan/run`` on both
backends (``TorchPlan``; ``TritonPlan`` under TRITON_INTERPRET=1, tests/conftest.py) and ``tinyattn.PagedAttention``.

tests/test_cases.py drives the public ops; these drive the plan itself: its copied tables, its per-step "template"
mask of selections without a window, the packed (``P > 64``) and sorted selection keys, the Triton one-stage and
two-stage selections, graph-mode capacity, reuse across steps of other sizes, and the autograd route. Expected values
come from the reference loops (:mod:`tinyattn.reference`), on the tables as planned.
"""

import pytest
import torch

import tinyattn
from tinyattn import reference as R
from tinyattn.layer import PagedAttention, SparsityConfig

from paged_problems import make_problem, relocate

BACKENDS = ["torch", "triton"]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _problem(seed, lens, *, page_size=4, num_kv_heads=2, group=2, head_dim=16, num_query_tokens=1, **kw):
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


def _plan(backend, p, *, num_query_tokens=1, **kw):
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
        return R.sparse_paged_attention(qf, k, v, p.block_table, p.seq_lens, page_indices=page_indices, **kw)
    if page_budget is not None:
        return R.sparse_paged_attention(qf, k, v, p.block_table, p.seq_lens, k_min=k_min.to(qf.dtype),
                                        k_max=k_max.to(qf.dtype), page_budget=page_budget, **kw)
    return R.paged_attention(qf, k, v, p.block_table, p.seq_lens, **kw)


# ---- kinds 1, 2, 4, 6, 7: one planned step against the reference -------------------------------------------------
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_planned_step_matches_the_reference(backend, name):
    lens, prob, plan_kw, run_kw = CASES[name]
    p = _problem(len(name), lens, **prob)
    Tq = prob.get("num_query_tokens", 1)
    dtype = prob.get("dtype", torch.float32)
    k_min, k_max = _boxes(p)
    q = _q(p, Tq)
    sel = dict(k_min=k_min.to(dtype), k_max=k_max.to(dtype)) if "page_budget" in plan_kw else {}
    got = _plan(backend, p, num_query_tokens=Tq, **plan_kw).run(q, p.k_cache, p.v_cache, return_lse=True,
                                                                **sel, **run_kw)
    want = _want(p, q, k_min=k_min, k_max=k_max, return_lse=True, **plan_kw, **run_kw)
    _close(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", [0.0, float("nan"), float("inf"), float("-inf")])
def test_boxes_with_ties_nan_and_infinite_bounds(backend, fill):
    """Kind 7: three pages of row 0 share one box (ties, NaN = -inf, +-inf bounds); with and without a sink."""
    p = _problem(4, [29, 30, 13])
    q = p.q[:, 0]
    k_min, k_max = p.bounds()
    pages = p.block_table[0, 2:5].long()
    k_min[pages] = fill
    k_max[pages] = fill
    for sinks in (0, 1):
        got = _plan(backend, p, page_budget=3, num_sink_pages=sinks).run(q, p.k_cache, p.v_cache, k_min=k_min,
                                                                          k_max=k_max)
        _close(got, _want(p, q, k_min=k_min, k_max=k_max, page_budget=3, num_sink_pages=sinks))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window_left", [-1, 6])
@pytest.mark.parametrize("num_query_tokens", [1, 2])
def test_listed_pages_with_duplicates_minus_one_and_int64_past_int32(backend, window_left, num_query_tokens):
    """Kinds 5 and 7: listed pages with duplicates, -1, ids past the row's end and past int32 (2**40), an empty
    row; the reference gets the de-duplicated list."""
    p = _problem(5, [29, 0, 13], num_query_tokens=num_query_tokens)
    listed = torch.tensor([[[0, 0, 2, -1], [3, 3, 3, 1]], [[7, -1, -1, 1], [1, 0, 9, 9]],
                           [[0, 0, 0, 0], [2**40, 1, 2**40, -1]]], dtype=torch.int64)
    dedup = torch.tensor([[sorted({j for j in r if 0 <= j < 2**31}) + [-1] * (4 - len({j for j in r
                                                                                      if 0 <= j < 2**31}))
                           for r in row] for row in listed.tolist()])
    q = _q(p, num_query_tokens)
    got = _plan(backend, p, num_query_tokens=num_query_tokens).run(q, p.k_cache, p.v_cache, page_indices=listed,
                                                                    window_left=window_left, return_lse=True)
    _close(got, _want(p, q, page_indices=dedup, window_left=window_left, return_lse=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_stage_triton_selection_with_windows_and_nan_boxes(backend):
    """``B * Hkv >= 132``: the Triton plan selects in one stage (bound kernel, window mask, top-k kernel), the path
    the interpreter's small problems never take otherwise (they select in two stages)."""
    lens = [(i * 7) % 40 for i in range(34)]
    p = _problem(6, lens, num_kv_heads=4, group=1, head_dim=8, num_query_tokens=2)
    k_min, k_max = _boxes(p)
    g = torch.Generator().manual_seed(1)
    nan_pages = torch.rand(k_min.shape[0], generator=g) < 0.3
    k_min[nan_pages] = float("nan")
    k_max[nan_pages] = float("nan")
    for window_left in (-1, 5):
        got = _plan(backend, p, num_query_tokens=2, page_budget=3).run(p.q, p.k_cache, p.v_cache, k_min=k_min,
                                                                       k_max=k_max, window_left=window_left,
                                                                       return_lse=True)
        _close(got, _want(p, p.q, k_min=k_min, k_max=k_max, page_budget=3, window_left=window_left,
                          return_lse=True))


# ---- kinds 3 and 5: high page ids, int64 tables, layouts, dtypes ----------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("int64", [False, True])
def test_rows_at_high_page_ids(backend, int64):
    p = relocate(_problem(3, [29, 30, 13]), num_pages=4000, spare_columns=2, poison=float("nan"), seed=1)
    k_min = torch.full((4000, 2, 16), float("nan"))
    k_max = k_min.clone()
    R.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
    q = p.q[:, 0]
    bt, sl = (p.block_table.long(), p.seq_lens.long()) if int64 else (p.block_table, p.seq_lens)
    plan = tinyattn.PagedAttentionPlan(backend=backend).plan(bt, sl, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                            page_size=4, page_budget=3)
    _close(plan.run(q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max),
           _want(p, q, k_min=k_min, k_max=k_max, page_budget=3))
    _close(plan.run(q, p.k_cache, p.v_cache), _want(p, q))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_q_pools_boxes_and_out(backend):
    p = _problem(1, [29, 30, 13])
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
    plan = _plan(backend, p, page_budget=3)
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
    p = _problem(3, [29, 30, 13])
    k_min, k_max = p.bounds()
    plan = _plan(backend, p, page_budget=3)
    for kw in ({}, dict(k_min=k_min, k_max=k_max)):
        with pytest.raises(TypeError, match="k_cache: expected dtype float32"):
            plan.run(p.q[:, 0], p.k_cache.half(), p.v_cache.half(), **kw)


# ---- reuse: steps of other sizes, graph-mode capacity, fp64 --------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_plan_reused_across_steps_of_other_sizes(backend):
    plan = tinyattn.PagedAttentionPlan(backend=backend)
    for seed, lens, Tq, budget in [(5, [29, 30, 13], 1, 3), (6, [9], 1, 2), (7, [40, 3, 0, 17, 22], 2, 4),
                                   (8, [5, 5], 1, None), (9, [60, 61], 3, 5), (10, [13, 2, 7], 1, 3)]:
        p = _problem(seed, lens, num_query_tokens=Tq)
        k_min, k_max = _boxes(p)
        q = _q(p, Tq)
        plan.plan(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                  num_query_tokens=Tq, page_budget=budget)
        sel = dict(k_min=k_min, k_max=k_max) if budget else {}
        _close(plan.run(q, p.k_cache, p.v_cache, return_lse=True, **sel),
               _want(p, q, k_min=k_min, k_max=k_max, page_budget=budget, return_lse=True))
        _close(plan.run(q, p.k_cache, p.v_cache, window_left=5), _want(p, q, window_left=5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_mode_steps_that_shrink_the_batch_and_the_rows(backend):
    """Graph mode: capacity 6 rows x 20 pages; later steps have fewer rows, shorter tables, empty rows; fp64 runs
    the torch plan over the Triton plan's capacity-wide tables."""
    plan = tinyattn.PagedAttentionPlan(backend=backend)
    for seed, lens, budget in [(11, [29, 30, 13, 50], 3), (12, [9, 20], 3), (13, [57], 4), (14, [0, 33, 5], 3),
                               (15, [1, 2, 3, 4, 5, 6], 3)]:
        p = _problem(seed, lens)
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


# ---- kind 9: gradients through the plan ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Tq, lens, budget, window_left", [(1, [29, 30, 13], 3, -1), (3, [29, 0, 13], 4, -1),
                                                           (2, [29, 30], 4, 5), (1, [29, 30, 13], None, 4)])
def test_gradients_with_selection_shared_pages_and_poisoned_slots(backend, Tq, lens, budget, window_left):
    """Selection + backward; rows 0 and 1 share their first three pages (prefix sharing: gradients accumulate);
    unused slots hold NaN (no NaN may reach dq, nor the gradient of any valid slot)."""
    p = _problem(16, lens, num_query_tokens=Tq)
    bt = p.block_table.clone()
    if lens[1] > 0:
        bt[1, :3] = bt[0, :3]
    k_min = torch.zeros(p.k_cache.shape[0], 2, 16)
    k_max = torch.zeros_like(k_min)
    R.update_page_metadata(p.k_cache, bt, p.seq_lens, k_min, k_max)
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
            o = R.sparse_paged_attention(q, k, v, bt, p.seq_lens, k_min=k_min, k_max=k_max, page_budget=budget,
                                         window_left=window_left)
        else:
            o = R.paged_attention(q, k, v, bt, p.seq_lens, window_left=window_left)
        (o * w).sum().backward()
        grads.append([o.detach(), q.grad, torch.nan_to_num(k.grad, nan=7.0), torch.nan_to_num(v.grad, nan=7.0)])
    assert not torch.isnan(grads[0][1]).any()
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


# ---- the plan's tables: in-place changes after plan(), through the layer and the public ops -------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["quest", "oracle", "streaming"])
def test_layer_keeps_the_planned_tables(backend, policy):
    p = _problem(7, [29, 0, 30, 13])
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
        want = R.sparse_paged_attention(q, p.k_cache, p.v_cache, *planned, k_min=k_min, k_max=k_max, page_budget=3,
                                        num_sink_pages=attn.sparsity.num_sink_pages)    # the default recipe's
        _close(first, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_ops_see_tables_changed_between_calls(backend):
    """The public ops reuse a plan while the validated tables hold the same values: a change in place between
    two calls (lengths, pages, listed pages) must be planned anew."""
    p = _problem(6, [29, 30, 13])
    k_min, k_max = p.bounds()
    q = p.q[:, 0]
    args = lambda: (q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)          # noqa: E731
    for step in range(2):
        if step:
            p.seq_lens[0] -= 5
            p.seq_lens[2] -= 1
            p.block_table[1, :2] = p.block_table[1, :2].flip(0).clone()
            R.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
        _close(tinyattn.sparse_paged_attention(*args(), k_min=k_min, k_max=k_max, page_budget=3, backend=backend),
               R.sparse_paged_attention(*args(), k_min=k_min, k_max=k_max, page_budget=3))
        _close(tinyattn.paged_attention(*args(), backend=backend), R.paged_attention(*args()))
    listed = torch.tensor([[[0, 3, -1], [1, 2, 5]]] * 3)
    tinyattn.sparse_paged_attention(*args(), page_indices=listed, backend=backend)
    listed[0, 0, 1] = 6
    _close(tinyattn.sparse_paged_attention(*args(), page_indices=listed, backend=backend),
           R.sparse_paged_attention(*args(), page_indices=listed))


# ---- kind 5: what run() is given beside the planned tables ---------------------------------------------------------
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
    p = _problem(1, [29, 30, 13])
    with pytest.raises(error, match=match):
        _plan(backend, p).run(p.q[:, 0], p.k_cache, p.v_cache, page_indices=page_indices)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                          ("0.5", TypeError), (True, TypeError)])
def test_run_rejects_a_bad_scale_override(backend, scale, error):
    """``run(scale=...)`` (a layer's own scale) is checked like ``plan(scale=...)``: NaN / inf gave NaN outputs, a
    string was parsed."""
    p = _problem(1, [29, 30, 13])
    with pytest.raises(error, match="scale: expected"):
        _plan(backend, p).run(p.q[:, 0], p.k_cache, p.v_cache, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_rejects_integer_boxes_and_an_out_of_another_dtype(backend):
    """Integer boxes were scored as numbers; an int ``out`` received the output truncated to integers."""
    p = _problem(1, [29, 30, 13])
    k_min, k_max = p.bounds()
    plan = _plan(backend, p, page_budget=3)
    q = p.q[:, 0]
    with pytest.raises(TypeError, match="k_min: expected a floating dtype"):
        plan.run(q, p.k_cache, p.v_cache, k_min=k_min.int(), k_max=k_max.int())
    for dtype in (torch.int32, torch.float16):
        with pytest.raises(TypeError, match="out: expected dtype float32"):
            plan.run(q, p.k_cache, p.v_cache, out=torch.zeros(q.shape, dtype=dtype))


# ---- kind 2 on the paths an lse request skips, and on the torch backend's chunked (split-K) path --------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window_left", [-1, 2])
@pytest.mark.parametrize("budget", [None, 3])
def test_no_lse_path_with_empty_rows_and_very_negative_logits(backend, window_left, budget):
    """Without ``return_lse`` the torch plan runs SDPA with an additive ``-inf`` mask: an empty row, queries that
    see nothing and logits near -1e8 must still give the reference (zeros, no NaN)."""
    p = _problem(4, [29, 0, 13], num_query_tokens=2, logit_scale=1e4)
    k_min, k_max = p.bounds()
    sel = dict(k_min=k_min, k_max=k_max) if budget else {}
    got = _plan(backend, p, num_query_tokens=2, page_budget=budget).run(p.q, p.k_cache, p.v_cache,
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
    p = _problem(9, [61, 0, 37, 3], num_query_tokens=Tq)
    k_min, k_max = _boxes(p)
    q = _q(p, Tq)
    sel = dict(k_min=k_min, k_max=k_max) if budget else {}
    plan = _plan("torch", p, num_query_tokens=Tq, page_budget=budget)
    assert chunked.chunk_keys(64, 8, 16) == 16
    _close(plan.run(q, p.k_cache, p.v_cache, return_lse=True, **sel),
           _want(p, q, k_min=k_min, k_max=k_max, page_budget=budget, return_lse=True))
    _close(plan.run(q, p.k_cache, p.v_cache, **sel), _want(p, q, k_min=k_min, k_max=k_max, page_budget=budget))
