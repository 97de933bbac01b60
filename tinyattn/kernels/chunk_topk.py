"""Two-stage page selection for small batches and long rows: fused score + per-chunk top-k, then a merge.

1. ``score_chunk_topk_kernel``, grid ``(B, Hkv, NC)``, ``NC = cdiv(max_pages, CHUNK)``: each program scores the
   ``CHUNK`` logical pages of its chunk (``scoring._page_bounds``, the code of ``page_scores``), hides the pages
   before a sliding window, and writes its best ``min(rest, pages)`` candidates (order key + page id, ascending)
   into ``KC = min(page_budget, CHUNK)`` workspace slots, ``-1`` padded. The forced pages never enter it.
2. ``merge_chunks_kernel``, grid ``(B, Hkv)``: the final ``rest`` among the ``NC * KC`` candidates (radix select
   or argmax loop of ``topk.py``), plus the forced ranges, ascending, ``-1`` padded.

Why this selects exactly what ``select_pages(page_scores(...))`` selects, and when the plan uses it
(``use_two_stage``): docs/layout.md, "Two-stage selection". Integer constants stay int32 (the interpreter
computes through numpy, where ``1 << 31`` silently becomes int64 while the GPU wraps it): the smallest key is
written ``-2147483647 - 1``, and program ids are widened to int64 before meeting a stride.
"""
import triton
import triton.language as tl

from . import is_interpreting
from .attention import _window_start
from .scoring import _page_bounds, score_blocks
from .topk import RADIX_MIN_BUDGET, _forced_ranges, _order_key, _top_rest_by_radix


@triton.jit
def _top_mask(b_key, m_cand, o_c, rest, RADIX: tl.constexpr, BITS: tl.constexpr):
    """``[N]`` mask of the ``rest`` largest keys among ``m_cand``, ties to the lowest index.

    All candidates when they are ``rest`` or fewer (a chunk no larger than the budget selects nothing).
    """
    n_cand = tl.sum(m_cand.to(tl.int32), axis=0)
    m_top = m_cand
    if rest < n_cand:
        if RADIX:
            m_top = _top_rest_by_radix(b_key, m_cand, o_c, rest, BITS)
        else:
            m_top = m_cand & (o_c < 0)
            for _ in range(rest):
                # argmax returns the first (lowest) index among equal keys
                b_cand = tl.where(m_top | (~m_cand), -2147483647 - 1, b_key)
                i_top = tl.argmax(b_cand, axis=0)
                m_top |= o_c == i_top
    return m_top


@triton.jit
def score_chunk_topk_kernel(
    q,  # [B, TQ, HQ, D]
    k_min,  # [num_pages, Hkv, D]
    k_max,  # [num_pages, Hkv, D]
    block_table,  # [B, max_pages_per_seq] int32
    seq_lens,  # [B] int32
    ws_key,  # [B, Hkv, NC * KC] int32 order keys of the candidates
    ws_page,  # [B, Hkv, NC * KC] int32 logical pages of the candidates, -1 padded
    scores,  # [B, Hkv, MAXP] fp32, written when SCORES (top-p reads every valid page's score): else unused
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_np, stride_nh, stride_nd,
    stride_xp, stride_xh, stride_xd,
    stride_bt,
    stride_wb, stride_wh,
    stride_sb, stride_sh,
    MAXP, TQ, D, BUDGET, NUM_SINK, NUM_RECENT, WINDOW, KC,
    GAMMA,  # fp32 share of the box half-width (1: Quest's bound)
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BM: tl.constexpr,
    BP: tl.constexpr,
    BD: tl.constexpr,
    CHUNK: tl.constexpr,
    BKC: tl.constexpr,
    RADIX: tl.constexpr,
    BITS: tl.constexpr = 1,  # radix digit width (radix_bits)
    SCORES: tl.constexpr = False,  # also score the forced pages and write every valid page's score (top-p)
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_c = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens + i_b)
    n, s_end, r_start, rest = _forced_ranges(seq_len, TQ, BUDGET, NUM_SINK, NUM_RECENT, MAXP, PAGE_SIZE)

    o_c = tl.arange(0, CHUNK)  # [CHUNK] page within the chunk
    o_j = i_c * CHUNK + o_c  # [CHUNK] logical pages (int64)
    m_pool = (o_j >= s_end) & (o_j < r_start)  # r_start <= n <= MAXP: never past the row's end
    p_qb = q + i_b * stride_qb
    p_bt = block_table + i_b * stride_bt
    b_s = tl.full([CHUNK], float("-inf"), tl.float32)
    for sub in range(CHUNK // BP):
        o_jb = i_c * CHUNK + sub * BP + tl.arange(0, BP)  # [BP]
        m_jb = (o_jb >= s_end) & (o_jb < r_start)
        if SCORES:  # the forced pages' scores too: their mass counts towards top_p
            m_jb = o_jb < n
        o_p = tl.load(p_bt + o_jb, mask=m_jb, other=0).to(tl.int64)  # [BP] physical pages
        b_sb = _page_bounds(p_qb, k_min, k_max, o_p, m_jb, i_h,
                            stride_qt, stride_qh, stride_qd, stride_np, stride_nh, stride_nd,
                            stride_xp, stride_xh, stride_xd, TQ, D, GAMMA, G=G, BM=BM, BP=BP, BD=BD)  # [BP]
        # place the BP bounds at [sub * BP, (sub + 1) * BP) of the chunk tile, in registers
        b_rep = tl.reshape(tl.broadcast_to(b_sb[None, :], (CHUNK // BP, BP)), (CHUNK,))  # [CHUNK]
        b_s = tl.where(o_c // BP == sub, b_rep, b_s)
    # pages wholly before the earliest query's window rank below every page that overlaps it (the rule of
    # selection_torch.mask_pages_before_window; WINDOW = -1: no window, first = -1 hides nothing)
    first = _window_start(seq_len - TQ, WINDOW)
    b_s = tl.where((o_j + 1) * PAGE_SIZE <= first, float("-inf"), b_s)
    if SCORES:
        tl.store(scores + i_b * stride_sb + i_h * stride_sh + o_j, b_s, mask=o_j < MAXP)
    b_key = _order_key(b_s)  # [CHUNK]

    m_top = _top_mask(b_key, m_pool, o_c, rest, RADIX=RADIX, BITS=BITS)  # at most min(rest, CHUNK) <= KC pages
    o_pos = tl.cumsum(m_top.to(tl.int32), axis=0) - 1  # [CHUNK] ascending slots
    n_top = tl.sum(m_top.to(tl.int32), axis=0)
    o_w = i_b * stride_wb + i_h * stride_wh + i_c * KC
    tl.store(ws_key + o_w + o_pos, b_key, mask=m_top)
    tl.store(ws_page + o_w + o_pos, o_j.to(tl.int32), mask=m_top)
    o_k = tl.arange(0, BKC)  # [BKC]
    m_pad = (o_k >= n_top) & (o_k < KC)
    tl.store(ws_key + o_w + o_k, tl.full([BKC], -2147483647 - 1, tl.int32), mask=m_pad)
    tl.store(ws_page + o_w + o_k, tl.full([BKC], -1, tl.int32), mask=m_pad)


@triton.jit
def merge_chunks_kernel(
    ws_key,  # [B, Hkv, NCAND] int32
    ws_page,  # [B, Hkv, NCAND] int32, -1 padded, ascending among valid entries
    seq_lens,  # [B] int32
    out,  # [B, Hkv, BUDGET] int32
    stride_wb, stride_wh,
    stride_ob, stride_oh, stride_ok,
    NCAND, MAXP, TQ, BUDGET, NUM_SINK, NUM_RECENT,
    PAGE_SIZE: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    RADIX: tl.constexpr,
    BITS: tl.constexpr = 1,  # radix digit width (radix_bits)
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens + i_b)
    n, s_end, r_start, rest = _forced_ranges(seq_len, TQ, BUDGET, NUM_SINK, NUM_RECENT, MAXP, PAGE_SIZE)

    o_n = tl.arange(0, BN)  # [BN] candidate slots
    m_n = o_n < NCAND
    o_w = i_b * stride_wb + i_h * stride_wh
    b_page = tl.load(ws_page + o_w + o_n, mask=m_n, other=-1)  # [BN]
    b_key = tl.load(ws_key + o_w + o_n, mask=m_n, other=0)  # [BN]
    m_cand = b_page >= 0
    # slots are in ascending page order, so the lowest slot among equal keys is the lowest page
    m_top = _top_mask(b_key, m_cand, o_n, rest, RADIX=RADIX, BITS=BITS)

    p_o = out + i_b * stride_ob + i_h * stride_oh
    o_pos = s_end + tl.cumsum(m_top.to(tl.int32), axis=0) - 1  # [BN] after the sinks
    tl.store(p_o + o_pos * stride_ok, b_page, mask=m_top)
    # sinks at [0, s_end), the pool's rest pages at [s_end, s_end + rest), recent pages after them
    o_k = tl.arange(0, BK)  # [BK] output slots
    n_front = s_end + rest
    n_kept = n_front + (n - r_start)
    b_fixed = tl.where(o_k < s_end, o_k, tl.where(o_k < n_kept, r_start + (o_k - n_front), -1))
    m_fixed = (o_k < BUDGET) & ((o_k < s_end) | (o_k >= n_front))
    tl.store(p_o + o_k * stride_ok, b_fixed.to(tl.int32), mask=m_fixed)


# ------------------------------------------------------------------------------------------ heuristics
# SMs assumed when no CUDA device can be queried (attention.NUM_SMS_DEFAULT)
NUM_SMS_DEFAULT = 132
# above this many pages per row the one-stage select tile (next_pow2(pages) keys in one program) is past
# what 4 warps keep in registers, whatever the batch
ONE_STAGE_MAX_PAGES = 2048
# stage 1 aims at this many programs per SM: two co-resident programs hide one's box loads behind the other's
# reductions
PROGRAMS_PER_SM = 2
# chunk sizes on a GPU: below 64 pages the per-program work is a few loads; above 1024 the chunk tile and its
# radix passes dominate
MIN_CHUNK, MAX_CHUNK = 64, 1024
# stage 2 holds the NC * KC candidates in one tile: keep it within a 4096-key tile when the chunks allow it
MAX_CANDIDATES = 4096
# the interpreter runs programs one after another: one small config, so that test rows of a few pages span
# several chunks
INTERPRET_CHUNK = 4
# a chunk holds at least this many times the budget (when the budget is large), so that stage 1 filters: at B = 1,
# 32K, budget 128 the GPU-filling chunk alone (64 pages) keeps every page, and the merge sees all 2048
FILTER = 2
# elements of a radix pass's [keys, 2**BITS] counting tile (32 per thread at 4 warps: no spills on sm_90)
RADIX_TILE = 4096


def use_two_stage(batch: int, num_kv_heads: int, max_pages: int, page_budget: int,
                  num_sms: int = NUM_SMS_DEFAULT) -> bool:
    """True when the two-stage selection beats ``page_scores`` + ``select_pages`` by design.

    It pays when the one-stage select leaves SMs idle (``B * Hkv < num_sms``, e.g. 8 programs at batch 1) or
    its tile is too large (``max_pages > ONE_STAGE_MAX_PAGES``); and only when some row can hold more pages than
    the budget (else selection is "every page" and either path is a copy). Everything else keeps one stage.
    """
    if max_pages <= page_budget:
        return False
    return batch * num_kv_heads < num_sms or max_pages > ONE_STAGE_MAX_PAGES


def chunk_blocks(batch: int, num_kv_heads: int, max_pages: int, page_budget: int, num_queries: int, group: int,
                 head_dim: int, page_size: int, num_sms: int = NUM_SMS_DEFAULT, chunk: int = 0) -> dict:
    """Sizes of both stages for ``(batch, KV heads, pages, budget)``; shared with compile.py and the plan.

    Chunk size (a power of two): ``PROGRAMS_PER_SM * num_sms`` stage-1 programs spread over ``B * Hkv`` rows
    (B = 1, Hkv = 8: 33 chunks per row, so 64 pages at 2048 pages, 256 at 8192), clamped to ``[MIN_CHUNK,
    MAX_CHUNK]``, then doubled while stage 2 would see more than ``MAX_CANDIDATES`` candidates. Under the
    interpreter one config, ``INTERPRET_CHUNK``. ``chunk`` > 0 forces it (tests).

    Returns ``stage1`` / ``stage2`` constexpr dicts (``num_warps`` included), ``NC``, ``KC``.
    """
    max_pages, page_budget = max(max_pages, 1), max(page_budget, 1)
    if chunk <= 0:
        if is_interpreting():
            chunk = INTERPRET_CHUNK
        else:
            per_row = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(batch * num_kv_heads, 1))
            chunk = min(max(triton.next_power_of_2(triton.cdiv(max_pages, per_row)), MIN_CHUNK), MAX_CHUNK)
            if page_budget > RADIX_MIN_BUDGET:           # a large budget: chunks larger than it, so stage 1 filters
                chunk = max(chunk, min(triton.next_power_of_2(FILTER * page_budget), MAX_CHUNK))
            chunk = min(chunk, triton.next_power_of_2(max_pages))
            while chunk < triton.next_power_of_2(max_pages) and \
                    triton.cdiv(max_pages, chunk) * min(page_budget, chunk) > MAX_CANDIDATES:
                chunk *= 2
    assert chunk & (chunk - 1) == 0, "chunk must be a power of two"
    num_chunks = triton.cdiv(max_pages, chunk)
    kc = min(page_budget, chunk)
    score = score_blocks(num_queries, group, head_dim, page_size, chunk)  # BP <= chunk
    ncand = num_chunks * kc
    bn = triton.next_power_of_2(ncand)
    radix = page_budget > RADIX_MIN_BUDGET
    stage1 = dict(score, CHUNK=chunk, BKC=triton.next_power_of_2(kc), RADIX=radix, BITS=radix_bits(chunk),
                  num_warps=4)
    stage2 = dict(PAGE_SIZE=page_size, BN=bn, BK=triton.next_power_of_2(page_budget), RADIX=radix,
                  BITS=radix_bits(bn), num_warps=4 if bn <= 1024 else 8)
    return dict(stage1=stage1, stage2=stage2, NC=num_chunks, KC=kc)


def radix_bits(num_keys: int) -> int:
    """Radix digit width for a select over ``num_keys`` keys: 4 bits (8 dependent passes) while the
    ``[num_keys, 16]`` counting tile stays within ``RADIX_TILE`` elements, else 2 (16 passes), else 1 (32).
    (A 16384-element tile spilled 2 KB on sm_90 in the compile tier for the 1024-candidate merge.)"""
    for bits in (4, 2):
        if num_keys << bits <= RADIX_TILE:
            return bits
    return 1


def workspace_shape(batch: int, num_kv_heads: int, meta: dict) -> tuple:
    """Shape of each candidate workspace (keys, pages), int32, for :func:`score_and_select_pages`."""
    return (batch, num_kv_heads, meta["NC"] * meta["KC"])
