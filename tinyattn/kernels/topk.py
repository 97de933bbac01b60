"""Page selection: forced recent and sink pages, then the top-scoring pages, within a budget.

Quest (Tang et al., ICML 2024) keeps the top-K pages by their upper-bound score; TinyServe
(arXiv 2509.12211, sec. 3, eq. 2-3) adds the always-kept recent and sink pages. Per (row, KV head),
with ``n = cdiv(seq_len, page_size)`` valid pages:

- ``n <= budget``: keep every valid page (sparse == dense exactly);
- else, in priority order until the budget is full: (1) the last ``R`` pages, ``R = max(recent, 1,
  pages holding the Tq query tokens)`` (newest first if they alone overflow the budget); (2) the first
  ``num_sink_pages`` pages; (3) the highest scores among the rest, ties to the lower page index,
  NaN counting as ``-inf`` (a tie with it, won by the lower index), pages past the end never chosen.

Output: ascending page ids, ``-1`` padded. Grid ``(B, Hkv)``; one program holds the row's scores as
a ``[BP]`` tile of order-preserving int32 keys and picks the top pages with ``tl.argmax`` in a loop
for small budgets (argmax breaks ties to the lowest index), or by a 32-pass radix select of the
threshold key for budgets above ``RADIX_MIN_BUDGET``, then compacts with a cumsum.

``top_p_filter_kernel`` prunes such a selection (or the two-stage one) to the fewest best pages whose estimated
attention mass ``softmax(scale · score)``, with the forced pages', reaches ``top_p`` (Twilight, Lin et al., arXiv
2502.02770), into a second buffer; fixed shapes, no sort.
"""
import triton
import triton.language as tl


@triton.jit
def _forced_ranges(seq_len, TQ, BUDGET, NUM_SINK, NUM_RECENT, MAXP, PAGE_SIZE: tl.constexpr):
    """``(n, s_end, r_start, rest)`` of one row: the forced pages of the selection (the one Triton copy of the rule,
    used by :func:`select_pages_kernel` and both stages of :mod:`tinyattn.kernels.chunk_topk`).

    Kept: sinks ``[0, s_end)``, recent ``[r_start, n)``, and ``rest`` best pages of ``[s_end, r_start)``.
    With ``n <= BUDGET``: ``s_end = r_start = rest = 0`` (every valid page is "recent").
    """
    n = tl.minimum((seq_len + PAGE_SIZE - 1) // PAGE_SIZE, MAXP)
    # recent pages include every page holding a query token (clamped: no negative division)
    first_q = tl.maximum(seq_len - TQ, 0) // PAGE_SIZE
    n_recent = tl.minimum(tl.maximum(tl.maximum(NUM_RECENT, 1), n - first_q), BUDGET)
    s_end = tl.minimum(NUM_SINK, BUDGET - n_recent)
    short = n <= BUDGET
    n_recent = tl.where(short, n, n_recent)
    s_end = tl.where(short, 0, s_end)
    rest = tl.where(short, 0, BUDGET - n_recent - s_end)
    return n, s_end, n - n_recent, rest


@triton.jit
def select_pages_kernel(
    scores,  # [B, HKV, MAXP] fp32
    seq_lens,  # [B] int32
    out,  # [B, HKV, BUDGET] int32
    stride_sb, stride_sh, stride_sj,
    stride_ob, stride_oh, stride_ok,
    MAXP, BUDGET, NUM_SINK, NUM_RECENT, TQ,
    PAGE_SIZE: tl.constexpr,
    BP: tl.constexpr,
    BK: tl.constexpr,
    RADIX: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens + i_b)
    # (1) recent pages, including every page holding a query token, (2) sink pages from page 0 with whatever
    # budget is left; every valid page when the row fits the budget
    n, s_end, r_start, rest = _forced_ranges(seq_len, TQ, BUDGET, NUM_SINK, NUM_RECENT, MAXP, PAGE_SIZE)

    o_j = tl.arange(0, BP)  # [BP] logical pages
    m_j = (o_j < n) & (o_j < MAXP)
    b_s = tl.load(scores + i_b * stride_sb + i_h * stride_sh + o_j * stride_sj, mask=m_j, other=0.0)
    keep = m_j & ((o_j < s_end) | (o_j >= r_start))  # [BP]

    # (3) order-preserving int32 image of the score: flip the magnitude bits of negatives;
    # -0 == +0 and NaN == -inf so that ties stay ties (the lower page index wins them)
    b_key = _order_key(b_s)  # [BP]
    if RADIX:
        keep |= _top_rest_by_radix(b_key, m_j & ~keep, o_j, rest)
    else:
        for _ in range(rest):
            # argmax returns the first (lowest) index among equal keys
            b_cand = tl.where(keep | (~m_j), -2147483647 - 1, b_key)  # [BP]
            i_top = tl.argmax(b_cand, axis=0)
            keep |= o_j == i_top

    # compact the kept pages in ascending order, then pad with -1
    o_pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1  # [BP]
    n_kept = tl.sum(keep.to(tl.int32), axis=0)
    p_o = out + i_b * stride_ob + i_h * stride_oh
    tl.store(p_o + o_pos * stride_ok, o_j, mask=keep)
    o_k = tl.arange(0, BK)  # [BK]
    tl.store(p_o + o_k * stride_ok, tl.full([BK], -1, tl.int32), mask=(o_k >= n_kept) & (o_k < BUDGET))


@triton.jit
def _order_key(b_s):
    """Order-preserving int32 image of fp32 scores: flip the magnitude bits of negatives.

    -0 == +0 and NaN == -inf, so that ties stay ties (the lower page index wins them); -inf -> -2139095041,
    so ``-2147483647 - 1`` (written so: the literal ``-2147483648`` is an int64 in Triton) stays below every key.
    """
    b_s = tl.where(b_s == 0.0, 0.0, b_s)
    b_s = tl.where(b_s != b_s, float("-inf"), b_s)
    b_bits = b_s.to(tl.int32, bitcast=True)
    return tl.where(b_bits >= 0, b_bits, b_bits ^ 0x7FFFFFFF)


@triton.jit
def _top_rest_by_radix(b_key, m_cand, o_j, rest, BITS: tl.constexpr = 1):
    """The ``rest`` largest keys among ``m_cand``, ties to the lowest index, as a ``[BP]`` mask.

    Radix select: build the ``rest``-th largest key ``T`` from the top, ``BITS`` bits (one digit) per pass
    (``32 / BITS`` counting passes over the row, whatever the budget), then keep every key above ``T`` and the
    lowest-index keys equal to ``T`` until ``rest`` are kept. On a GPU this replaces ``rest`` dependent argmax
    passes (128 of them for a 2048-token budget at page size 16) by 32 / BITS dependent reductions. A pass of
    ``BITS`` > 1 counts, for every digit ``d``, the keys ``>= T + d * 2**shift`` in one ``[BP, 2**BITS]`` tile
    and takes the largest ``d`` whose count still reaches ``rest`` (the counts fall with ``d``, and ``d = 0``
    always reaches it): the same ``T`` as bit by bit, in 8 passes for 4-bit digits instead of 32.
    """
    b_u = b_key.to(tl.int64) + 2147483648  # [BP] in [0, 2^32): unsigned order = key order
    b_t = tl.zeros([], tl.int64)
    if BITS == 1:
        b_one = tl.full([], 1, tl.int64)  # int64: 1 << 31 in int32 would wrap negative
        for bit in range(31, -1, -1):
            b_try = b_t | (b_one << bit)
            n_ge = tl.sum((m_cand & (b_u >= b_try)).to(tl.int32), axis=0)
            b_t = tl.where(n_ge >= rest, b_try, b_t)
    else:
        o_d = tl.arange(0, 1 << BITS).to(tl.int64)  # [R] digits
        for step in range(32 // BITS):
            shift = 32 - BITS * (step + 1)
            b_try = b_t + (o_d << shift)  # [R]
            m_ge = m_cand[:, None] & (b_u[:, None] >= b_try[None, :])  # [BP, R]
            n_ge = tl.sum(m_ge.to(tl.int32), axis=0)  # [R]
            b_d = tl.sum(((n_ge >= rest) & (o_d > 0)).to(tl.int64), axis=0)  # largest digit that keeps rest
            b_t = b_t + (b_d << shift)
    m_gt = m_cand & (b_u > b_t)  # [BP]
    m_eq = m_cand & (b_u == b_t)
    need = rest - tl.sum(m_gt.to(tl.int32), axis=0)
    m_eq_first = m_eq & (tl.cumsum(m_eq.to(tl.int32), axis=0) <= need)  # ties: lowest page first
    # rest >= 0 always (forced pages never exceed the budget); with rest == 0, T ends at 2^32 - 1 and
    # need == 0, so nothing is added
    return m_gt | m_eq_first


# above this budget the radix select beats the argmax loop (on a GPU; the interpreter pays per op,
# so small budgets keep the loop there too)
RADIX_MIN_BUDGET = 16


def topk_blocks(max_pages: int, page_budget: int, page_size: int) -> dict:
    """Constexprs of ``select_pages_kernel`` (shared with compile.py)."""
    return dict(PAGE_SIZE=page_size, BP=triton.next_power_of_2(max(max_pages, 1)),
                BK=triton.next_power_of_2(max(page_budget, 1)), RADIX=page_budget > RADIX_MIN_BUDGET)


@triton.jit
def top_p_filter_kernel(
    scores,  # [B, HKV, MAXP] fp32: the scores the capacity was selected by (masked by a window if any)
    sel,  # [B, HKV, BUDGET] int32: the capacity selection, ascending, -1 padded
    seq_lens,  # [B] int32
    out,  # [B, HKV, BUDGET] int32: the pages top-p keeps, ascending, -1 padded (not sel: no in-place race)
    stride_sb, stride_sh, stride_sj,
    stride_cb, stride_ch, stride_ck,
    stride_ob, stride_oh, stride_ok,
    MAXP, BUDGET, NUM_SINK, NUM_RECENT, TQ,
    TOP_P,  # fp32 in (0, 1]; >= 1 keeps the capacity
    SCALE,  # fp32 > 0: softmax scale of the estimated mass
    PAGE_SIZE: tl.constexpr,
    BP: tl.constexpr,  # pages per pass over the row (its softmax normaliser)
    BK: tl.constexpr,  # next_pow2(BUDGET): the capacity's slots
    BJ: tl.constexpr,  # slots per block of the pairwise "mass ranked above me" sum
):
    """Top-p over a capacity selection (Twilight, Lin et al., arXiv 2502.02770), one program per (row, KV head).

    Mass of a page: ``exp(SCALE * (s - s_max)) / Σ`` over the row's valid pages (NaN as ``-inf``, ``+inf`` as
    ``FLT_MAX``; all ``-inf``: 0). The forced pages (recent / query pages, sinks: the rule of ``_forced_ranges``
    without its short-row shortcut) are kept and their mass ``F`` counted; a scored page of the selection is kept
    while ``F`` plus the mass of the selected scored pages ranked above it (score descending, ties to the lower page,
    NaN as ``-inf``: ``_order_key``) is below ``TOP_P``. The "ranked above" sums are pairwise, ``[BK, BJ]`` tiles
    (no sort: a fixed number of passes whatever the scores). Kept pages are compacted in ascending order.
    """
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens + i_b)
    n = tl.minimum((seq_len + PAGE_SIZE - 1) // PAGE_SIZE, MAXP)
    first_q = tl.maximum(seq_len - TQ, 0) // PAGE_SIZE
    n_recent = tl.minimum(tl.maximum(tl.maximum(NUM_RECENT, 1), n - first_q), BUDGET)
    s_end = tl.minimum(NUM_SINK, BUDGET - n_recent)
    r_start = n - n_recent
    p_s = scores + i_b * stride_sb + i_h * stride_sh

    # the row's softmax normaliser (two passes: max, then sum) and the forced pages' share of it
    b_top = tl.full([], float("-inf"), tl.float32)
    for j0 in range(0, n, BP):
        o_j = j0 + tl.arange(0, BP)
        b_x = _mass_logit(tl.load(p_s + o_j * stride_sj, mask=o_j < n, other=float("-inf")))
        b_top = tl.maximum(b_top, tl.max(b_x, axis=0))
    b_total = tl.zeros([], tl.float32)
    b_forced = tl.zeros([], tl.float32)
    for j0 in range(0, n, BP):
        o_j = j0 + tl.arange(0, BP)
        b_x = _mass_logit(tl.load(p_s + o_j * stride_sj, mask=o_j < n, other=float("-inf")))
        b_e = tl.where(b_x == float("-inf"), 0.0, tl.exp((b_x - b_top) * SCALE))
        b_total += tl.sum(b_e, axis=0)
        b_forced += tl.sum(tl.where((o_j < s_end) | (o_j >= r_start), b_e, 0.0), axis=0)
    b_inv = tl.where(b_total > 0, 1.0 / tl.maximum(b_total, 1e-30), 0.0)  # b_total >= 1 unless all -inf

    p_c = sel + i_b * stride_cb + i_h * stride_ch
    o_k = tl.arange(0, BK)  # [BK] slots of the capacity
    b_page = tl.load(p_c + o_k * stride_ck, mask=o_k < BUDGET, other=-1)  # [BK]
    m_valid = (b_page >= 0) & (b_page < n)
    m_forced = m_valid & ((b_page < s_end) | (b_page >= r_start))
    m_scored = m_valid & ~m_forced
    b_key = _order_key(tl.load(p_s + b_page * stride_sj, mask=m_scored, other=float("-inf")))  # [BK]
    b_above = tl.zeros([BK], tl.float32)  # mass of the selected scored pages ranked above each slot
    for k0 in range(0, BUDGET, BJ):
        o_c = k0 + tl.arange(0, BJ)  # [BJ]
        b_pc = tl.load(p_c + o_c * stride_ck, mask=o_c < BUDGET, other=-1)
        m_c = (b_pc >= 0) & (b_pc < n) & (b_pc >= s_end) & (b_pc < r_start)
        b_sc = tl.load(p_s + b_pc * stride_sj, mask=m_c, other=float("-inf"))
        b_xc = _mass_logit(b_sc)
        b_mc = tl.where(m_c & (b_xc != float("-inf")), tl.exp((b_xc - b_top) * SCALE) * b_inv, 0.0)  # [BJ]
        b_kc = _order_key(b_sc)
        m_above = (b_kc[None, :] > b_key[:, None]) | ((b_kc[None, :] == b_key[:, None]) &
                                                      (b_pc[None, :] < b_page[:, None]))  # [BK, BJ]
        b_above += tl.sum(tl.where(m_above, b_mc[None, :], 0.0), axis=1)
    keep = m_forced | (m_scored & ((b_forced * b_inv + b_above < TOP_P) | (TOP_P >= 1.0)))

    o_pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1  # [BK] ascending: sel is ascending
    n_kept = tl.sum(keep.to(tl.int32), axis=0)
    p_o = out + i_b * stride_ob + i_h * stride_oh
    tl.store(p_o + o_pos * stride_ok, b_page, mask=keep)
    tl.store(p_o + o_k * stride_ok, tl.full([BK], -1, tl.int32), mask=(o_k >= n_kept) & (o_k < BUDGET))


@triton.jit
def _mass_logit(b_s):
    """A score as the estimated mass reads it: NaN as ``-inf``, ``+inf`` as ``FLT_MAX``."""
    b_s = tl.where(b_s != b_s, float("-inf"), b_s)
    return tl.minimum(b_s, 3.4028234663852886e38)


# elements of the pairwise [BK, BJ] tile of top_p_filter_kernel
TOP_P_TILE = 4096


def top_p_blocks(max_pages: int, page_budget: int, page_size: int) -> dict:
    """Constexprs of ``top_p_filter_kernel`` (shared with compile.py)."""
    bk = triton.next_power_of_2(max(page_budget, 1))
    return dict(PAGE_SIZE=page_size, BP=min(triton.next_power_of_2(max(max_pages, 1)), 1024), BK=bk,
                BJ=max(1, min(bk, TOP_P_TILE // bk)))
