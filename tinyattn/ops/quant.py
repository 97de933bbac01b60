"""KV cache formats (vLLM's ``kv_cache_dtype``): names, storage dtypes, per-(page, KV head) quantization, and the
dtypes page boxes may be stored in (``box_dtype``).

=============  ========================  ==================================================================
format         pool dtype                scales
=============  ========================  ==================================================================
``"auto"``     the model dtype           none
``"fp16"``     ``torch.float16``         none
``"bf16"``     ``torch.bfloat16``        none
``"int8"``     ``torch.int8``            ``k_scale``, ``v_scale`` ``[num_pages, Hkv]`` fp32, symmetric:
                                         ``x ≈ q * scale``, ``q`` in ``[-127, 127]``, ``scale = absmax / 127``
``"fp8_e4m3"`` ``torch.float8_e4m3fn``   the same, ``q`` an e4m3 value in ``[-448, 448]``, ``scale = absmax / 448``
=============  ========================  ==================================================================

One scale per (physical page, KV head) for K and one for V: every value of the page's ``page_size x D`` tile
of that head shares it. Dequantized values are ``q.to(float32) * scale`` (fp64 for fp64 math): every backend,
the reference and the page boxes of :class:`tinyattn.PagedKVCache` use this one product, so the Quest bound
computed from the boxes is exact for the keys attention reads.
"""

from __future__ import annotations

import torch

__all__ = ["KV_CACHE_DTYPES", "QUANTIZED_DTYPES", "BOX_DTYPES", "box_dtype_for", "storage_dtype", "is_quantized",
           "qmax", "quantize", "exact_div",
           "dequantize", "dequantize_rows", "scale_rows"]

KV_CACHE_DTYPES = ("auto", "fp16", "bf16", "int8", "fp8_e4m3")
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
_STORAGE = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_TINY = torch.finfo(torch.float32).tiny


def storage_dtype(kv_cache_dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype of a format name (``"auto"``: ``model_dtype``).

    Raises:
        ValueError: ``kv_cache_dtype`` is not one of :data:`KV_CACHE_DTYPES`.
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else _STORAGE[kv_cache_dtype]


#: ``box_dtype`` names of :class:`tinyattn.cache.PagedKVCache`: ``"auto"`` = the pool's dtype (fp32 for an int8 /
#: fp8 pool), exact; the others round outward when narrower than the keys.
BOX_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def box_dtype_for(box_dtype: str, pool_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The torch dtype of the boxes for the cache option ``box_dtype`` (a key of :data:`BOX_DTYPES`).

    Raises ``ValueError`` naming the supported names for another value."""
    if box_dtype not in BOX_DTYPES:
        raise ValueError(f"box_dtype: expected one of {sorted(BOX_DTYPES)}, got {box_dtype!r}")
    chosen = BOX_DTYPES[box_dtype]
    if chosen is None:
        return torch.float32 if quantized else pool_dtype
    return chosen


def is_quantized(x) -> bool:
    """Whether a pool (tensor) or dtype holds quantized values that need scales (int8, fp8 e4m3)."""
    dtype = x.dtype if isinstance(x, torch.Tensor) else x
    return dtype in QUANTIZED_DTYPES


def qmax(dtype: torch.dtype) -> float:
    """Largest magnitude of the quantized grid: 127 (int8), 448 (fp8 e4m3)."""
    return _QMAX[dtype]


def exact_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` rounded once (IEEE), on every device. PyTorch's CUDA kernels divide by a Python number as
    ``x * (1 / divisor)`` (two roundings: an ulp off at times), which the Triton kernels' ``div_rn`` then would not
    match bit for bit; dividing by a 0-dim tensor on ``x``'s device takes the true division."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` rounded onto ``dtype``'s grid (int8: round to nearest, clamp to ±127; fp8: clamp to ±448,
    round to nearest e4m3). ``scale`` broadcasts against ``x``; a zero scale (only ever that of an all-zero
    tile: scales are ``>= absmax / qmax``) quantizes to 0."""
    y = x.float() / (scale.clamp_min(_TINY) if isinstance(scale, torch.Tensor) else max(scale, _TINY))
    m = _QMAX[dtype]
    if dtype == torch.int8:
        return y.round_().clamp_(-m, m).to(torch.int8)
    return y.clamp_(-m, m).to(dtype)


def dequantize(pool: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A whole pool ``[num_pages, page_size, Hkv, D]`` with its ``[num_pages, Hkv]`` scales -> ``dtype`` values
    (``pool.to(float32) * scale``, then cast)."""
    math = torch.float64 if dtype == torch.float64 else torch.float32
    out = pool.to(math) * scale.to(math)[:, None, :, None]
    return out if out.dtype == dtype else out.to(dtype)


def scale_rows(rows: torch.Tensor, page_size: int, num_kv_heads: int) -> torch.Tensor:
    """Flat scale indices ``page * Hkv + head`` of flat pool rows ``(page * page_size + slot) * Hkv + head``."""
    per_page = page_size * num_kv_heads
    return torch.div(rows, per_page, rounding_mode="floor") * num_kv_heads + rows % num_kv_heads


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered quantized rows ``[N, D]`` times their scales ``scale.view(-1)[idx]`` (``idx`` from
    :func:`scale_rows`), in ``dtype``."""
    math = torch.float64 if dtype == torch.float64 else torch.float32
    s = scale.reshape(-1).index_select(0, idx).to(math)
    out = values.to(math).mul_(s[:, None])
    return out if out.dtype == dtype else out.to(dtype)
