"""One fused KV write: append a step's K/V to the paged pool and grow the page boxes in the same pass.

vLLM's ``reshape_and_cache`` stores ``k``, ``v`` ``[N, Hkv, D]`` at ``slots`` ``[N]`` (``slot = page * page_size +
offset``); a Quest cache must also grow each touched page's key box ``k_min`` / ``k_max`` ``[num_pages, Hkv, D]``
(Quest, Tang et al., ICML 2024, sec. 3) and, for int8 / fp8 e4m3 pools, each touched page's per-(page, KV head)
fp32 scale. This kernel does all of it in **one launch per layer** for every KV format, with the policy of
:mod:`tinyattn.ops.kv_write` (its torch twin) and :func:`tinyattn.ops.reference.write_kv` (the loop reference):

- float pools (fp32 / fp16 / bf16): the new rows are stored in the pool dtype (round to nearest) and the box
  grows by them, rounded outward when the box is narrower (``k_min`` down, ``k_max`` up; :mod:`tinyattn.ops.boxes`).
- int8 / fp8 pools: the page's scale grows to hold the new tokens (int8: to ``absmax / 127``; fp8: by the smallest
  power of two, a page's first write sets ``absmax / 448``); if it grew, the codes of the page's valid slots
  (``< fill``) are re-quantized onto the new scale; the new tokens are quantized; a K head whose scale grew has its
  box refitted over the valid slots, otherwise the box grows by the new dequantized keys.

Grid: ``(N, Hkv)``. Tokens that write the same page are handled by one program, its **leader** (the page's first
token in ``slots``): only a token that starts a run (its predecessor writes another page) scans ``slots`` to find
the page's tokens and whether it leads; the other programs return at once. The leader builds ``src[s]`` (which token
writes slot ``s`` of the page; the last one if ``slots`` repeats a slot) and then holds the whole ``[page_size, D]``
tile of its KV head in registers: no atomics, no second pass, deterministic. Cost: one scan of ``slots`` per run
(decode: ``B`` runs of one token, ``B^2`` int loads; prefill: ``N / page_size`` runs).

Interpreter facts handled here (TRITON_ON_CPU.md, and two found while writing this kernel with triton 3.9):
the interpreter's fp32 -> bf16 cast truncates and its fp32 -> fp8e4nv cast drops the carry of a mantissa that
rounds up into the next binade, so both roundings are done by hand (bits / exact fp32 arithmetic) and the final
casts only ever see exactly representable values. Divisions use ``div_rn`` (a GPU's ``/`` is approximate).
Physical pages are int64 before they meet a stride.
"""
import torch
import triton
import triton.language as tl

from . import pad_head_dim

_TINY = 1.1754943508222875e-38        # torch.finfo(torch.float32).tiny: the clamp of a zero scale (quant.quantize)
_ROUND_INT = 12582912.0               # 1.5 * 2**23: (y + c) - c rounds |y| < 2**22 to an integer, half to even
SCAN_TILE = 4096                      # elements of a leader's [BN, BS] slot-match tile


@triton.jit
def _round_to_pool(x, POOL_BF16: tl.constexpr, out_ty: tl.constexpr):
    """fp32 ``x`` -> the pool dtype, round to nearest even (bf16 by hand: the interpreter's cast truncates)."""
    if POOL_BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16     # RNE on the upper half (carry into the exponent)
        y = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), y)          # NaN stays NaN
    else:
        return x.to(out_ty)


@triton.jit
def _round_out(x, DOWN: tl.constexpr, BOX_KIND: tl.constexpr):
    """fp32 ``x`` -> the box dtype rounded outward (``DOWN``: largest value ``<= x``, else smallest ``>= x``),
    returned as fp32. ``BOX_KIND``: 0 fp32 (exact), 1 fp16, 2 bf16. The loop twin is ``reference._outward``."""
    if BOX_KIND == 0:
        return x
    else:
        if BOX_KIND == 2:
            y = _round_to_pool(x, True, tl.bfloat16)
        else:
            y = x.to(tl.float16)
        yf = y.to(tl.float32)
        bits = y.to(tl.int16, bitcast=True).to(tl.int32)       # sign-magnitude: +1 moves away from zero
        if DOWN:
            wrong = yf > x
            step = tl.where(yf > 0, bits - 1, tl.where(yf == 0, -32767, bits + 1))   # 0 -> -min subnormal
        else:
            wrong = yf < x
            step = tl.where(yf > 0, bits + 1, tl.where(yf == 0, 1, bits - 1))       # 0 -> +min subnormal
        if BOX_KIND == 2:
            z = step.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        else:
            z = step.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.where(wrong, z, yf)


@triton.jit
def _quantize(y, FP8: tl.constexpr, QMAX: tl.constexpr):
    """fp32 ``y`` (already divided by the scale) onto the grid, as fp32: int8 clamps to ±127 and rounds half to
    even; fp8 e4m3 clamps to ±448 and rounds to nearest even e4m3 (sign of zero kept), as ``quant.quantize``."""
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if FP8:
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127        # floor(log2 |y|)
        e = tl.maximum(e, -6)                                          # e4m3 subnormals: steps of 2**-9
        c = ((e + 20 + 127) << 23 | 0x400000).to(tl.float32, bitcast=True)   # 1.5 * 2**23 * ulp, ulp = 2**(e-3)
        r = (y + c) - c
        return tl.where(r == 0, y * 0.0, r)                            # -0 rounds to -0 (torch's cast)
    else:
        return (y + 12582912.0) - 12582912.0


@triton.jit
def _pow2_ceil(r):
    """``2 ** ceil(log2 r)`` exactly for fp32 ``r > 0`` (normal), from its bits; ``inf`` past fp32's range."""
    bits = r.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (tl.minimum(e + 127, 255) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quantized_half(
    b_x,  # [BS, BD] fp32 new rows of this page and KV head (0 where not written)
    p_c,  # [BS, BD] pointers into the pool tile
    p_sc,  # pointer to the (page, head) scale
    m_new,  # [BS] slots written by this step
    m_valid,  # [BS] slots below the page's new fill
    m_d,  # [BD]
    FP8: tl.constexpr,
    QMAX: tl.constexpr,
):
    """Grow one (page, head) scale, re-quantize the valid codes if it grew, store the new codes; returns
    ``(codes [BS, BD] fp32 of the valid + new slots, new scale, grew)``."""
    m_nd = m_new[:, None] & m_d[None, :]
    amax = tl.max(tl.max(tl.where(m_nd, tl.abs(b_x), 0.0), axis=1), axis=0)
    old = tl.load(p_sc)
    new = tl.maximum(old, tl.math.div_rn(amax, QMAX))
    if FP8:  # a page holding tokens grows by a power of two: its codes only shift exponents
        grow = (old > 0) & (new > old)
        factor = _pow2_ceil(tl.math.div_rn(new, tl.where(old > 0, old, 1.0)))
        new = tl.where(grow, old * factor, new)
    grew = new > old
    ratio = tl.where(grew, tl.math.div_rn(old, tl.where(grew, new, 1.0)), 1.0)
    m_old = (m_valid[:, None] & m_d[None, :]) & (tl.zeros([1, 1], tl.int32) + grew.to(tl.int32) != 0)  # [BS, BD]
    b_old = tl.load(p_c, mask=m_old, other=0.0).to(tl.float32)  # [BS, BD]
    b_req = _quantize(b_old * ratio, FP8, QMAX)
    b_newq = _quantize(tl.math.div_rn(b_x, tl.maximum(new, 1.1754943508222875e-38)), FP8, QMAX)
    b_out = tl.where(m_new[:, None], b_newq, b_req)  # [BS, BD] fp32 values exactly on the grid
    tl.store(p_c, b_out.to(p_c.dtype.element_ty), mask=m_nd | m_old)
    tl.store(p_sc, new)
    return b_out, new, grew


@triton.jit
def kv_write_kernel(
    k,  # [N, Hkv, D] new keys, any float dtype
    v,  # [N, Hkv, D] new values
    slots,  # [N] int32 / int64, page * PAGE_SIZE + offset
    k_cache,  # [num_pages, PAGE_SIZE, Hkv, D] fp32 / fp16 / bf16 / int8 / fp8e4nv
    v_cache,  # [num_pages, PAGE_SIZE, Hkv, D]
    k_min,  # [num_pages, Hkv, D] fp32 / fp16 / bf16 (BOXES only)
    k_max,  # [num_pages, Hkv, D]
    k_scale,  # [num_pages, Hkv] fp32 (QUANT only)
    v_scale,  # [num_pages, Hkv] fp32 (QUANT only)
    fill,  # [num_pages] int64 valid slots per page (QUANT only)
    N, D,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_cp, stride_cs, stride_ch, stride_cd,
    stride_wp, stride_ws, stride_wh, stride_wd,
    stride_np, stride_nh, stride_nd,
    stride_xp, stride_xh, stride_xd,
    stride_ksp, stride_ksh,
    stride_vsp, stride_vsh,
    PAGE_SIZE: tl.constexpr,
    BS: tl.constexpr,  # PAGE_SIZE padded to a power of two
    BD: tl.constexpr,
    BN: tl.constexpr,  # slots per scan iteration
    BOXES: tl.constexpr,
    QUANT: tl.constexpr,
    FP8: tl.constexpr,
    QMAX: tl.constexpr,
    POOL_BF16: tl.constexpr,
    BOX_KIND: tl.constexpr,  # 0 fp32, 1 fp16, 2 bf16 boxes
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.load(slots + i_t).to(tl.int64) // PAGE_SIZE
    prev = tl.load(slots + tl.maximum(i_t - 1, 0)).to(tl.int64) // PAGE_SIZE
    if (i_t == 0) | (prev != i_p):  # a run starts here: find the page's tokens and whether this one leads
        o_s = tl.arange(0, BS)  # [BS] slots of the page
        src = tl.full([BS], -1, tl.int64)  # token writing each slot (the last one if repeated)
        first = N
        for n0 in range(0, N, BN):
            o_n = n0 + tl.arange(0, BN)  # [BN]
            b_slot = tl.load(slots + o_n, mask=o_n < N, other=-1).to(tl.int64)
            m_pg = (b_slot >= 0) & (b_slot // PAGE_SIZE == i_p)  # [BN]
            first = tl.minimum(first, tl.min(tl.where(m_pg, o_n, N), axis=0))
            hit = m_pg[:, None] & ((b_slot - i_p * PAGE_SIZE)[:, None] == o_s[None, :])  # [BN, BS]
            src = tl.maximum(src, tl.max(tl.where(hit, o_n[:, None], -1), axis=0))
        if first == i_t:
            o_d = tl.arange(0, BD)
            m_d = o_d < D
            m_new = src >= 0  # [BS]
            m_nd = m_new[:, None] & m_d[None, :]  # [BS, BD]
            o_src = tl.maximum(src, 0)
            # the new rows, upcast at once (bf16 arithmetic is wrong in the interpreter)
            b_k = tl.load(k + o_src[:, None] * stride_kn + i_h * stride_kh + o_d[None, :] * stride_kd,
                          mask=m_nd, other=0.0).to(tl.float32)  # [BS, BD]
            b_v = tl.load(v + o_src[:, None] * stride_vn + i_h * stride_vh + o_d[None, :] * stride_vd,
                          mask=m_nd, other=0.0).to(tl.float32)  # [BS, BD]
            p_kc = (k_cache + i_p * stride_cp + o_s[:, None] * stride_cs + i_h * stride_ch
                    + o_d[None, :] * stride_cd)  # [BS, BD]
            p_vc = (v_cache + i_p * stride_wp + o_s[:, None] * stride_ws + i_h * stride_wh
                    + o_d[None, :] * stride_wd)
            if QUANT:
                old_fill = tl.load(fill + i_p)
                new_fill = tl.maximum(old_fill, tl.max(tl.where(m_new, o_s, -1), axis=0) + 1)
                if i_h == 0:  # every head computes the same fill: any read order gives this value
                    tl.store(fill + i_p, new_fill)
                m_valid = o_s < new_fill  # [BS]
                b_kq, sk, grew_k = _quantized_half(b_k, p_kc, k_scale + i_p * stride_ksp + i_h * stride_ksh,
                                                   m_new, m_valid, m_d, FP8, QMAX)
                _quantized_half(b_v, p_vc, v_scale + i_p * stride_vsp + i_h * stride_vsh, m_new, m_valid, m_d,
                                FP8, QMAX)
                b_keys = b_kq * sk  # [BS, BD] what attention reads
                m_box = tl.where(grew_k, m_valid, m_new)  # a grown scale: refit over the valid slots
                refit = grew_k
            else:
                b_kp = _round_to_pool(b_k, POOL_BF16, k_cache.dtype.element_ty)
                tl.store(p_kc, b_kp, mask=m_nd)
                tl.store(p_vc, _round_to_pool(b_v, POOL_BF16, v_cache.dtype.element_ty), mask=m_nd)
                b_keys = b_kp.to(tl.float32)  # the stored keys
                m_box = m_new
                refit = False
            if BOXES:
                m_b = m_box[:, None] & m_d[None, :]
                lo = _round_out(tl.min(tl.where(m_b, b_keys, float("inf")), axis=0), True, BOX_KIND)  # [BD]
                hi = _round_out(tl.max(tl.where(m_b, b_keys, float("-inf")), axis=0), False, BOX_KIND)
                p_n = k_min + i_p * stride_np + i_h * stride_nh + o_d * stride_nd
                p_x = k_max + i_p * stride_xp + i_h * stride_xh + o_d * stride_xd
                old_lo = tl.load(p_n, mask=m_d, other=0.0).to(tl.float32)
                old_hi = tl.load(p_x, mask=m_d, other=0.0).to(tl.float32)
                lo = tl.where(refit, lo, tl.minimum(old_lo, lo))
                hi = tl.where(refit, hi, tl.maximum(old_hi, hi))
                # lo / hi are representable in the box dtype: the casts are exact
                tl.store(p_n, lo.to(k_min.dtype.element_ty), mask=m_d)
                tl.store(p_x, hi.to(k_max.dtype.element_ty), mask=m_d)


_BOX_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kv_write_blocks(page_size: int, head_dim: int, pool_dtype: torch.dtype, box_dtype) -> dict:
    """Constexprs of ``kv_write_kernel`` (shared with compile.py). ``box_dtype`` None: no boxes."""
    quantized = pool_dtype in (torch.int8, torch.float8_e4m3fn)
    return dict(PAGE_SIZE=page_size, BS=triton.next_power_of_2(page_size), BD=pad_head_dim(head_dim),
                BN=max(16, SCAN_TILE // triton.next_power_of_2(page_size)), BOXES=box_dtype is not None,
                QUANT=quantized,
                FP8=pool_dtype == torch.float8_e4m3fn, QMAX=448.0 if pool_dtype == torch.float8_e4m3fn else 127.0,
                POOL_BF16=pool_dtype == torch.bfloat16, BOX_KIND=_BOX_KIND[box_dtype] if box_dtype is not None else 0,
                num_warps=4)
