"""Per-page key bounding boxes (Quest, Tang et al., ICML 2024, sec. 3).

For physical page ``p``, KV head ``h`` and channel ``i``::

    k_min[p, h, i] = min_t K[p, t, h, i],   k_max[p, h, i] = max_t K[p, t, h, i]

over the *valid* slots ``t`` of the page only: the last page of a row is partial and its slots
``>= seq_len - j * page_size`` hold stale or garbage keys that must not widen the box
(TinyServe, arXiv 2509.12211, eq. 2 is an upper bound only if the box is exact).

Grid: ``(B, cdiv(max_pages, BP), Hkv)``; each program reduces ``BP`` pages of one KV head of one
row, ``BS`` slots at a time (a ``[BP, BS, BD]`` tile). A page shared by several rows is written by
each of them with the same value, which is harmless.
"""
import triton
import triton.language as tl

from . import pad_head_dim

# elements of one [BP, BS, BD] tile: ~32 fp32 registers per thread with 4 warps
TILE_ELEMS = 4096


@triton.jit
def page_minmax_kernel(
    k_cache,  # [num_pages, page_size, Hkv, D] any float dtype
    block_table,  # [B, MAXP] int32
    seq_lens,  # [B] int32
    k_min,  # [num_pages, Hkv, D]
    k_max,  # [num_pages, Hkv, D]
    k_scale,  # [num_pages, Hkv] fp32 (QUANT only)
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_bt,
    stride_np, stride_nh, stride_nd,
    stride_xp, stride_xh, stride_xd,
    stride_sp, stride_sh,
    MAXP, D,
    PAGE_SIZE: tl.constexpr,
    BP: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    QUANT: tl.constexpr = False,  # int8 / fp8 e4m3 keys: boxes of code * scale[page, head]
):
    i_b = tl.program_id(0).to(tl.int64)
    i_pb = tl.program_id(1)
    i_h = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens + i_b)

    o_j = i_pb * BP + tl.arange(0, BP)  # [BP] logical pages
    # a page is valid when it holds at least one token; entries past it may be -1 or garbage
    m_j = (o_j < MAXP) & (o_j * PAGE_SIZE < seq_len)
    o_p = tl.load(block_table + i_b * stride_bt + o_j, mask=m_j, other=0).to(tl.int64)  # [BP]
    o_d = tl.arange(0, BD)
    m_d = o_d < D

    b_min = tl.full([BP, BD], float("inf"), tl.float32)
    b_max = tl.full([BP, BD], float("-inf"), tl.float32)
    for s0 in range(0, PAGE_SIZE, BS):  # a real loop: no unrolling of 256-slot pages
        o_s = s0 + tl.arange(0, BS)  # [BS] slots
        # only slots before seq_len are keys; the rest of the last page is padding
        m_s = m_j[:, None] & (o_j[:, None] * PAGE_SIZE + o_s[None, :] < seq_len)  # [BP, BS]
        m_k = m_s[:, :, None] & m_d[None, None, :]  # [BP, BS, BD]
        p_k = (k_cache + o_p[:, None, None] * stride_kp + o_s[None, :, None] * stride_ks
               + i_h * stride_kh + o_d[None, None, :] * stride_kd)
        # min/max are exact in fp32 for every input dtype (also bf16 in the interpreter)
        b_k = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)  # [BP, BS, BD]
        b_min = tl.minimum(b_min, tl.min(tl.where(m_k, b_k, float("inf")), axis=1))  # [BP, BD]
        b_max = tl.maximum(b_max, tl.max(tl.where(m_k, b_k, float("-inf")), axis=1))  # [BP, BD]

    if QUANT:
        # scale > 0 and rounding is monotone: min/max of the codes times the scale are exactly the min/max of
        # the dequantized keys (code.to(fp32) * scale), the values attention reads
        b_sc = tl.load(k_scale + o_p * stride_sp + i_h * stride_sh, mask=m_j, other=1.0)  # [BP]
        b_min = b_min * b_sc[:, None]
        b_max = b_max * b_sc[:, None]
    m_o = m_j[:, None] & m_d[None, :]  # [BP, BD]
    p_n = k_min + o_p[:, None] * stride_np + i_h * stride_nh + o_d[None, :] * stride_nd
    p_x = k_max + o_p[:, None] * stride_xp + i_h * stride_xh + o_d[None, :] * stride_xd
    tl.store(p_n, b_min.to(k_min.dtype.element_ty), mask=m_o)
    tl.store(p_x, b_max.to(k_max.dtype.element_ty), mask=m_o)


def metadata_blocks(page_size: int, head_dim: int, max_pages: int) -> dict:
    """Constexprs of ``page_minmax_kernel`` (shared with compile.py)."""
    BD = pad_head_dim(head_dim)
    BS = min(page_size, max(1, TILE_ELEMS // BD))
    BP = max(1, min(triton.next_power_of_2(max(max_pages, 1)), TILE_ELEMS // (BS * BD)))
    return dict(PAGE_SIZE=page_size, BP=BP, BS=BS, BD=BD)
