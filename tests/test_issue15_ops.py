"""Issue 15, ops items: NaN scores in selection, validating references, one forced-pages budget rule.

Expected values are computed here independently (a brute-force ranking written in the test), never by
the code under test.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference
from paged_problems import make_problem

BACKENDS = ["torch", "triton"]
NAN, NEG_INF = float("nan"), float("-inf")


# ---- NaN counts as -inf, ties (NaN vs -inf, -inf vs -inf) to the lower page index ---------------------------
def brute_force_select(scores, seq_lens, *, page_size, page_budget, num_sink_pages, num_recent_pages):
    """The rule of docs/layout.md, by hand: forced recent (newest first) and sink pages, then the best scores
    with NaN read as -inf and ties broken by the lower page index; ascending, -1 padded."""
    B, Hkv, _ = scores.shape
    out = torch.full((B, Hkv, page_budget), -1, dtype=torch.int32)
    for b in range(B):
        n = -(-int(seq_lens[b]) // page_size)
        for h in range(Hkv):
            if n <= page_budget:
                keep = list(range(n))
            else:
                keep = list(range(n - 1, n - 1 - max(num_recent_pages, 1), -1))
                keep += [j for j in range(min(num_sink_pages, n)) if j not in keep]
                vals = [-math.inf if math.isnan(v) else v for v in scores[b, h, :n].tolist()]
                ranked = sorted((j for j in range(n) if j not in keep), key=lambda j: (-vals[j], j))
                keep += ranked[: page_budget - len(keep)]
            keep = sorted(keep)
            out[b, h, : len(keep)] = torch.tensor(keep, dtype=torch.int32)
    return out


SELECTORS = {
    "reference": reference.select_pages,
    "torch": lambda *a, **k: tinyattn.select_pages(*a, **k, backend="torch"),
    "triton": lambda *a, **k: tinyattn.select_pages(*a, **k, backend="triton"),
}


@pytest.mark.parametrize("impl", SELECTORS)
def test_nan_score_counts_as_minus_inf_and_ties_go_to_the_lower_page(impl):
    scores = torch.tensor([[[NAN, NEG_INF, 0.0]]])
    got = SELECTORS[impl](scores, torch.tensor([48]), page_size=16, page_budget=2)
    assert got.tolist() == [[[0, 2]]]
    scores = torch.tensor([[[NEG_INF, NAN, NEG_INF, 0.0]]])                   # NaN after -inf: -inf (page 0) wins
    got = SELECTORS[impl](scores, torch.tensor([64]), page_size=16, page_budget=2)
    assert got.tolist() == [[[0, 3]]]


@pytest.mark.parametrize("impl", SELECTORS)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_selection_with_nan_inf_and_ties_matches_brute_force(impl, data):
    """Small budgets (the kernel's argmax loop) and budgets above 16 pages (its radix select)."""
    B, Hkv = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    radix = data.draw(st.booleans())
    P = data.draw(st.integers(18, 40) if radix else st.integers(1, 10))
    page_size = 4
    lens = torch.tensor([data.draw(st.integers(0, P * page_size)) for _ in range(B)], dtype=torch.int32)
    pool = st.sampled_from([NAN, NEG_INF, -1.0, 0.0, -0.0, 2.0, math.inf])
    scores = torch.tensor(data.draw(st.lists(pool, min_size=B * Hkv * P, max_size=B * Hkv * P))).view(B, Hkv, P)
    sinks, recent = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    low = sinks + max(recent, 1)
    budget = data.draw(st.integers(max(low, 17), max(low, 17) + 6) if radix else st.integers(low, low + P))
    opts = dict(page_size=page_size, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent)
    assert torch.equal(SELECTORS[impl](scores, lens, **opts), brute_force_select(scores, lens, **opts))


# ---- the references validate exactly like the public ops -------------------------------------------------
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


# ---- one rule for the forced pages: num_sink_pages + max(num_recent_pages, 1) <= page_budget ---------------
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


# ---- torch.compile(fullgraph=True) with the default value checks, with and without grad ---------------------
def _compile_problem():
    p = make_problem(11, batch=2, seq_lens=[5, 21], page_size=8, num_kv_heads=1, group=2, head_dim=8)
    lo, hi = p.bounds()
    return p, lo, hi


def _op(kind, p, lo, hi, backend):
    args = (p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    if kind == "dense":
        return lambda x: tinyattn.paged_attention(x, *args, backend=backend)
    if kind == "sparse":
        return lambda x: tinyattn.sparse_paged_attention(x, *args, k_min=lo, k_max=hi, page_budget=2,
                                                         num_sink_pages=1, backend=backend)
    indices = torch.tensor([[[0, -1]], [[2, 0]]], dtype=torch.int32)
    return lambda x: tinyattn.sparse_paged_attention(x, *args, page_indices=indices, backend=backend)


def _reference(kind, p, lo, hi, x):
    args = (x, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    if kind == "dense":
        return reference.paged_attention(*args)
    if kind == "sparse":
        return reference.sparse_paged_attention(*args, k_min=lo, k_max=hi, page_budget=2, num_sink_pages=1)
    return reference.sparse_paged_attention(*args, page_indices=torch.tensor([[[0, -1]], [[0, 2]]]))


def _check_compiled(kind, backend, compiler, grad):
    torch._dynamo.reset()
    p, lo, hi = _compile_problem()
    f = _op(kind, p, lo, hi, backend)
    q = p.q[:, 0].detach()
    x_eager, x_comp = q.clone().requires_grad_(grad), q.clone().requires_grad_(grad)
    want = f(x_eager)
    got = torch.compile(f, fullgraph=True, backend=compiler)(x_comp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.detach(), _reference(kind, p, lo, hi, q), atol=3e-5, rtol=3e-5)
    if grad:
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(x_comp.grad, x_eager.grad, atol=1e-6, rtol=1e-6)
        assert x_comp.grad.abs().sum() > 0


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("kind", ["dense", "sparse", "page_indices"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_compile_aot_eager_equals_eager(backend, kind, grad):
    """Default value checks on: they are skipped while tracing; the no-grad path goes through the custom ops."""
    _check_compiled(kind, backend, "aot_eager", grad)


@pytest.mark.parametrize("backend, kind, grad", [("torch", "dense", True), ("triton", "sparse", False)])
def test_fullgraph_compile_inductor_equals_eager(backend, kind, grad):
    """Inductor on the CPU compiles C++ (a few seconds a graph here): two cases only."""
    _check_compiled(kind, backend, "inductor", grad)


def test_value_checks_still_run_in_eager_after_compiling():
    p, lo, hi = _compile_problem()
    f = _op("dense", p, lo, hi, "torch")
    torch.compile(f, fullgraph=True, backend="aot_eager")(p.q[:, 0])
    with pytest.raises(ValueError, match="seq_lens: expected values <="):
        tinyattn.paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens + 1000, backend="torch")
