"""Issue 35's second stage (docs/design_rerank.md): 4-bit key codes of full pages and the candidates' log attention
mass estimated from them, and the re-ranked selection built on it.

Proven here, on the torch forms and the Triton kernels (interpreter), against the loop references:

- ``encode_key_codes`` writes the reference's codes bit for bit (float pools of every width, int8 / fp8 pools with
  their scales, boxes of the pool's dtype, fp32 or bf16; exact, loose, narrow and garbage boxes; NaN / inf keys;
  slots in any order, some of which fill no page), leaves every page no slot fills untouched, codes a zero-width
  channel 0 and, inside an exact box, puts every key within half a step of its decoded value (checked here by hand).
- ``rerank_scores`` equals the fp64 reference (ragged and empty rows, rows shorter than the candidate list, ``-1``
  padding and ids past the end, GQA 1-4, ``Tq`` 1-3, windows, peaked, flat and tied logits, random or encoded codes);
  the masses of each (row, KV head) sum to the number of its query rows that see a candidate key (counted by hand);
  NaN in one row's query stays in that row.
- With keys on each page's 16-level grid (so the codes are exact) and every page a candidate, ``μ`` is the log of
  the page's true attention mass, computed here by a plain fp64 softmax; and the re-ranked selection with a fixed
  budget keeps the oracle's pages (the brute-force rule over that mass).
- ``sparse_paged_attention(rerank="int4")`` and ``PagedAttentionPlan(rerank="int4")`` attend exactly the pages of the
  reference pipeline ``select_pages(rerank_scores(..., select_pages(page_scores(...), ceil(c·K))), K, top_p, 1)``;
  ``top_p=1`` is the fixed budget; a covering budget with every page a candidate is dense attention; the errors name
  their argument.

The fp32 forms and the fp64 reference round differently, so the pipeline tests run on problems whose scores and
masses have no near-ties and whose top-p thresholds are not within rounding (the fixed cases assert it, the drawn
ones are filtered by it); the masses are compared down to where fp32's exp underflows (:data:`UNDERFLOW`).
"""
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import reference as R
from tinyattn.ops.kv_cache import reference as kv_cache_reference
from tinyattn.ops.kv_cache import torch_impl as kv_cache_torch
from tinyattn.ops.selection import reference as selection_reference
from tinyattn.ops.selection import torch_impl as selection_torch

from paged_problems import (BACKENDS, LAYOUTS, QMAX, SLOW_TRITON, Problem, brute_force_select, contiguous_kv,
    make_problem, problems, quantize_problem, relayout)

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
           "fp8_e4m3": torch.float8_e4m3fn}
# below this log-mass the fp32 forms may underflow to 0 (exp(-87) is fp32's smallest normal), which the fp64
# reference still represents: there the forms are only asked for a log-mass this low or -inf
UNDERFLOW = -60.0


def _unpack(code: torch.Tensor) -> torch.Tensor:
    """int64 codes ``[..., D]`` of packed bytes ``[..., D/2]``: low nibble of byte i = channel i, high = i + D/2."""
    c = code.to(torch.int64)
    return torch.cat([c & 15, c >> 4], dim=-1)


def _as_sets(pages: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> list:
    """Per (row, KV head): the set of the row's valid pages listed (``-1`` and ids past the end dropped)."""
    out = []
    for b in range(pages.shape[0]):
        n = -(-int(seq_lens[b]) // page_size)
        out.append([{int(j) for j in pages[b, h].tolist() if 0 <= j < n} for h in range(pages.shape[1])])
    return out


# ============================================================================ the codes
@st.composite
def code_problems(draw, max_slots: int):
    """``(k_cache, slots, k_min, k_max, k_scale)`` of every kind the encoder must survive."""
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    S, Hkv = draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.integers(1, 3))
    D, P = draw(st.sampled_from([2, 8, 16, 24, 40, 64])), draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    keys = torch.randn(P, S, Hkv, D, generator=g) * draw(st.sampled_from([0.01, 1.0, 300.0]))
    keys = keys + torch.randn(P, 1, Hkv, D, generator=g) * draw(st.sampled_from([0.0, 5.0]))
    flat = torch.rand(P, 1, Hkv, D, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))   # zero-width channels
    keys = torch.where(flat, keys[:, :1].expand_as(keys), keys)
    k_scale = None
    if fmt in ("int8", "fp8_e4m3"):
        k_scale = keys.abs().amax(dim=(1, 3)) / QMAX[fmt]
        y = keys / k_scale.clamp_min(1e-30)[:, None, :, None]
        pool = y.round().clamp(-127, 127).to(torch.int8) if fmt == "int8" else y.clamp(-448, 448).to(FORMATS[fmt])
        deq = pool.float() * k_scale[:, None, :, None]
    else:
        if draw(st.booleans()):             # a few NaN / infinite keys
            r = torch.rand(keys.shape, generator=g)
            keys = torch.where(r < 0.04, float("nan"), torch.where(r > 0.97, float("inf") * keys.sign(), keys))
        pool = keys.to(FORMATS[fmt])
        deq = pool.float()
    lo, hi = deq.amin(1), deq.amax(1)                                             # [P, Hkv, D]
    kind = draw(st.sampled_from(["exact", "loose", "narrow", "garbage"]))
    width = (hi - lo).nan_to_num(0.0, 0.0, 0.0)
    if kind == "loose":
        lo, hi = lo - width * torch.rand(lo.shape, generator=g), hi + width * torch.rand(lo.shape, generator=g)
    elif kind == "narrow":                  # keys outside the box: codes clamp to 0 / 15
        lo, hi = lo + 0.3 * width, hi - 0.3 * width
    elif kind == "garbage":                 # inverted, NaN, infinite, zero-width boxes
        pick = torch.randint(0, 5, lo.shape, generator=g)
        a, b = torch.randn(lo.shape, generator=g), torch.randn(lo.shape, generator=g)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 1.0])
        lo = torch.where(pick == 0, a, specials[torch.randint(0, 5, lo.shape, generator=g)])
        hi = torch.where(pick <= 1, b, torch.where(pick == 2, lo, specials[torch.randint(0, 5, lo.shape, generator=g)]))
    box = draw(st.sampled_from(["fp32", "bf16"] + ([] if k_scale is not None else ["pool"])))
    box_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "pool": pool.dtype}[box]
    n = draw(st.integers(0, min(max_slots, P * S)))
    slots = torch.randperm(P * S, generator=g)[:n]
    if n and draw(st.booleans()):           # the last slot of a random page, so that some page fills
        slots = torch.cat([slots, torch.randint(0, P, (1,), generator=g) * S + S - 1])
    slots = slots.to(draw(st.sampled_from([torch.int32, torch.int64])))
    return dict(k_cache=pool, slots=slots, k_min=lo.to(box_dtype), k_max=hi.to(box_dtype), k_scale=k_scale,
                exact=kind == "exact" and box == "fp32" and k_scale is None and bool(deq.isfinite().all()))


def _check_encoder(backend, case, gen):
    k_cache, slots = case["k_cache"], case["slots"]
    P, S, Hkv, D = k_cache.shape
    start = torch.randint(0, 256, (P, S, Hkv, D // 2), generator=gen, dtype=torch.uint8)   # poison: never read
    want, got = start.clone(), start.clone()
    kv_cache_reference.encode_key_codes(k_cache, slots, case["k_min"], case["k_max"], want, k_scale=case["k_scale"])
    tinyattn.encode_key_codes(k_cache, slots, case["k_min"], case["k_max"], got, k_scale=case["k_scale"],
                              backend=backend)
    assert torch.equal(got, want)
    # by hand: a page no slot fills keeps its bytes; a filled page's zero-width channels are coded 0; inside an
    # exact box, each key lies within half a step of its code's value lo + code · step
    filled = {int(s) // S for s in slots.tolist() if int(s) % S == S - 1}
    for p in range(P):
        if p not in filled:
            assert torch.equal(got[p], start[p])
            continue
        codes = _unpack(got[p])                                                     # [S, Hkv, D]
        lo, hi = case["k_min"][p].float(), case["k_max"][p].float()
        zero = (hi == lo)[None].expand_as(codes)
        assert bool((codes[zero] == 0).all())
        if case["exact"]:
            step = ((hi.double() - lo.double()) / 15)[None]
            err = (k_cache[p].double() - (lo.double()[None] + codes * step)).abs()
            assert bool((err <= step * (0.5 + 1e-5) + 1e-30).all())


@pytest.mark.parametrize("backend, examples", [("torch", 60), ("triton", 6),
                                               pytest.param("triton", 14, marks=pytest.mark.slow)])
def test_encode_key_codes_matches_the_reference_bit_for_bit(backend, examples):
    @settings(max_examples=examples, deadline=None)
    @given(code_problems(max_slots=40 if backend == "torch" else 10), st.integers(0, 2**31 - 1))
    def check(case, seed):
        _check_encoder(backend, case, torch.Generator().manual_seed(seed))

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_width_channels_code_zero_and_decode_exactly_to_k_min(backend):
    """A page whose keys are constant in some channels: codes 0 there, and the decoder of the torch form and the
    reference's give back exactly ``k_min`` (no ``0 · step`` rounding); the other channels span 0..15."""
    g = torch.Generator().manual_seed(4)
    S, Hkv, D = 4, 2, 8
    keys = torch.randn(3, S, Hkv, D, generator=g) * 3
    keys[:, :, :, 1] = keys[:, :1, :, 1]                          # channel 1 (low nibble) constant in every page
    keys[:, :, 0, 6] = 1e-3                                       # channel 6 (high nibble) of head 0
    k_min, k_max = keys.amin(1), keys.amax(1)
    code = torch.full((3, S, Hkv, D // 2), 0xFF, dtype=torch.uint8)
    tinyattn.encode_key_codes(keys, torch.tensor([S - 1, 2 * S - 1, 3 * S - 1]), k_min, k_max, code, backend=backend)
    codes = _unpack(code)
    assert bool((codes[:, :, :, 1] == 0).all()) and bool((codes[:, :, 0, 6] == 0).all())
    assert bool((codes[:, :, :, 0].amin(1) == 0).all()) and bool((codes[:, :, :, 0].amax(1) == 15).all())
    for p in range(3):
        for h in range(Hkv):
            decoded = selection_torch.decode_key_codes(code, k_min, k_max, torch.tensor(p), torch.tensor(h))
            assert torch.equal(decoded[:, 1], k_min[p, h, 1].expand(S))
            ref = selection_reference._decoded_keys(code, k_min, k_max, p, h, torch.float64)
            assert torch.equal(ref[:, 1], k_min[p, h, 1].double().expand(S))
            if h == 0:
                assert torch.equal(decoded[:, 6], torch.full((S,), 1e-3))


def test_the_encoder_forms_take_the_same_arguments():
    """The torch twin and the Triton launcher called directly (``k_scale`` positional), as the public op calls
    them: the reference's codes."""
    from tinyattn.ops.kv_cache import triton_impl as kv_cache_triton

    g = torch.Generator().manual_seed(5)
    q8 = torch.randint(-127, 128, (3, 4, 2, 8), generator=g, dtype=torch.int8)
    k_scale = torch.rand(3, 2, generator=g) + 0.1
    deq = q8.float() * k_scale[:, None, :, None]
    k_min, k_max = deq.amin(1), deq.amax(1)
    slots = torch.tensor([3, 5, 11, 6], dtype=torch.int64)          # pages 0 and 2 fill, page 1 does not
    want = torch.zeros(3, 4, 2, 4, dtype=torch.uint8)
    kv_cache_reference.encode_key_codes(q8, slots, k_min, k_max, want, k_scale=k_scale)
    for form in (kv_cache_torch.encode_key_codes, kv_cache_triton.encode_key_codes):
        got = torch.zeros_like(want)
        form(q8, slots, k_min, k_max, got, k_scale)
        assert torch.equal(got, want)
    assert want[1].eq(0).all()                                          # page 1 was not filled


# ============================================================================ the mass
@st.composite
def rerank_problems(draw):
    """``(problem, k_code, k_min, k_max, candidates, scale, window_left)``: the harness's ragged problems (garbage
    past each row's end, empty rows), random or encoded codes, the group's queries flat, peaked, tied or normal."""
    p = draw(problems(dtypes=("fp32", "bf16", "fp16"), max_query_tokens=3, page_sizes=(1, 2, 4, 8, 16),
                      head_dims=(2, 8, 16, 24, 32), groups=(1, 2, 4), max_kv_heads=2, max_pages_per_row=5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    num_pages, S, Hkv, D = p.k_cache.shape
    B, max_pages = p.block_table.shape
    k_min, k_max = p.bounds(draw(st.sampled_from([torch.float32, p.k_cache.dtype])))
    kind = draw(st.sampled_from(["normal", "peaked", "flat", "ties"]))
    q = p.q.clone()
    if kind == "peaked":
        q[:, :, draw(st.integers(0, q.shape[2] - 1))] *= 8.0
    elif kind == "flat":
        q.zero_()
    elif kind == "ties":                    # integer queries, integer decoded keys (steps of 1 or 2): tied logits
        q = torch.randint(-1, 2, q.shape, generator=g).float()
        k_min = torch.randint(-2, 2, k_min.shape, generator=g).float()
        k_max = k_min + 15 * torch.randint(0, 3, k_min.shape, generator=g).float()
    if draw(st.booleans()):                 # some channels of zero width
        k_max = torch.where(torch.rand(k_max.shape, generator=g) < 0.3, k_min, k_max)
    if draw(st.booleans()):
        code = torch.randint(0, 256, (num_pages, S, Hkv, D // 2), generator=g, dtype=torch.uint8)
    else:
        code = torch.zeros(num_pages, S, Hkv, D // 2, dtype=torch.uint8)
        tinyattn.encode_key_codes(p.k_cache, torch.arange(num_pages * S), k_min, k_max, code, backend="torch")
    C = draw(st.integers(1, max_pages + 2))
    cand = torch.full((B, Hkv, C), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(Hkv):
            count = int(torch.randint(0, C + 1, (1,), generator=g))
            cand[b, h, :count] = torch.randperm(max_pages + 2, generator=g)[:count]   # any order, some past the end
    cand = cand.to(draw(st.sampled_from([torch.int32, torch.int64])))
    scale = draw(st.sampled_from([None, 0.3, 1.0]))
    window = draw(st.sampled_from([-1, 0, 1, 3, 9]))
    if q.shape[1] == 1 and draw(st.booleans()):
        q = q[:, 0]                         # the decode form [B, Hq, D]
    else:
        q = relayout(q, draw(st.sampled_from(LAYOUTS)))
    return p, q, code, k_min, k_max, cand, scale, window


def _assert_mu_close(got, want):
    """fp32, same shape; ``-inf`` exactly where the reference's is; close wherever the reference's log-mass is above
    :data:`UNDERFLOW`; below it (fp32's exp underflows) as low or ``-inf``."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not bool(got.isnan().any())
    neg = want == float("-inf")
    assert torch.equal(got == float("-inf"), neg | ((got == float("-inf")) & (want < UNDERFLOW)))
    high = want >= UNDERFLOW
    torch.testing.assert_close(got[high], want[high], atol=1e-4, rtol=1e-4)
    low = ~neg & ~high
    assert bool((got[low] < UNDERFLOW + 10).all())


def _rows_that_see_a_candidate(q, cand, seq_lens, page_size, num_kv_heads, window):
    """[B, Hkv] how many of the group's ``Tq·G`` query rows see some key of a valid candidate page (by hand)."""
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    B, Tq, Hq, _ = q4.shape
    G = Hq // num_kv_heads
    out = torch.zeros(B, num_kv_heads, dtype=torch.int64)
    for b in range(B):
        n_tok = int(seq_lens[b])
        n = -(-n_tok // page_size)
        for h in range(num_kv_heads):
            keys = {j * page_size + s for j in set(cand[b, h].tolist()) if 0 <= j < n for s in range(page_size)}
            keys = {t for t in keys if t < n_tok}
            for t in range(Tq):
                pos = n_tok - Tq + t
                first = pos - window if window >= 0 else 0
                out[b, h] += G * any(first <= k <= pos for k in keys)
    return out


@pytest.mark.parametrize("backend, examples", [("torch", 30), ("triton", 4),
                                               pytest.param("triton", 10, marks=pytest.mark.slow)])
def test_rerank_scores_match_the_reference(backend, examples):
    @settings(max_examples=examples, deadline=None)
    @given(rerank_problems())
    def check(problem):
        p, q, code, k_min, k_max, cand, scale, window = problem
        args = (q, code, p.k_cache, k_min, k_max, cand, p.block_table, p.seq_lens)
        want = R.rerank_scores(*args, scale=scale, window_left=window)
        # the reference's masses per (row, KV head) sum to the query rows that see a candidate key
        seen = _rows_that_see_a_candidate(q, cand, p.seq_lens, p.page_size, p.num_kv_heads, window)
        total = torch.logsumexp(want.double(), -1).exp()
        torch.testing.assert_close(total, seen.double(), atol=1e-5, rtol=1e-5)
        got = tinyattn.rerank_scores(*args, scale=scale, window_left=window, backend=backend)
        assert got.shape == (p.block_table.shape[0], p.num_kv_heads, p.block_table.shape[1])
        _assert_mu_close(got, want)

    check()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", [99, -1])
def test_an_empty_row_reads_nothing_of_its_table(backend, entry):
    """A row of ``seq_len`` 0 holds no page: its table entries are never read (an id past the pool, or the ``-1``
    that ``PagedKVCache.block_table`` writes for an empty sequence; the attention ops accept both) and its
    candidates are ``-1``; its scores are ``-inf`` and the other row's are the reference's."""
    g = torch.Generator().manual_seed(6)
    k = torch.randn(4, 4, 1, 8, generator=g)
    k_min, k_max = k.amin(1), k.amax(1)
    code = torch.randint(0, 256, (4, 4, 1, 4), generator=g, dtype=torch.uint8)
    q = torch.randn(2, 1, 8, generator=g)
    table = torch.tensor([[0, 1], [entry, -1]], dtype=torch.int32)
    lens = torch.tensor([6, 0], dtype=torch.int32)
    cand = torch.tensor([[[0, 1]], [[-1, -1]]], dtype=torch.int32)
    tinyattn.paged_attention(q, k, k, table, lens, backend=backend)          # a table the ops accept
    want = R.rerank_scores(q, code, k, k_min, k_max, cand, table, lens)
    got = tinyattn.rerank_scores(q, code, k, k_min, k_max, cand, table, lens, backend=backend)
    _assert_mu_close(got, want)
    assert bool((got[1] == float("-inf")).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_query_stays_in_its_row_and_masses_nothing(backend, bad):
    """NaN or ±inf in one query head: every (row, KV head) pair as the reference, that one included: a page whose
    mass is undefined (NaN) has none (``-inf``), one whose keys all give the infinite head ``-inf`` logits keeps
    the sound heads' mass (a fault hunt: torch gave NaN, the Triton kernel +inf for an infinite query, which would
    rank those pages first for the group's sound heads)."""
    p = make_problem(7, batch=3, seq_lens=[9, 14, 20], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    code = torch.randint(0, 256, (p.k_cache.shape[0], 4, 2, 4), generator=torch.Generator().manual_seed(7),
                         dtype=torch.uint8)
    q = p.q.clone()
    q[1, 0, 2, 3] = bad                                                           # row 1, KV head 1
    q[2, 0, 0, 1] = bad                                                           # row 2, KV head 0
    cand = torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32).expand(3, 2, 5).contiguous()
    args = (q, code, p.k_cache, k_min, k_max, cand, p.block_table, p.seq_lens)
    got = tinyattn.rerank_scores(*args, backend=backend)
    want = R.rerank_scores(*args)
    assert got.shape == (3, 2, p.block_table.shape[1]) and got.dtype == torch.float32
    _assert_mu_close(got, want)
    assert bool((want[1, 1] == float("-inf")).any())


# ============================================================================ exact keys: the true attention mass
def grid_problem(seed, *, seq_lens, page_size=4, num_kv_heads=2, group=2, head_dim=8, spread=1.0):
    """A problem whose keys lie on each page's 16-level grid: ``k = lo + c · step`` with ``step`` a multiple of 1/8,
    ``lo`` of 1/8 and every code 0 and 15 present in each channel of each page (so the box is the keys' own), some
    channels of zero width. Every value is exact in fp32, so the codes stand for the keys exactly. Returns
    ``(problem, k_min, k_max, k_code)`` with the codes of the reference encoder over every page."""
    p = make_problem(seed, batch=len(seq_lens), seq_lens=seq_lens, page_size=page_size, num_kv_heads=num_kv_heads,
                     group=group, head_dim=head_dim, in_order=True)
    g = torch.Generator().manual_seed(seed)
    num_pages, S, Hkv, D = p.k_cache.shape
    lo = torch.randint(-16, 16, (num_pages, Hkv, D), generator=g).float() / 8
    step = torch.randint(0, 3, (num_pages, Hkv, D), generator=g).float() / 8 * spread
    codes = torch.randint(0, 16, (num_pages, S, Hkv, D), generator=g)
    codes[:, 0], codes[:, 1 % S] = 0, 15
    keys = lo[:, None] + codes.float() * step[:, None]
    k_min, k_max = lo, lo + 15 * step
    assert torch.equal(keys.amin(1), k_min) and torch.equal(keys.amax(1), k_max)
    code = torch.zeros(num_pages, S, Hkv, D // 2, dtype=torch.uint8)
    R.encode_key_codes(keys, torch.arange(num_pages * S), k_min, k_max, code)
    assert torch.equal(_unpack(code), torch.where(step[:, None] > 0, codes, 0))     # the codes are the grid's
    p.k_cache.copy_(keys)
    return p, k_min, k_max, code


def true_log_mass(p, q, scale, window=-1):
    """fp64 ``[B, Hkv, max_pages]``: ``log Σ_g Σ_{t∈j} softmax_t(scale · q_g·k_t)`` over the keys each decode query
    sees, by a plain softmax over the row's contiguous keys (no tinyattn code); ``-inf`` where no key is seen."""
    B, Hq, _ = q.shape
    Hkv = p.num_kv_heads
    G = Hq // Hkv
    out = torch.full((B, Hkv, p.block_table.shape[1]), -math.inf, dtype=torch.float64)
    for b in range(B):
        n = int(p.seq_lens[b])
        if n == 0:
            continue
        keys, _ = contiguous_kv(p, b)                                              # [n, Hkv, D] fp64
        first = n - 1 - window if window >= 0 else 0
        pos = torch.arange(n)
        for h in range(Hkv):
            mass = torch.zeros(n, dtype=torch.float64)
            for gi in range(G):
                logits = scale * (keys[:, h] @ q[b, h * G + gi].double())
                logits[pos < first] = -math.inf
                mass += torch.softmax(logits, 0)
            for j in range(-(-n // p.page_size)):
                m = float(mass[j * p.page_size:(j + 1) * p.page_size].sum())
                out[b, h, j] = math.log(m) if m > 0 else -math.inf
    return out


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("window", [-1, 5])
def test_exact_keys_give_the_true_attention_mass(backend, window):
    p, k_min, k_max, code = grid_problem(8, seq_lens=[13, 21, 4])
    q = p.q[:, 0]
    B, max_pages = p.block_table.shape
    every = torch.arange(max_pages, dtype=torch.int32).expand(B, 2, max_pages).contiguous()
    args = (q, code, p.k_cache, k_min, k_max, every, p.block_table, p.seq_lens)
    if backend == "reference":
        got = R.rerank_scores(*args, scale=0.7, window_left=window)
    else:
        got = tinyattn.rerank_scores(*args, scale=0.7, window_left=window, backend=backend)
    want = true_log_mass(p, q, 0.7, window)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got.double()[want.isfinite()], want[want.isfinite()], atol=2e-5, rtol=2e-5)


def _separated(scores: torch.Tensor, seq_lens: torch.Tensor, page_size: int, gap: float) -> bool:
    """No two finite scores of a row's valid pages within ``gap + 1e-4 · |score|`` of each other (exact ties
    included): the forms' rounding (well under that) cannot reorder them."""
    for b in range(scores.shape[0]):
        n = -(-int(seq_lens[b]) // page_size)
        for h in range(scores.shape[1]):
            v = sorted(x for x in scores[b, h, :n].double().tolist() if math.isfinite(x))
            if any(y - x <= gap + 1e-4 * abs(x) for x, y in zip(v, v[1:])):
                return False
    return True


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_exact_keys_and_every_page_a_candidate_select_the_oracles_pages(backend):
    """The design's first check: with codes that stand for the keys exactly and every page a candidate, the fixed
    budget keeps the forced pages and then the pages of largest true attention mass (the brute-force rule of
    tests/paged_problems.py over the fp64 softmax above)."""
    p, k_min, k_max, code = grid_problem(9, seq_lens=[37, 29, 45], spread=2.0)
    q = p.q[:, 0] * 2
    true = true_log_mass(p, q, 0.5)
    assert _separated(true.float(), p.seq_lens, 4, 1e-3)
    for budget, sinks in ((4, 0), (6, 1)):             # candidates: every page of the longest row (12)
        oracle = brute_force_select(true.float(), p.seq_lens, page_size=4, page_budget=budget, num_sink_pages=sinks)
        plan = tinyattn.PagedAttentionPlan(backend=backend)
        plan.plan(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
                  page_budget=budget, num_sink_pages=sinks, scale=0.5, rerank="int4", candidates=12 / budget)
        out = plan.run(q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, k_code=code)
        assert _as_sets(plan.last_selection, p.seq_lens, 4) == _as_sets(oracle, p.seq_lens, 4)
        want = R.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, page_indices=oracle,
                                        scale=0.5)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


# ============================================================================ the re-ranked selection
def reference_pipeline(q, k_cache, code, k_min, k_max, table, lens, *, page_size, page_budget, candidates=1.0,
                       top_p=None, gamma=1.0, num_sink_pages=0, num_recent_pages=1, scale=None, window_left=-1):
    """``(scores, mu, pages)`` of the rule, by the reference ops: the estimate (masked before the window), its
    ``ceil(candidates · page_budget)`` best pages, their log-mass from the codes, the selection over it."""
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    Tq = q4.shape[1]
    scale = q4.shape[-1] ** -0.5 if scale is None else scale
    rules = dict(page_size=page_size, num_sink_pages=num_sink_pages, num_recent_pages=num_recent_pages,
                 num_query_tokens=Tq)
    scores = R.page_scores(q, k_min, k_max, table, lens, page_size=page_size, gamma=gamma)
    selection_reference.mask_pages_before_window(scores, lens, page_size=page_size, num_query_tokens=Tq,
                                                 window_left=window_left)
    cand = R.select_pages(scores, lens, page_budget=math.ceil(candidates * page_budget), **rules)
    mu = R.rerank_scores(q, code, k_cache, k_min, k_max, cand, table, lens, scale=scale, window_left=window_left)
    pages = R.select_pages(mu, lens, page_budget=page_budget, top_p=top_p, scale=1.0 if top_p else None, **rules)
    return scores, mu, pages


def _well_conditioned(q, p, code, k_min, k_max, opts) -> bool:
    """The reference pipeline's choices survive fp32 rounding: estimates and log-masses without near-ties, and
    top-p's pages the same at ``top_p ± 1e-3``."""
    scores, mu, _ = reference_pipeline(q, p.k_cache, code, k_min, k_max, p.block_table, p.seq_lens,
                                       page_size=p.page_size, **opts)
    if not (_separated(scores, p.seq_lens, p.page_size, 1e-3) and _separated(mu, p.seq_lens, p.page_size, 5e-4)):
        return False
    top_p = opts.get("top_p")
    if top_p is None or top_p >= 1.0:
        return True
    rules = dict(page_size=p.page_size, page_budget=opts["page_budget"], num_sink_pages=opts.get("num_sink_pages", 0),
                 num_recent_pages=opts.get("num_recent_pages", 1), num_query_tokens=p.q.shape[1], scale=1.0)
    low = R.select_pages(mu, p.seq_lens, top_p=top_p - 1e-3, **rules)
    high = R.select_pages(mu, p.seq_lens, top_p=min(top_p + 1e-3, 1.0), **rules)
    return _as_sets(low, p.seq_lens, p.page_size) == _as_sets(high, p.seq_lens, p.page_size)


def _encoded(p, k_min, k_max):
    code = torch.zeros(*p.k_cache.shape[:3], p.k_cache.shape[3] // 2, dtype=torch.uint8)
    R.encode_key_codes(p.k_cache, torch.arange(p.k_cache.shape[0] * p.page_size), k_min, k_max, code)
    return code


def _pipeline_problem(seed, *, Tq=1, group=2, seq_lens=(37, 22, 53)):
    p = make_problem(seed, batch=len(seq_lens), seq_lens=list(seq_lens), page_size=4, num_kv_heads=2, group=group,
                     head_dim=8, num_query_tokens=Tq, logit_scale=2.0)
    k_min, k_max = p.bounds()
    return p, k_min, k_max, _encoded(p, k_min, k_max)


def _check_against_pipeline(backend, p, k_min, k_max, code, opts, discriminating=True):
    """``sparse_paged_attention(rerank="int4")`` and the plan's run and ``last_selection``: the reference
    pipeline's pages, and attention over exactly them. ``discriminating``: check that the re-rank changes some
    row's pages from the estimate's own selection (else the test could not tell the two apart)."""
    assert _well_conditioned(p.q, p, code, k_min, k_max, opts), "near-ties in this problem: pick another seed"
    scores, _, pages = reference_pipeline(p.q, p.k_cache, code, k_min, k_max, p.block_table, p.seq_lens,
                                          page_size=p.page_size, **opts)
    if discriminating:
        plain = R.select_pages(scores, p.seq_lens, page_size=p.page_size, page_budget=opts["page_budget"],
                               num_sink_pages=opts.get("num_sink_pages", 0),
                               num_recent_pages=opts.get("num_recent_pages", 1), num_query_tokens=p.q.shape[1])
        assert _as_sets(plain, p.seq_lens, p.page_size) != _as_sets(pages, p.seq_lens, p.page_size)
    attend = dict(scale=opts.get("scale"), window_left=opts.get("window_left", -1))
    want = R.sparse_paged_attention(*p.args, page_indices=pages, **attend)
    sel = {k: v for k, v in opts.items() if k not in ("scale", "window_left")}
    got = tinyattn.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, rerank="int4", k_code=code,
                                          backend=backend, **sel, **attend)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    _, Tq, Hq, D = p.q.shape
    plan = tinyattn.PagedAttentionPlan(backend=backend)
    plan.plan(p.block_table, p.seq_lens, num_q_heads=Hq, num_kv_heads=p.num_kv_heads, head_dim=D,
              page_size=p.page_size, num_query_tokens=Tq, scale=opts.get("scale"), rerank="int4", **sel)
    out = plan.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, k_code=code,
                   window_left=attend["window_left"])
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    if plan.selects:
        assert _as_sets(plan.last_selection, p.seq_lens, p.page_size) == _as_sets(pages, p.seq_lens, p.page_size)


@pytest.mark.parametrize("backend", SLOW_TRITON)
@pytest.mark.parametrize("top_p", [None, 0.5, 0.9, 1.0])
def test_sparse_attention_with_rerank_attends_the_reference_pipelines_pages(backend, top_p):
    p, k_min, k_max, code = _pipeline_problem(10)
    _check_against_pipeline(backend, p, k_min, k_max, code,
                            dict(page_budget=4, candidates=2.0, top_p=top_p, gamma=0.25, num_sink_pages=1))


@pytest.mark.parametrize("backend", SLOW_TRITON)
@pytest.mark.parametrize("case", ["gqa4-prefill", "window", "candidates-1", "more-candidates-than-columns"])
def test_the_pipeline_with_gqa_prefill_chunks_and_windows(backend, case):
    if case == "gqa4-prefill":
        p, k_min, k_max, code = _pipeline_problem(12, Tq=3, group=4, seq_lens=(37, 22, 53))
        opts = dict(page_budget=5, candidates=1.5, top_p=0.8, num_recent_pages=2, scale=0.5)
    elif case == "window":
        p, k_min, k_max, code = _pipeline_problem(12, Tq=2, seq_lens=(45, 30, 61))
        opts = dict(page_budget=4, candidates=3.0, window_left=21, gamma=0.0)
    elif case == "candidates-1":
        p, k_min, k_max, code = _pipeline_problem(13, seq_lens=(41, 6, 33))
        opts = dict(page_budget=3, candidates=1.0, top_p=0.7)
    else:                                       # C = 18 candidates of a 15-column table
        p, k_min, k_max, code = _pipeline_problem(10)
        opts = dict(page_budget=6, candidates=3.0, top_p=0.95)
        assert math.ceil(3.0 * 6) > p.block_table.shape[1]
    _check_against_pipeline(backend, p, k_min, k_max, code, opts)


def test_the_pipeline_on_random_problems():
    """The torch plan on drawn problems (the Triton plan's launches run the kernels the fixed cases above and the
    property tests of the mass check; in the interpreter one drawn problem costs ~10 s)."""
    backend = "torch"

    @settings(max_examples=20, deadline=None)
    @given(st.integers(0, 2**31 - 1), st.integers(1, 2), st.sampled_from([1, 2, 4]), st.integers(2, 6),
           st.sampled_from([1.0, 1.5, 2.0]), st.sampled_from([None, 0.5, 0.9, 1.0]), st.sampled_from([0.0, 0.25, 1.0]),
           st.sampled_from([-1, 9]))
    def check(seed, Tq, group, budget, candidates, top_p, gamma, window):
        g = torch.Generator().manual_seed(seed)
        lens = [int(torch.randint(Tq, 60, (1,), generator=g)) for _ in range(3)]
        p, k_min, k_max, code = _pipeline_problem(seed, Tq=Tq, group=group, seq_lens=lens)
        opts = dict(page_budget=max(budget, 2), candidates=candidates, top_p=top_p, gamma=gamma, window_left=window)
        assume(_well_conditioned(p.q, p, code, k_min, k_max, opts))
        _check_against_pipeline(backend, p, k_min, k_max, code, opts, discriminating=False)

    check()


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_top_p_one_keeps_the_fixed_budgets_pages(backend):
    p, k_min, k_max, code = _pipeline_problem(14)
    opts = dict(page_budget=4, candidates=2.0, gamma=0.25)
    ref = [reference_pipeline(p.q, p.k_cache, code, k_min, k_max, p.block_table, p.seq_lens, page_size=4,
                              top_p=top_p, **opts)[2] for top_p in (None, 1.0)]
    assert torch.equal(ref[0], ref[1])
    selections, outs = [], []
    for top_p in (None, 1.0):
        plan = tinyattn.PagedAttentionPlan(backend=backend)
        plan.plan(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, top_p=top_p,
                  rerank="int4", **opts)
        outs.append(plan.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, k_code=code))
        selections.append(_as_sets(plan.last_selection, p.seq_lens, 4))
    assert selections[0] == selections[1] == _as_sets(ref[0], p.seq_lens, 4)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_p", [None, 1.0])
def test_every_page_a_candidate_and_a_covering_budget_is_dense_attention(backend, top_p):
    p, k_min, k_max, code = _pipeline_problem(15, Tq=2)
    budget = p.block_table.shape[1]
    got = tinyattn.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, page_budget=budget, candidates=3.0,
                                          rerank="int4", k_code=code, top_p=top_p, backend=backend)
    want = tinyattn.paged_attention(*p.args, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, R.paged_attention(*p.args), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_the_pipeline_with_an_empty_row(backend):
    """A batch with a row of ``seq_len`` 0 (its table entries garbage, as make_problem writes them)."""
    p, k_min, k_max, code = _pipeline_problem(16, seq_lens=(37, 0, 53))
    _check_against_pipeline(backend, p, k_min, k_max, code, dict(page_budget=4, candidates=2.0, top_p=0.9))


@pytest.mark.parametrize("backend", SLOW_TRITON)
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_int8_and_fp8_pools_rerank_their_dequantized_keys(backend, fmt):
    """A quantized pool: boxes and codes of the dequantized keys, the last page read exactly through ``k_scale``;
    the mass equals the reference's and the attention attends the reference pipeline's pages."""
    p, _, _, _ = _pipeline_problem(19)
    kq, vq, ks, vs = quantize_problem(p, fmt)
    num_pages, S, Hkv, D = kq.shape
    k_min, k_max = torch.zeros(num_pages, Hkv, D), torch.zeros(num_pages, Hkv, D)
    R.update_page_metadata(kq, p.block_table, p.seq_lens, k_min, k_max, k_scale=ks)
    code = torch.zeros(num_pages, S, Hkv, D // 2, dtype=torch.uint8)
    R.encode_key_codes(kq, torch.arange(num_pages * S), k_min, k_max, code, k_scale=ks)
    every = torch.arange(p.block_table.shape[1], dtype=torch.int32).expand(3, 2, -1).contiguous()
    args = (p.q, code, kq, k_min, k_max, every, p.block_table, p.seq_lens)
    _assert_mu_close(tinyattn.rerank_scores(*args, k_scale=ks, backend=backend), R.rerank_scores(*args, k_scale=ks))
    # the pipeline, by the reference ops on the quantized pool
    opts = dict(page_size=4, num_sink_pages=0, num_recent_pages=1, num_query_tokens=1)
    scores = R.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=4)
    cand = R.select_pages(scores, p.seq_lens, page_budget=8, **opts)
    mu = R.rerank_scores(p.q, code, kq, k_min, k_max, cand, p.block_table, p.seq_lens, k_scale=ks)
    assert _separated(scores, p.seq_lens, 4, 1e-3) and _separated(mu, p.seq_lens, 4, 5e-4)
    pages = R.select_pages(mu, p.seq_lens, page_budget=4, **opts)
    quant = (p.q, kq, vq, p.block_table, p.seq_lens)
    want = R.sparse_paged_attention(*quant, page_indices=pages, k_scale=ks, v_scale=vs)
    got = tinyattn.sparse_paged_attention(*quant, k_min=k_min, k_max=k_max, page_budget=4, candidates=2, rerank="int4",
                                          k_code=code, k_scale=ks, v_scale=vs, backend=backend)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_one_plan_serves_every_layer_with_its_own_codes(backend):
    """A plan is made once per step and run by each layer with that layer's pool, boxes and codes: every run
    selects by its own codes (the plan keeps no layer's candidates or masses)."""
    p0, k_min, k_max, code = _pipeline_problem(20)
    g = torch.Generator().manual_seed(21)
    layers = [(p0, k_min, k_max, code)]
    # a second layer: other keys, values and queries in the same slots (the same poison elsewhere)
    k1 = torch.where(p0.k_cache.isnan(), p0.k_cache, torch.randn(p0.k_cache.shape, generator=g) * 2)
    v1 = torch.where(p0.v_cache.isnan(), p0.v_cache, torch.randn(p0.v_cache.shape, generator=g))
    p1 = Problem(torch.randn(p0.q.shape, generator=g), k1, v1, p0.block_table, p0.seq_lens, 4)
    k_min1, k_max1 = p1.bounds()
    layers.append((p1, k_min1, k_max1, _encoded(p1, k_min1, k_max1)))
    opts = dict(page_budget=4, candidates=2.0, top_p=0.8)
    plan = tinyattn.PagedAttentionPlan(backend=backend)
    plan.plan(p0.block_table, p0.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, rerank="int4",
              **opts)
    for _ in range(2):
        chosen = []
        for p, k_min, k_max, code in layers:
            assert _well_conditioned(p.q, p, code, k_min, k_max, opts)
            _, _, pages = reference_pipeline(p.q, p.k_cache, code, k_min, k_max, p.block_table, p.seq_lens,
                                             page_size=4, **opts)
            out = plan.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, k_code=code)
            chosen.append(_as_sets(plan.last_selection, p.seq_lens, 4))
            assert chosen[-1] == _as_sets(pages, p.seq_lens, 4)
            torch.testing.assert_close(out, R.sparse_paged_attention(*p.args, page_indices=pages), atol=2e-5,
                                       rtol=1e-4)
        assert chosen[0] != chosen[1]                   # the layers' own codes pick other pages


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_calls_on_the_same_tables_never_reuse_another_settings_plan(backend):
    """``sparse_paged_attention`` keeps the plan of the last call's tables: switching ``rerank`` and
    ``candidates`` between calls on the same tables still gives each call its own rule."""
    p, k_min, k_max, code = _pipeline_problem(23)
    plain = dict(page_budget=4, gamma=0.25)
    for rerank, candidates in ((None, 1.0), ("int4", 1.0), ("int4", 3.0), (None, 1.0), ("int4", 1.0)):
        if rerank is None:
            want = R.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, **plain)
            got = tinyattn.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, backend=backend, **plain)
        else:
            opts = dict(plain, candidates=candidates)
            assert _well_conditioned(p.q, p, code, k_min, k_max, opts)
            _, _, pages = reference_pipeline(p.q, p.k_cache, code, k_min, k_max, p.block_table, p.seq_lens,
                                             page_size=4, **opts)
            want = R.sparse_paged_attention(*p.args, page_indices=pages)
            got = tinyattn.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, rerank="int4", k_code=code,
                                                  backend=backend, **opts)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp64_inputs_run_the_rule_too(backend):
    """fp64 queries and pools (the Triton backend hands them to the torch plan): the reference pipeline's pages."""
    p, k_min, k_max, code = _pipeline_problem(24)
    p.q, p.k_cache, p.v_cache = p.q.double(), p.k_cache.double(), p.v_cache.double()
    k_min, k_max = k_min.double(), k_max.double()
    _check_against_pipeline(backend, p, k_min, k_max, code, dict(page_budget=4, candidates=2.0, top_p=0.9))


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_more_query_rows_than_one_block(backend):
    """A prefill chunk of 20 tokens with groups of 4: 80 query rows per KV head (the Triton kernel walks them in
    blocks of at most 64, summing the masses across blocks)."""
    p = make_problem(25, batch=2, seq_lens=[27, 41], page_size=4, num_kv_heads=2, group=4, head_dim=16,
                     num_query_tokens=20)
    k_min, k_max = p.bounds()
    code = _encoded(p, k_min, k_max)
    cand = torch.tensor([[[0, 3, 6, 2, -1], [5, 1, 4, 6, 0]]], dtype=torch.int32).expand(2, 2, 5).contiguous()
    args = (p.q, code, p.k_cache, k_min, k_max, cand, p.block_table, p.seq_lens)
    for window in (-1, 11):
        want = R.rerank_scores(*args, window_left=window)
        got = tinyattn.rerank_scores(*args, window_left=window, backend=backend)
        _assert_mu_close(got, want)


@pytest.mark.slow
def test_graph_mode_with_rerank_allocates_nothing_and_never_syncs(monkeypatch):
    """The graph-mode contract (tests/ops/test_plan.py, tests/ops/test_top_p.py) with the re-rank and top-p on the
    Triton plan: after one warm-up step, plan() + run() with new tables allocate no tensor, read no value on the
    host, keep every buffer's storage, and attend the reference pipeline's pages."""
    from host_calls import check_graph_step, graph_mode_pool, graph_mode_step, watch_host_calls

    cap_b, cap_p, S, budget = 2, 24, 4, 5
    plans = tinyattn.PagedAttentionPlan(backend="triton")
    g = torch.Generator().manual_seed(0)
    k, v, k_min, k_max, code = graph_mode_pool(g, page_size=S, key_scale=2, codes=True)
    out = torch.empty(cap_b, 4, 16)
    ptrs = None
    for step in range(4):
        table, lens, q = graph_mode_step(g, step, batch=cap_b, page_size=S)
        seen = []
        if step > 0:
            watch_host_calls(monkeypatch, seen)
        plans.plan(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=S, page_budget=budget,
                   trusted=True, max_batch=cap_b, max_pages_per_seq=cap_p, gamma=0.25, top_p=0.8, rerank="int4",
                   candidates=2.0)
        got = plans.run(q, k, v, k_min=k_min, k_max=k_max, k_code=code, out=out)
        monkeypatch.undo()
        ptrs = check_graph_step(step, seen, got, out, plans, ptrs)
        assert {"candidates", "mass", "kept"} <= set(ptrs)
        _, mu, pages = reference_pipeline(q, k, code, k_min, k_max, table, lens, page_size=S, page_budget=budget,
                                          candidates=2.0, gamma=0.25, top_p=0.8)
        assert _separated(mu, lens, S, 5e-4)
        want = R.sparse_paged_attention(q, k, v, table, lens, page_indices=pages)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


# ============================================================================ errors
def _small():
    p = make_problem(17, batch=2, seq_lens=[9, 17], page_size=4, num_kv_heads=2, group=2, head_dim=8)
    k_min, k_max = p.bounds()
    return p, k_min, k_max, _encoded(p, k_min, k_max)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_and_huge_candidates_count_as_the_reference_does(backend):
    """A page listed twice counts once and an int64 id past the row (2^40: beyond int32) is ignored, as in the
    reference; the forms assume distinct in-range ids, so the op puts the list in canonical form first (a fault
    hunt: torch and Triton counted a duplicate twice, Triton read 2^40 as page 0)."""
    p, k_min, k_max, code = _small()
    clean = torch.tensor([[[0, 2, -1, -1], [1, -1, -1, -1]], [[0, 3, 4, -1], [2, 4, -1, -1]]], dtype=torch.int64)
    messy = torch.tensor([[[0, 0, 2, 2**40], [1, 1, 1, -1]], [[4, 0, 3, 4], [2**40, 2, 4, 2]]], dtype=torch.int64)
    args = (p.block_table, p.seq_lens)
    want = R.rerank_scores(p.q, code, p.k_cache, k_min, k_max, clean, *args)
    assert torch.equal(R.rerank_scores(p.q, code, p.k_cache, k_min, k_max, messy, *args), want)
    got = tinyattn.rerank_scores(p.q, code, p.k_cache, k_min, k_max, messy, *args, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_candidates_than_pages_are_every_page(backend):
    """``candidates`` beyond the table's width (1e6, the largest float) hands every page to the re-rank, as a
    covering multiple does: the same output, no kernel block or workspace sized by the huge count (a fault hunt:
    the Triton backend asked for a 4M-element block, and 1.79e308 overflowed ``ceil``)."""
    p, k_min, k_max, code = _small()                                   # 5 pages per row at most
    args = dict(k_min=k_min, k_max=k_max, page_budget=2, rerank="int4", k_code=code, backend=backend)
    want = tinyattn.sparse_paged_attention(*p.args, candidates=2.5, **args)
    for huge in (3.0, 1e6, 1.79e308):
        torch.testing.assert_close(tinyattn.sparse_paged_attention(*p.args, candidates=huge, **args), want,
                                   atol=0, rtol=0)
        plan = tinyattn.PagedAttentionPlan(backend=backend).plan(
            p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, page_budget=2,
            rerank="int4", candidates=huge)
        torch.testing.assert_close(plan.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, k_code=code), want,
                                   atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw, error, name", [
    (dict(rerank="int8"), ValueError, "rerank"),
    (dict(rerank=True), ValueError, "rerank"),
    (dict(candidates=0.5), ValueError, "candidates"),
    (dict(candidates=float("nan")), ValueError, "candidates"),
    (dict(candidates=float("inf")), ValueError, "candidates"),
    (dict(candidates="2"), TypeError, "candidates"),
    (dict(candidates=True), TypeError, "candidates"),
    (dict(candidates=None), TypeError, "candidates"),
    (dict(rerank=None, k_code=None, candidates=2.0), ValueError, "candidates: expected 1.0 without rerank"),
    (dict(k_code=None), ValueError, r"k_code: .*key_codes=True.*got None"),
    (dict(k_code="wrong shape"), ValueError, "k_code"),
    (dict(k_code="wrong dtype"), TypeError, "k_code"),
])
def test_bad_rerank_arguments_are_named(backend, kw, error, name):
    p, k_min, k_max, code = _small()
    args = dict(k_min=k_min, k_max=k_max, page_budget=2, rerank="int4", k_code=code, backend=backend)
    if kw.get("k_code") == "wrong shape":
        kw = dict(k_code=code[:, :, :, :3].contiguous())
    elif kw.get("k_code") == "wrong dtype":
        kw = dict(k_code=code.to(torch.int8))
    args.update(kw)
    with pytest.raises(error, match=name):
        tinyattn.sparse_paged_attention(*p.args, **args)
    plan_kw = {k: v for k, v in kw.items() if k in ("rerank", "candidates")}
    if plan_kw:
        with pytest.raises(error, match=name):
            tinyattn.PagedAttentionPlan(backend=backend).plan(
                p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, page_budget=2,
                **{"rerank": "int4", **plan_kw})


@pytest.mark.parametrize("backend", BACKENDS)
def test_rerank_errors_of_the_selection_setup(backend):
    p, k_min, k_max, code = _small()
    with pytest.raises(ValueError, match="rerank"):               # listed pages: nothing to re-rank
        tinyattn.sparse_paged_attention(*p.args, page_indices=torch.zeros(2, 2, 1, dtype=torch.int32),
                                        rerank="int4", k_code=code, backend=backend)
    with pytest.raises(ValueError, match="k_code"):               # codes nothing reads
        tinyattn.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, page_budget=2, k_code=code,
                                        backend=backend)
    with pytest.raises(ValueError, match="k_code"):
        tinyattn.sparse_paged_attention(*p.args, page_indices=torch.zeros(2, 2, 1, dtype=torch.int32), k_code=code,
                                        backend=backend)
    with pytest.raises(ValueError, match="rerank"):               # a plan without a budget selects nothing
        tinyattn.PagedAttentionPlan(backend=backend).plan(p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2,
                                                          head_dim=8, page_size=4, rerank="int4")
    plan = tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, page_budget=2,
        rerank="int4")
    with pytest.raises((TypeError, ValueError), match="k_code"):
        plan.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max)
    with pytest.raises(ValueError, match="k_code"):
        plan.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, k_code=code[:-1])
    plain = tinyattn.PagedAttentionPlan(backend=backend).plan(
        p.block_table, p.seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, page_budget=2)
    with pytest.raises(ValueError, match="k_code"):
        plain.run(p.q, p.k_cache, p.v_cache, k_min=k_min, k_max=k_max, k_code=code)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_odd_head_dim_is_an_error_naming_it(backend):
    p = make_problem(18, batch=1, seq_lens=[9], page_size=4, num_kv_heads=1, group=1, head_dim=7)
    k_min, k_max = p.bounds()
    code = torch.zeros(p.k_cache.shape[0], 4, 1, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="head_dim"):
        tinyattn.sparse_paged_attention(*p.args, k_min=k_min, k_max=k_max, page_budget=2, rerank="int4", k_code=code,
                                        backend=backend)
    with pytest.raises(ValueError, match="head_dim"):
        tinyattn.encode_key_codes(p.k_cache, torch.tensor([3]), k_min, k_max, code, backend=backend)
    cand = torch.zeros(1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim"):
        tinyattn.rerank_scores(p.q, code, p.k_cache, k_min, k_max, cand, p.block_table, p.seq_lens, backend=backend)
    with pytest.raises(ValueError, match="rerank: expected an even head_dim .* got head_dim=7"):   # at plan, not run
        tinyattn.PagedAttentionPlan(backend=backend).plan(p.block_table, p.seq_lens, num_q_heads=1, num_kv_heads=1,
                                                          head_dim=7, page_size=4, page_budget=2, rerank="int4")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_operands_of_the_two_ops_are_named(backend):
    p, k_min, k_max, code = _small()
    cand = torch.zeros(2, 2, 3, dtype=torch.int32)
    base = (p.q, code, p.k_cache, k_min, k_max, cand, p.block_table, p.seq_lens)
    for i, bad, name in [(5, cand[:, :1], "candidates"), (5, cand.float(), "candidates"), (5, cand[0], "candidates"),
                         (1, code.to(torch.int16), "k_code"), (1, code[:, :2], "k_code")]:
        args = list(base)
        args[i] = bad
        with pytest.raises((TypeError, ValueError), match=name):
            tinyattn.rerank_scores(*args, backend=backend)
    slots = torch.tensor([3, 7])
    for kw, name in [(dict(slots=slots.float()), "slots"), (dict(slots=slots[None]), "slots"),
                     (dict(k_code=code[:, :, :, :3]), "k_code"), (dict(k_code=code.to(torch.int8)), "k_code"),
                     (dict(k_min=k_min[:, :1]), "k_min")]:
        args = dict(k_cache=p.k_cache, slots=slots, k_min=k_min, k_max=k_max, k_code=code.clone())
        args.update(kw)
        with pytest.raises((TypeError, ValueError), match=name):
            tinyattn.encode_key_codes(backend=backend, **args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rerank_scores_checks_its_pool_against_the_boxes_and_its_scales(backend):
    """The pool ``rerank_scores`` reads each row's last page from: a pool smaller than the boxes (the Triton kernel
    read it out of bounds, the torch form raised an IndexError), of another ``head_dim`` (Triton read past each key,
    torch raised an einsum error), an int8 pool without its ``k_scale`` (its codes were read as values, silently), a
    ``k_scale`` with a float pool (silently applied) or of the wrong shape (an AssertionError), and no pool at all
    (an error about ``page_size``) are errors naming the argument."""
    p, k_min, k_max, code = _small()
    cand = torch.zeros(2, 2, 1, dtype=torch.int32)
    num_pages, _, Hkv, _ = p.k_cache.shape
    scale = torch.ones(num_pages, Hkv)
    cases = [(dict(k_cache=p.k_cache[:3], k_code=code[:3]), ValueError, "k_cache"),
             (dict(k_cache=p.k_cache[..., :4], k_code=code), ValueError, "k_cache"),
             (dict(k_cache=None), TypeError, "k_cache"),
             (dict(k_cache=p.k_cache[0]), ValueError, "k_cache"),
             (dict(k_cache=p.k_cache.to(torch.int8)), ValueError, "k_scale"),
             (dict(k_cache=p.k_cache.to(torch.int8), k_scale=scale[:, :1]), ValueError, "k_scale"),
             (dict(k_cache=p.k_cache.to(torch.int8), k_scale=scale.double()), TypeError, "k_scale"),
             (dict(k_scale=scale), ValueError, "k_scale")]
    for kw, error, name in cases:
        args = dict(k_code=code, k_cache=p.k_cache, k_scale=None)
        args.update(kw)
        with pytest.raises(error, match=name):
            tinyattn.rerank_scores(p.q, args["k_code"], args["k_cache"], k_min, k_max, cand, p.block_table,
                                   p.seq_lens, k_scale=args["k_scale"], backend=backend)
    # the valid quantized call still runs, and equals the reference on the same pool and scales
    k_codes, _, k_scale, _ = quantize_problem(p, "int8", poison_scales=False)
    got = tinyattn.rerank_scores(p.q, code, k_codes, k_min, k_max, cand, p.block_table, p.seq_lens, k_scale=k_scale,
                                 backend=backend)
    want = R.rerank_scores(p.q, code, k_codes, k_min, k_max, cand, p.block_table, p.seq_lens, k_scale=k_scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_key_codes_checks_the_slot_range(backend):
    """A slot past the pool (or negative) whose offset is the page's last: the Triton kernel coded a page past the
    pool (out of bounds on a GPU; silently nothing under the interpreter), the torch form raised a bare IndexError.
    Now a ValueError naming ``slots``, before anything is written; ``value_checks(False)`` skips the check."""
    p, k_min, k_max, code = _small()
    capacity = p.k_cache.shape[0] * p.k_cache.shape[1]
    for bad in ([capacity + 3], [-1], [3, capacity * 100 + 3]):
        before = code.clone()
        with pytest.raises(ValueError, match="slots"):
            tinyattn.encode_key_codes(p.k_cache, torch.tensor(bad), k_min, k_max, code, backend=backend)
        assert torch.equal(code, before)
    tinyattn.encode_key_codes(p.k_cache, torch.tensor([capacity - 1]), k_min, k_max, code, backend=backend)   # in range
