"""The candidates' estimated attention mass from 4-bit keys (issue 35's second stage; docs/design_rerank.md;
Twilight, Lin et al., arXiv 2502.02770, which scores Quest's candidates with INT4 keys).

For row ``b``, KV head ``h``, its ``M = Tq·G`` query rows ``q_m`` and candidate pages ``j`` (``cand[b, h, :]``)::

    k~_t  = k_min[j] + code_t * (k_max[j] - k_min[j]) / 15     (the row's last page: its exact keys)
    l_mt  = scale * q_m . k~_t                                  (-inf where query m does not see key t)
    Z_m   = logsumexp_t l_mt
    mu_j  = log sum_m sum_{t in j} exp(l_mt - Z_m)               -> out[b, h, j]

Grid: ``(B, Hkv)``: one program walks the candidates twice per block of ``BM`` query rows (an online
``logsumexp`` for ``Z``, then the per-page mass), ``BS`` slots x ``D/2`` packed bytes per page tile, two
``tl.dot`` per tile (the low and the high nibbles' channels). The masses stay in registers (``[BC]``, one per
candidate) until one scatter store of their logs; the launcher fills ``out`` with ``-inf`` first. Reads ``S·D/2``
bytes per candidate page and head: 1/8 of its fp32 keys.
"""
import triton
import triton.language as tl

from . import pad_head_dim


@triton.jit
def _candidate_logits(
    b_qa, b_qb,  # [BM, BDH] fp32 the rows' channels [0, D/2) and [D/2, D)
    o_qpos, o_qlo, m_m,  # [BM] positions, first visible key, real rows
    cand, k_code, k_cache, k_min, k_max, k_scale, block_table,
    i_b, i_h, c, n_pages, seq_len, scale,
    stride_cb, stride_ch,
    stride_bt,
    stride_cp, stride_cs, stride_chh, stride_cd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_np, stride_nh, stride_nd,
    stride_xp, stride_xh, stride_xd,
    stride_sp, stride_sh,
    HALF,
    PAGE_SIZE: tl.constexpr,
    BS: tl.constexpr,
    BDH: tl.constexpr,
    QUANT: tl.constexpr,
):
    """``[BM, BS]`` scaled logits of candidate ``c`` (``-inf`` where hidden, padded or not a candidate)."""
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BDH)
    # the candidate's page id, as [BS] and [BDH] vectors (the interpreter cannot mask with a loaded scalar's bool)
    j_s = tl.load(cand + i_b * stride_cb + i_h * stride_ch + c + o_s * 0).to(tl.int64)  # [BS], all equal
    j_d = tl.load(cand + i_b * stride_cb + i_h * stride_ch + c + o_d * 0).to(tl.int64)  # [BDH]
    ok_s = (j_s >= 0) & (j_s < n_pages)
    ok_d = (j_d >= 0) & (j_d < n_pages)
    j = tl.max(tl.where(ok_s, j_s, 0), axis=0)
    i_p = tl.load(block_table + i_b * stride_bt + j).to(tl.int64)
    # the row's last page is read exactly (it is always attended; its codes exist only once it is full)
    last_s = j_s == n_pages - 1
    o_kpos = j * PAGE_SIZE + o_s  # [BS]
    m_s = ok_s & (o_s < PAGE_SIZE) & (o_kpos < seq_len)  # [BS]
    m_d = o_d < HALF
    p_n = k_min + i_p * stride_np + i_h * stride_nh
    p_x = k_max + i_p * stride_xp + i_h * stride_xh
    b_lo_a = tl.load(p_n + o_d * stride_nd, mask=m_d & ok_d, other=0.0).to(tl.float32)
    b_lo_b = tl.load(p_n + (o_d + HALF) * stride_nd, mask=m_d & ok_d, other=0.0).to(tl.float32)
    b_st_a = (tl.load(p_x + o_d * stride_xd, mask=m_d & ok_d, other=0.0).to(tl.float32) - b_lo_a) / 15.0
    b_st_b = (tl.load(p_x + (o_d + HALF) * stride_xd, mask=m_d & ok_d, other=0.0).to(tl.float32) - b_lo_b) / 15.0
    b_st_a = tl.where(b_st_a > 0.0, b_st_a, 0.0)
    b_st_b = tl.where(b_st_b > 0.0, b_st_b, 0.0)
    m_c = m_s[:, None] & m_d[None, :]  # [BS, BDH]
    p_c = k_code + i_p * stride_cp + o_s[:, None] * stride_cs + i_h * stride_chh + o_d[None, :] * stride_cd
    b_code = tl.load(p_c, mask=m_c & ~last_s[:, None], other=0)  # [BS, BDH] uint8
    b_ka = b_lo_a[None, :] + (b_code & 15).to(tl.float32) * b_st_a[None, :]
    b_kb = b_lo_b[None, :] + (b_code >> 4).to(tl.float32) * b_st_b[None, :]
    p_k = k_cache + i_p * stride_kp + o_s[:, None] * stride_ks + i_h * stride_kh
    b_ea = tl.load(p_k + o_d[None, :] * stride_kd, mask=m_c & last_s[:, None], other=0.0).to(tl.float32)
    b_eb = tl.load(p_k + (o_d[None, :] + HALF) * stride_kd, mask=m_c & last_s[:, None], other=0.0).to(tl.float32)
    if QUANT:
        b_sc = tl.load(k_scale + i_p * stride_sp + i_h * stride_sh + o_s * 0, mask=m_s & last_s, other=0.0)
        b_sc = tl.max(b_sc, axis=0)  # the page's K scale (0 when it is not the last page: unused then)
        b_ea = b_ea * b_sc
        b_eb = b_eb * b_sc
    b_ka = tl.where(last_s[:, None], b_ea, b_ka)
    b_kb = tl.where(last_s[:, None], b_eb, b_kb)
    b_l = tl.dot(b_qa, tl.trans(b_ka), input_precision="ieee") + tl.dot(b_qb, tl.trans(b_kb), input_precision="ieee")
    m_vis = m_m[:, None] & m_s[None, :] & (o_kpos[None, :] <= o_qpos[:, None]) & (o_kpos[None, :] >= o_qlo[:, None])
    return tl.where(m_vis, b_l * scale, float("-inf"))


@triton.jit
def rerank_kernel(
    q,  # [B, Tq, Hq, D]
    k_code,  # [num_pages, page_size, Hkv, D // 2] uint8
    k_cache,  # [num_pages, page_size, Hkv, D] (the last pages' exact keys)
    k_min, k_max,  # [num_pages, Hkv, D]
    k_scale,  # [num_pages, Hkv] fp32 (QUANT only)
    cand,  # [B, Hkv, C] int32 logical pages, -1 padded
    block_table,  # [B, MAXP] int32
    seq_lens,  # [B] int32
    out,  # [B, Hkv, MAXP] fp32, filled with -inf by the launcher
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_cb, stride_ch,
    stride_bt,
    stride_cp, stride_cs, stride_chh, stride_cd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_np, stride_nh, stride_nd,
    stride_xp, stride_xh, stride_xd,
    stride_sp, stride_sh,
    stride_ob, stride_oh, stride_oj,
    TQ, C, HALF, scale,
    WINDOW_LEFT,  # -1: no window
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BM: tl.constexpr,
    BS: tl.constexpr,
    BDH: tl.constexpr,
    BC: tl.constexpr,
    QUANT: tl.constexpr = False,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens + i_b).to(tl.int64)
    n_pages = (seq_len + PAGE_SIZE - 1) // PAGE_SIZE
    o_c = tl.arange(0, BC)
    b_mass = tl.zeros([BC], tl.float32)  # per candidate, summed over the row blocks
    o_d = tl.arange(0, BDH)
    m_d = o_d < HALF
    for m0 in range(0, TQ * G, BM):
        o_m = m0 + tl.arange(0, BM)
        m_m = o_m < TQ * G
        o_t = (o_m // G).to(tl.int64)
        o_qpos = seq_len - TQ + o_t  # [BM]
        o_qlo = tl.where(WINDOW_LEFT >= 0, o_qpos - WINDOW_LEFT, 0)
        p_q = q + i_b * stride_qb + o_t[:, None] * stride_qt + (i_h * G + o_m % G)[:, None] * stride_qh
        m_q = m_m[:, None] & m_d[None, :]
        b_qa = tl.load(p_q + o_d[None, :] * stride_qd, mask=m_q, other=0.0).to(tl.float32)
        b_qb = tl.load(p_q + (o_d[None, :] + HALF) * stride_qd, mask=m_q, other=0.0).to(tl.float32)
        # pass 1: Z_m, an online logsumexp over every candidate key the row sees
        b_max = tl.full([BM], float("-inf"), tl.float32)
        b_sum = tl.zeros([BM], tl.float32)
        for c in range(0, C):
            b_l = _candidate_logits(b_qa, b_qb, o_qpos, o_qlo, m_m, cand, k_code, k_cache, k_min, k_max, k_scale,
                                    block_table, i_b, i_h, c, n_pages, seq_len, scale, stride_cb, stride_ch,
                                    stride_bt, stride_cp, stride_cs, stride_chh, stride_cd, stride_kp, stride_ks,
                                    stride_kh, stride_kd, stride_np, stride_nh, stride_nd, stride_xp, stride_xh,
                                    stride_xd, stride_sp, stride_sh, HALF, PAGE_SIZE, BS, BDH, QUANT)
            b_new = tl.maximum(b_max, tl.max(b_l, axis=1))
            b_shift = tl.where(b_new == float("-inf"), 0.0, b_new)
            b_sum = b_sum * tl.exp(b_max - b_shift) + tl.sum(tl.exp(b_l - b_shift[:, None]), axis=1)
            b_max = b_new
        # a row that sees no candidate key: Z = 0 and its exps are all 0 (it adds nothing); a +inf logit: Z = +inf
        # as logsumexp's (b_sum is NaN then), so the +inf keys' shares are NaN, stored as -inf below, and the
        # others' 0; a NaN logit: Z is NaN, every share NaN (the reference's rule)
        b_z = tl.where(b_max == float("-inf"), 0.0, tl.where(b_max == float("inf"), b_max, b_max + tl.log(b_sum)))
        # pass 2: each candidate's share of every row's mass
        for c in range(0, C):
            b_l = _candidate_logits(b_qa, b_qb, o_qpos, o_qlo, m_m, cand, k_code, k_cache, k_min, k_max, k_scale,
                                    block_table, i_b, i_h, c, n_pages, seq_len, scale, stride_cb, stride_ch,
                                    stride_bt, stride_cp, stride_cs, stride_chh, stride_cd, stride_kp, stride_ks,
                                    stride_kh, stride_kd, stride_np, stride_nh, stride_nd, stride_xp, stride_xh,
                                    stride_xd, stride_sp, stride_sh, HALF, PAGE_SIZE, BS, BDH, QUANT)
            b_page = tl.sum(tl.sum(tl.exp(b_l - b_z[:, None]), axis=1), axis=0)
            b_mass = tl.where(o_c == c, b_mass + b_page, b_mass)
    o_j = tl.load(cand + i_b * stride_cb + i_h * stride_ch + o_c, mask=o_c < C, other=-1).to(tl.int64)
    m_j = (o_j >= 0) & (o_j < n_pages)
    b_mu = tl.where(b_mass > 0.0, tl.log(b_mass), float("-inf"))
    tl.store(out + i_b * stride_ob + i_h * stride_oh + o_j * stride_oj, b_mu, mask=m_j)


def rerank_blocks(num_queries: int, group: int, head_dim: int, page_size: int, num_candidates: int) -> dict:
    """Constexprs of ``rerank_kernel`` (shared with compile.py): ``BM`` the ``Tq·G`` rows padded to a power of
    two >= 16 (``tl.dot``), at most 64; ``BS`` the page padded to >= 16; ``BC`` the candidates padded."""
    return dict(G=group, PAGE_SIZE=page_size, BM=min(64, max(16, triton.next_power_of_2(num_queries * group))),
                BS=max(16, page_size), BDH=pad_head_dim(head_dim // 2),
                BC=max(1, triton.next_power_of_2(max(num_candidates, 1))))
