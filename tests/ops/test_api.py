"""The public functions' checks and error messages (DESIGN.md §2, CASES.md kinds 4 and 5): bad input raises a
TypeError / ValueError naming the argument, the expected and the actual value, before any state changes, on both
backends; the references reject what the public ops reject, with the same argument named; the forced-pages rule
and its one message everywhere; boxes never filled are refused (with value checks on); the validation memo of
repeated calls never hides a changed table, a changed argument or a call made with value checks off; and a warm
call of the README's snippet runs a bounded number of tinyattn functions (the call budget).

Expected messages are written here from DESIGN.md's contract; expected values, where a call must succeed, come from
the reference (``tinyattn.reference``).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import tinyattn
from tinyattn.cache import PagedKVCache
from tinyattn.layer import PagedAttention
from tinyattn.ops import api
from tinyattn import reference

from paged_problems import BACKENDS, SLOW_TRITON, brute_force_select, make_problem


# ---- CASES.md kind 4: head counts that do not divide ------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_head_counts_that_do_not_divide_raise(backend):
    p = make_problem(41, batch=2, seq_lens=[5, 6], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    q = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"q: .*divisible by num_kv_heads=2.*Hq=3"):
        tinyattn.paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend=backend)


# ---- CASES.md kind 5: layout, dtype and index validation -------------------------------------------------------------
def test_page_ids_out_of_range_raise():
    p = make_problem(52, batch=2, seq_lens=[5, 11], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    bad = p.block_table.clone()
    bad[1, 2] = p.k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table: expected physical page ids in \[0, \d+\).*got \d+ at \[1, 2\]"):
        tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, bad, p.seq_lens)
    bad[1, 2] = -1
    with pytest.raises(ValueError, match="block_table"):
        tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, bad, p.seq_lens)


@pytest.mark.parametrize("call,match", [
    (lambda p: tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, 5), "seq_lens: expected a torch.Tensor"),
    (lambda p: tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens.float()), "seq_lens: expected dtype"),
    (lambda p: tinyattn.paged_attention(p.q, p.k_cache.half(), p.v_cache, p.block_table, p.seq_lens), "k_cache: expected dtype float32"),
    (lambda p: tinyattn.paged_attention(p.q[:, :, :, :4], p.k_cache, p.v_cache, p.block_table, p.seq_lens), "k_cache: expected head_dim 4"),
    (lambda p: tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table[:1], p.seq_lens), "block_table: expected 2 rows"),
    (lambda p: tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens + 100), "seq_lens: expected values <="),
    (lambda p: tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens - 100), "seq_lens: expected values >= 0"),
    (lambda p: tinyattn.paged_attention(p.q.int(), p.k_cache, p.v_cache, p.block_table, p.seq_lens), "q: expected dtype"),
    (lambda p: tinyattn.paged_attention(p.q[0, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens), r"q: expected a \[B, Hq, D\]"),
    (lambda p: tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, scale="x"), "scale: expected a real number"),
    (lambda p: tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend="cuda"), "backend: expected one of"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens), "k_min, k_max, page_budget"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=p.k_cache[:, 0],
                                               k_max=p.k_cache[:, 0], page_budget=0), "page_budget: expected an int >= 1, got 0"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                               k_min=p.k_cache[:2, 0], k_max=p.k_cache[:2, 0], page_budget=2), "k_min: expected shape"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                               page_indices=torch.zeros(2, 1, 2)), "page_indices: expected dtype"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                               page_indices=torch.zeros(2, 3, 2, dtype=torch.int32)), r"page_indices: expected shape \[B=2, Hkv=1"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                               page_indices=torch.full((2, 1, 2), -3, dtype=torch.int32)), "page_indices: expected logical page ids >= -1"),
    (lambda p: tinyattn.select_pages(torch.zeros(2, 1, 4), p.seq_lens, page_size=4, page_budget=2, num_sink_pages=-1), "num_sink_pages: expected an int >= 0"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                               page_indices=torch.zeros(2, 1, 2, dtype=torch.int32), page_budget=2),
     "page_indices: expected either page_indices or k_min, k_max and page_budget, got page_indices together with page_budget"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=p.k_cache[:, 0].int(),
                                               k_max=p.k_cache[:, 0], page_budget=2),
     r"k_min: expected dtype float32 \(that of the cache\) or bfloat16, float16 \(narrower boxes rounded outward\), "
     r"got int32"),
    (lambda p: tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=p.k_cache[:, 0].half(),
                                               k_max=p.k_cache[:, 0], page_budget=2),
     r"k_max: expected the dtype of k_min \(float16\), got float32"),
    # page_scores has no pool: its boxes are held to q's dtype (integer boxes were scored as they were, silently)
    (lambda p: tinyattn.page_scores(p.q, p.k_cache[:, 0].int(), p.k_cache[:, 0].int(), p.block_table, p.seq_lens,
                                    page_size=4, gamma=0.25),
     r"k_min: expected dtype float32 \(that of q\) or bfloat16, float16 \(narrower boxes rounded outward\), got int32"),
    (lambda p: tinyattn.page_scores(p.q, p.k_cache[:, 0].double(), p.k_cache[:, 0].double(), p.block_table, p.seq_lens,
                                    page_size=4), r"k_min: expected dtype float32 \(that of q\) .*got float64"),
])
def test_bad_input_names_the_argument(call, match):
    p = make_problem(53, batch=2, seq_lens=[5, 11], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        call(p)
    assert "tensor(" not in str(info.value)                                   # never str(tensor)


def test_budget_too_small_for_the_query_pages_raises():
    p = make_problem(54, batch=2, seq_lens=[20, 11], page_size=4, num_kv_heads=1, group=2, head_dim=8,
                     num_query_tokens=9)
    k_min, k_max = p.bounds()
    with pytest.raises(ValueError, match=r"page_budget: expected at least 3 .*Tq=9.*got 2"):
        tinyattn.sparse_paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                        k_max=k_max, page_budget=2)


def test_triton_backend_rejects_a_page_size_that_is_not_a_power_of_two():
    p = make_problem(55, batch=2, seq_lens=[5, 11], page_size=6, num_kv_heads=1, group=2, head_dim=8)
    with pytest.raises(ValueError, match="page_size: expected a power of two for the Triton backend.*got 6"):
        tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend="triton")
    # the torch backend takes any page size
    got = tinyattn.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend="torch")
    torch.testing.assert_close(got, reference.paged_attention(p.q, p.k_cache, p.v_cache, p.block_table, p.seq_lens))


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_zero_raises_named_value_error(backend, monkeypatch):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    q = torch.randn(2, 1, 0)
    k = torch.randn(1, 4, 1, 0)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    sl = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim|D"):
        tinyattn.paged_attention(q, k, k, bt, sl, backend=backend)


def test_numpy_float_scale():
    """A NumPy float is a real number: accepted as scale, same result as the Python float."""
    import numpy as np
    k = v = torch.randn(4, 4, 1, 8)
    q = torch.randn(1, 2, 8)
    bt, sl = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    a = tinyattn.paged_attention(q, k, v, bt, sl, scale=np.float32(0.25), backend="torch")
    torch.testing.assert_close(a, tinyattn.paged_attention(q, k, v, bt, sl, scale=0.25, backend="torch"))


def test_box_dtype_errors_name_the_option():
    with pytest.raises(ValueError, match="box_dtype: expected one of"):
        PagedKVCache(1, 1, 8, page_size=4, num_pages=2, box_dtype="int8")
    p = make_problem(0, batch=1, seq_lens=[5], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    lo = torch.zeros(p.k_cache.shape[0], 1, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k_max: expected the dtype of k_min"):
        tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, lo, lo.float())
    with pytest.raises(TypeError, match="k_min: expected dtype"):
        tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, lo.to(torch.float64), lo.double())


def test_page_grad_norms_validates_its_arguments():
    x = torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match=r"dv_cache: expected shape \(3, 4, 2, 8\)"):
        tinyattn.page_grad_norms(x, torch.zeros(3, 4, 2, 4))
    with pytest.raises(ValueError, match=r"dk_cache: expected a \[num_pages, page_size, Hkv, D\]"):
        tinyattn.page_grad_norms(torch.zeros(3, 4), x)
    with pytest.raises(TypeError, match=r"dk_cache: expected dtype"):
        tinyattn.page_grad_norms(x.int(), x)


# ---- the references validate exactly like the public ops ---------------------------------------------------------
def _p():
    return make_problem(3, batch=2, seq_lens=[9, 5], page_size=4, num_kv_heads=2, group=2, head_dim=8)


def _bounds(p):
    return p.bounds()


def _bad_cases():
    """(name, function name, args builder) of inputs both the op and its reference must reject."""
    cases = []

    def add(name, fn, build):
        cases.append(pytest.param(fn, build, id=name))

    def scoring(q=None, k_min=None, k_max=None, block_table=None, seq_lens=None, page_size=4):
        def build():
            p = _p()
            lo, hi = _bounds(p)
            return ((p.q[:, 0] if q is None else q(p), lo if k_min is None else k_min(lo),
                     hi if k_max is None else k_max(hi), p.block_table if block_table is None else block_table(p),
                     p.seq_lens if seq_lens is None else seq_lens(p)), dict(page_size=page_size))
        return build

    add("scores-issue-example-hq3-hkv2", "page_scores",
        lambda: ((torch.randn(1, 3, 8), torch.zeros(2, 2, 8), torch.ones(2, 2, 8), torch.tensor([[0, 1]]),
                  torch.tensor([5])), dict(page_size=4)))
    add("scores-hkv0", "page_scores",
        lambda: ((torch.randn(1, 3, 8), torch.zeros(2, 0, 8), torch.ones(2, 0, 8), torch.tensor([[0, 1]]),
                  torch.tensor([5])), dict(page_size=4)))
    add("scores-head-dim", "page_scores", scoring(k_min=lambda t: t[..., :4], k_max=lambda t: t[..., :4]))
    add("scores-kmax-shape", "page_scores", scoring(k_max=lambda t: t[:1]))
    add("scores-kmax-dtype", "page_scores", scoring(k_max=lambda t: t.half()))
    add("scores-q-2d", "page_scores", scoring(q=lambda p: p.q[0, 0]))
    add("scores-q-int", "page_scores", scoring(q=lambda p: p.q[:, 0].int()))
    add("scores-page-size-0", "page_scores", scoring(page_size=0))
    add("scores-page-size-float", "page_scores", scoring(page_size=4.0))
    add("scores-seq-len-over-capacity", "page_scores", scoring(seq_lens=lambda p: p.seq_lens + 1000))
    add("scores-negative-seq-len", "page_scores", scoring(seq_lens=lambda p: p.seq_lens - 100))
    add("scores-bad-page-id", "page_scores", scoring(block_table=lambda p: p.block_table.clamp(max=0) + 10_000))
    add("scores-seq-lens-float", "page_scores", scoring(seq_lens=lambda p: p.seq_lens.float()))
    add("scores-batch-mismatch", "page_scores", scoring(seq_lens=lambda p: p.seq_lens[:1]))

    def select(scores=None, seq_lens=None, **kw):
        def build():
            s = torch.zeros(2, 2, 4) if scores is None else scores
            lens = torch.tensor([9, 5]) if seq_lens is None else seq_lens
            return (s, lens), dict(dict(page_size=4, page_budget=2), **kw)
        return build

    add("select-scores-fp16", "select_pages", select(scores=torch.zeros(2, 2, 4, dtype=torch.float16)))
    add("select-scores-2d", "select_pages", select(scores=torch.zeros(2, 4)))
    add("select-seq-lens-length", "select_pages", select(seq_lens=torch.tensor([9])))
    add("select-seq-lens-float", "select_pages", select(seq_lens=torch.tensor([9.0, 5.0])))
    add("select-seq-len-over-capacity", "select_pages", select(seq_lens=torch.tensor([17, 5])))
    add("select-negative-seq-len", "select_pages", select(seq_lens=torch.tensor([-1, 5])))
    add("select-budget-0", "select_pages", select(page_budget=0))
    add("select-budget-float", "select_pages", select(page_budget=2.0))
    add("select-sinks-negative", "select_pages", select(num_sink_pages=-1))
    add("select-sinks-over-budget", "select_pages", select(num_sink_pages=5))
    add("select-recent-over-budget", "select_pages", select(num_recent_pages=3))
    add("select-query-tokens-0", "select_pages", select(num_query_tokens=0))
    add("select-query-pages-over-budget", "select_pages", select(num_query_tokens=9, page_budget=2))

    def metadata(change):
        def build():
            p = _p()
            lo, hi = _bounds(p)
            args = dict(k_cache=p.k_cache, block_table=p.block_table, seq_lens=p.seq_lens, k_min=lo, k_max=hi)
            args.update(change(p, lo, hi))
            return tuple(args.values()), {}
        return build

    add("metadata-kmin-shape", "update_page_metadata", metadata(lambda p, lo, hi: dict(k_min=lo[:, :1])))
    add("metadata-kmax-dtype", "update_page_metadata", metadata(lambda p, lo, hi: dict(k_max=hi.half())))
    add("metadata-cache-3d", "update_page_metadata", metadata(lambda p, lo, hi: dict(k_cache=p.k_cache[0])))
    add("metadata-bad-page-id", "update_page_metadata",
        metadata(lambda p, lo, hi: dict(block_table=p.block_table.clamp(max=0) + 10_000)))
    add("metadata-seq-len-over-capacity", "update_page_metadata",
        metadata(lambda p, lo, hi: dict(seq_lens=p.seq_lens + 1000)))
    add("metadata-table-1d", "update_page_metadata", metadata(lambda p, lo, hi: dict(block_table=p.block_table[0])))

    def sparse(**kw):
        def build():
            p = _p()
            lo, hi = _bounds(p)
            given = dict(k_min=lo, k_max=hi, page_budget=2)
            given.update({k: (v(p, lo, hi) if callable(v) else v) for k, v in kw.items()})
            return (p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens), {
                k: v for k, v in given.items() if v is not None or k == "page_indices"}
        return build

    add("sparse-nothing-to-select-with", "sparse_paged_attention", sparse(k_min=None, k_max=None, page_budget=None))
    add("sparse-missing-kmax", "sparse_paged_attention", sparse(k_max=None))
    add("sparse-indices-and-bounds", "sparse_paged_attention",
        sparse(page_indices=lambda p, lo, hi: torch.zeros(2, 2, 1, dtype=torch.int32)))
    add("sparse-indices-below-minus-1", "sparse_paged_attention",
        sparse(k_min=None, k_max=None, page_budget=None,
               page_indices=lambda p, lo, hi: torch.full((2, 2, 1), -2, dtype=torch.int32)))
    add("sparse-indices-shape", "sparse_paged_attention",
        sparse(k_min=None, k_max=None, page_budget=None,
               page_indices=lambda p, lo, hi: torch.zeros(2, 1, 1, dtype=torch.int32)))
    add("sparse-indices-float", "sparse_paged_attention",
        sparse(k_min=None, k_max=None, page_budget=None,
               page_indices=lambda p, lo, hi: torch.zeros(2, 2, 1)))
    add("sparse-sinks-over-budget", "sparse_paged_attention", sparse(num_sink_pages=5))
    add("sparse-budget-0", "sparse_paged_attention", sparse(page_budget=0))
    add("sparse-kmin-shape", "sparse_paged_attention", sparse(k_min=lambda p, lo, hi: lo[:1]))
    add("sparse-scale-nan", "sparse_paged_attention", sparse(scale=float("nan")))

    def dense(change):
        def build():
            p = _p()
            args = dict(q=p.q[:, 0], k_cache=p.k_cache, v_cache=p.v_cache, block_table=p.block_table,
                        seq_lens=p.seq_lens)
            args.update(change(p))
            return tuple(args.values()), {}
        return build

    add("dense-hq-not-multiple", "paged_attention", dense(lambda p: dict(q=torch.randn(2, 3, 8))))
    add("dense-v-shape", "paged_attention", dense(lambda p: dict(v_cache=p.v_cache[:1])))
    add("dense-cache-dtype", "paged_attention",
        dense(lambda p: dict(k_cache=p.k_cache.half(), v_cache=p.v_cache.half())))
    return cases


@pytest.mark.parametrize("fn, build", _bad_cases())
def test_reference_rejects_what_the_public_op_rejects(fn, build):
    args, kwargs = build()
    with pytest.raises((ValueError, TypeError)) as public:
        getattr(tinyattn, fn)(*args, **kwargs, backend="torch")
    args, kwargs = build()
    with pytest.raises((ValueError, TypeError)) as ref:
        getattr(reference, fn)(*args, **kwargs)
    assert type(ref.value) is type(public.value)
    assert str(ref.value).split(":")[0] == str(public.value).split(":")[0]       # names the same argument


# ---- one rule for the forced pages: num_sink_pages + max(num_recent_pages, 1) <= page_budget ---------------------
FORCED_MESSAGE = ("page_budget: expected at least num_sink_pages + max(num_recent_pages, 1) = 5 + 1 = 6 "
                  "(the pages always kept), got page_budget=2 with num_sink_pages=5, num_recent_pages=1")


def test_sinks_over_budget_raise_the_same_error_everywhere():
    from tinyattn.models import SparsityConfig

    p = make_problem(5, batch=2, seq_lens=[40, 13], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    lo, hi = p.bounds()
    args = (p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    scores = reference.page_scores(p.q[:, 0], lo, hi, p.block_table, p.seq_lens, page_size=4)
    calls = [
        lambda: tinyattn.sparse_paged_attention(*args, k_min=lo, k_max=hi, page_budget=2, num_sink_pages=5,
                                                backend="torch"),
        lambda: tinyattn.sparse_paged_attention(*args, k_min=lo, k_max=hi, page_budget=2, num_sink_pages=5,
                                                backend="triton"),
        lambda: reference.sparse_paged_attention(*args, k_min=lo, k_max=hi, page_budget=2, num_sink_pages=5),
        lambda: tinyattn.select_pages(scores, p.seq_lens, page_size=4, page_budget=2, num_sink_pages=5),
        lambda: reference.select_pages(scores, p.seq_lens, page_size=4, page_budget=2, num_sink_pages=5),
        lambda: SparsityConfig(page_budget=2, num_sink_pages=5),
    ]
    for call in calls:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == FORCED_MESSAGE


@pytest.mark.parametrize("sinks, recent, budget, ok", [
    (1, 1, 2, True), (2, 1, 2, False), (1, 0, 2, True), (2, 0, 2, False),   # recent 0 still keeps the last page
    (0, 0, 1, True), (0, 2, 1, False), (3, 3, 6, True), (3, 4, 6, False),
])
def test_forced_pages_rule_counts_at_least_one_recent_page(sinks, recent, budget, ok):
    from tinyattn.models import SparsityConfig

    scores = torch.arange(10.0).view(1, 1, 10)
    lens = torch.tensor([40])
    opts = dict(page_size=4, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent)
    for call in (lambda: tinyattn.select_pages(scores, lens, **opts, backend="torch"),
                 lambda: reference.select_pages(scores, lens, **opts),
                 lambda: SparsityConfig(page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent)):
        if ok:
            call()
        else:
            with pytest.raises(ValueError, match=r"num_sink_pages \+ max\(num_recent_pages, 1\)"):
                call()
    if ok:                                                  # exactly the forced pages fit, then the best scores
        want = brute_force_select(scores, lens, **opts)
        assert torch.equal(tinyattn.select_pages(scores, lens, **opts, backend="torch"), want)


# ---- window_left ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, error", [(-2, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError)])
def test_bad_window_left_raises_naming_it(bad, error):
    p = make_problem(0, batch=1, seq_lens=[5], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    k_min, k_max = p.bounds()
    calls = [
        lambda: tinyattn.paged_attention(*p.args, window_left=bad),
        lambda: tinyattn.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, page_budget=1, window_left=bad),
        lambda: reference.paged_attention(*p.args, window_left=bad),
        lambda: tinyattn.PagedAttentionPlan(backend="torch").plan(
            p.block_table, p.seq_lens, num_q_heads=1, num_kv_heads=1, head_dim=8, page_size=4).run(
            p.q[:, 0], p.k_cache, p.v_cache, window_left=bad),
    ]
    for call in calls:
        with pytest.raises(error, match="window_left"):
            call()
    attn = PagedAttention(backend="torch").begin(p.block_table, p.seq_lens, num_q_heads=1, num_kv_heads=1,
                                                 head_dim=8, page_size=4)
    with pytest.raises(error, match="window_left"):
        attn(0, p.q[:, 0], p.k_cache, p.v_cache, window_left=bad)


def test_windowed_selection_by_boxes_refuses_sink_pages():
    p = make_problem(0, batch=1, seq_lens=[20], page_size=4, num_kv_heads=1, group=1, head_dim=8)
    k_min, k_max = p.bounds()
    for fn in (tinyattn, reference):
        with pytest.raises(ValueError, match="num_sink_pages"):
            fn.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, page_budget=3, num_sink_pages=1,
                                      window_left=4)
    # listed pages carry no forced sinks: allowed
    idx = torch.tensor([[[0, 3, 4]]], dtype=torch.int32)
    tinyattn.sparse_paged_attention(*p.args, page_indices=idx, num_sink_pages=1, window_left=4)


# ---- the KV write: PagedKVCache.write and tinyattn.ops.api.write_kv ---------------------------------------------
def test_cache_write_rejects_float_slots():
    from tinyattn.cache import PagedKVCache
    c = PagedKVCache(1, 1, 2, page_size=4, num_pages=2, dtype=torch.float32, device="cpu")
    c.extend([c.add_sequence()], 2)
    # 0.5 is not a slot: it must not be silently truncated to slot 0
    with pytest.raises(TypeError, match="slots"):
        c.write(0, torch.tensor([0.5]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))


def test_cache_write_out_of_range_slot_names_argument_and_leaves_pool_untouched():
    from tinyattn.cache import PagedKVCache
    c = PagedKVCache(1, 1, 2, page_size=4, num_pages=2, dtype=torch.float32, device="cpu")
    c.extend([c.add_sequence()], 2)
    before = c.k_cache[0].clone()
    with pytest.raises(ValueError, match="slots"):
        c.write(0, torch.tensor([-1]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert torch.equal(c.k_cache[0], before)


def test_write_kv_names_bad_arguments():
    pool = torch.zeros(4, 2, 1, 8)
    k = torch.zeros(3, 1, 8)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="k: expected shape"):
        api.write_kv(k[:2], k, slots, pool, pool.clone())
    with pytest.raises(TypeError, match="slots"):
        api.write_kv(k, k, slots.float(), pool, pool.clone())
    with pytest.raises(ValueError, match="v_cache"):
        api.write_kv(k, k, slots, pool, pool.half())
    with pytest.raises(ValueError, match="k_scale"):
        api.write_kv(k, k, slots, pool.to(torch.int8), pool.to(torch.int8))
    with pytest.raises(ValueError, match="backend"):
        api.write_kv(k, k, slots, pool, pool.clone(), backend="cuda")


def test_default_backend_is_torch_on_the_cpu_even_when_interpreting():
    """The CPU write path stays the torch one (bit-identical CPU behaviour); Triton is the default on CUDA."""
    assert api.resolve_write_backend(None, torch.device("cpu")) == "torch"
    assert api.resolve_write_backend(None, torch.device("cuda")) == "triton"


def _decode_problem(seed, lens, *, page_size, num_kv_heads=2, dtype=torch.float32):
    """A decode step of the shared harness (4 query heads per 2 KV heads, or 2 per 1; D = 8; NaN in unowned slots):
    ``(q [B, Hq, D], k_cache, v_cache, block_table, seq_lens, k_min, k_max)``, boxes from the reference."""
    p = make_problem(seed, batch=len(lens), seq_lens=list(lens), page_size=page_size, num_kv_heads=num_kv_heads,
                     group=2, head_dim=8, dtype=dtype)
    k_min, k_max = p.bounds(torch.float64 if dtype == torch.float64 else torch.float32)
    return p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min, k_max


def _close_to(got, want):
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


# ---- the validation memo: a repeated call is checked once, a changed one again --------------------------------------
def test_a_call_under_value_checks_off_is_not_remembered_as_checked():
    """value_checks(False) skips the checks; the same call with checks on must still raise the block_table error."""
    k = v = torch.randn(4, 4, 1, 8)
    q = torch.randn(1, 2, 8)
    bad = torch.tensor([[0, 9]], dtype=torch.int32)                    # page 9 of a 4-page pool
    sl = torch.tensor([6], dtype=torch.int32)
    with tinyattn.value_checks(False):
        try:
            tinyattn.paged_attention(q, k, v, bad, sl, backend="torch")
        except Exception:                                             # an out-of-range read, unchecked: anything
            pass
    with pytest.raises(ValueError, match="block_table"):
        tinyattn.paged_attention(q, k, v, bad, sl, backend="torch")


@pytest.mark.parametrize("sparse", [False, True])
def test_repeated_calls_skip_checks_only_for_unchanged_tables(sparse):
    """The public ops validate a (block_table, seq_lens) pair once per thread; changed values (in place, or a
    new tensor) are validated again, and a reused plan never serves stale tables."""
    q, k, v, table, sl, k_min, k_max = _decode_problem(5, [40, 17], page_size=8)
    kw = dict(k_min=k_min, k_max=k_max, page_budget=2) if sparse else {}
    op = tinyattn.sparse_paged_attention if sparse else tinyattn.paged_attention
    ref_op = reference.sparse_paged_attention if sparse else reference.paged_attention
    for _ in range(2):
        torch.testing.assert_close(op(q, k, v, table, sl, **kw), ref_op(q, k, v, table, sl, **kw),
                                   atol=2e-5, rtol=1e-4)
    sl[1] = 10_000                                          # in place: the version counter moves
    with pytest.raises(ValueError, match="seq_lens"):
        op(q, k, v, table, sl, **kw)
    sl[1] = 9                                               # a valid change: a new answer, not the cached one
    torch.testing.assert_close(op(q, k, v, table, sl, **kw), ref_op(q, k, v, table, sl, **kw),
                               atol=2e-5, rtol=1e-4)
    bad = table.clone()
    bad[0, 0] = 10_000                                      # a new tensor with a bad page id
    with pytest.raises(ValueError, match="block_table"):
        op(q, k, v, bad, sl, **kw)


def test_remembered_call_still_checks_every_other_argument():
    """After a validated call is remembered (same tables), a call that differs in any other argument - a
    ``True`` budget for ``1``, a NaN scale, a q of another dtype, boxes of another shape - is checked afresh."""
    q0, k, v, table, sl, k_min, k_max = _decode_problem(8, [40, 17], page_size=8)
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


def test_tables_written_behind_autograds_back_are_seen():
    """A host buffer shared with seq_lens (torch.from_numpy, as serving loops reuse one) changes without a
    version bump: the op still answers for the new values and still rejects bad ones."""
    import numpy as np
    q, k, v, table, _, _, _ = _decode_problem(6, [5, 11], page_size=4, num_kv_heads=1)
    host = np.array([5, 11], dtype=np.int32)
    sl = torch.from_numpy(host)
    tinyattn.paged_attention(q, k, v, table, sl)
    host[1] = 6
    torch.testing.assert_close(tinyattn.paged_attention(q, k, v, table, sl),
                               reference.paged_attention(q, k, v, table, sl), atol=2e-5, rtol=1e-4)
    host[1] = 1000
    with pytest.raises(ValueError, match="seq_lens"):
        tinyattn.paged_attention(q, k, v, table, sl)


def test_inference_mode_tables_and_fp64_masks():
    """Tables made under torch.inference_mode work; fp64 with a mask (unequal lengths) matches the reference
    (SDPA needs the mask in the query's dtype)."""
    q, k, v, table, sl, k_min, k_max = _decode_problem(7, [10, 23], page_size=4, dtype=torch.float64)
    with torch.inference_mode():
        table_i, sl_i = table.clone(), sl.clone()
    for op, kw, ref in ((tinyattn.paged_attention, {}, reference.paged_attention(q, k, v, table, sl)),
                        (tinyattn.sparse_paged_attention, dict(k_min=k_min, k_max=k_max, page_budget=2),
                         reference.sparse_paged_attention(q, k, v, table, sl, k_min=k_min, k_max=k_max,
                                                  page_budget=2))):
        torch.testing.assert_close(op(q, k, v, table_i, sl_i, backend="torch", **kw), ref,
                                   atol=1e-10, rtol=1e-10)


def test_public_op_reads_the_tables_it_is_given_after_buffer_reuse():
    """The public ops reuse a plan while the table values repeat; a caller that then rewrites its old int64 buffers
    and passes new tensors gets the answer of the new tensors (the plan's host tables are copies, not views)."""
    q, k, v, table, sl, _, _ = _decode_problem(9, [13, 7], page_size=4, dtype=torch.float64)
    a, lens = table.long(), sl.long()
    tinyattn.paged_attention(q, k, v, a, lens)                      # fp64: the PyTorch path builds host tables
    b, lens_b = a.clone(), lens.clone()
    a[:] = a.flip(0)
    lens[:] = lens.flip(0)
    got = tinyattn.paged_attention(q, k, v, b, lens_b, window_left=3)
    torch.testing.assert_close(got, reference.paged_attention(q, k, v, b, lens_b, window_left=3))


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_public_ops_see_tables_changed_between_calls(backend):
    """The public ops reuse a plan while the validated tables hold the same values: a change in place between
    two calls (lengths, pages, listed pages) must be planned anew."""
    p = make_problem(6, batch=3, seq_lens=[29, 30, 13], page_size=4, num_kv_heads=2, group=2, head_dim=16)
    k_min, k_max = p.bounds()
    q = p.q[:, 0]
    args = lambda: (q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)          # noqa: E731
    for step in range(2):
        if step:
            p.seq_lens[0] -= 5
            p.seq_lens[2] -= 1
            p.block_table[1, :2] = p.block_table[1, :2].flip(0).clone()
            reference.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
        _close_to(tinyattn.sparse_paged_attention(*args(), k_min=k_min, k_max=k_max, page_budget=3, backend=backend),
               reference.sparse_paged_attention(*args(), k_min=k_min, k_max=k_max, page_budget=3))
        _close_to(tinyattn.paged_attention(*args(), backend=backend), reference.paged_attention(*args()))
    listed = torch.tensor([[[0, 3, -1], [1, 2, 5]]] * 3)
    tinyattn.sparse_paged_attention(*args(), page_indices=listed, backend=backend)
    listed[0, 0, 1] = 6
    _close_to(tinyattn.sparse_paged_attention(*args(), page_indices=listed, backend=backend),
           reference.sparse_paged_attention(*args(), page_indices=listed))


# ---- boxes never filled: with value checks on, refused naming update_page_metadata ----------------------------------
MESSAGE = r"k_min, k_max: .*update_page_metadata"


def _readme_problem(seed=0):
    """The README's snippet, small: 1 row of 40 tokens in pages of 8, 2 KV heads, 4 query heads, D=16."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(6, 8, 2, 16, generator=g), torch.randn(6, 8, 2, 16, generator=g)
    block_table = torch.tensor([[4, 0, 2, 5, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([40], dtype=torch.int32)
    q = torch.randn(1, 4, 16, generator=g)
    return q, k_cache, v_cache, block_table, seq_lens


def _call(backend, q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, **kw):
    return tinyattn.sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, k_min=k_min, k_max=k_max,
                                           page_budget=2, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", ["empty_inf", "nan", "reversed", "zeros"])
def test_unfilled_boxes_raise_naming_update_page_metadata(backend, fill):
    """``torch.full(inf)`` / ``-inf`` (a fresh PagedKVCache box), NaN, ``k_min > k_max`` and never-filled zeros
    (what ``torch.empty`` often returns) all raise the one ValueError."""
    q, k_cache, v_cache, bt, sl = _readme_problem()
    k_min, k_max = torch.empty(6, 2, 16), torch.empty(6, 2, 16)
    tinyattn.update_page_metadata(k_cache, bt, sl, k_min, k_max)
    page, head, ch = 2, 1, 5                                     # physical page 2 is in use (logical page 2)
    if fill == "empty_inf":
        k_min[page], k_max[page] = float("inf"), float("-inf")
    elif fill == "nan":
        k_min[page, head, ch] = float("nan")
    elif fill == "reversed":
        k_min[page, head, ch], k_max[page, head, ch] = k_max[page, head, ch] + 1, k_min[page, head, ch]
    else:
        k_min.zero_(), k_max.zero_()
    with pytest.raises(ValueError, match=MESSAGE) as err:
        _call(backend, q, k_cache, v_cache, bt, sl, k_min, k_max)
    if fill != "zeros":
        assert f"physical page {page}" in str(err.value)
    if fill in ("nan", "reversed"):
        assert f"KV head {head}, channel {ch}" in str(err.value)
    with tinyattn.value_checks(False):                          # skipped when the checks are off
        _call(backend, q, k_cache, v_cache, bt, sl, k_min, k_max)


@pytest.mark.parametrize("backend", BACKENDS)
def test_filled_boxes_pass_and_pages_not_in_use_are_not_read(backend):
    """Exact boxes pass; a page past every row's end may hold anything (its box is never scored)."""
    q, k_cache, v_cache, bt, sl = _readme_problem()
    k_min, k_max = torch.empty(6, 2, 16), torch.empty(6, 2, 16)
    tinyattn.update_page_metadata(k_cache, bt, sl, k_min, k_max)
    k_min[3], k_max[3] = float("nan"), float("-inf")             # physical page 3: not in the block table
    out = _call(backend, q, k_cache, v_cache, bt, sl, k_min, k_max)
    ref = tinyattn.reference.sparse_paged_attention(q, k_cache, v_cache, bt, sl, k_min=k_min, k_max=k_max,
                                                    page_budget=2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend, fmt", [("torch", "int8"), ("triton", "int8"), ("torch", "fp8_e4m3")])
def test_quantized_cache_boxes_pass_and_a_stale_box_raises(backend, fmt):
    """A quantized PagedKVCache's boxes (of the dequantized keys) pass; reset one page's box (in place, after a
    call that passed: the checked-call memo must not hide it) and the call raises."""
    c = PagedKVCache(1, 2, 16, page_size=8, num_pages=6, kv_cache_dtype=fmt)
    seq = c.add_sequence()
    g = torch.Generator().manual_seed(1)
    c.write(0, c.extend([seq], 30), torch.randn(30, 2, 16, generator=g) * 3, torch.randn(30, 2, 16, generator=g))
    q = torch.randn(1, 4, 16, generator=g)
    bt, sl = c.block_table([seq]), c.seq_lens([seq])
    kw = dict(k_scale=c.k_scale[0], v_scale=c.v_scale[0])
    _call(backend, q, c.k_cache[0], c.v_cache[0], bt, sl, c.k_min[0], c.k_max[0], **kw)
    c.k_min[0][c.pages(seq)[1]], c.k_max[0][c.pages(seq)[1]] = float("inf"), float("-inf")
    with pytest.raises(ValueError, match=MESSAGE):
        _call(backend, q, c.k_cache[0], c.v_cache[0], bt, sl, c.k_min[0], c.k_max[0], **kw)


def test_the_check_runs_again_only_after_a_write():
    """A pass is remembered per (boxes, tables) until a torch in-place write touches one of them."""
    from tinyattn.ops import validation

    q, k_cache, v_cache, bt, sl = _readme_problem()
    k_min, k_max = torch.empty(6, 2, 16), torch.empty(6, 2, 16)
    tinyattn.update_page_metadata(k_cache, bt, sl, k_min, k_max)
    validation.check_boxes_filled(k_min, k_max, k_cache, bt, sl, 8)
    saved = k_min.clone()
    k_min.data[2] = float("inf")             # through .data: no version bump, so the pass is (knowingly) recalled
    validation.check_boxes_filled(k_min, k_max, k_cache, bt, sl, 8)
    k_min.copy_(saved)                       # an in-place torch write: checked again, and passes
    validation.check_boxes_filled(k_min, k_max, k_cache, bt, sl, 8)
    k_min[2] = float("inf")
    with pytest.raises(ValueError, match=MESSAGE):
        validation.check_boxes_filled(k_min, k_max, k_cache, bt, sl, 8)


# ---- the call budget: a warm call runs few tinyattn functions (per-call overhead counts: one call per layer per token)
ROOT = os.path.dirname(tinyattn.__file__)


def _functions(fn):
    """Distinct tinyattn functions (file, name) one call of ``fn`` runs."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            seen.add((os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("op", ["sparse", "dense"])
def test_a_warm_call_of_the_readme_snippet_runs_at_most_16_functions_in_5_files(op):
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(256, 16, 8, 128), torch.randn(256, 16, 8, 128)
    block_table = torch.randperm(256, dtype=torch.int32)[None]
    seq_lens = torch.tensor([4096], dtype=torch.int32)
    k_min, k_max = torch.empty(256, 8, 128), torch.empty(256, 8, 128)
    tinyattn.update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, backend="torch")
    q = torch.randn(1, 32, 128)
    if op == "sparse":
        def call():
            return tinyattn.sparse_paged_attention(q, k_cache, v_cache, block_table, seq_lens, k_min=k_min,
                                                   k_max=k_max, page_budget=64, backend="torch")
    else:
        def call():
            return tinyattn.paged_attention(q, k_cache, v_cache, block_table, seq_lens, backend="torch")
    first = call()
    functions = _functions(call)
    files = {f for f, _ in functions}
    assert len(functions) <= 16 and len(files) <= 5, sorted(functions)
    torch.testing.assert_close(call(), first)                   # the reused plan computes the same
    block_table[0, :2] = block_table[0, :2].flip(0)             # new tables: planned (and checked) again
    assert len(_functions(call)) > len(functions)

