"""Loop references of the page pool's upkeep: key boxes (recomputed or grown by a write), outward rounding, the KV
write with int8 / fp8 scale growth.

Simple loops, one (page, KV head) at a time, written for clarity, not speed: the oracle of
:mod:`tinyattn.ops.kv_cache.torch_impl` and of the Triton kernels (``kernels/metadata.py``, ``kernels/kv_write.py``).
They share no code with those beyond argument validation and the format's code / scale product
(:mod:`tinyattn.ops.quant`).

Method: Quest (Tang et al., ICML 2024, §3.2): per physical page ``p`` and KV head ``h``,
``k_min[p, h, i] = min_t K[p, t, h, i]`` and ``k_max[p, h, i] = max_t K[p, t, h, i]`` over the page's valid tokens.
"""

from __future__ import annotations

import math

import torch

from .. import quant
from .. import validation as V

__all__ = ["update_page_metadata", "write_kv", "outward", "encode_key_codes"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, *, backend=None, k_scale=None):
    """Recompute per-page, per-KV-head min/max of the keys over valid slots only (in place); an int8 / fp8 pool
    with ``k_scale`` is dequantized first."""
    _, page_size, _, _ = V.check_metadata_inputs(k_cache, block_table, seq_lens, k_min, k_max, k_scale)
    if k_scale is not None:
        k_cache = quant.dequantize(k_cache, k_scale)
    for b in range(block_table.shape[0]):
        n_tokens = int(seq_lens[b])
        for j in range(_cdiv(n_tokens, page_size)):
            phys = int(block_table[b, j])
            keys = k_cache[phys, : min(page_size, n_tokens - j * page_size)]     # [valid, Hkv, D]
            k_min[phys] = outward(keys.amin(0), k_min.dtype, -1)
            k_max[phys] = outward(keys.amax(0), k_max.dtype, +1)


def outward(x, dtype, direction: int):
    """``x`` in ``dtype`` rounded toward ``direction * inf``, one value at a time (the loop twin of
    :mod:`tinyattn.ops.kv_cache.torch_impl`): the representable neighbour on the right side when rounding moved it
    across."""
    out = x.to(dtype).clone()
    flat, src = out.view(-1), x.reshape(-1).double()
    toward = torch.tensor(direction * float("inf"), dtype=dtype)
    for i in range(flat.numel()):
        if (flat[i].double() - src[i]) * direction < 0:                # rounded to the wrong side
            flat[i] = torch.nextafter(flat[i], toward)
    return out


def write_kv(k, v, slots, k_cache, v_cache, *, k_min=None, k_max=None, k_scale=None, v_scale=None, fill=None,
             pages=None, backend=None):
    """Store ``k``, ``v`` ``[N, Hkv, D]`` at ``slots`` and grow boxes / scales, one (page, KV head) at a time.
    See :func:`tinyattn.ops.kv_cache.torch_impl.write_kv` (the policy is spelled out there); CPU tensors, in place."""
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    quantized = quant.is_quantized(k_cache)
    order = []                                                 # touched pages, in order of first appearance
    for t in range(slots.shape[0]):
        if int(slots[t]) // page_size not in order:
            order.append(int(slots[t]) // page_size)
    for p in order:
        tokens = [t for t in range(slots.shape[0]) if int(slots[t]) // page_size == p]
        offsets = [int(slots[t]) % page_size for t in tokens]
        if not quantized:
            for h in range(Hkv):
                for t, s in zip(tokens, offsets):
                    k_cache[p, s, h] = k[t, h].to(k_cache.dtype)
                    v_cache[p, s, h] = v[t, h].to(v_cache.dtype)
                if k_min is not None:
                    keys = torch.stack([k_cache[p, s, h] for s in offsets]).double()     # [n, D] the stored keys
                    lo = torch.minimum(k_min[p, h].double(), outward(keys.amin(0), k_min.dtype, -1).double())
                    hi = torch.maximum(k_max[p, h].double(), outward(keys.amax(0), k_max.dtype, +1).double())
                    k_min[p, h], k_max[p, h] = lo.to(k_min.dtype), hi.to(k_max.dtype)
            continue
        m = quant.qmax(k_cache.dtype)
        new_fill = max(int(fill[p]), max(offsets) + 1)
        fill[p] = new_fill
        for h in range(Hkv):
            grew_k = False
            for pool, scales, x, is_k in ((k_cache, k_scale, k, True), (v_cache, v_scale, v, False)):
                rows = [x[t, h].float() for t in tokens]                          # [D] fp32 each
                amax = torch.stack([r.abs().max() for r in rows]).max()
                old = scales[p, h].clone()                                        # fp32 0-d
                new = torch.maximum(old, amax / m)
                if k_cache.dtype == torch.float8_e4m3fn and old > 0 and new > old:
                    mant, exp = math.frexp(float(new / old))                      # exact: ceil(log2(new / old))
                    new = old * 2.0 ** (exp - 1 if mant == 0.5 else exp)
                grew = bool(new > old)
                if grew:
                    for s in range(new_fill):                                     # the valid slots only
                        pool[p, s, h] = quant.quantize(pool[p, s, h].float() * (old / new), 1.0, pool.dtype)
                for r, s in zip(rows, offsets):
                    pool[p, s, h] = quant.quantize(r, new, pool.dtype)
                scales[p, h] = new
                grew_k = grew if is_k else grew_k
            if k_min is None:
                continue
            slots_read = range(new_fill) if grew_k else offsets                   # a grown K scale: refit
            keys = torch.stack([k_cache[p, s, h].float() * k_scale[p, h] for s in slots_read]).double()
            lo, hi = outward(keys.amin(0), k_min.dtype, -1), outward(keys.amax(0), k_max.dtype, +1)
            if not grew_k:
                lo = torch.minimum(k_min[p, h].double(), lo.double()).to(k_min.dtype)
                hi = torch.maximum(k_max[p, h].double(), hi.double()).to(k_max.dtype)
            k_min[p, h], k_max[p, h] = lo, hi


def encode_key_codes(k_cache, slots, k_min, k_max, k_code, *, k_scale=None, backend=None):
    """4-bit codes of the keys of every page that a slot of ``slots`` fills (its last slot, ``page_size - 1``),
    one element at a time in fp32 (in place): ``code = clamp(floor((k - k_min) / step + 0.5), 0, 15)`` with
    ``step = (k_max - k_min) / 15`` per (page, KV head, channel), ``0`` where ``step`` is not ``> 0`` or the
    quotient is NaN; channel ``i`` in the low nibble of byte ``i``, channel ``i + D/2`` in its high nibble."""
    page_size, Hkv, D = k_cache.shape[1:]
    keys = quant.dequantize(k_cache, k_scale) if k_scale is not None else k_cache
    half = D // 2
    for t in range(slots.shape[0]):
        slot = int(slots[t])
        if slot % page_size != page_size - 1:
            continue
        p = slot // page_size
        for s in range(page_size):
            for h in range(Hkv):
                codes = []
                for i in range(D):
                    lo = torch.tensor(float(k_min[p, h, i]), dtype=torch.float32)
                    step = (torch.tensor(float(k_max[p, h, i]), dtype=torch.float32) - lo) / 15.0
                    x = (keys[p, s, h, i].float() - lo) / step + 0.5
                    ok = bool(step > 0) and not bool(torch.isnan(x))
                    codes.append(int(torch.clamp(torch.floor(x), 0, 15)) if ok else 0)
                k_code[p, s, h] = torch.tensor([codes[i] | (codes[i + half] << 4) for i in range(half)],
                                               dtype=torch.uint8)
