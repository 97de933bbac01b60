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


# ---- one rule for the forced pages: num_sink_pages + max(num_recent_pages, 1) <= page_budget ---------------
FORCED_MESSAGE = ("page_budget: expected at least num_sink_pages + max(num_recent_pages, 1) = 5 + 1 = 6 "
                  "(the pages always kept), got page_budget=2 with num_sink_pages=5, num_recent_pages=1")


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
