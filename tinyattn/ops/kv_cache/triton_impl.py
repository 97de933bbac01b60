"""The Triton form of the page pool's upkeep: launchers of ``kernels/metadata.py`` (page boxes recomputed) and
``kernels/kv_write.py`` (the fused KV write: K/V, box growth, int8 / fp8 scale growth and re-quantization).

Launchers take canonical, validated tensors (int32 tables, preallocated outputs) and make one launch each, with
keyword arguments; the block sizes come from the kernel modules' ``*_blocks`` functions (shared with the compile
tier, :mod:`tinyattn.kernels.compile`).
"""
from __future__ import annotations

import torch
import triton

from ...kernels import strides
from ...kernels.key_codes import encode_key_codes_kernel, key_codes_blocks
from ...kernels.kv_write import kv_write_kernel, kv_write_blocks
from ...kernels.metadata import metadata_blocks, page_minmax_kernel

__all__ = ["update_page_metadata", "write_kv", "encode_key_codes"]


def update_page_metadata(k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         k_min: torch.Tensor, k_max: torch.Tensor, k_scale: torch.Tensor | None = None) -> None:
    """Recompute ``k_min``/``k_max`` ``[num_pages, Hkv, D]`` of every valid page of every row, in place.

    k_cache: ``[num_pages, page_size, Hkv, D]``; block_table ``[B, max_pages]`` int32;
    seq_lens ``[B]`` int32. Pages that no row touches are left as they are. k_scale ``[num_pages, Hkv]`` fp32:
    an int8 / fp8 pool's scales; the boxes are then those of the dequantized keys.
    """
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, max_pages = block_table.shape
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    if batch == 0 or max_pages == 0:
        return
    meta = metadata_blocks(page_size, head_dim, max_pages)
    grid = (batch, triton.cdiv(max_pages, meta["BP"]), num_kv_heads)
    quantized = k_scale is not None
    page_minmax_kernel[grid](
        k_cache=k_cache, block_table=block_table, seq_lens=seq_lens, k_min=k_min, k_max=k_max,
        k_scale=k_scale if quantized else k_min,
        **strides("s", k_scale, "ph"), QUANT=quantized,
        **strides("k", k_cache, "pshd"), **strides("b", block_table, "t"), **strides("n", k_min, "phd"),
        **strides("x", k_max, "phd"),
        MAXP=max_pages, D=head_dim, **meta,
    )


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             k_min: torch.Tensor | None = None, k_max: torch.Tensor | None = None,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             fill: torch.Tensor | None = None) -> None:
    """Launch the fused write (one launch). Tensors as :func:`tinyattn.ops.api.write_kv` validated them:
    ``k``, ``v`` ``[N, Hkv, D]``; ``slots`` ``[N]`` int32 / int64 in range; pools ``[num_pages, page_size, Hkv, D]``
    fp32 / fp16 / bf16 / int8 / float8_e4m3fn; boxes ``[num_pages, Hkv, D]`` fp32 / fp16 / bf16 or None; int8 / fp8
    pools with ``k_scale`` / ``v_scale`` ``[num_pages, Hkv]`` fp32 and ``fill`` ``[num_pages]`` int64."""
    N, Hkv, D = k.shape
    if N == 0:
        return
    page_size = k_cache.shape[1]
    boxes = k_min is not None
    meta = kv_write_blocks(page_size, D, k_cache.dtype, k_min.dtype if boxes else None)
    quant = meta["QUANT"]
    dummy = k_cache                      # never dereferenced when its constexpr is off
    kv_write_kernel[(N, Hkv)](
        k=k, v=v, slots=slots, k_cache=k_cache, v_cache=v_cache,
        k_min=k_min if boxes else dummy, k_max=k_max if boxes else dummy,
        k_scale=k_scale if quant else dummy, v_scale=v_scale if quant else dummy, fill=fill if quant else dummy,
        N=N, D=D,
        **strides("k", k, "nhd"), **strides("v", v, "nhd"), **strides("c", k_cache, "pshd"),
        **strides("w", v_cache, "pshd"), **strides("n", k_min, "phd"), **strides("x", k_max, "phd"),
        **strides("ks", k_scale if quant else None, "ph"), **strides("vs", v_scale if quant else None, "ph"),
        **meta,
    )


def encode_key_codes(k_cache: torch.Tensor, slots: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor,
                     k_code: torch.Tensor, k_scale: torch.Tensor | None = None) -> None:
    """Launch ``kernels/key_codes.py`` over the ``N`` written ``slots`` (one launch, grid ``(N, Hkv)``): the codes
    ``k_code`` ``[num_pages, page_size, Hkv, D/2]`` uint8 of every page a slot fills, from its keys and box."""
    N = slots.shape[0]
    _, page_size, Hkv, D = k_cache.shape
    if N == 0 or Hkv == 0:
        return
    quantized = k_scale is not None
    encode_key_codes_kernel[(N, Hkv)](
        k_cache=k_cache, slots=slots, k_min=k_min, k_max=k_max, k_code=k_code,
        k_scale=k_scale if quantized else k_min,
        **strides("k", k_cache, "pshd"), **strides("n", k_min, "phd"), **strides("x", k_max, "phd"),
        **strides("c", k_code, "pshd"), **strides("s", k_scale, "ph"),
        HALF=D // 2, QUANT=quantized, **key_codes_blocks(page_size, D),
    )
