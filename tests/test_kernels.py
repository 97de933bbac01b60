"""The Triton kernels (``tinyattn.kernels``) in the interpreter against the PyTorch reference.

Property tests (hypothesis) over ragged batches, page sizes 1..32, odd head dims, GQA/MQA, Tq > 1,
shuffled and poisoned page pools (CASES.md kinds 1-7), non-contiguous q / out / caches, split-K,
and a pool whose used pages sit past 2**31 elements (64-bit offsets).

Tolerance (STYLE.md, flash-attention's rule): the kernel's max error against the fp32 reference is at
most 2x that of the same attention computed by PyTorch in the input dtype, plus a small floor.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (tests/conftest.py sets it too)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tinyattn.ops.attention import triton_impl as attention_triton  # noqa: E402
from tinyattn.ops.kv_cache import triton_impl as kv_cache_triton  # noqa: E402
from tinyattn.ops.selection import triton_impl as selection_triton  # noqa: E402
from tinyattn.kernels.attention import choose_num_splits  # noqa: E402
from tinyattn.ops import reference  # noqa: E402
from paged_problems import make_problem  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ATOL_FLOOR = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
PAGE_SIZES = (1, 2, 4, 8, 16, 32)
HEAD_DIMS = (8, 16, 24, 40, 64, 80, 128)
FAST = settings(max_examples=20, deadline=None)


# ----------------------------------------------------------------------------------------------------------------
# problem generation
# ----------------------------------------------------------------------------------------------------------------
@st.composite
def attn_problems(draw, dtypes=("fp32", "fp16"), max_pages_per_row=5):
    page_size = draw(st.sampled_from(PAGE_SIZES))
    batch = draw(st.integers(2, 3))
    boundary = st.sampled_from([0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size])
    anywhere = st.integers(0, max_pages_per_row * page_size)
    lens = [max(0, draw(st.one_of(boundary, anywhere))) for _ in range(batch)]
    assume(len(set(lens)) > 1)  # B >= 2 with different lengths (CASES.md 5)
    p = make_problem(
        draw(st.integers(0, 2**31 - 1)), batch=batch, seq_lens=lens, page_size=page_size,
        num_kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 3, 4])),
        head_dim=draw(st.sampled_from(HEAD_DIMS)), num_query_tokens=draw(st.integers(1, 2 * page_size)),
        dtype=DTYPES[draw(st.sampled_from(dtypes))], poison=draw(st.sampled_from([math.nan, 1e30, -1e30])),
        spare_columns=draw(st.integers(0, 2)))
    return p, draw(st.sampled_from(["contiguous", "transposed", "strided"]))


def relayout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Same values as ``x`` [B, T, H, D], in a non-contiguous layout (transposed view or stride(-1) == 2)."""
    if layout == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":
        return torch.stack([x, torch.full_like(x, math.nan)], -1)[..., 0]
    return x


def empty_out(q: torch.Tensor, layout: str):
    """NaN-filled ``out`` like q (in ``layout``) and ``lse`` (transposed view), so unwritten entries show."""
    out = relayout(torch.full(q.shape, math.nan, dtype=q.dtype), layout)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan).transpose(1, 2)
    return out, lse


def interleave_kv(k: torch.Tensor, v: torch.Tensor):
    """K and V as views of one ``[P, 2, S, H, D]`` pool (page stride 2x the page size)."""
    kv = torch.stack([k, v], 1)
    return kv[:, 0], kv[:, 1]


def n_pages(seq_len: int, page_size: int) -> int:
    return -(-int(seq_len) // page_size)


def random_selection(p, budget: int, seed: int) -> torch.Tensor:
    """Canonical page_indices [B, Hkv, budget]: a random subset of each row's valid pages, ascending, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv = p.q.shape[0], p.num_kv_heads
    idx = torch.full((B, Hkv, budget), -1, dtype=torch.int32)
    for b in range(B):
        n = n_pages(p.seq_lens[b], p.page_size)
        for h in range(Hkv):
            keep = int(torch.randint(0, min(n, budget) + 1, (1,), generator=g))
            pages = torch.randperm(n, generator=g)[:keep].sort().values
            idx[b, h, :keep] = pages.to(torch.int32)
    return idx


# ----------------------------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------------------------
def lowp_attention(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale):
    """Attention done by PyTorch in the input dtype (logits, softmax and P @ V rounded): torch's own error."""
    B, Tq, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros_like(q)
    for b in range(B):
        n_tok = int(seq_lens[b])
        for h in range(Hkv):
            if page_indices is None:
                pages = range(n_pages(n_tok, S))
            else:
                pages = [int(j) for j in page_indices[b, h] if 0 <= int(j) < n_pages(n_tok, S)]
            if not pages:
                continue
            phys = block_table[b, list(pages)].long()
            pos = (torch.tensor(list(pages))[:, None] * S + torch.arange(S)).reshape(-1)
            keep = pos < n_tok
            k = k_cache[phys, :, h].reshape(-1, D)[keep]
            v = v_cache[phys, :, h].reshape(-1, D)[keep]
            qg = q[b, :, h * G:(h + 1) * G]  # [Tq, G, D]
            logits = (qg @ k.T) * scale  # [Tq, G, N] in q.dtype
            q_pos = n_tok - Tq + torch.arange(Tq)
            mask = pos[keep][None, None, :] <= q_pos[:, None, None]
            probs = torch.softmax(logits.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0)
            out[b, :, h * G:(h + 1) * G] = probs @ v
    return out


def ref_attention(p, q, k, v, page_indices, scale):
    """fp32 reference output and lse (the reference upcasts; we hand it fp32 copies to keep out in fp32)."""
    args = (q.float(), k.float(), v.float(), p.block_table, p.seq_lens)
    if page_indices is None:
        return reference.paged_attention(*args, scale=scale, return_lse=True)
    return reference.sparse_paged_attention(*args, page_indices=page_indices, scale=scale, return_lse=True)


def run_attention(p, q, k, v, page_indices, scale, layout="contiguous", num_splits=None):
    out, lse = empty_out(q, layout)
    attention_triton.paged_attention(q, k, v, p.block_table, p.seq_lens, page_indices=page_indices, scale=scale, out=out,
                      lse=lse, num_splits=num_splits)
    return out, lse


def check_attention(p, out, lse, page_indices, scale, q, k, v):
    """NaN check, empty rows, then error vs the fp32 reference bounded by 2x torch's low-precision error."""
    assert not out.isnan().any() and not lse.isnan().any()
    ref_out, ref_lse = ref_attention(p, q, k, v, page_indices, scale)
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead)  # lse = -inf exactly where no key is visible
    assert (out.float()[dead] == 0).all()
    err = (out.float() - ref_out).abs().max().item() if out.numel() else 0.0
    if q.dtype == torch.float32:
        base = 0.0
    else:
        lowp = lowp_attention(q, k, v, p.block_table, p.seq_lens, page_indices, scale)
        base = (lowp.float() - ref_out).abs().max().item()
    assert err <= 2 * base + ATOL_FLOOR[q.dtype], (err, base)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------------------------
@FAST
@given(attn_problems(), st.sampled_from([None, 1, 2, 3, 7]), st.booleans())
def test_dense_attention_matches_reference(case, num_splits, interleaved):
    p, layout = case
    q = relayout(p.q, layout)
    k, v = interleave_kv(p.k_cache, p.v_cache) if interleaved else (p.k_cache, p.v_cache)
    scale = p.q.shape[-1] ** -0.5
    out, lse = run_attention(p, q, k, v, None, scale, layout, num_splits)
    check_attention(p, out, lse, None, scale, q, k, v)


@FAST
@given(attn_problems(), st.integers(1, 6), st.sampled_from([None, 1, 3]), st.integers(0, 2**31 - 1))
def test_sparse_attention_matches_reference(case, budget, num_splits, seed):
    p, layout = case
    q = relayout(p.q, layout)
    idx = random_selection(p, budget, seed)
    scale = 0.7 * p.q.shape[-1] ** -0.5
    out, lse = run_attention(p, q, p.k_cache, p.v_cache, idx, scale, layout, num_splits)
    check_attention(p, out, lse, idx, scale, q, p.k_cache, p.v_cache)


@settings(max_examples=5, deadline=None)
@given(attn_problems(dtypes=("bf16",), max_pages_per_row=3), st.sampled_from([None, 2]))
def test_bf16_attention_matches_reference(case, num_splits):
    p, layout = case
    scale = p.q.shape[-1] ** -0.5
    out, lse = run_attention(p, p.q, p.k_cache, p.v_cache, None, scale, layout, num_splits)
    check_attention(p, out, lse, None, scale, p.q, p.k_cache, p.v_cache)


@settings(max_examples=10, deadline=None)
@given(attn_problems(dtypes=("fp32", "fp16")), st.integers(0, 3))
def test_selecting_every_page_equals_dense(case, extra):
    p, _ = case
    B, Hkv, S = p.q.shape[0], p.num_kv_heads, p.page_size
    idx = torch.full((B, Hkv, p.block_table.shape[1] + extra), -1, dtype=torch.int32)
    for b in range(B):
        n = n_pages(p.seq_lens[b], S)
        idx[b, :, :n] = torch.arange(n, dtype=torch.int32)
    scale = p.q.shape[-1] ** -0.5
    dense = run_attention(p, p.q, p.k_cache, p.v_cache, None, scale, num_splits=1)
    sparse = run_attention(p, p.q, p.k_cache, p.v_cache, idx, scale, num_splits=1)
    # the same token stream, only extra fully-masked tiles (alpha = 1, p = 0): bitwise equal
    assert torch.equal(dense[0], sparse[0]) and torch.equal(dense[1], sparse[1])


@settings(max_examples=10, deadline=None)
@given(attn_problems(dtypes=("fp32", "fp16")), st.booleans(), st.integers(0, 2**31 - 1))
def test_permuting_physical_pages_leaves_output_unchanged(case, sparse, seed):
    p, _ = case
    g = torch.Generator().manual_seed(seed)
    P = p.k_cache.shape[0]
    perm = torch.randperm(P, generator=g)  # page i moves to perm[i]
    k2, v2 = torch.empty_like(p.k_cache), torch.empty_like(p.v_cache)
    k2[perm], v2[perm] = p.k_cache, p.v_cache
    bt2 = p.block_table.clone()
    for b in range(bt2.shape[0]):
        n = n_pages(p.seq_lens[b], p.page_size)
        bt2[b, :n] = perm[p.block_table[b, :n].long()].to(torch.int32)
    idx = random_selection(p, 4, seed) if sparse else None
    scale = p.q.shape[-1] ** -0.5
    a = run_attention(p, p.q, p.k_cache, p.v_cache, idx, scale)
    out, lse = empty_out(p.q, "contiguous")
    attention_triton.paged_attention(p.q, k2, v2, bt2, p.seq_lens, page_indices=idx, scale=scale, out=out, lse=lse)
    assert torch.equal(a[0], out) and torch.equal(a[1], lse)


@pytest.mark.parametrize("dtype,sparse", [(torch.float32, False), (torch.float32, True), (torch.float16, False)])
def test_split_k_gives_the_same_answer(dtype, sparse):
    # rows of 5 and 4 iterations of BLOCK_N = 64 tokens, a short one and an empty one: with 7 splits
    # some splits of every row are empty and must merge as weight 0
    p = make_problem(7, batch=4, seq_lens=[300, 5, 0, 200], page_size=16, num_kv_heads=2, group=3,
                     head_dim=40, num_query_tokens=3, dtype=dtype)
    idx = random_selection(p, 16, 3) if sparse else None
    scale = 40 ** -0.5
    outs = [run_attention(p, p.q, p.k_cache, p.v_cache, idx, scale, num_splits=s) for s in (1, 2, 3, 7)]
    check_attention(p, *outs[0], idx, scale, p.q, p.k_cache, p.v_cache)
    for out, lse in outs[1:]:
        # partials are merged in fp32: only the final rounding to the output dtype differs
        torch.testing.assert_close(out, outs[0][0], atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=1e-3)
        torch.testing.assert_close(lse, outs[0][1], atol=1e-5, rtol=1e-5)


def test_num_splits_heuristic():
    # short contexts and full grids: no split; long decode with a small batch: fill the SMs
    assert choose_num_splits(num_programs=8, max_tokens=256, block_n=64, num_sms=132) == 1
    assert choose_num_splits(num_programs=512, max_tokens=1 << 15, block_n=64, num_sms=132) == 1
    s = choose_num_splits(num_programs=8, max_tokens=1 << 15, block_n=64, num_sms=132)
    assert 8 <= s <= 64 and 8 * s >= 132


def test_empty_rows_and_very_negative_logits():
    # rows: empty, shorter than Tq (first queries see nothing), normal; logits around -1e4 stay finite
    p = make_problem(1, batch=3, seq_lens=[0, 2, 9], page_size=4, num_kv_heads=1, group=2, head_dim=16,
                     num_query_tokens=4)
    k = p.k_cache.clone()
    k[p.k_cache.isfinite()] = k[p.k_cache.isfinite()].abs() + 1.0
    q = -p.q.abs() - 1.0  # q.k < 0 everywhere, scaled by 300: logits ~ -1e4
    for num_splits in (1, 3):
        out, lse = run_attention(p, q, k, p.v_cache, None, 300.0, num_splits=num_splits)
        check_attention(p, out, lse, None, 300.0, q, k, p.v_cache)
        assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :2]).all()
        assert (lse[2] < -1000).all() and lse[2].isfinite().all()


def big_pool(page_size, num_kv_heads, head_dim, dtype, num_used):
    """A pool of > 2**31 elements per page stride step whose last ``num_used`` pages are the only ones touched.

    ``new_empty`` of a few GiB only reserves address space (pages are committed when written), and the
    interpreter hands CPU storages to the kernel without copying. K and V interleave page by page
    (page stride 2 * page_size * Hkv * D), so ``page_id * stride`` is above 2**31 for every used page.
    """
    page_elems = page_size * num_kv_heads * head_dim
    num_pages = (2**31) // (2 * page_elems) + num_used + 1
    buf = torch.zeros(0, dtype=dtype).new_empty(num_pages * 2 * page_elems)
    kv = buf.view(num_pages, 2, page_size, num_kv_heads, head_dim)
    return kv[:, 0], kv[:, 1], num_pages


def test_pages_past_2_pow_31_elements():
    """64-bit offsets (CASES.md 3): the same pages at ids whose element offset exceeds 2**31 give the same answer."""
    p = make_problem(3, batch=2, seq_lens=[37, 20], page_size=8, num_kv_heads=2, group=2, head_dim=64,
                     num_query_tokens=2, dtype=torch.float16, poison=0.0)
    P = p.k_cache.shape[0]
    k_big, v_big, num_pages = big_pool(8, 2, 64, torch.float16, P)
    base = num_pages - P  # every used id * page stride > 2**31
    assert base * k_big.stride(0) > 2**31
    k_big[base:], v_big[base:] = p.k_cache, p.v_cache
    bt_big = p.block_table.clone()
    for b in range(2):
        n = n_pages(p.seq_lens[b], 8)
        bt_big[b, :n] += base
    scale = 0.125
    for idx in (None, random_selection(p, 3, 0)):
        small = run_attention(p, p.q, p.k_cache, p.v_cache, idx, scale)
        out, lse = empty_out(p.q, "contiguous")
        attention_triton.paged_attention(p.q, k_big, v_big, bt_big, p.seq_lens, page_indices=idx, scale=scale, out=out, lse=lse)
        assert torch.equal(small[0], out) and torch.equal(small[1], lse)
    # metadata and scores read the same pool (and bounds with a page stride just as large)
    lo, hi, _ = big_pool(8, 2, 64, torch.float16, P)
    k_min, k_max = lo[:, 0], hi[:, 0]  # [num_pages, Hkv, D], page stride 2 * page_size * Hkv * D
    kv_cache_triton.update_page_metadata(k_big, bt_big, p.seq_lens, k_min, k_max)
    ref_min, ref_max = torch.zeros(P, 2, 64, dtype=torch.float16), torch.zeros(P, 2, 64, dtype=torch.float16)
    kv_cache_triton.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, ref_min, ref_max)
    used = bt_big[0, :5].long()
    assert torch.equal(k_min[used], ref_min[used - base]) and torch.equal(k_max[used], ref_max[used - base])
    s_big, s_small = torch.empty(2, 2, bt_big.shape[1]), torch.empty(2, 2, bt_big.shape[1])
    selection_triton.page_scores(p.q, k_min, k_max, bt_big, p.seq_lens, page_size=8, out=s_big)
    selection_triton.page_scores(p.q, ref_min, ref_max, p.block_table, p.seq_lens, page_size=8, out=s_small)
    assert torch.equal(s_big, s_small)


# ----------------------------------------------------------------------------------------------------------------
# metadata, scores, selection
# ----------------------------------------------------------------------------------------------------------------
@FAST
@given(attn_problems(dtypes=("fp32", "fp16", "bf16")), st.booleans())
def test_update_page_metadata_matches_reference(case, fp32_bounds):
    p, _ = case
    P, S, Hkv, D = p.k_cache.shape
    dtype = torch.float32 if fp32_bounds else p.k_cache.dtype
    k_min, k_max = torch.full((P, Hkv, D), 7.0, dtype=dtype), torch.full((P, Hkv, D), 7.0, dtype=dtype)
    r_min, r_max = k_min.clone(), k_max.clone()
    kv_cache_triton.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
    reference.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, r_min, r_max)
    # exact: min / max never round; untouched pages keep their 7.0, poisoned slots never leak
    assert torch.equal(k_min, r_min) and torch.equal(k_max, r_max)


@FAST
@given(attn_problems(dtypes=("fp32", "fp16", "bf16")))
def test_page_scores_match_reference_and_bound_every_key(case):
    p, layout = case
    P, S, Hkv, D = p.k_cache.shape
    q = relayout(p.q, layout)
    k_min, k_max = torch.zeros(P, Hkv, D, dtype=p.k_cache.dtype), torch.zeros(P, Hkv, D, dtype=p.k_cache.dtype)
    kv_cache_triton.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max)
    scores = torch.full((p.q.shape[0], Hkv, p.block_table.shape[1]), math.nan)
    selection_triton.page_scores(q, k_min, k_max, p.block_table, p.seq_lens, page_size=S, out=scores)
    ref = reference.page_scores(p.q, k_min, k_max, p.block_table, p.seq_lens, page_size=S)
    torch.testing.assert_close(scores, ref, atol=1e-4, rtol=1e-5)
    # the bound: score >= q.k for every valid key of the page, every query token and head of the group
    G, Tq = p.q.shape[2] // Hkv, p.q.shape[1]
    for b in range(p.q.shape[0]):
        n_tok = int(p.seq_lens[b])
        for j in range(n_pages(n_tok, S)):
            keys = p.k_cache[p.block_table[b, j].long(), : min(S, n_tok - j * S)].double()  # [s, Hkv, D]
            qg = p.q[b].double().view(Tq, Hkv, G, D)
            logits = torch.einsum("thgd,shd->hstg", qg, keys).reshape(Hkv, -1).amax(1)  # [Hkv]
            assert (scores[b, :, j].double() >= logits - 1e-4 * (1 + logits.abs())).all()


@st.composite
def selection_cases(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    B, Hkv, maxp = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    seq_lens = torch.tensor([draw(st.integers(0, maxp * page_size)) for _ in range(B)], dtype=torch.int32)
    # few distinct values -> many ties; -inf and NaN scores; pages past the end score +inf (must still lose)
    pool = st.sampled_from([-2.0, -1.0, 0.0, -0.0, 1.0, 3.5, -math.inf, math.nan])
    scores = torch.tensor([draw(pool) for _ in range(B * Hkv * maxp)], dtype=torch.float32).view(B, Hkv, maxp)
    for b in range(B):
        scores[b, :, n_pages(seq_lens[b], page_size):] = math.inf
    opts = dict(page_size=page_size, page_budget=draw(st.integers(1, maxp + 2)),
                num_sink_pages=draw(st.integers(0, 3)), num_recent_pages=draw(st.integers(0, 3)),
                num_query_tokens=draw(st.integers(1, 2 * page_size)))
    return scores, seq_lens, opts


@settings(max_examples=40, deadline=None)
@given(selection_cases())
def test_select_pages_matches_reference(case):
    scores, seq_lens, opts = case
    try:
        ref = reference.select_pages(scores, seq_lens, **opts)
    except ValueError:  # the budget cannot hold the query pages: the ops layer raises before the kernel
        assume(False)
    out = torch.full(ref.shape, -7, dtype=torch.int32)
    selection_triton.select_pages(scores, seq_lens, **opts, out=out)
    assert torch.equal(out, ref)
