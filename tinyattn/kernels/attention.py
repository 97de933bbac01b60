"""Fused paged attention over all valid pages (dense) or over selected pages (sparse), with split-K.

Sparse mode attends only to the pages that Quest (Tang et al., ICML 2024) / TinyServe
(arXiv 2509.12211, eq. 2-3) selected by their upper-bound score ``sum_i max(q_i k_min_i, q_i k_max_i)``;
dense mode walks every valid page and is the baseline.

Program ``(b, h * NUM_MB + mb, s)`` owns KV head ``h`` of row ``b``, query block ``mb`` and split ``s``.
Its ``BLOCK_M`` rows are the flattened ``(query token t, query head g of the group)`` pairs
``m = t * G + g``, so every query head of a GQA group and every query token reads each K/V tile once.
The program walks the list of pages (dense: ``0 .. n-1``; sparse: ``page_indices[b, h]``) as one
stream of ``len(list) * PAGE_SIZE`` tokens, ``BLOCK_N`` tokens per iteration (``BLOCK_N / PAGE_SIZE``
pages per iteration when pages are small, part of a page when they are large): one ``[BLOCK_N, BD]``
K tile and V tile, online softmax in fp32 (base 2, with ``scale * log2(e)`` folded into the logits).

Causality is bottom-right aligned: query ``t`` sits at ``p = seq_len - Tq + t`` and sees keys at positions
``<=`` its own; with a sliding window (``WINDOW_LEFT >= 0``, FlashInfer's ``window_left``) only those at
positions ``>= p - WINDOW_LEFT`` too, and the dense walk starts at the page of the block's earliest
query's first visible key (pages wholly before every window of the block are never read). A row that sees
no key keeps ``m = -inf, l = 0`` and writes ``out = 0, lse = -inf``.

Split-K: the token stream of a row is cut into ``num_splits`` contiguous ranges; each split writes its
normalised partial output and base-2 LSE to an fp32 workspace, and ``merge_splits_kernel`` combines
them by LSE weights ``exp2(lse_s - max_s lse_s)`` in fp32 (partials are never rounded to 16 bits).
"""

import torch
import triton
import triton.language as tl

from . import pad_head_dim

LOG2E = 1.4426950408889634                # log2(e): the kernels use exp2/log2, so logits are scaled by it
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)  # the same constant, readable inside @triton.jit bodies
NUM_SMS_DEFAULT = 132  # H100 SXM; used when no CUDA device can be queried


@triton.jit(do_not_specialize=["WINDOW_LEFT"])  # one binary for every window (no ==1 / %16 variants)
def attn_fwd_kernel(
    q,  # [B, TQ, HQ, D]
    k_cache,  # [num_pages, page_size, Hkv, D]
    v_cache,  # [num_pages, page_size, Hkv, D]
    block_table,  # [B, MAXP] int32
    seq_lens,  # [B] int32
    page_indices,  # [B, HKV, K] int32 logical pages (SPARSE only)
    k_scale,  # [num_pages, Hkv] fp32 (QUANT only)
    v_scale,  # [num_pages, Hkv] fp32 (QUANT only)
    out,  # [B, TQ, HQ, D]                 (not SPLIT)
    lse,  # [B, TQ, HQ] fp32 natural log   (not SPLIT)
    ws_o,  # [num_splits, B, Tq, Hq, D] fp32        (SPLIT)
    ws_lse,  # [num_splits, B, Tq, Hq] fp32 base 2  (SPLIT)
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_ib, stride_ih,
    stride_sp, stride_sh,  # k_scale and v_scale (the same strides)
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    stride_ws, stride_wb, stride_wt, stride_wh,
    stride_zs, stride_zb, stride_zt, stride_zh,
    qk_scale,  # scale * log2(e)
    TQ, D, NUM_MB, NUM_LIST, NUM_SPLITS,
    WINDOW_LEFT,  # keys before its own position a query sees; -1 = no window
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BD: tl.constexpr,
    SPARSE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr = False,  # int8 / fp8 e4m3 K/V: dequantized in registers by their (page, head) scale
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = (tl.program_id(1) // NUM_MB).to(tl.int64)
    i_mb = tl.program_id(1) % NUM_MB
    i_s = tl.program_id(2)
    seq_len = tl.load(seq_lens + i_b)

    # rows of the tile: query token o_t, query head o_hq, absolute position o_qpos
    o_m = i_mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_m = o_m < TQ * G
    o_t = o_m // G
    o_hq = i_h * G + o_m % G
    o_qpos = seq_len - TQ + o_t  # [BM]
    o_qlo = _window_start(o_qpos, WINDOW_LEFT)  # [BM] int64 first visible key position (-1: no window)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_q = (q + i_b * stride_qb + o_t[:, None].to(tl.int64) * stride_qt + o_hq[:, None] * stride_qh
           + o_d[None, :] * stride_qd)
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    if UPCAST or QUANT:
        b_q = b_q.to(tl.float32)

    tok0, n_tok = _block_tokens(seq_len, i_mb, TQ, G, WINDOW_LEFT, NUM_LIST, BLOCK_M, PAGE_SIZE, SPARSE)
    n_it = tl.cdiv(tl.maximum(n_tok - tok0, 0), BLOCK_N)
    it_per_split = tl.cdiv(n_it, NUM_SPLITS)
    it_lo = i_s * it_per_split
    it_hi = tl.minimum(it_lo + it_per_split, n_it)

    # loop invariants: per-row base pointers of the block table / page list, per-channel K/V pointers
    p_bt = block_table + i_b * stride_bt
    p_idx = page_indices + i_b * stride_ib + i_h * stride_ih
    o_d64 = o_d.to(tl.int64)
    p_k0 = k_cache + i_h * stride_kh + o_d64[None, :] * stride_kd  # [1, BD]
    p_v0 = v_cache + i_h * stride_vh + o_d64[None, :] * stride_vd  # [1, BD]
    p_ks0 = k_scale + i_h * stride_sh  # scales of KV head i_h: + page * stride_sp
    p_vs0 = v_scale + i_h * stride_sh
    o_n = tl.arange(0, BLOCK_N)

    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
    b_l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    b_acc = tl.zeros([BLOCK_M, BD], tl.float32)
    for it in range(it_lo, it_hi):
        b_m, b_l, b_acc = _attn_tile(
            b_q, b_m, b_l, b_acc, tok0 + it * BLOCK_N + o_n, o_qpos, o_qlo, m_d, seq_len, n_tok,
            p_bt, p_idx, p_k0, p_v0, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale,
            p_ks0, p_vs0, stride_sp,
            PAGE_SIZE, SPARSE, UPCAST, PRECISION, QUANT,
        )

    # rows that saw no key: l = 0, acc = 0 -> out 0, lse -inf (never 0/0)
    b_l_safe = tl.where(b_l == 0.0, 1.0, b_l)
    b_o = b_acc / b_l_safe[:, None]  # [BM, BD]
    b_lse2 = tl.where(b_l == 0.0, float("-inf"), b_m + tl.log2(b_l_safe))  # [BM]
    m_o = m_m[:, None] & m_d[None, :]
    if SPLIT:
        p_w = (ws_o + i_s.to(tl.int64) * stride_ws + i_b * stride_wb + o_t[:, None].to(tl.int64) * stride_wt
               + o_hq[:, None] * stride_wh + o_d[None, :])
        tl.store(p_w, b_o, mask=m_o)
        p_z = ws_lse + i_s.to(tl.int64) * stride_zs + i_b * stride_zb + o_t.to(tl.int64) * stride_zt + o_hq * stride_zh
        tl.store(p_z, b_lse2, mask=m_m)
    else:
        p_o = (out + i_b * stride_ob + o_t[:, None].to(tl.int64) * stride_ot + o_hq[:, None] * stride_oh
               + o_d[None, :] * stride_od)
        tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_o)
        p_l = lse + i_b * stride_lb + o_t.to(tl.int64) * stride_lt + o_hq * stride_lh
        tl.store(p_l, b_lse2 / _LOG2E, mask=m_m)


@triton.jit
def _window_start(o_qpos, WINDOW_LEFT):
    """First key position each query at ``o_qpos`` sees: ``o_qpos - WINDOW_LEFT`` (int64, no overflow for any
    window), or ``-1`` (every key) without a window."""
    return tl.where(WINDOW_LEFT >= 0, o_qpos.to(tl.int64) - WINDOW_LEFT, -1)


@triton.jit
def _block_tokens(seq_len, i_mb, TQ, G, WINDOW_LEFT, NUM_LIST, BLOCK_M: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  SPARSE: tl.constexpr):
    """The stretch of the page list's token stream that query block ``i_mb`` (rows ``t * G + g``) walks:
    ``(tok0, n_tok)``, tokens ``[tok0, n_tok)``. Sparse: the whole list (``NUM_LIST`` pages; the tile masks
    invalid ids). Dense: the valid pages cut at the last page the block's newest query sees, started at the page
    holding the first key its earliest query's window keeps (token 0 without a window). One copy for the forward
    and backward kernels."""
    if SPARSE:
        tok0 = 0
        n_list = NUM_LIST
    else:
        t_last = tl.minimum(TQ - 1, (i_mb * BLOCK_M + BLOCK_M - 1) // G)
        n_seen = tl.maximum(seq_len - TQ + t_last + 1, 0)
        n_list = (tl.minimum(seq_len, n_seen) + PAGE_SIZE - 1) // PAGE_SIZE
        lo = tl.maximum(_window_start(seq_len - TQ + (i_mb * BLOCK_M) // G, WINDOW_LEFT), 0)  # no window: token 0
        tok0 = ((lo // PAGE_SIZE) * PAGE_SIZE).to(tl.int32)
    return tok0, n_list * PAGE_SIZE


@triton.jit
def _attn_tile(
    b_q, b_m, b_l, b_acc, o_u, o_qpos, o_qlo, m_d, seq_len, n_tok,
    p_bt, p_idx, p_k0, p_v0, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale,
    p_ks0, p_vs0, stride_sp,
    PAGE_SIZE: tl.constexpr,
    SPARSE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One step of the online softmax over tokens ``o_u`` [BN] of the page list; returns ``(m, l, acc)``."""
    m_u = o_u < n_tok
    o_slot = o_u % PAGE_SIZE
    if SPARSE:
        o_j = tl.load(p_idx + o_u // PAGE_SIZE, mask=m_u, other=-1)  # [BN] logical page (-1: none)
    else:
        o_j = o_u // PAGE_SIZE  # [BN] logical page
    o_kpos = o_j * PAGE_SIZE + o_slot  # [BN] absolute key position
    # a key exists when its page is listed (not -1) and it is before seq_len: never read past it
    m_n = m_u & (o_j >= 0) & (o_kpos < seq_len)
    o_p = tl.load(p_bt + o_j, mask=m_n, other=0).to(tl.int64)  # [BN] physical page, 64-bit before the stride
    o_slot = o_slot.to(tl.int64)
    m_kv = m_n[:, None] & m_d[None, :]  # [BN, BD]
    b_k = tl.load(p_k0 + (o_p * stride_kp + o_slot * stride_ks)[:, None], mask=m_kv, other=0.0)  # [BN, BD]
    b_v = tl.load(p_v0 + (o_p * stride_vp + o_slot * stride_vs)[:, None], mask=m_kv, other=0.0)  # [BN, BD]
    if QUANT:  # codes -> values in registers: code.to(fp32) * scale[page, head], the product every backend uses
        b_sk = tl.load(p_ks0 + o_p * stride_sp, mask=m_n, other=0.0)  # [BN] fp32
        b_sv = tl.load(p_vs0 + o_p * stride_sp, mask=m_n, other=0.0)  # [BN]
        b_k = b_k.to(tl.float32) * b_sk[:, None]  # [BN, BD]
        b_v = b_v.to(tl.float32) * b_sv[:, None]
    elif UPCAST:
        b_k = b_k.to(tl.float32)
        b_v = b_v.to(tl.float32)

    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # [BM, BN]
    m_vis = m_n[None, :] & (o_kpos[None, :] <= o_qpos[:, None]) & (o_kpos[None, :] >= o_qlo[:, None])  # [BM, BN]
    b_s = tl.where(m_vis, b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))  # [BM]
    # a row with nothing seen so far has m = -inf: shift by 0 so that exp2(-inf - -inf) never occurs
    b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # [BM]
    b_alpha = tl.exp2(b_m - b_shift)  # [BM]
    b_p = tl.exp2(b_s - b_shift[:, None])  # [BM, BN]
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    # the probabilities (FlashAttention's P) in the V dtype (fp16/bf16 tensor-core dot on GPU), fp32 accumulator
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return b_m_new, b_l, b_acc


@triton.jit
def merge_splits_kernel(
    ws_o,  # [num_splits, B, Tq, Hq, D] fp32
    ws_lse,  # [num_splits, B, Tq, Hq] fp32 base 2
    out,  # [B, TQ, HQ, D]
    lse,  # [B, TQ, HQ] fp32
    stride_ws, stride_wb, stride_wt, stride_wh,
    stride_zs, stride_zb, stride_zt, stride_zh,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    TQ, HQ, D, NUM_SPLITS,
    BH: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
):
    i_b = (tl.program_id(0) // TQ).to(tl.int64)
    i_t = (tl.program_id(0) % TQ).to(tl.int64)
    o_h = tl.program_id(1) * BH + tl.arange(0, BH)  # [BH] query heads
    o_s = tl.arange(0, BS)  # [BS] splits
    o_d = tl.arange(0, BD)
    m_hs = (o_h[:, None] < HQ) & (o_s[None, :] < NUM_SPLITS)  # [BH, BS]
    m_d = o_d < D

    p_z = ws_lse + o_s[None, :].to(tl.int64) * stride_zs + i_b * stride_zb + i_t * stride_zt + o_h[:, None] * stride_zh
    b_lse = tl.load(p_z, mask=m_hs, other=float("-inf"))  # [BH, BS]
    b_max = tl.max(b_lse, axis=1)  # [BH]
    b_w = tl.exp2(b_lse - tl.where(b_max == float("-inf"), 0.0, b_max)[:, None])  # [BH, BS], 0 for empty splits
    b_sum = tl.sum(b_w, axis=1)  # [BH]
    b_sum_safe = tl.where(b_sum == 0.0, 1.0, b_sum)  # rows no split saw: out 0, lse -inf
    p_w = (ws_o + o_s[None, :, None].to(tl.int64) * stride_ws + i_b * stride_wb + i_t * stride_wt
           + o_h[:, None, None] * stride_wh + o_d[None, None, :])
    b_po = tl.load(p_w, mask=m_hs[:, :, None] & m_d[None, None, :], other=0.0)  # [BH, BS, BD]
    b_o = tl.sum(b_w[:, :, None] * b_po, axis=1) / b_sum_safe[:, None]  # [BH, BD]
    b_lse_out = tl.where(b_sum == 0.0, float("-inf"), (b_max + tl.log2(b_sum_safe)) / _LOG2E)

    m_h = o_h < HQ
    p_o = out + i_b * stride_ob + i_t * stride_ot + o_h[:, None] * stride_oh + o_d[None, :] * stride_od
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])
    tl.store(lse + i_b * stride_lb + i_t * stride_lt + o_h * stride_lh, b_lse_out, mask=m_h)


def attention_blocks(num_queries: int, group: int, head_dim: int, page_size: int) -> dict:
    """Constexprs and launch options of ``attn_fwd_kernel`` (shared with compile.py).

    BLOCK_M: the ``Tq * G`` rows padded to a power of two >= 16 (``tl.dot``), at most 64 (32 when
    BD = 256), larger prefills get several query blocks. BLOCK_N: 64 tokens per iteration (32 when
    BD = 256) so that a K and a V tile stay small in shared memory, i.e. ``64 / page_size`` pages.
    """
    BD = pad_head_dim(head_dim)
    cap = 64 if BD <= 128 else 32
    BLOCK_M = max(16, min(triton.next_power_of_2(num_queries * group), cap))
    BLOCK_N = 64 if BD <= 128 else 32
    num_warps = 4 if BLOCK_M * BD <= 64 * 64 else 8
    return dict(G=group, PAGE_SIZE=page_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BD=BD, num_warps=num_warps)


def merge_blocks(num_heads: int, num_splits: int, head_dim: int) -> dict:
    """Constexprs of ``merge_splits_kernel`` (shared with compile.py)."""
    BD = triton.next_power_of_2(head_dim)
    BS = triton.next_power_of_2(num_splits)
    BH = max(1, min(triton.next_power_of_2(num_heads), 4096 // (BS * BD)))
    return dict(BH=BH, BS=BS, BD=BD)


def choose_num_splits(num_programs: int, max_tokens: int, block_n: int, num_sms: int) -> int:
    """Split the pages of a row when the grid would not fill the GPU (decode, long context, small batch).

    Aims at ~one wave of ``num_sms`` programs, but gives each split at least 4 iterations of
    ``block_n`` tokens so that the merge stays cheap; 1 for short contexts or large grids.
    """
    if num_programs >= num_sms:
        return 1
    by_work = max_tokens // (4 * block_n)
    return max(1, min(triton.cdiv(num_sms, num_programs), by_work, 64))


def plan_num_splits(batch: int, num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    page_size: int, num_list: int, device: torch.device) -> int:
    """``num_splits`` that :func:`paged_attention` picks for these sizes (a plan computes it once per step)."""
    meta = attention_blocks(num_queries, num_heads // num_kv_heads, head_dim, page_size)
    num_mb = triton.cdiv(num_queries * num_heads // num_kv_heads, meta["BLOCK_M"])
    return choose_num_splits(batch * num_kv_heads * num_mb, num_list * page_size, meta["BLOCK_N"], num_sms(device))


def num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT
