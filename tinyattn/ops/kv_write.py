"""The KV write op: append a step's K/V at ``slots`` of a paged pool and grow the touched pages' boxes (and, for
int8 / fp8 pools, their scales), by backend: the fused Triton kernel (:mod:`tinyattn.kernels.kv_write`, one launch)
or its PyTorch twin (this module, a few vectorised ops). :func:`tinyattn.ops.reference.write_kv` is the loop
reference both are tested against; :meth:`tinyattn.PagedKVCache.write` calls :func:`write_kv`.

Policy (the same in all three; :mod:`tinyattn.cache` explains why):

- float pools: rows stored in the pool dtype; each touched page's box grows by the stored keys, rounded outward
  when the box is narrower (:mod:`tinyattn.ops.boxes`).
- int8 / fp8 e4m3 pools (:mod:`tinyattn.ops.quant`): ``fill[page]`` (valid slots) grows to ``max(offset) + 1``; each
  touched (page, KV head) scale grows to hold the new tokens (int8: ``absmax / 127``; fp8: an empty page takes
  ``absmax / 448``, a page holding tokens grows by the smallest power of two ``2**ceil(log2(new / old))``, computed
  exactly); where it grew, the codes of the page's slots below ``fill`` are re-quantized onto it (slots at or past
  ``fill`` are never touched); the new tokens are quantized; where a K scale grew, the box is refitted over the
  valid slots (dequantized), else it grows by the new dequantized keys.

Slots must be distinct (as :meth:`PagedKVCache.extend` gives them): which of two writes to one slot wins is
unspecified. NaN keys give unspecified boxes.
"""

from __future__ import annotations

import warnings

import torch

from . import boxes, quant
from .spans import span

__all__ = ["write_kv", "WRITE_BACKENDS"]

WRITE_BACKENDS = ("torch", "triton")
# torch marks index_reduce_ beta and warns once per process; its semantics here are plain amin / amax
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")


def resolve_write_backend(backend, device: torch.device) -> str:
    """``None``: ``"triton"`` for CUDA pools, ``"torch"`` otherwise (also under ``TRITON_INTERPRET=1``: the CPU's
    write path stays the torch one). ``"triton"`` on a CPU needs ``TRITON_INTERPRET=1`` (tests).

    Raises:
        ValueError: an unknown backend, or ``"triton"`` for CPU pools without the interpreter.
    """
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in WRITE_BACKENDS:
        raise ValueError(f"backend: expected one of {WRITE_BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda":
        from ..kernels import is_interpreting
        if not is_interpreting():
            raise ValueError(f"backend: 'triton' needs CUDA pools or TRITON_INTERPRET=1 set before triton is "
                             f"imported, got pools on {device}")
    return backend


def _check(k, v, slots, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill) -> None:
    """Shapes, dtypes and devices (no data-dependent check: no host sync)."""
    for name, x in (("k", k), ("v", v), ("slots", slots), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: expected the shape and dtype of k_cache {tuple(k_cache.shape)} {k_cache.dtype} "
                         f"[num_pages, page_size, Hkv, D], got {tuple(v_cache.shape)} {v_cache.dtype}")
    num_pages, _, Hkv, D = k_cache.shape
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots: expected a 1-D int32/int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (slots.shape[0], Hkv, D):
            raise ValueError(f"{name}: expected shape {(slots.shape[0], Hkv, D)} [N, Hkv, D], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name}: expected a float tensor, got {x.dtype}")
    if (k_min is None) != (k_max is None):
        raise ValueError("k_min, k_max: expected both or neither")
    if k_min is not None:
        for name, x in (("k_min", k_min), ("k_max", k_max)):
            if tuple(x.shape) != (num_pages, Hkv, D) or x.dtype != k_min.dtype:
                raise ValueError(f"{name}: expected shape {(num_pages, Hkv, D)} of one dtype, got "
                                 f"{tuple(x.shape)} {x.dtype}")
    if quant.is_quantized(k_cache):
        for name, x, shape, dtype in (("k_scale", k_scale, (num_pages, Hkv), torch.float32),
                                      ("v_scale", v_scale, (num_pages, Hkv), torch.float32),
                                      ("fill", fill, (num_pages,), torch.int64)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != dtype:
                got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else repr(x)
                raise ValueError(f"{name}: expected a {dtype} tensor of shape {shape} for a {k_cache.dtype} pool, "
                                 f"got {got}")
    for name, x in (("k", k), ("v", v), ("slots", slots), ("v_cache", v_cache), ("k_min", k_min),
                    ("k_max", k_max), ("k_scale", k_scale), ("v_scale", v_scale), ("fill", fill)):
        if isinstance(x, torch.Tensor) and x.device != k_cache.device:
            raise ValueError(f"{name}: expected a tensor on {k_cache.device} (k_cache's device), got {x.device}")


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
             k_min: torch.Tensor | None = None, k_max: torch.Tensor | None = None,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             fill: torch.Tensor | None = None, pages: torch.Tensor | None = None, backend: str | None = None) -> None:
    """Store ``k``, ``v`` at ``slots`` and grow the touched pages' boxes and scales, in place (module docstring).

    Args:
        k, v: ``[N, Hkv, D]`` float (any float dtype; cast to the pool's).
        slots: ``[N]`` int32 / int64 physical slots ``page * page_size + offset``, in ``[0, num_pages * page_size)``
            (not checked here: no host sync; :meth:`PagedKVCache.write` checks), distinct.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` fp32 / fp16 / bf16 / int8 / float8_e4m3fn (fp64: torch
            backend only).
        k_min, k_max: ``[num_pages, Hkv, D]`` boxes (fp32 / fp16 / bf16), or None (no boxes).
        k_scale, v_scale: int8 / fp8 pools: ``[num_pages, Hkv]`` fp32 scales (``value = code * scale``).
        fill: int8 / fp8 pools: ``[num_pages]`` int64 valid slots per page (shared by all layers; idempotent).
        pages: optional ``slots // page_size`` (int64) when the caller has it (torch backend).
        backend: None (Triton for CUDA pools, torch otherwise), ``"torch"`` or ``"triton"``.

    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, dtypes or devices, before anything
        is written (:func:`resolve_write_backend` for ``backend``).
    """
    _check(k, v, slots, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill)
    backend = resolve_write_backend(backend, k_cache.device)
    if backend == "triton" and k_cache.dtype != torch.float64:
        from ..kernels import kv_write as kernel
        with span("metadata", k_new=k, pages=k.shape[0]):
            kernel.write_kv(k, v, slots, k_cache, v_cache, k_min, k_max, k_scale, v_scale, fill)
        return
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
    lo, hi = (k, k) if k.dtype == box else (boxes.round_down(k, box), boxes.round_up(k, box))
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
        new = old.clone().index_reduce_(1, inv, x.abs().amax(-1).div_(m), "amax")  # [2, U, Hkv]
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
        boxes.store_box(k_min, k_max, touched, torch.where(v4, keys, inf).amin(1), torch.where(v4, keys, -inf).amax(1))
