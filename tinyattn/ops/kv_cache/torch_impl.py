"""The torch form of the page pool's upkeep: key boxes (recomputed, grown by a write, refitted after a cut), their
outward rounding, and the KV write with int8 / fp8 scale growth (DESIGN.md §1; docs/layout.md).

**Boxes** narrower than the keys (bf16 / fp16 boxes of an fp32 pool) are rounded **outward**: ``k_min`` toward
``-inf``, ``k_max`` toward ``+inf`` (to the nearest representable value on that side), so the Quest bound
``ub = sum_i max(q_i k_min_i, q_i k_max_i) >= max_t q.k_t`` (Quest, Tang et al. 2024, eq. 1) stays an upper bound.
Rounding in one direction is monotone, so the min of rounded-down keys is the rounded-down min: a write can round
each key and reduce in the narrow dtype. Overflow follows the same rule: an fp16 ``k_max`` above 65504 becomes
``+inf`` (an fp16 ``k_min`` there becomes 65504), still a bound; bf16 has fp32's range.

**The KV write** (:func:`write_kv`; the same policy in :mod:`.reference` and ``kernels/kv_write.py``):

- float pools: rows stored in the pool dtype; each touched page's box grows by the stored keys, rounded outward
  when the box is narrower.
- int8 / fp8 e4m3 pools (:mod:`tinyattn.ops.quant`): ``fill[page]`` (valid slots) grows to ``max(offset) + 1``; each
  touched (page, KV head) scale grows to hold the new tokens (int8: ``absmax / 127``; fp8: an empty page takes
  ``absmax / 448``, a page holding tokens grows by the smallest power of two ``2**ceil(log2(new / old))``, computed
  exactly); where it grew, the codes of the page's slots below ``fill`` are re-quantized onto it (slots at or past
  ``fill`` are never touched); the new tokens are quantized; where a K scale grew, the box is refitted over the
  valid slots (dequantized), else it grows by the new dequantized keys.

Slots must be distinct (as :meth:`tinyattn.PagedKVCache.extend` gives them): which of two writes to one slot wins
is unspecified. NaN keys give unspecified boxes.
"""

from __future__ import annotations

import warnings

import torch

from .. import quant
from ..layout import num_valid_pages
from ..spans import span

__all__ = ["round_down", "round_up", "store_box", "reset_boxes", "update_page_metadata", "write_kv", "refit_page",
           "key_codes", "encode_key_codes"]

# torch marks index_reduce_ beta and warns once per process; its semantics here are plain amin / amax
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")


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


def reset_boxes(k_min: torch.Tensor, k_max: torch.Tensor, pages: torch.Tensor) -> None:
    """Empty boxes (``k_min = +inf``, ``k_max = -inf``) for ``pages`` (int64 ``[N]``, on the boxes' device; repeats
    allowed): a page (re)allocated to a sequence starts from nothing, so the first key written sets its box and
    padding never enters it."""
    k_min.index_fill_(0, pages, float("inf"))
    k_max.index_fill_(0, pages, float("-inf"))


def update_page_metadata(k_cache, block_table, seq_lens, k_min, k_max, k_scale=None):
    """Min/max over valid slots of every valid page, written at the physical page ids (of the dequantized keys
    ``code.float() * scale`` with an int8 / fp8 pool and its ``k_scale``); boxes narrower than the keys are
    rounded outward."""
    page_size = k_cache.shape[1]
    cols = torch.arange(block_table.shape[1], device=k_cache.device)
    valid = cols[None, :] < num_valid_pages(seq_lens, page_size)[:, None]               # [B, max_pages]
    rows, logical = valid.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return
    phys = block_table[rows, logical].to(torch.int64)                                   # [N]
    keys = k_cache[phys]                                                                # [N, page_size, Hkv, D]
    if k_scale is not None:
        keys = keys.float() * k_scale[phys][:, None, :, None]
    n_tok = (seq_lens.to(torch.int64)[rows] - logical * page_size).clamp(max=page_size)  # [N]
    slot_ok = (torch.arange(page_size, device=k_cache.device)[None, :] < n_tok[:, None])[:, :, None, None]
    inf = torch.tensor(float("inf"), dtype=keys.dtype, device=keys.device)
    store_box(k_min, k_max, phys, torch.where(slot_ok, keys, inf).amin(1), torch.where(slot_ok, keys, -inf).amax(1))


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             k_min: torch.Tensor | None, k_max: torch.Tensor | None, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None, fill: torch.Tensor | None, pages: torch.Tensor | None = None) -> None:
    """The torch form of :func:`tinyattn.ops.api.write_kv` on validated inputs (the policy: module docstring)."""
    slots = slots.to(torch.int64)
    pages = torch.div(slots, k_cache.shape[1], rounding_mode="floor") if pages is None else pages
    if quant.is_quantized(k_cache):
        _write_quantized(k, v, slots, pages, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill)
        return
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)
    # one index_copy_ per pool on its [num_pages * page_size, Hkv, D] view (slots are token rows)
    k_cache.view(-1, Hkv, D).index_copy_(0, slots, k)
    v_cache.view(-1, Hkv, D).index_copy_(0, slots, v)
    if k_min is None:
        return
    # index_reduce_ rather than scatter_reduce_: same boxes (repeated pages reduce together), and no
    # OpenMP parallel region for a few elements (each one costs a time slice when a core is busy)
    with span("metadata", k_new=k, pages=k.shape[0]):      # incremental box upkeep, for the profiler
        _grow_boxes(k_min, k_max, pages, k)


def _grow_boxes(k_min: torch.Tensor, k_max: torch.Tensor, pages: torch.Tensor, k: torch.Tensor) -> None:
    """Grow the boxes of ``pages`` by the keys ``k`` (rounded outward first when the boxes are narrower:
    one-directional rounding is monotone, so reducing the rounded keys gives the rounded min / max)."""
    box = k_min.dtype
    lo, hi = (k, k) if k.dtype == box else (round_down(k, box), round_up(k, box))
    k_min.index_reduce_(0, pages, lo, "amin")
    k_max.index_reduce_(0, pages, hi, "amax")


def _pow2_ceil(r: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2 r)`` exactly for ``r > 0`` (frexp: ``r = m * 2**e``, ``m`` in [0.5, 1))."""
    m, e = torch.frexp(r)
    return torch.ldexp(torch.ones_like(r), torch.where(m == 0.5, e - 1, e))


def _write_quantized(k, v, slots, pages, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill) -> None:
    """int8 / fp8 write: grow the touched pages' scales to hold the new tokens, re-quantize the valid slots of
    those pages onto the new scales, store the new tokens, refit the touched pages' boxes from the dequantized
    keys of their valid slots when a K scale grew (else grow them by the new keys)."""
    if slots.numel() == 0:
        return
    page_size, Hkv, D = k_cache.shape[1:]
    dtype, m = k_cache.dtype, quant.qmax(k_cache.dtype)
    touched, inv = torch.unique(pages, return_inverse=True)                         # [U], [N]
    offsets = slots - pages * page_size
    new_fill = fill.index_select(0, touched).index_reduce_(0, inv, offsets + 1, "amax")
    fill.index_copy_(0, touched, new_fill)
    valid = torch.arange(page_size, device=k_cache.device)[None, :] < new_fill[:, None]   # [U, page_size]
    with span("metadata", k_new=k, pages=k.shape[0]):
        # K and V together: [2, ...] stacks (index 0 = K, 1 = V), one op each instead of two
        x = torch.stack([k.detach(), v.detach()]).float()                          # [2, N, Hkv, D]
        old = torch.stack([k_scale.index_select(0, touched), v_scale.index_select(0, touched)])   # [2, U, Hkv]
        new = old.clone().index_reduce_(1, inv, quant.exact_div(x.abs().amax(-1), m), "amax")  # [2, U, Hkv]
        if dtype == torch.float8_e4m3fn:
            # fp8: a page that already holds tokens grows its scale by a power of two, so rescaling its codes
            # only shifts their exponents (exact above e4m3's subnormals): no re-rounding error accumulates
            factor = _pow2_ceil(new / torch.where(old > 0, old, 1.0))
            new = torch.where((old > 0) & (new > old), old * factor, new)
        grew_k, grew_v = (new > old).flatten(1).any(-1).tolist()                    # one host sync
        for i, (pool, scales, regrow) in enumerate(((k_cache, k_scale, grew_k), (v_cache, v_scale, grew_v))):
            if regrow:                    # re-quantize the valid slots of pages whose scale grew
                ratio = torch.where(new[i] > old[i], old[i] / new[i], 1.0)[:, None, :, None]  # [U, 1, Hkv, 1]
                stored = pool.index_select(0, touched)
                requantized = quant.quantize(stored.float() * ratio, 1.0, dtype).view(torch.uint8)
                requantized = torch.where(valid[:, :, None, None], requantized, stored.view(torch.uint8))
                pool.view(torch.uint8).index_copy_(0, touched, requantized)
                scales.index_copy_(0, touched, new[i])
        refit = grew_k                  # a page's K scale grew (its stored keys changed): refit its box
        token_scale = new.index_select(1, inv)[..., None]                           # [2, N, Hkv, 1]
        xq = quant.quantize(x, token_scale, dtype)                                  # [2, N, Hkv, D]
        codes = xq.view(torch.uint8)
        k_cache.view(torch.uint8).view(-1, Hkv, D).index_copy_(0, slots, codes[0])
        v_cache.view(torch.uint8).view(-1, Hkv, D).index_copy_(0, slots, codes[1])
        if k_min is None:
            return
        if not refit:                   # no stored key changed: the boxes grow by the new keys, as in fp32
            k_read = xq[0].float() * token_scale[0]     # what attention reads of the new keys
            _grow_boxes(k_min, k_max, pages, k_read)
            return
        keys = quant.dequantize(k_cache.index_select(0, touched), k_scale.index_select(0, touched))  # [U, S, Hkv, D]
        inf = torch.tensor(float("inf"), device=k_cache.device)
        v4 = valid[:, :, None, None]
        store_box(k_min, k_max, touched, torch.where(v4, keys, inf).amin(1), torch.where(v4, keys, -inf).amax(1))


def refit_page(k_cache: torch.Tensor, v_cache: torch.Tensor, k_min: torch.Tensor | None, k_max: torch.Tensor | None,
               k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, page: int, valid: int) -> None:
    """One layer's physical ``page`` after a cut to its first ``valid`` slots (:meth:`tinyattn.PagedKVCache.truncate`):
    int8 / fp8 pools first shrink their K and V scales to what those slots hold and re-quantize them (a scale kept
    from tokens that were cut would quantize every later token of the page with the coarse step of the cut ones);
    then the box is recomputed from the kept keys (exact, not merely a bound).

    int8: the scale becomes ``absmax / 127`` of the kept dequantized values (``code * scale``), as if they had been
    written into an empty page (each code re-rounded by at most half a step of the new scale). fp8 e4m3: the scale
    shrinks by the largest power of two that still holds them (the growth rule run backwards), so the kept codes are
    rescaled exactly. An all-zero page gets scale 0: the next write sets it.
    """
    if quant.is_quantized(k_cache):
        m = quant.qmax(k_cache.dtype)
        for pool, scale in ((k_cache, k_scale), (v_cache, v_scale)):
            old = scale[page]                                              # [Hkv]
            x = pool[page, :valid].float() * old[None, :, None]           # [valid, Hkv, D] what attention reads
            absmax = x.abs().amax(dim=(0, 2))                              # [Hkv]
            if k_cache.dtype == torch.float8_e4m3fn:
                shrink = torch.exp2(torch.floor(torch.log2(m * old / absmax)).clamp_min(0))
                new = torch.where(absmax > 0, old / shrink, 0.0)
            else:
                new = quant.exact_div(absmax, m)
            pool[page, :valid] = quant.quantize(x, new[None, :, None], k_cache.dtype)
            scale[page] = new
    if k_min is not None:
        table = torch.tensor([[page]], dtype=torch.int64, device=k_cache.device)
        lens = torch.tensor([valid], dtype=torch.int64, device=k_cache.device)
        update_page_metadata(k_cache, table, lens, k_min, k_max, k_scale)


def key_codes(keys: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit codes ``[..., S, Hkv, D/2]`` uint8 of ``keys`` ``[..., S, Hkv, D]`` inside their page's box
    ``[..., Hkv, D]``: ``clamp(floor((k - k_min) / step + 0.5), 0, 15)``, ``step = (k_max - k_min) / 15`` in fp32
    (``0`` where ``step`` is not ``> 0`` or the quotient is NaN); channel ``i`` in the low nibble of byte ``i``,
    channel ``i + D/2`` in the high one. The page's box is the quantization range: no scale is stored (issue 35,
    docs/design_rerank.md; Twilight's INT4 keys, arXiv 2502.02770)."""
    lo, hi = k_min.float().unsqueeze(-3), k_max.float().unsqueeze(-3)             # [..., 1, Hkv, D]
    step = quant.exact_div(hi - lo, 15.0)        # IEEE, as the Triton writer's div_rn (not x * (1/15))
    x = (keys.float() - lo) / step + 0.5
    codes = torch.where((step > 0) & ~torch.isnan(x), x.floor().clamp(0, 15), 0.0).to(torch.uint8)
    half = keys.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def encode_key_codes(k_cache: torch.Tensor, slots: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor,
                     k_code: torch.Tensor, k_scale: torch.Tensor | None = None) -> None:
    """Write ``k_code`` of every page that a slot of ``slots`` fills (its slot ``page_size - 1``), from the page's
    keys (dequantized with ``k_scale``) and its current box (:func:`key_codes`), in place. Call it after the
    write that stored those slots and grew the boxes."""
    page_size = k_cache.shape[1]
    slots = slots.to(torch.int64)
    full = torch.div(slots[slots % page_size == page_size - 1], page_size, rounding_mode="floor")
    if full.numel() == 0:
        return
    keys = k_cache.index_select(0, full)                                             # [N, S, Hkv, D]
    if k_scale is not None:
        keys = keys.float() * k_scale.index_select(0, full)[:, None, :, None]
    k_code.index_copy_(0, full, key_codes(keys, k_min.index_select(0, full), k_max.index_select(0, full)))
