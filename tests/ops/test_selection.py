"""Selection (``tinyattn.ops.selection``): the Quest bound and the page choice, on both backends, against the
reference and brute force.

Proven here:

- the bound: ``page_scores`` equals the reference and is an upper bound of ``q.k`` for every valid key of the page
  (fp64 max over the page's keys), also over half-precision boxes rounded outward;
- ``select_pages`` equals the reference and a brute-force ranking written in the test: forced recent / sink pages,
  NaN read as -inf, ties to the lower page index (NaN vs -inf too), padding never outranking a real -inf, budgets
  below and above the radix-select threshold, the query pages of a prefill chunk;
- pages wholly before a sliding window are never selected nor read;
- the two-stage selection (``tinyattn.kernels.chunk_topk``) against the reference and the one-stage kernels: integer
  boxes (exact fp32 bounds, many ties) compared with ``reference.select_pages(reference.page_scores(...))``, Gaussian
  boxes bit for bit with the one-stage kernels, over ragged batches, GQA 1-4, Tq > 1, sinks / recent pages, NaN
  boxes, poisoned pages past the end and forced chunk sizes 1..64.

The policies built on these rules (``tinyattn.selection``: quest, questmass, h2o, ...) are tested in
tests/test_selection.py.
"""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn.kernels import chunk_topk
from tinyattn.ops.kv_cache import triton_impl as kv_cache_triton
from tinyattn.ops.plan import PagedAttentionPlan
from tinyattn.ops.selection import torch_impl as selection_torch
from tinyattn.ops.selection import triton_impl as selection_triton
from tinyattn import reference

from paged_problems import (BACKENDS, SLOW_TRITON, brute_force_select, laid_out_problems, make_problem, problems,
    relayout, tiers)


CHUNKS = (1, 2, 4, 8, 64)


@st.composite
def selection_problems(draw, integer=True):
    """A paged problem with boxes, selection options and a forced chunk size."""
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    batch = draw(st.integers(2, 3))
    max_pages = draw(st.integers(1, 24 if page_size == 1 else 9))
    lens = [draw(st.integers(0, max_pages * page_size)) for _ in range(batch)]
    assume(len(set(lens)) > 1)
    Hkv, G = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3, 4]))
    Tq = draw(st.integers(1, 2 * page_size))
    D = draw(st.sampled_from([4, 8, 24]))
    p = make_problem(draw(st.integers(0, 2**31 - 1)), batch=batch, seq_lens=lens, page_size=page_size,
                     num_kv_heads=Hkv, group=G, head_dim=D, num_query_tokens=Tq,
                     spare_columns=draw(st.integers(0, 2)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    num_pages = p.k_cache.shape[0]
    if integer:
        # small integers: every bound is exact in fp32, many pages tie
        q = torch.randint(-2, 3, p.q.shape, generator=g).float()
        lo = torch.randint(-2, 2, (num_pages, Hkv, D), generator=g).float()
        k_min, k_max = lo, lo + torch.randint(0, 2, (num_pages, Hkv, D), generator=g).float()
    else:
        q = p.q
        k_min, k_max = p.bounds()
    # boxes of pages no row owns are poison (rows must never read them through ids past their end)
    owned = torch.zeros(num_pages, dtype=torch.bool)
    for b, n in enumerate(lens):
        owned[p.block_table[b, :-(-n // page_size)].long()] = True
    k_min[~owned], k_max[~owned] = math.inf, math.nan
    if draw(st.booleans()):  # a NaN box: the page scores NaN, which counts as -inf
        j = int(torch.randint(0, num_pages, (1,), generator=g))
        k_min[j, 0, 0] = math.nan
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    opts = dict(page_size=page_size, page_budget=draw(st.sampled_from([1, 2, 3, 5, 17, 20, max_pages + 2])),
                num_sink_pages=draw(st.integers(0, 3)), num_recent_pages=draw(st.integers(0, 3)))
    return (q.to(dtype), k_min.to(dtype), k_max.to(dtype), p.block_table, p.seq_lens, opts,
            draw(st.sampled_from(CHUNKS)))


def two_stage(q, k_min, k_max, block_table, seq_lens, opts, chunk, window_left=-1):
    B, Tq, Hq, D = q.shape
    Hkv, maxp, budget = k_min.shape[1], block_table.shape[1], opts["page_budget"]
    meta = chunk_topk.chunk_blocks(B, Hkv, maxp, budget, Tq, Hq // Hkv, D, opts["page_size"], chunk=chunk)
    shape = chunk_topk.workspace_shape(B, Hkv, meta)
    ws_key, ws_page = torch.full(shape, 123, dtype=torch.int32), torch.full(shape, 123, dtype=torch.int32)
    out = torch.full((B, Hkv, budget), -7, dtype=torch.int32)
    selection_triton.score_and_select_pages(q, k_min, k_max, block_table, seq_lens, **opts, meta=meta, ws_key=ws_key,
                             ws_page=ws_page, out=out, window_left=window_left)
    return out


def one_stage(q, k_min, k_max, block_table, seq_lens, opts, window_left=-1):
    B, Tq = q.shape[:2]
    scores = torch.full((B, k_min.shape[1], block_table.shape[1]), math.nan)
    selection_triton.page_scores(q, k_min, k_max, block_table, seq_lens, page_size=opts["page_size"], out=scores)
    selection_torch.mask_pages_before_window(scores, seq_lens, opts["page_size"], Tq, window_left)
    out = torch.full((B, k_min.shape[1], opts["page_budget"]), -7, dtype=torch.int32)
    selection_triton.select_pages(scores, seq_lens, **opts, num_query_tokens=Tq, out=out)
    return out, scores


@tiers(2, 150)
def test_two_stage_matches_reference(examples):
    @settings(max_examples=examples, deadline=None)
    @given(selection_problems(integer=True))
    def check(case):
        q, k_min, k_max, table, seq_lens, opts, chunk = case
        ref_scores = reference.page_scores(q, k_min, k_max, table, seq_lens, page_size=opts["page_size"])
        try:
            ref = reference.select_pages(ref_scores, seq_lens, **opts, num_query_tokens=q.shape[1])
        except ValueError:  # the budget cannot hold the query pages: the ops layer raises before the kernel
            assume(False)
        assert torch.equal(two_stage(q, k_min, k_max, table, seq_lens, opts, chunk), ref)

    check()


@tiers(2, 100)
def test_two_stage_equals_one_stage(examples):
    @settings(max_examples=examples, deadline=None)
    @given(selection_problems(integer=False), st.sampled_from([-1, 0, 3, 9]))
    def check(case, window_left):
        q, k_min, k_max, table, seq_lens, opts, chunk = case
        try:
            reference.select_pages(torch.zeros(q.shape[0], 1, table.shape[1]), seq_lens, **opts,
                                   num_query_tokens=q.shape[1])
        except ValueError:
            assume(False)
        one, _ = one_stage(q, k_min, k_max, table, seq_lens, opts, window_left)
        assert torch.equal(two_stage(q, k_min, k_max, table, seq_lens, opts, chunk, window_left), one)

    check()


@pytest.mark.slow
def test_all_ties_radix_and_short_rows():
    """Every page scores the same (the lowest pages win), a row of 0 tokens, a short row kept whole."""
    p = make_problem(0, batch=3, seq_lens=[40, 0, 7], page_size=1, num_kv_heads=2, group=2, head_dim=8)
    num_pages = p.k_cache.shape[0]
    k_min, k_max = torch.zeros(num_pages, 2, 8), torch.ones(num_pages, 2, 8)
    opts = dict(page_size=1, page_budget=20, num_sink_pages=2, num_recent_pages=3)
    ref = reference.select_pages(reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=1),
                                 p.seq_lens, **opts)
    for chunk in (4, 16, 64):
        got = two_stage(p.q, k_min, k_max, p.block_table, p.seq_lens, opts, chunk)
        assert torch.equal(got, ref)
    assert ref[0, 0].tolist() == [0, 1] + list(range(2, 17)) + [37, 38, 39]
    assert (ref[1] == -1).all() and ref[2, 0].tolist() == list(range(7)) + [-1] * 13


@pytest.mark.parametrize("chunk", [pytest.param(8, marks=pytest.mark.slow), pytest.param(32, marks=pytest.mark.slow), 128])
def test_radix_select_over_long_rows(chunk):
    """Budgets above ``RADIX_MIN_BUDGET`` (radix select in both stages) on rows of 70-100 pages, Tq = 3."""
    p = make_problem(7, batch=2, seq_lens=[100, 70], page_size=1, num_kv_heads=2, group=3, head_dim=16,
                     num_query_tokens=3)
    k_min, k_max = p.bounds()
    k_min[int(p.block_table[0, 50])] = math.nan                    # one NaN box in the pool of row 0
    for budget, sink in ((20, 2), (40, 0)):
        opts = dict(page_size=1, page_budget=budget, num_sink_pages=sink, num_recent_pages=2)
        one, scores = one_stage(p.q, k_min, k_max, p.block_table, p.seq_lens, opts)
        ref = reference.select_pages(scores, p.seq_lens, **opts, num_query_tokens=3)
        assert torch.equal(one, ref)
        assert torch.equal(two_stage(p.q, k_min, k_max, p.block_table, p.seq_lens, opts, chunk), ref)


def test_heuristic_table(monkeypatch):
    """GPU sizes: at B = 1 and a large budget the chunks are larger than the budget (stage 1 filters: the merge
    sees at most half the pages), the candidates stay in one tile, and the radix passes take 4-bit digits where
    the counting tile allows (stage 1: 8 dependent passes; the merge of 1024 candidates: 16, instead of 32); a small budget keeps the
    GPU-filling chunks (>= 2 programs per SM)."""
    monkeypatch.setattr(chunk_topk, "is_interpreting", lambda: False)
    for pages, chunk, cand, bits in ((2048, 256, 1024, 2), (8192, 256, 4096, 1)):
        meta = chunk_topk.chunk_blocks(1, 8, pages, 128, 1, 4, 128, 16, num_sms=132)
        assert meta["stage1"]["CHUNK"] == chunk and meta["NC"] * meta["KC"] == cand
        assert chunk >= chunk_topk.FILTER * 128 and cand <= pages // 2 and meta["stage2"]["BN"] <= chunk_topk.MAX_CANDIDATES
        assert meta["stage1"]["BITS"] == 4 and meta["stage2"]["BITS"] == bits
        assert chunk_topk.use_two_stage(1, 8, pages, 128)
    meta = chunk_topk.chunk_blocks(1, 8, 2048, 8, 1, 4, 128, 16, num_sms=132)        # a small budget: fill the GPU
    assert meta["stage1"]["CHUNK"] == 64 and 8 * meta["NC"] >= 2 * 132 - 8
    assert [chunk_topk.radix_bits(n) for n in (64, 256, 512, 1024, 2048, 4096)] == [4, 4, 2, 2, 1, 1]
    assert not chunk_topk.use_two_stage(64, 8, 2048, 128)            # 512 rows x heads fill the GPU: one stage
    assert chunk_topk.use_two_stage(64, 8, 4096, 128)                # the one-stage tile would hold 4096 keys
    assert not chunk_topk.use_two_stage(1, 8, 100, 128)              # every page fits the budget: nothing to select
    for batch, pages, budget in ((1, 3, 2), (4, 32768, 128), (16, 2048, 8), (1, 100000, 512)):
        meta = chunk_topk.chunk_blocks(batch, 8, pages, budget, 1, 4, 128, 16)
        chunk = meta["stage1"]["CHUNK"]
        assert chunk & (chunk - 1) == 0 and meta["NC"] * chunk >= pages and meta["KC"] == min(budget, chunk)
    monkeypatch.undo()
    assert chunk_topk.chunk_blocks(1, 8, 8192, 128, 1, 4, 128, 16)["stage1"]["CHUNK"] == chunk_topk.INTERPRET_CHUNK


@pytest.mark.parametrize("window_left", [-1, 5])
def test_plan_uses_two_stage_and_matches_one_stage(monkeypatch, window_left):
    """The plan's sparse step goes through the two-stage selection at small batch, same pages as one stage."""
    p = make_problem(5, batch=2, seq_lens=[61, 30], page_size=4, num_kv_heads=2, group=2, head_dim=16,
                     num_query_tokens=2)
    k_min, k_max = p.bounds()
    plan_args = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, num_query_tokens=2, page_budget=5,
                     num_sink_pages=1 if window_left < 0 else 0)   # a sliding window takes no sinks
    calls = []
    real = selection_triton.merge_chunks
    monkeypatch.setattr(selection_triton, "merge_chunks", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    plan = PagedAttentionPlan(backend="triton").plan(p.block_table, p.seq_lens, **plan_args)
    assert plan._impl._chunks is not None and plan._impl._chunks["NC"] == -(-p.block_table.shape[1] // chunk_topk.INTERPRET_CHUNK) > 1
    two = plan.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, window_left=window_left)
    pages_two = plan._impl._selected.clone()
    assert calls == [1]
    monkeypatch.setattr(chunk_topk, "use_two_stage", lambda *a, **k: False)
    plan1 = PagedAttentionPlan(backend="triton").plan(p.block_table, p.seq_lens, **plan_args)
    assert plan1._impl._chunks is None
    one = plan1.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, window_left=window_left)
    assert calls == [1] and torch.equal(plan1._impl._selected, pages_two) and torch.equal(one, two)


# ---- select_pages: ties, padding, the forced pages, radix-size budgets (CASES.md kind 7) ----------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_lower_page_index(backend):
    scores = torch.tensor([[[1.0, 5.0, 5.0, 5.0, 0.0, 5.0, 2.0]]])
    got = tinyattn.select_pages(scores, torch.tensor([28], dtype=torch.int32), page_size=4, page_budget=3,
                                backend=backend)
    assert got.tolist() == [[[1, 2, 6]]]                                    # recent page 6, then 1 and 2 of the ties
    want = reference.select_pages(scores, torch.tensor([28]), page_size=4, page_budget=3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_never_outranks_a_real_minus_inf_score(backend):
    scores = torch.tensor([[[float("-inf"), float("-inf"), float("-inf"), 9.0, 9.0]]])
    got = tinyattn.select_pages(scores, torch.tensor([10], dtype=torch.int32), page_size=4, page_budget=3,
                                num_recent_pages=1, backend=backend)
    assert got.tolist() == [[[0, 1, 2]]]                                    # pages 3, 4 are past the end


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_selection_properties(backend, data):
    B, Hkv, max_pages_per_seq = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    lens = torch.tensor([data.draw(st.integers(0, max_pages_per_seq * page_size)) for _ in range(B)], dtype=torch.int32)
    raw = data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, -1.0, float("-inf"), 3.5]), min_size=B * Hkv * max_pages_per_seq,
                             max_size=B * Hkv * max_pages_per_seq))
    scores = torch.tensor(raw).reshape(B, Hkv, max_pages_per_seq)
    sinks, recent = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    forced = sinks + max(recent, 1)                                  # a smaller budget raises (issue 15)
    opts = dict(page_size=page_size, page_budget=data.draw(st.integers(forced, max(forced, max_pages_per_seq + 2))),
                num_sink_pages=sinks, num_recent_pages=recent)
    got = tinyattn.select_pages(scores, lens, **opts, backend=backend)
    assert torch.equal(got, reference.select_pages(scores, lens, **opts))
    n_valid = (lens + page_size - 1) // page_size
    for b in range(B):
        for h in range(Hkv):
            kept = [j for j in got[b, h].tolist() if j >= 0]
            assert kept == sorted(set(kept)) and all(j < n_valid[b] for j in kept)
            assert len(kept) == min(opts["page_budget"], int(n_valid[b]))
            if n_valid[b]:
                assert int(n_valid[b]) - 1 in kept                          # the partial last page


@pytest.mark.parametrize("backend", SLOW_TRITON)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_large_budgets_with_ties_match_reference(backend, data):
    """Budgets above the kernel's radix-select threshold (16 pages), with ties, -inf and NaN scores."""
    B, Hkv, max_pages_per_seq = 2, 2, data.draw(st.integers(20, 140))
    lens = torch.tensor([data.draw(st.integers(0, 4 * max_pages_per_seq)) for _ in range(B)], dtype=torch.int32)
    pool = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf"), float("nan"), 3.5, -0.0, 1e30])
    choice = torch.tensor(data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=B * Hkv * max_pages_per_seq,
                                             max_size=B * Hkv * max_pages_per_seq)))
    scores = torch.where(torch.rand(B, Hkv, max_pages_per_seq, generator=torch.Generator().manual_seed(max_pages_per_seq)) < 0.5,
                         pool[choice].reshape(B, Hkv, max_pages_per_seq), torch.randn(B, Hkv, max_pages_per_seq))
    sinks, recent = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 20))
    opts = dict(page_size=4, page_budget=data.draw(st.integers(max(17, sinks + max(recent, 1)), max_pages_per_seq + 3)),
                num_sink_pages=sinks, num_recent_pages=recent)
    got = tinyattn.select_pages(scores, lens, **opts, backend=backend)
    assert torch.equal(got, reference.select_pages(scores, lens, **opts))


def num_valid_pages(seq_len, page_size: int) -> int:
    return -(-int(seq_len) // page_size)


# ---- the Triton scoring and selection kernels against the reference; the bound holds for every key ---------------
@tiers(4, 20)
def test_page_scores_match_reference_and_bound_every_key(examples):
    @settings(max_examples=examples, deadline=None)
    @given(laid_out_problems(dtypes=("fp32", "fp16", "bf16")))
    def check(case):
        p, layout = case
        num_pages, page_size, Hkv, D = p.k_cache.shape
        q = relayout(p.q, layout)
        k_min, k_max = torch.zeros(num_pages, Hkv, D, dtype=p.k_cache.dtype), torch.zeros(num_pages, Hkv, D, dtype=p.k_cache.dtype)
        kv_cache_triton.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
        scores = torch.full((p.q.shape[0], Hkv, p.block_table.shape[1]), math.nan)
        selection_triton.page_scores(q, k_min, k_max, p.block_table, p.seq_lens, page_size=page_size, out=scores)
        ref = reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=page_size)
        torch.testing.assert_close(scores, ref, atol=1e-4, rtol=1e-5)
        # the bound: score >= q.k for every valid key of the page, every query token and head of the group
        G, Tq = p.q.shape[2] // Hkv, p.q.shape[1]
        for b in range(p.q.shape[0]):
            n_tok = int(p.seq_lens[b])
            for j in range(num_valid_pages(n_tok, page_size)):
                keys = p.k_cache[p.block_table[b, j].long(), : min(page_size, n_tok - j * page_size)].double()  # [s, Hkv, D]
                qg = p.q[b].double().view(Tq, Hkv, G, D)
                logits = torch.einsum("thgd,shd->hstg", qg, keys).reshape(Hkv, -1).amax(1)  # [Hkv]
                assert (scores[b, :, j].double() >= logits - 1e-4 * (1 + logits.abs())).all()

    check()


@st.composite
def selection_cases(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    B, Hkv, maxp = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    seq_lens = torch.tensor([draw(st.integers(0, maxp * page_size)) for _ in range(B)], dtype=torch.int32)
    # few distinct values -> many ties; -inf and NaN scores; pages past the end score +inf (must still lose)
    pool = st.sampled_from([-2.0, -1.0, 0.0, -0.0, 1.0, 3.5, -math.inf, math.nan])
    scores = torch.tensor([draw(pool) for _ in range(B * Hkv * maxp)], dtype=torch.float32).view(B, Hkv, maxp)
    for b in range(B):
        scores[b, :, num_valid_pages(seq_lens[b], page_size):] = math.inf
    opts = dict(page_size=page_size, page_budget=draw(st.integers(1, maxp + 2)),
                num_sink_pages=draw(st.integers(0, 3)), num_recent_pages=draw(st.integers(0, 3)),
                num_query_tokens=draw(st.integers(1, 2 * page_size)))
    return scores, seq_lens, opts


@tiers(10, 40)
def test_select_pages_matches_reference(examples):
    @settings(max_examples=examples, deadline=None)
    @given(selection_cases())
    def check(case):
        scores, seq_lens, opts = case
        try:
            ref = reference.select_pages(scores, seq_lens, **opts)
        except ValueError:  # the budget cannot hold the query pages: the ops layer raises before the kernel
            assume(False)
        out = torch.full(ref.shape, -7, dtype=torch.int32)
        selection_triton.select_pages(scores, seq_lens, **opts, out=out)
        assert torch.equal(out, ref)

    check()


# ---- NaN scores count as -inf, ties go to the lower page (NaN vs -inf too), against a brute-force ranking ---------
NAN, NEG_INF = float("nan"), float("-inf")

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
    max_pages_per_seq = data.draw(st.integers(18, 40) if radix else st.integers(1, 10))
    page_size = 4
    lens = torch.tensor([data.draw(st.integers(0, max_pages_per_seq * page_size)) for _ in range(B)], dtype=torch.int32)
    pool = st.sampled_from([NAN, NEG_INF, -1.0, 0.0, -0.0, 2.0, math.inf])
    scores = torch.tensor(data.draw(st.lists(pool, min_size=B * Hkv * max_pages_per_seq, max_size=B * Hkv * max_pages_per_seq))).view(B, Hkv, max_pages_per_seq)
    sinks, recent = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    low = sinks + max(recent, 1)
    budget = data.draw(st.integers(max(low, 17), max(low, 17) + 6) if radix else st.integers(low, low + max_pages_per_seq))
    opts = dict(page_size=page_size, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent)
    assert torch.equal(SELECTORS[impl](scores, lens, **opts), brute_force_select(scores, lens, **opts))


# ---- pages wholly before a window are never selected nor read ----------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_query_tokens", [1, 4])
def test_pages_wholly_before_the_window_are_never_read(backend, num_query_tokens):
    """NaN in every page before the earliest query's window: the output is still the reference's. A walk or gather
    that read those pages would turn ``0 * NaN`` into NaN, so this proves that they are skipped."""
    page_size, W = 4, 5
    lens = [30, 21]
    p = make_problem(4, batch=2, seq_lens=lens, page_size=page_size, num_kv_heads=2, group=2, head_dim=8,
                     num_query_tokens=num_query_tokens)
    ref = reference.paged_attention(*p.args, window_left=W)
    k, v = p.k_cache.clone(), p.v_cache.clone()
    for b, n in enumerate(lens):
        first_key = n - num_query_tokens - W
        for j in range(first_key // page_size):                                      # wholly before every window
            k[int(p.block_table[b, j])] = float("nan")
            v[int(p.block_table[b, j])] = float("nan")
    out = tinyattn.paged_attention(p.q, k, v, p.block_table, p.seq_lens, window_left=W, backend=backend)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


# ---- scores over half-precision boxes (rounded outward) still bound every logit (fp64 max over the page's keys) ----
NARROW = [torch.bfloat16, torch.float16]
INF = float("inf")

def _max_logit(p, magnitude: bool = False):
    """fp64 ``max_t q.k_t`` per (row, KV head, logical page), over the group's heads and the page's valid keys
    (and, with ``magnitude``, ``max_t |q|.|k_t|``: the scale of the fp32 rounding error of a score)."""
    B, Tq, Hq, D = p.q.shape
    Hkv, page_size = p.num_kv_heads, p.page_size
    out = torch.full((B, Hkv, p.block_table.shape[1]), -INF, dtype=torch.float64)
    mag = torch.zeros_like(out)
    for b in range(B):
        n = int(p.seq_lens[b])
        for j in range(-(-n // page_size)):
            keys = p.k_cache[int(p.block_table[b, j]), : min(page_size, n - j * page_size)].double()    # [t, Hkv, D]
            for h in range(Hkv):
                qg = p.q[b, :, h * (Hq // Hkv):(h + 1) * (Hq // Hkv)].double().reshape(-1, D)
                out[b, h, j] = (qg @ keys[:, h].T).max()
                mag[b, h, j] = (qg.abs() @ keys[:, h].abs().T).max()
    return (out, mag) if magnitude else out


@settings(max_examples=25, deadline=None)
@given(problems(dtypes=("fp32",)), st.sampled_from(NARROW), st.sampled_from(["torch", "triton"]))
def test_scores_over_narrow_boxes_bound_every_logit(p, box, backend):
    if backend == "triton" and p.page_size & (p.page_size - 1):
        return
    shape = (p.k_cache.shape[0], p.num_kv_heads, p.k_cache.shape[3])
    lo, hi = torch.zeros(shape, dtype=box), torch.zeros(shape, dtype=box)
    tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, lo, hi, backend="torch")
    ub = tinyattn.page_scores(p.q, lo, hi, p.block_table, p.seq_lens, page_size=p.page_size, backend=backend)
    best, mag = _max_logit(p, magnitude=True)
    valid = best > -INF
    assert bool((ub.double()[valid] >= best[valid] - 1e-5 * mag[valid]).all())
