"""4-bit key codes of full pages, inside each page's key box (issue 35's second stage; docs/design_rerank.md).

For physical page ``p``, KV head ``h``, slot ``s`` and channel ``i`` (fp32 arithmetic, as the reference)::

    step = (k_max[p, h, i] - k_min[p, h, i]) / 15
    code = clamp(floor((K[p, s, h, i] - k_min[p, h, i]) / step + 0.5), 0, 15)     (0 where step <= 0 or NaN)

packed two per byte: channel ``i`` in the low nibble of ``k_code[p, s, h, i]``, channel ``i + D/2`` in its high
nibble. The box is the quantization range, so no scale is stored: the codes cost ``D/2`` bytes per key and head.

Grid: ``(N, Hkv)`` over the ``N`` slots just written: the program of a slot that is its page's last
(``slot % page_size == page_size - 1``, the write that filled the page) encodes that page's ``BS`` slots at a time;
every other program loads and stores nothing (a fixed grid and a data-dependent mask: no host sync, CUDA-graph
safe). Launch it after the write that grew the boxes (``kv_write.py``).
"""
import triton
import triton.language as tl

from . import pad_head_dim

TILE_ELEMS = 4096


@triton.jit
def _codes(b_k, b_lo, b_step):
    """fp32 ``[BS, BDH]`` keys -> their 4-bit codes (fp32 values 0..15) in the box ``b_lo + code * b_step``."""
    b_x = tl.math.div_rn(b_k - b_lo[None, :], b_step[None, :]) + 0.5
    b_c = tl.minimum(tl.maximum(tl.floor(b_x), 0.0), 15.0)
    return tl.where((b_step[None, :] > 0.0) & (b_x == b_x), b_c, 0.0)


@triton.jit
def encode_key_codes_kernel(
    k_cache,  # [num_pages, page_size, Hkv, D] any float dtype, or int8 / fp8 with k_scale
    slots,  # [N] int32 / int64 physical slots just written
    k_min,  # [num_pages, Hkv, D]
    k_max,  # [num_pages, Hkv, D]
    k_code,  # [num_pages, page_size, Hkv, D // 2] uint8
    k_scale,  # [num_pages, Hkv] fp32 (QUANT only)
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_np, stride_nh, stride_nd,
    stride_xp, stride_xh, stride_xd,
    stride_cp, stride_cs, stride_ch, stride_cd,
    stride_sp, stride_sh,
    HALF,  # D // 2
    PAGE_SIZE: tl.constexpr,
    BS: tl.constexpr,
    BDH: tl.constexpr,
    QUANT: tl.constexpr = False,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots + i_n).to(tl.int64)
    i_p = slot // PAGE_SIZE
    o_d = tl.arange(0, BDH)
    # this write filled the page (a [BDH] mask: the interpreter cannot mask with a loaded scalar's bool)
    m_d = (o_d < HALF) & ((o_d * 0 + slot) % PAGE_SIZE == PAGE_SIZE - 1)
    p_n = k_min + i_p * stride_np + i_h * stride_nh
    p_x = k_max + i_p * stride_xp + i_h * stride_xh
    b_lo_a = tl.load(p_n + o_d * stride_nd, mask=m_d, other=0.0).to(tl.float32)  # channels [0, D/2)
    b_lo_b = tl.load(p_n + (o_d + HALF) * stride_nd, mask=m_d, other=0.0).to(tl.float32)  # [D/2, D)
    # div_rn: IEEE division, as torch's (a compiled `/` is the approximate div.full.f32 on NVIDIA GPUs)
    b_step_a = tl.math.div_rn(tl.load(p_x + o_d * stride_xd, mask=m_d, other=0.0).to(tl.float32) - b_lo_a, 15.0)
    b_step_b = tl.math.div_rn(tl.load(p_x + (o_d + HALF) * stride_xd, mask=m_d, other=0.0).to(tl.float32) - b_lo_b,
                              15.0)
    if QUANT:
        b_sc = tl.max(tl.load(k_scale + i_p * stride_sp + i_h * stride_sh + o_d * 0, mask=m_d, other=0.0), axis=0)
    for s0 in range(0, PAGE_SIZE, BS):
        o_s = s0 + tl.arange(0, BS)
        m_k = (o_s < PAGE_SIZE)[:, None] & m_d[None, :]  # [BS, BDH]
        p_k = k_cache + i_p * stride_kp + o_s[:, None] * stride_ks + i_h * stride_kh
        b_ka = tl.load(p_k + o_d[None, :] * stride_kd, mask=m_k, other=0.0).to(tl.float32)
        b_kb = tl.load(p_k + (o_d[None, :] + HALF) * stride_kd, mask=m_k, other=0.0).to(tl.float32)
        if QUANT:
            b_ka = b_ka * b_sc
            b_kb = b_kb * b_sc
        b_code = _codes(b_ka, b_lo_a, b_step_a).to(tl.uint8) | (_codes(b_kb, b_lo_b, b_step_b).to(tl.uint8) << 4)
        p_c = k_code + i_p * stride_cp + o_s[:, None] * stride_cs + i_h * stride_ch + o_d[None, :] * stride_cd
        tl.store(p_c, b_code, mask=m_k)


def key_codes_blocks(page_size: int, head_dim: int) -> dict:
    """Constexprs of ``encode_key_codes_kernel`` (shared with compile.py)."""
    BDH = pad_head_dim(head_dim // 2)
    return dict(PAGE_SIZE=page_size, BS=min(page_size, max(1, TILE_ELEMS // BDH)), BDH=BDH)
