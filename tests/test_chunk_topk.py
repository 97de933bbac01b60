"""The two-stage selection (``tinyattn.kernels.chunk_topk``) in the interpreter, against the reference and the
one-stage kernels (``page_scores`` + ``select_pages``).

Two families of boxes: integer-valued queries and boxes, whose bounds are exact in fp32 whatever the order
of the channel sum (so the kernel's bounds equal the reference's bit for bit, and equal bounds, i.e. ties,
are frequent), compared with ``reference.select_pages(reference.page_scores(...))``; and Gaussian boxes,
compared with the one-stage kernels bit for bit. Both over ragged batches (B >= 2), GQA 1-4, Tq > 1,
budgets above and below the page count (argmax loops and radix select), sinks / recent pages, NaN boxes,
poisoned pages past the end and forced chunk sizes 1 .. 64 (several chunks per row, one chunk per row).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (tests/conftest.py sets it too)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tinyattn.ops.selection import triton_impl as selection_triton  # noqa: E402
from tinyattn.kernels import chunk_topk as C  # noqa: E402
from tinyattn.ops import reference  # noqa
from tinyattn.ops.selection import torch_impl as core  # noqa: E402
from tinyattn.ops.plan import PagedAttentionPlan  # noqa: E402
from paged_problems import make_problem  # noqa: E402

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
    P = p.k_cache.shape[0]
    if integer:
        # small integers: every bound is exact in fp32, many pages tie
        q = torch.randint(-2, 3, p.q.shape, generator=g).float()
        lo = torch.randint(-2, 2, (P, Hkv, D), generator=g).float()
        k_min, k_max = lo, lo + torch.randint(0, 2, (P, Hkv, D), generator=g).float()
    else:
        q = p.q
        k_min, k_max = p.bounds()
    # boxes of pages no row owns are poison (rows must never read them through ids past their end)
    owned = torch.zeros(P, dtype=torch.bool)
    for b, n in enumerate(lens):
        owned[p.block_table[b, :-(-n // page_size)].long()] = True
    k_min[~owned], k_max[~owned] = math.inf, math.nan
    if draw(st.booleans()):  # a NaN box: the page scores NaN, which counts as -inf
        j = int(torch.randint(0, P, (1,), generator=g))
        k_min[j, 0, 0] = math.nan
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    opts = dict(page_size=page_size, page_budget=draw(st.sampled_from([1, 2, 3, 5, 17, 20, max_pages + 2])),
                num_sink_pages=draw(st.integers(0, 3)), num_recent_pages=draw(st.integers(0, 3)))
    return (q.to(dtype), k_min.to(dtype), k_max.to(dtype), p.block_table, p.seq_lens, opts,
            draw(st.sampled_from(CHUNKS)))


def two_stage(q, k_min, k_max, block_table, seq_lens, opts, chunk, window_left=-1):
    B, Tq, Hq, D = q.shape
    Hkv, maxp, budget = k_min.shape[1], block_table.shape[1], opts["page_budget"]
    meta = C.chunk_blocks(B, Hkv, maxp, budget, Tq, Hq // Hkv, D, opts["page_size"], chunk=chunk)
    shape = C.workspace_shape(B, Hkv, meta)
    ws_key, ws_page = torch.full(shape, 123, dtype=torch.int32), torch.full(shape, 123, dtype=torch.int32)
    out = torch.full((B, Hkv, budget), -7, dtype=torch.int32)
    selection_triton.score_and_select_pages(q, k_min, k_max, block_table, seq_lens, **opts, meta=meta, ws_key=ws_key,
                             ws_page=ws_page, out=out, window_left=window_left)
    return out


def one_stage(q, k_min, k_max, block_table, seq_lens, opts, window_left=-1):
    B, Tq = q.shape[:2]
    scores = torch.full((B, k_min.shape[1], block_table.shape[1]), math.nan)
    selection_triton.page_scores(q, k_min, k_max, block_table, seq_lens, page_size=opts["page_size"], out=scores)
    core.mask_pages_before_window(scores, seq_lens, opts["page_size"], Tq, window_left)
    out = torch.full((B, k_min.shape[1], opts["page_budget"]), -7, dtype=torch.int32)
    selection_triton.select_pages(scores, seq_lens, **opts, num_query_tokens=Tq, out=out)
    return out, scores


@settings(max_examples=150, deadline=None)
@given(selection_problems(integer=True))
def test_two_stage_matches_reference(case):
    q, k_min, k_max, table, seq_lens, opts, chunk = case
    ref_scores = reference.page_scores(q, k_min, k_max, table, seq_lens, page_size=opts["page_size"])
    try:
        ref = reference.select_pages(ref_scores, seq_lens, **opts, num_query_tokens=q.shape[1])
    except ValueError:  # the budget cannot hold the query pages: the ops layer raises before the kernel
        assume(False)
    assert torch.equal(two_stage(q, k_min, k_max, table, seq_lens, opts, chunk), ref)


@settings(max_examples=100, deadline=None)
@given(selection_problems(integer=False), st.sampled_from([-1, 0, 3, 9]))
def test_two_stage_equals_one_stage(case, window_left):
    q, k_min, k_max, table, seq_lens, opts, chunk = case
    try:
        reference.select_pages(torch.zeros(q.shape[0], 1, table.shape[1]), seq_lens, **opts,
                               num_query_tokens=q.shape[1])
    except ValueError:
        assume(False)
    one, _ = one_stage(q, k_min, k_max, table, seq_lens, opts, window_left)
    assert torch.equal(two_stage(q, k_min, k_max, table, seq_lens, opts, chunk, window_left), one)


def test_all_ties_radix_and_short_rows():
    """Every page scores the same (the lowest pages win), a row of 0 tokens, a short row kept whole."""
    p = make_problem(0, batch=3, seq_lens=[40, 0, 7], page_size=1, num_kv_heads=2, group=2, head_dim=8)
    P = p.k_cache.shape[0]
    k_min, k_max = torch.zeros(P, 2, 8), torch.ones(P, 2, 8)
    opts = dict(page_size=1, page_budget=20, num_sink_pages=2, num_recent_pages=3)
    ref = reference.select_pages(reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=1),
                                 p.seq_lens, **opts)
    for chunk in (4, 16, 64):
        got = two_stage(p.q, k_min, k_max, p.block_table, p.seq_lens, opts, chunk)
        assert torch.equal(got, ref)
    assert ref[0, 0].tolist() == [0, 1] + list(range(2, 17)) + [37, 38, 39]
    assert (ref[1] == -1).all() and ref[2, 0].tolist() == list(range(7)) + [-1] * 13


@pytest.mark.parametrize("chunk", [8, 32, 128])
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
    monkeypatch.setattr(C, "is_interpreting", lambda: False)
    for pages, chunk, cand, bits in ((2048, 256, 1024, 2), (8192, 256, 4096, 1)):
        meta = C.chunk_blocks(1, 8, pages, 128, 1, 4, 128, 16, num_sms=132)
        assert meta["stage1"]["CHUNK"] == chunk and meta["NC"] * meta["KC"] == cand
        assert chunk >= C.FILTER * 128 and cand <= pages // 2 and meta["stage2"]["BN"] <= C.MAX_CANDIDATES
        assert meta["stage1"]["BITS"] == 4 and meta["stage2"]["BITS"] == bits
        assert C.use_two_stage(1, 8, pages, 128)
    meta = C.chunk_blocks(1, 8, 2048, 8, 1, 4, 128, 16, num_sms=132)        # a small budget: fill the GPU
    assert meta["stage1"]["CHUNK"] == 64 and 8 * meta["NC"] >= 2 * 132 - 8
    assert [C.radix_bits(n) for n in (64, 256, 512, 1024, 2048, 4096)] == [4, 4, 2, 2, 1, 1]
    assert not C.use_two_stage(64, 8, 2048, 128)            # 512 rows x heads fill the GPU: one stage
    assert C.use_two_stage(64, 8, 4096, 128)                # the one-stage tile would hold 4096 keys
    assert not C.use_two_stage(1, 8, 100, 128)              # every page fits the budget: nothing to select
    for batch, pages, budget in ((1, 3, 2), (4, 32768, 128), (16, 2048, 8), (1, 100000, 512)):
        meta = C.chunk_blocks(batch, 8, pages, budget, 1, 4, 128, 16)
        chunk = meta["stage1"]["CHUNK"]
        assert chunk & (chunk - 1) == 0 and meta["NC"] * chunk >= pages and meta["KC"] == min(budget, chunk)
    monkeypatch.undo()
    assert C.chunk_blocks(1, 8, 8192, 128, 1, 4, 128, 16)["stage1"]["CHUNK"] == C.INTERPRET_CHUNK


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
    assert plan._impl._chunks is not None and plan._impl._chunks["NC"] == -(-p.block_table.shape[1] // C.INTERPRET_CHUNK) > 1
    two = plan.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, window_left=window_left)
    pages_two = plan._impl._selected.clone()
    assert calls == [1]
    monkeypatch.setattr(C, "use_two_stage", lambda *a, **k: False)
    plan1 = PagedAttentionPlan(backend="triton").plan(p.block_table, p.seq_lens, **plan_args)
    assert plan1._impl._chunks is None
    one = plan1.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, window_left=window_left)
    assert calls == [1] and torch.equal(plan1._impl._selected, pages_two) and torch.equal(one, two)
