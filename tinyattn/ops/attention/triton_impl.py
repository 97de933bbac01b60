"""The Triton form of attention: launchers of ``kernels/attention.py`` (paged attention forward, dense or over
listed pages, split-K partials merged by lse) and ``kernels/attention_bwd.py`` (its backward, and the per-page
gradient norms of gradient-aware retention).

Launchers take canonical, validated tensors (int32 tables, preallocated outputs) and make one launch each, with
keyword arguments; the block sizes come from the kernel modules' ``*_blocks`` functions (shared with the compile
tier, :mod:`tinyattn.kernels.compile`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ...kernels import needs_upcast, strides
from ...kernels.attention import (LOG2E, attention_blocks, attn_fwd_kernel, choose_num_splits, merge_blocks,
                                  merge_splits_kernel, num_sms)
from ...kernels.attention_bwd import attn_bwd_kernel, page_grad_norm_kernel, page_norm_blocks

__all__ = ["paged_attention", "paged_attention_bwd", "page_grad_norms"]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, page_indices: Optional[torch.Tensor], scale: float,
                    out: torch.Tensor, lse: torch.Tensor, num_splits: Optional[int] = None,
                    ws_o: Optional[torch.Tensor] = None, ws_lse: Optional[torch.Tensor] = None,
                    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                    window_left: int = -1) -> None:
    """Attention of q ``[B, Tq, Hq, D]`` over the paged cache; writes ``out`` (q's shape/dtype) and ``lse``.

    k_cache/v_cache ``[num_pages, page_size, Hkv, D]``; block_table ``[B, max_pages]`` int32; seq_lens
    ``[B]`` int32 (including the Tq queries); page_indices ``None`` (dense) or ``[B, Hkv, K]`` int32
    logical pages, deduplicated (-1 entries and pages past the end are skipped; duplicates would be
    counted twice, the ops layer removes them); lse ``[B, Tq, Hq]`` fp32 natural log.
    num_splits: ``None`` picks it with ``choose_num_splits``; an int forces it (tests, plans).
    ws_o ``[>= num_splits, B, Tq, Hq, D]`` / ws_lse ``[>= num_splits, B, Tq, Hq]`` fp32: split-K partials
    preallocated by a plan (``tinyattn.ops.plan``); allocated here when ``None`` and needed.
    k_scale / v_scale ``[num_pages, Hkv]`` fp32: with int8 / float8_e4m3fn pools, the per-(page, KV head) scales;
    K and V tiles are dequantized in registers (``code.to(fp32) * scale``) and the math runs in fp32.
    window_left: sliding window, FlashInfer's convention: a query at position ``p`` sees keys in
    ``[p - window_left, p]``; ``-1`` = no window (a runtime argument: one compiled kernel serves every window).
    """
    batch, num_queries, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    if batch == 0 or num_queries == 0 or num_heads == 0:
        return
    group = num_heads // num_kv_heads
    meta = attention_blocks(num_queries, group, head_dim, page_size)
    num_mb = triton.cdiv(num_queries * group, meta["BLOCK_M"])
    sparse = page_indices is not None
    num_list = page_indices.shape[2] if sparse else block_table.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads * num_mb, num_list * page_size, meta["BLOCK_N"],
                                       num_sms(q.device))
    split = num_splits > 1
    if split and (ws_o is None or ws_lse is None or ws_o.shape[0] < num_splits):
        ws_o = torch.empty((num_splits, batch, num_queries, num_heads, head_dim), device=q.device,
                           dtype=torch.float32)
        ws_lse = torch.empty((num_splits, batch, num_queries, num_heads), device=q.device, dtype=torch.float32)
    elif not split:
        ws_o, ws_lse = out, lse  # unused
    idx = page_indices if sparse else block_table  # unused when dense
    quantized = k_scale is not None
    if quantized:
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    else:
        k_scale = v_scale = lse  # unused
    attn_fwd_kernel[(batch, num_kv_heads * num_mb, num_splits)](
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
        page_indices=idx, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse,
        # (the strides of an argument the kernel does not read, its constexpr off, are zeros)
        **strides("q", q, "bthd"), **strides("k", k_cache, "pshd"), **strides("v", v_cache, "pshd"),
        **strides("b", block_table, "t"), **strides("i", page_indices, "bh"),
        **strides("s", k_scale if quantized else None, "ph"), **strides("o", out, "bthd"), **strides("l", lse, "bth"),
        **strides("w", ws_o if split else None, "sbth"), **strides("z", ws_lse if split else None, "sbth"),
        qk_scale=scale * LOG2E, TQ=num_queries, D=head_dim, NUM_MB=num_mb, NUM_LIST=num_list,
        NUM_SPLITS=num_splits, WINDOW_LEFT=window_left, SPARSE=sparse, SPLIT=split, UPCAST=needs_upcast(q.dtype),
        PRECISION="ieee", QUANT=quantized, **meta,
    )
    if split:
        mmeta = merge_blocks(num_heads, num_splits, head_dim)
        merge_splits_kernel[(batch * num_queries, triton.cdiv(num_heads, mmeta["BH"]))](
            ws_o=ws_o, ws_lse=ws_lse, out=out, lse=lse,
            **strides("w", ws_o, "sbth"), **strides("z", ws_lse, "sbth"), **strides("o", out, "bthd"),
            **strides("l", lse, "bth"),
            TQ=num_queries, HQ=num_heads, D=head_dim, NUM_SPLITS=num_splits, **mmeta,
        )


def paged_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, *, page_indices: Optional[torch.Tensor],
                        out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor], scale: float,
                        dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, window_left: int = -1) -> None:
    """Gradients of ``attention.paged_attention``; writes ``dq`` and adds into ``dk`` / ``dv``.

    dout, out, q, dq ``[B, Tq, Hq, D]`` (any strides); lse, dlse ``[B, Tq, Hq]`` fp32 (``dlse`` may be
    ``None``); k_cache/v_cache ``[num_pages, page_size, Hkv, D]``; block_table ``[B, max_pages]`` and
    seq_lens ``[B]`` int32; page_indices ``None`` (dense) or ``[B, Hkv, K]`` int32, deduplicated.
    dk / dv: **contiguous fp32**, pool-shaped, zero-initialised by the caller; only slots the forward read
    receive a value. Masks and page walk are the forward's (``window_left``: its sliding window, -1 = none).
    """
    batch, num_queries, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    assert dk.dtype == torch.float32 and dv.dtype == torch.float32 and dk.is_contiguous() and dv.is_contiguous()
    assert dk.shape == k_cache.shape and dv.shape == v_cache.shape
    if batch == 0 or num_queries == 0 or num_heads == 0:
        return
    group = num_heads // num_kv_heads
    meta = attention_blocks(num_queries, group, head_dim, page_size)
    num_mb = triton.cdiv(num_queries * group, meta["BLOCK_M"])
    sparse = page_indices is not None
    idx = page_indices if sparse else block_table  # unused when dense
    num_list = page_indices.shape[2] if sparse else block_table.shape[1]
    has_dlse = dlse is not None
    dl = dlse if has_dlse else lse  # unused when not has_dlse
    attn_bwd_kernel[(batch, num_kv_heads * num_mb)](
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens, page_indices=idx,
        out=out, dout=dout, lse=lse, dlse=dl, dq=dq, dk=dk, dv=dv,
        **strides("q", q, "bthd"), **strides("k", k_cache, "pshd"), **strides("v", v_cache, "pshd"),
        **strides("b", block_table, "t"), **strides("i", page_indices, "bh"), **strides("o", out, "bthd"),
        **strides("g", dout, "bthd"), **strides("l", lse, "bth"), **strides("e", dl, "bth"), **strides("x", dq, "bthd"),
        **strides("a", dk, "psh"),           # dv: dk's strides (both contiguous, pool-shaped)
        scale=scale, qk_scale=scale * LOG2E, TQ=num_queries, D=head_dim, NUM_MB=num_mb, NUM_LIST=num_list,
        WINDOW_LEFT=window_left, SPARSE=sparse, HAS_DLSE=has_dlse, UPCAST=needs_upcast(q.dtype), PRECISION="ieee",
        **meta,
    )


def page_grad_norms(dk: torch.Tensor, dv: torch.Tensor, *, out: torch.Tensor) -> None:
    """``out[p, h] = sum_{s, d} dk[p, s, h, d]^2 + dv[p, s, h, d]^2`` (fp32 math); dk/dv pool-shaped.

    out: ``[num_pages, Hkv]`` fp32. page_size must be a power of two.
    """
    num_pages, page_size, num_kv_heads, head_dim = dk.shape
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    if num_pages == 0 or num_kv_heads == 0:
        return
    meta = page_norm_blocks(page_size, head_dim)
    page_grad_norm_kernel[(triton.cdiv(num_pages, meta["BP"]), num_kv_heads)](
        dk=dk, dv=dv, norms=out,
        **strides("k", dk, "pshd"), **strides("v", dv, "pshd"), **strides("n", out, "ph"),
        P=num_pages, D=head_dim, **meta,
    )
