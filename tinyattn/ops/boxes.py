"""Page boxes narrower than the keys: outward rounding keeps Quest's bound an upper bound.

A page's box ``[k_min, k_max]`` feeds the bound ``ub = sum_i max(q_i k_min_i, q_i k_max_i) >= max_t q.k_t``
(Quest, Tang et al. 2024, eq. 1). Storing the box in bf16 / fp16 halves the bytes the scoring pass reads
(issue 10: scoring reads fp32 boxes, as many bytes as the selected K/V), but round-to-nearest could move
``k_min`` above a key or ``k_max`` below one and break the bound. So the box is rounded **outward**: ``k_min``
toward ``-inf``, ``k_max`` toward ``+inf`` (to the nearest representable value on that side). Rounding in one
direction is monotone, so the min of rounded-down keys is the rounded-down min: the incremental box upkeep of
:class:`tinyattn.cache.PagedKVCache` can round each key and reduce in the narrow dtype.

Overflow follows the same rule: an fp16 ``k_max`` above 65504 becomes ``+inf`` (an fp16 ``k_min`` there becomes
65504), which is still a bound; bf16 has fp32's range.
"""

from __future__ import annotations

import torch

__all__ = ["BOX_DTYPES", "box_dtype_for", "round_down", "round_up", "store_box"]

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


def _round(x: torch.Tensor, dtype: torch.dtype, toward: float) -> torch.Tensor:
    y = x.to(dtype)
    if y.dtype == x.dtype or torch.finfo(dtype).bits > torch.finfo(x.dtype).bits:
        return y                                   # a wider float holds every value exactly
    wrong = y.to(x.dtype) > x if toward < 0 else y.to(x.dtype) < x         # NaN compares False: kept as NaN
    return torch.where(wrong, torch.nextafter(y, torch.full_like(y, toward)), y)


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, each value the largest representable one ``<= x`` (exact when representable)."""
    return _round(x, dtype, float("-inf"))


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, each value the smallest representable one ``>= x`` (exact when representable)."""
    return _round(x, dtype, float("inf"))


def store_box(k_min: torch.Tensor, k_max: torch.Tensor, index: torch.Tensor, lo: torch.Tensor,
              hi: torch.Tensor) -> None:
    """``k_min[index] = lo`` and ``k_max[index] = hi`` rounded outward into the boxes' dtype (in place)."""
    k_min[index] = round_down(lo, k_min.dtype)
    k_max[index] = round_up(hi, k_max.dtype)
