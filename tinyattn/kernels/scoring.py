"""Query-aware page scores: an upper bound of ``q . k`` over each page's key bounding box.

Quest (Tang et al., ICML 2024, eq. 1) and TinyServe (arXiv 2509.12211, eq. 2)::

    ub(q, j) = sum_i max(q_i * k_min[j, i], q_i * k_max[j, i])  >=  max_{t in page j} q . k_t

Each term is the largest value ``q_i * k_i`` can take in ``[k_min_i, k_max_i]``, hence the bound. With a share
``gamma < 1`` of the half-width the kernels compute the box estimate ``q·c + gamma·|q|·r`` instead (box centre
``c``, half-width ``r``; ``= Σ_i a_i k_max_i + b_i k_min_i``, ``a = (q + gamma|q|)/2``, ``b = (q - gamma|q|)/2``):
no longer a bound, a sharper ranking (docs/api.md, ``gamma``).
For GQA the score of KV head ``h`` is the max over its ``G = Hq // Hkv`` query heads and the
``Tq`` query tokens: still an upper bound of every logit the group can produce on that page.

Grid: ``(B, Hkv, cdiv(max_pages, BP))``; each program scores ``BP`` pages (a ``[BP, BD]`` box tile)
against all ``Tq * G`` queries of the group, ``BM`` queries at a time (a ``[BM, BP, BD]`` product).
Math in fp32; logical pages past ``cdiv(seq_len, page_size)`` score ``-inf``; a page whose box holds a NaN
scores NaN for its KV head (as the reference; selection ranks it as ``-inf``).
"""
import triton
import triton.language as tl

from . import pad_head_dim

# elements of the [BM, BP, BD] product tile
TILE_ELEMS = 8192


@triton.jit
def _page_bounds(
    p_qb,  # q + row offset: [TQ, HQ, D] of one row
    k_min,  # [num_pages, Hkv, D]
    k_max,  # [num_pages, Hkv, D]
    o_p,  # [BP] int64 physical pages
    m_j,  # [BP] pages to score (others: -inf, nothing loaded)
    i_h,  # int64 KV head
    stride_qt, stride_qh, stride_qd,
    stride_np, stride_nh, stride_nd,
    stride_xp, stride_xh, stride_xd,
    TQ, D,
    GAMMA,  # fp32 share of the box half-width (1: Quest's bound)
    G: tl.constexpr,
    BM: tl.constexpr,
    BP: tl.constexpr,
    BD: tl.constexpr,
):
    """``[BP]`` Quest bound of pages ``o_p`` for the ``TQ * G`` queries of KV head ``i_h`` (max over them); with
    ``GAMMA < 1`` the box estimate ``Σ_i a_i·k_max_i + b_i·k_min_i``, ``a = (q + GAMMA|q|)/2``,
    ``b = (q - GAMMA|q|)/2`` (a runtime branch: no recompilation per value, and ``GAMMA = 1`` runs today's tile).

    Shared by ``page_scores_kernel`` and the fused chunk kernel of ``chunk_topk.py``, so that both compute
    every bound with the same tiles and the same order of the channel sum.
    """
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_box = m_j[:, None] & m_d[None, :]  # [BP, BD]
    # padded channels load 0 on both sides, so they add 0 to the bound
    p_n = k_min + o_p[:, None] * stride_np + i_h * stride_nh + o_d[None, :] * stride_nd
    p_x = k_max + o_p[:, None] * stride_xp + i_h * stride_xh + o_d[None, :] * stride_xd
    b_min = tl.load(p_n, mask=m_box, other=0.0).to(tl.float32)  # [BP, BD]
    b_max = tl.load(p_x, mask=m_box, other=0.0).to(tl.float32)  # [BP, BD]

    b_s = tl.full([BP], float("-inf"), tl.float32)
    m_nan = tl.zeros([BP], tl.int32)  # [BP] some query's bound is NaN (a NaN box channel)
    # rows m of the group: query token m // G, query head i_h * G + m % G
    for m0 in range(0, TQ * G, BM):
        o_m = m0 + tl.arange(0, BM)  # [BM]
        m_m = o_m < TQ * G
        o_t = (o_m // G).to(tl.int64)
        o_hq = i_h * G + o_m % G
        p_q = p_qb + o_t[:, None] * stride_qt + o_hq[:, None] * stride_qh + o_d[None, :] * stride_qd
        b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BM, BD]
        if GAMMA == 1.0:
            b_lo = b_q[:, None, :] * b_min[None, :, :]  # [BM, BP, BD]
            b_hi = b_q[:, None, :] * b_max[None, :, :]  # [BM, BP, BD]
            # a NaN in a box gives a NaN bound, as in the reference (torch.maximum), even where q_i == 0 makes the
            # other side 0; max and reductions drop NaN on a GPU and in the interpreter, so it is carried in m_nan
            b_ub = tl.sum(tl.maximum(b_lo, b_hi, propagate_nan=tl.PropagateNan.ALL), axis=2)  # [BM, BP]
        else:
            b_g = GAMMA * tl.abs(b_q)
            b_a = (b_q + b_g) * 0.5  # [BM, BD] against k_max
            b_b = (b_q - b_g) * 0.5  # [BM, BD] against k_min
            b_ub = tl.sum(b_a[:, None, :] * b_max[None, :, :] + b_b[:, None, :] * b_min[None, :, :], axis=2)
        m_nan = tl.maximum(m_nan, tl.max((m_m[:, None] & (b_ub != b_ub)).to(tl.int32), axis=0))
        # padded query rows would score 0 and could beat a negative bound: exclude them (and NaN, flagged above)
        b_ub = tl.where(m_m[:, None] & (b_ub == b_ub), b_ub, float("-inf"))
        b_s = tl.maximum(b_s, tl.max(b_ub, axis=0))  # [BP]
    b_s = tl.where(m_nan > 0, float("nan"), b_s)
    return tl.where(m_j, b_s, float("-inf"))


@triton.jit
def page_scores_kernel(
    q,  # [B, TQ, HQ, D]
    k_min,  # [num_pages, Hkv, D]
    k_max,  # [num_pages, Hkv, D]
    block_table,  # [B, max_pages_per_seq] int32
    seq_lens,  # [B] int32
    out,  # [B, Hkv, max_pages_per_seq] fp32
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_np, stride_nh, stride_nd,
    stride_xp, stride_xh, stride_xd,
    stride_bt,
    stride_ob, stride_oh, stride_oj,
    MAXP, TQ, D,
    GAMMA,  # fp32 (1: Quest's bound)
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BM: tl.constexpr,
    BP: tl.constexpr,
    BD: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_pb = tl.program_id(2)
    seq_len = tl.load(seq_lens + i_b)

    o_j = i_pb * BP + tl.arange(0, BP)  # [BP] logical pages
    m_j = (o_j < MAXP) & (o_j * PAGE_SIZE < seq_len)
    o_p = tl.load(block_table + i_b * stride_bt + o_j, mask=m_j, other=0).to(tl.int64)  # [BP]
    b_s = _page_bounds(q + i_b * stride_qb, k_min, k_max, o_p, m_j, i_h,
                       stride_qt, stride_qh, stride_qd, stride_np, stride_nh, stride_nd,
                       stride_xp, stride_xh, stride_xd, TQ, D, GAMMA, G=G, BM=BM, BP=BP, BD=BD)  # [BP]
    p_o = out + i_b * stride_ob + i_h * stride_oh + o_j * stride_oj
    tl.store(p_o, b_s, mask=o_j < MAXP)


def score_blocks(num_queries: int, group: int, head_dim: int, page_size: int, max_pages: int) -> dict:
    """Constexprs of ``page_scores_kernel`` for ``num_queries = Tq`` (shared with compile.py)."""
    BD = pad_head_dim(head_dim)
    BP = max(1, min(triton.next_power_of_2(max(max_pages, 1)), 2048 // BD))
    BM = max(1, min(triton.next_power_of_2(num_queries * group), TILE_ELEMS // (BP * BD)))
    return dict(G=group, PAGE_SIZE=page_size, BM=BM, BP=BP, BD=BD)
