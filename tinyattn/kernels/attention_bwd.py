"""Backward of the fused paged attention (dense or over selected pages), and per-page gradient norms.

Recomputes the attention probabilities from ``q``, ``k`` and the forward's log-sum-exp, as
FlashAttention-2 (Dao, 2023, Alg. 2) does, on the same page walk as ``attention.attn_fwd_kernel``:

    P  = exp(scale * q k^T - lse)                 (0 where the key is masked, or the row sees nothing)
    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - delta),   delta = rowsum(dO * O) - dlse
    dQ = scale * dS K,       dK = scale * dS^T Q

Program ``(b, h * NUM_MB + mb)`` owns KV head ``h`` of row ``b`` and query block ``mb`` (rows
``m = t * G + g``: query token ``t``, query head ``g`` of the group), exactly as in the forward. It
holds its ``dQ`` tile in registers for the whole walk and stores it once (no atomics on dQ). ``delta``
is computed by the program itself from its own ``dO`` and ``O`` rows before the walk (it owns them all),
so no separate pre-processing launch is needed. ``dK`` and ``dV`` tiles are added with ``tl.atomic_add``
into fp32 buffers shaped like the page pool: a physical page can be read by several rows (prefix
sharing), by several query blocks, and by several logical pages; the launcher casts the buffers to the
cache dtype at the end. Only slots of listed pages below ``seq_len`` are ever touched, so gradients of
unselected pages and of padding slots stay exactly zero. The mask (page listed, slot valid,
bottom-right causal, sliding window ``WINDOW_LEFT``) and the page walk (dense: from the page of the block's
first visible key) are the forward's.

``page_grad_norm_kernel``: ``||dK[p, :, h]||^2 + ||dV[p, :, h]||^2`` per physical page and KV head,
the signal of the gradient-aware KV retention of TinyServe (Liu & Yu, arXiv 2509.12211, §3.4).
"""

import triton
import triton.language as tl

from . import pad_head_dim
from .attention import _LOG2E, _block_tokens, _window_start


@triton.jit(do_not_specialize=["WINDOW_LEFT"])  # one binary for every window
def attn_bwd_kernel(
    q,  # [B, TQ, HQ, D]
    k_cache,  # [num_pages, page_size, Hkv, D]
    v_cache,  # [num_pages, page_size, Hkv, D]
    block_table,  # [B, MAXP] int32
    seq_lens,  # [B] int32
    page_indices,  # [B, HKV, K] int32 logical pages (SPARSE only)
    out,  # [B, TQ, HQ, D]  forward output
    dout,  # [B, TQ, HQ, D]
    lse,  # [B, TQ, HQ] fp32 natural log
    dlse,  # [B, TQ, HQ] fp32 (HAS_DLSE only)
    dq,  # [B, TQ, HQ, D]
    dk,  # [num_pages, page_size, Hkv, D] fp32, zero-initialised, accumulated atomically
    dv,  # [num_pages, page_size, Hkv, D] fp32, zero-initialised, accumulated atomically
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_ib, stride_ih,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_gb, stride_gt, stride_gh, stride_gd,
    stride_lb, stride_lt, stride_lh,
    stride_eb, stride_et, stride_eh,
    stride_xb, stride_xt, stride_xh, stride_xd,
    stride_ap, stride_as, stride_ah,
    scale,  # softmax scale
    qk_scale,  # scale * log2(e)
    TQ, D, NUM_MB, NUM_LIST,
    WINDOW_LEFT,  # keys before its own position a query sees; -1 = no window
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BD: tl.constexpr,
    SPARSE: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = (tl.program_id(1) // NUM_MB).to(tl.int64)
    i_mb = tl.program_id(1) % NUM_MB
    seq_len = tl.load(seq_lens + i_b)

    o_m = i_mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_m = o_m < TQ * G
    o_t = o_m // G
    o_hq = i_h * G + o_m % G
    o_qpos = seq_len - TQ + o_t  # [BM]
    o_qlo = _window_start(o_qpos, WINDOW_LEFT)  # [BM] int64 first visible key position (-1: no window)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_md = m_m[:, None] & m_d[None, :]  # [BM, BD]
    o_t64 = o_t[:, None].to(tl.int64)
    p_q = q + i_b * stride_qb + o_t64 * stride_qt + o_hq[:, None] * stride_qh + o_d[None, :] * stride_qd
    p_o = out + i_b * stride_ob + o_t64 * stride_ot + o_hq[:, None] * stride_oh + o_d[None, :] * stride_od
    p_g = dout + i_b * stride_gb + o_t64 * stride_gt + o_hq[:, None] * stride_gh + o_d[None, :] * stride_gd
    b_q = tl.load(p_q, mask=m_md, other=0.0)  # [BM, BD]
    b_do = tl.load(p_g, mask=m_md, other=0.0)  # [BM, BD]
    if UPCAST:
        b_q = b_q.to(tl.float32)
        b_do = b_do.to(tl.float32)
    b_o = tl.load(p_o, mask=m_md, other=0.0).to(tl.float32)  # [BM, BD]
    # delta = rowsum(dO * O) - dlse: d lse / d s = P folds the lse gradient into the same formula
    b_delta = tl.sum(b_do.to(tl.float32) * b_o, axis=1)  # [BM]
    o_l = i_b * stride_lb + o_t.to(tl.int64) * stride_lt + o_hq * stride_lh
    b_lse = tl.load(lse + o_l, mask=m_m, other=0.0)  # [BM] natural log, -inf for rows that see nothing
    if HAS_DLSE:
        o_e = i_b * stride_eb + o_t.to(tl.int64) * stride_et + o_hq * stride_eh
        b_delta -= tl.load(dlse + o_e, mask=m_m, other=0.0)
    # a row that sees nothing has lse = -inf and every logit masked: shift by 0 so no inf - inf occurs
    b_lse2 = tl.where(b_lse == float("-inf"), 0.0, b_lse * _LOG2E)  # [BM] base 2

    tok0, n_tok = _block_tokens(seq_len, i_mb, TQ, G, WINDOW_LEFT, NUM_LIST, BLOCK_M, PAGE_SIZE, SPARSE)
    n_it = tl.cdiv(tl.maximum(n_tok - tok0, 0), BLOCK_N)

    b_dq = tl.zeros([BLOCK_M, BD], tl.float32)
    for it in range(0, n_it):
        o_u = tok0 + it * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] index in the token stream of the page list
        m_u = o_u < n_tok
        o_slot = o_u % PAGE_SIZE
        if SPARSE:
            o_j = tl.load(page_indices + i_b * stride_ib + i_h * stride_ih + o_u // PAGE_SIZE, mask=m_u, other=-1)
        else:
            o_j = o_u // PAGE_SIZE  # [BN] logical page
        o_kpos = o_j * PAGE_SIZE + o_slot  # [BN]
        m_n = m_u & (o_j >= 0) & (o_kpos < seq_len)  # [BN] a key exists here
        o_p = tl.load(block_table + i_b * stride_bt + o_j, mask=m_n, other=0).to(tl.int64)  # [BN] physical page
        m_kv = m_n[:, None] & m_d[None, :]  # [BN, BD]
        p_k = (k_cache + o_p[:, None] * stride_kp + o_slot[:, None] * stride_ks + i_h * stride_kh
               + o_d[None, :] * stride_kd)
        p_v = (v_cache + o_p[:, None] * stride_vp + o_slot[:, None] * stride_vs + i_h * stride_vh
               + o_d[None, :] * stride_vd)
        b_k = tl.load(p_k, mask=m_kv, other=0.0)  # [BN, BD]
        b_v = tl.load(p_v, mask=m_kv, other=0.0)  # [BN, BD]
        if UPCAST:
            b_k = b_k.to(tl.float32)
            b_v = b_v.to(tl.float32)

        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # [BM, BN] base 2
        m_vis = (m_m[:, None] & m_n[None, :] & (o_kpos[None, :] <= o_qpos[:, None])
                 & (o_kpos[None, :] >= o_qlo[:, None]))  # [BM, BN]
        b_p = tl.where(m_vis, tl.exp2(tl.where(m_vis, b_s, 0.0) - b_lse2[:, None]), 0.0)  # [BM, BN]
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)  # [BM, BN]
        b_ds = b_p * (b_dp - b_delta[:, None])  # [BM, BN]
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PRECISION)  # [BM, BD]
        b_dk = tl.dot(tl.trans(b_ds).to(b_q.dtype), b_q, input_precision=PRECISION) * scale  # [BN, BD]
        b_dv = tl.dot(tl.trans(b_p).to(b_do.dtype), b_do, input_precision=PRECISION)  # [BN, BD]
        # pool-shaped fp32 buffers: several rows / query blocks may add into the same page
        o_a = o_p[:, None] * stride_ap + o_slot[:, None] * stride_as + i_h * stride_ah + o_d[None, :]  # [BN, BD]
        tl.atomic_add(dk + o_a, b_dk, mask=m_kv)
        tl.atomic_add(dv + o_a, b_dv, mask=m_kv)

    p_dq = dq + i_b * stride_xb + o_t64 * stride_xt + o_hq[:, None] * stride_xh + o_d[None, :] * stride_xd
    tl.store(p_dq, (b_dq * scale).to(dq.dtype.element_ty), mask=m_md)


@triton.jit
def page_grad_norm_kernel(
    dk,  # [num_pages, page_size, Hkv, D]
    dv,  # [num_pages, page_size, Hkv, D]
    norms,  # [num_pages, Hkv] fp32
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_np, stride_nh,
    P, D,  # P = num_pages (the pool), D = head_dim
    PAGE_SIZE: tl.constexpr,
    BP: tl.constexpr,
    BD: tl.constexpr,
):
    i_pb = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    o_r = tl.arange(0, BP * PAGE_SIZE)  # [BR] (page, slot) pairs of the block
    o_p = (i_pb * BP + o_r // PAGE_SIZE).to(tl.int64)  # [BR]
    o_s = o_r % PAGE_SIZE
    o_d = tl.arange(0, BD)
    m = (o_p < P)[:, None] & (o_d < D)[None, :]  # [BR, BD]
    p_k = dk + o_p[:, None] * stride_kp + o_s[:, None] * stride_ks + i_h * stride_kh + o_d[None, :] * stride_kd
    p_v = dv + o_p[:, None] * stride_vp + o_s[:, None] * stride_vs + i_h * stride_vh + o_d[None, :] * stride_vd
    b_k = tl.load(p_k, mask=m, other=0.0).to(tl.float32)  # [BR, BD]
    b_v = tl.load(p_v, mask=m, other=0.0).to(tl.float32)  # [BR, BD]
    b_r = tl.sum(b_k * b_k + b_v * b_v, axis=1)  # [BR]
    b_n = tl.sum(tl.reshape(b_r, [BP, PAGE_SIZE]), axis=1)  # [BP]
    o_pp = (i_pb * BP + tl.arange(0, BP)).to(tl.int64)  # [BP]
    tl.store(norms + o_pp * stride_np + i_h * stride_nh, b_n, mask=o_pp < P)


def page_norm_blocks(page_size: int, head_dim: int) -> dict:
    """Constexprs of ``page_grad_norm_kernel``: ``BP`` pages of ``PAGE_SIZE`` slots, ~4096 elements a tile."""
    BD = pad_head_dim(head_dim)
    BP = max(1, 4096 // (BD * page_size))
    BP = 1 << (BP.bit_length() - 1)  # a power of two, so BP * PAGE_SIZE is one
    return dict(PAGE_SIZE=page_size, BP=BP, BD=BD)
